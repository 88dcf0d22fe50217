"""Context and expert parallelism without processes: the zigzag split, the CP
mask, MoE routing and dispatch, the tiny-moe model and the rank layout."""

from __future__ import annotations

from dataclasses import replace

import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

from hetplan.errors import HetplanError
from hetplan.model.presets import get_model
from hetplan.plan.spec import Plan, uniform_stage


def test_zigzag_split_by_hand() -> None:
    from hetplan.runtime.cp import zigzag_positions

    assert zigzag_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert zigzag_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    assert zigzag_positions(12, 3, 1).tolist() == [2, 3, 8, 9]
    every = torch.cat([zigzag_positions(32, 4, r) for r in range(4)])
    assert sorted(every.tolist()) == list(range(32))  # each token on exactly one rank
    # balanced causal work: every rank's queries see the same number of keys in total
    work = [int((zigzag_positions(32, 4, r) + 1).sum()) for r in range(4)]
    assert len(set(work)) == 1, work
    with pytest.raises(HetplanError, match="2 x cp = 6"):
        zigzag_positions(8, 3, 0)


def test_causal_mask_by_hand() -> None:
    from hetplan.runtime.cp import causal_mask

    mask = causal_mask(torch.tensor([0, 3]), torch.tensor([0, 1, 2, 3, 4]))
    assert mask.tolist() == [[True, False, False, False, False], [True, True, True, True, False]]


@pytest.mark.parametrize("cp, kv_heads, rope", [(2, 4, False), (4, 2, True)])
def test_cp_attention_equals_full_causal_attention(cp: int, kv_heads: int, rope: bool) -> None:
    """Each rank's queries against the gathered keys (gathered here by indexing:
    rank 0's chunk, then rank 1's, ...) give the full attention's rows and gradients."""
    from hetplan.runtime.cp import ContextShard, context_parallel_attention
    from hetplan.runtime.models import _rope

    class LocalShard(ContextShard):
        """Hands out the whole sequence's keys, then values (what the all-gather returns)."""

        def __init__(self, rank: int, gathered: list[torch.Tensor]) -> None:
            super().__init__(None, rank, cp)
            self.gathered = gathered

        def gather(self, t: torch.Tensor, dim: int) -> torch.Tensor:
            return self.gathered.pop(0)

    torch.manual_seed(0)
    b, heads, s, d = 2, 4, 16, 8
    q = torch.randn(b, heads, s, d, requires_grad=True)
    k = torch.randn(b, kv_heads, s, d, requires_grad=True)
    v = torch.randn(b, kv_heads, s, d, requires_grad=True)
    w = torch.randn(b, heads, s, d)
    rq, rk = (_rope(q), _rope(k)) if rope else (q, k)
    rep = heads // kv_heads
    ref = F.scaled_dot_product_attention(rq, rk.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1),
                                         is_causal=True)
    grads_ref = torch.autograd.grad((ref * w).sum(), (q, k, v))
    order = torch.cat([ContextShard(None, r, cp).positions(s // cp) for r in range(cp)])  # gathered order
    total = 0.0
    for r in range(cp):
        pos = ContextShard(None, r, cp).positions(s // cp)
        shard = LocalShard(r, [(_rope(k) if rope else k)[:, :, order], v[:, :, order]])
        out = context_parallel_attention(q[:, :, pos], k[:, :, pos], v[:, :, pos], shard, _rope if rope else None)
        assert torch.allclose(out, ref[:, :, pos], atol=1e-6)
        total = total + (out * w[:, :, pos]).sum()
    for g, g_ref in zip(torch.autograd.grad(total, (q, k, v)), grads_ref):
        assert torch.allclose(g, g_ref, atol=1e-5)


def test_moe_dispatch_equals_a_loop_over_tokens() -> None:
    from hetplan.runtime.ep import moe_dispatch_combine

    torch.manual_seed(1)
    e, h, t, k = 4, 8, 10, 2
    weights = torch.randn(e, h, h)
    tokens = torch.randn(t, h)
    experts = torch.stack([torch.randperm(e)[:k] for _ in range(t)])
    gates = torch.rand(t, k)

    def expert_fn(rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        assert sum(counts) == rows.size(0) == t * k
        ids = torch.repeat_interleave(torch.arange(e), torch.tensor(counts))
        return torch.einsum("rh,rhg->rg", rows, weights[ids])

    out = moe_dispatch_combine(tokens, experts, gates, expert_fn, e)
    brute = torch.stack([sum(gates[i, j] * tokens[i] @ weights[experts[i, j]] for j in range(k)) for i in range(t)])
    assert torch.allclose(out, brute, atol=1e-5)


def test_tiny_moe_preset_maps_to_the_runtime_model() -> None:
    from hetplan.runtime.models import GPT, MoE, config_from_spec

    spec = get_model("tiny-moe")
    cfg = config_from_spec(spec)  # also checks every layer's parameter count against the spec
    assert (cfg.num_layers, cfg.hidden, cfg.num_experts, cfg.top_k, cfg.moe_layers) == (4, 64, 4, 2, (1, 3))
    model = GPT(cfg)
    assert isinstance(model.layers["1"].mlp, MoE) and not isinstance(model.layers["0"].mlp, MoE)
    assert sum(p.numel() for p in model.parameters()) == spec.total_params
    x = torch.randint(0, 256, (2, 32))
    assert model(x).shape == (2, 32, 256)


def test_moe_routes_each_token_to_its_top_k_experts() -> None:
    """Zeroing every expert but the one a token's router ranks first and second
    changes nothing; zeroing one of them changes that token's output."""
    from hetplan.runtime.models import GPTConfig, MoE

    torch.manual_seed(2)
    moe = MoE(GPTConfig(hidden=16, num_experts=4, top_k=2, expert_ffn=32, moe_layers=(0,)))
    for p in moe.experts.parameters():
        torch.nn.init.normal_(p)
    x = torch.randn(1, 1, 16)
    chosen = F.softmax(moe.router(x[0]), -1).topk(2).indices[0].tolist()
    base = moe(x)
    with torch.no_grad():
        for e in range(4):
            if e not in chosen:
                moe.experts.fc_weight[e].zero_()
    assert torch.allclose(moe(x), base)
    with torch.no_grad():
        moe.experts.proj_weight[chosen[0]].zero_()
        moe.experts.proj_bias[chosen[0]].zero_()
    assert not torch.allclose(moe(x), base)


def _plan(dp: int, cp: int, tp: int, ep: int, pp: int = 1) -> Plan:
    per = dp * cp * tp
    stages = tuple(replace(uniform_stage(layers, range(j * per, (j + 1) * per), dp, tp, dp), cp=cp, ep=ep)
                   for j, layers in enumerate([[0, 1, 2], [3, 4, 5]][:pp] if pp == 2 else [range(6)]))
    return Plan("tiny-moe", f"local-cpu-{per * pp}", 8, dp, 8 // dp, "1f1b", stages, planner="test")


def test_layout_positions_and_groups_with_cp_and_ep() -> None:
    from hetplan.plan.layout import PlanLayout

    names = [layer.name for layer in get_model("tiny-moe").layers]
    layout = PlanLayout.from_plan(_plan(dp=2, cp=2, tp=2, ep=2), names)
    pos = layout.position(5)  # devices: replica 1 owns 4..7; CP rank 0 of it 4, 5; TP rank 1
    assert (pos.dp_index, pos.cp_index, pos.tp_index) == (1, 0, 1)
    assert pos.ep_index(2, 2) == (1, 0)  # flat dp*cp index 2: expert-data-parallel 1, EP rank 0
    assert layout.mesh_ranks_cp() == [[[[0, 1], [2, 3]], [[4, 5], [6, 7]]]]
    # [pp][edp][ep][tp]: EP groups are consecutive (dp, cp) ranks of one TP rank
    assert layout.ep_mesh_ranks() == [[[[0, 1], [2, 3]], [[4, 5], [6, 7]]]]
    assert "cp=2 ep=2" in layout.describe()
    layout = PlanLayout.from_plan(_plan(dp=4, cp=1, tp=1, ep=2), names)
    assert layout.ep_mesh_ranks() == [[[[0], [1]], [[2], [3]]]]


def test_layout_refuses_cp_ep_it_cannot_run() -> None:
    from hetplan.plan.layout import PlanLayout, PlanNotSupportedError

    names = [layer.name for layer in get_model("tiny-moe").layers]
    plan = _plan(dp=2, cp=1, tp=1, ep=2, pp=2)
    mixed = plan.with_changes(stages=(plan.stages[0], replace(plan.stages[1], ep=1)))
    with pytest.raises(PlanNotSupportedError, match="same cp and ep in every stage"):
        PlanLayout.from_plan(mixed, names)
    uneven = plan.with_changes(micro_batch_size=4, num_micro_batches=2,
                               stages=tuple(replace(s, dp_split=(3, 1)) for s in plan.stages))
    with pytest.raises(PlanNotSupportedError, match="even dp_split"):
        PlanLayout.from_plan(uneven, names)


def test_preflight_refuses_a_model_without_cp_support() -> None:
    from torch import nn

    from hetplan.runtime.preflight import preflight
    from hetplan.plan.layout import PlanLayout
    from hetplan.runtime.models import build_preset_model

    spec = get_model("tiny-gpt")
    plan = replace(_plan(dp=1, cp=2, tp=1, ep=1), model="tiny-gpt")
    layout = PlanLayout.from_plan(plan, [layer.name for layer in spec.layers])

    class NoCP(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            inner = build_preset_model(spec)
            self.embed, self.layers, self.head = inner.embed, inner.layers, inner.head

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for layer in [self.embed, *self.layers.values(), self.head]:
                x = layer(x)
            return x

    with torch.device("meta"):
        model = NoCP()
    with pytest.raises(HetplanError, match="does not declare context-parallel support"):
        preflight(layout, spec, model)
    with torch.device("meta"):
        preflight(layout, spec, build_preset_model(spec))  # hetplan's GPT declares it


@pytest.mark.parametrize("mlp", ["gelu", "swiglu"])
def test_expert_tp_slices_sum_to_the_whole_experts(mlp: str) -> None:
    """Each TP rank's experts hold the slices ``tp_shard_dims`` names; their
    bias-free outputs summed plus the whole output bias are the whole experts'
    output, the input gradients summed are the whole input gradient (what the
    runtime's all-reduces do), and each slice's weight gradient is that slice
    of the whole one."""
    from hetplan.runtime.models import Experts, GPTConfig

    torch.manual_seed(3)
    tp, counts = 2, [3, 0, 2, 4]
    whole = Experts(GPTConfig(hidden=8, num_experts=4, expert_ffn=6, mlp=mlp, bias=mlp == "gelu"))
    for p in whole.parameters():
        torch.nn.init.normal_(p)
    rows = torch.randn(sum(counts), 8, requires_grad=True)
    w = torch.randn(sum(counts), 8)
    ref = whole(rows, counts)
    ref_grads = torch.autograd.grad((ref * w).sum(), [rows, *whole.parameters()])
    names = [n for n, _ in whole.named_parameters()]
    total, rows_grad = 0.0, torch.zeros_like(rows)
    for r in range(tp):
        part = Experts(GPTConfig(hidden=8, num_experts=4, expert_ffn=6 // tp, mlp=mlp, bias=mlp == "gelu"))
        with torch.no_grad():
            for n, p in part.named_parameters():
                full = whole.get_parameter(n)
                dim = Experts.tp_shard_dims.get(n)
                p.copy_(full if dim is None else full.chunk(tp, dim)[r])
                if n == "proj_bias":
                    p.zero_()  # the whole bias is added once, after the sum
        partial_rows = rows.detach().requires_grad_()
        out = part(partial_rows, counts)
        total = total + out
        grads = torch.autograd.grad((out * w).sum(), [partial_rows, *part.parameters()])
        rows_grad += grads[0]
        for n, g, g_ref in zip(names, grads[1:], ref_grads[1:]):
            dim = Experts.tp_shard_dims.get(n)
            if dim is not None:
                assert torch.allclose(g, g_ref.chunk(tp, dim)[r], atol=1e-5), n
    if whole.proj_bias is not None:
        total = total + whole.proj_bias.repeat_interleave(torch.tensor(counts), 0)
    assert torch.allclose(total, ref, atol=1e-5)
    assert torch.allclose(rows_grad, ref_grads[0], atol=1e-5)


def test_expert_placements_and_width_check() -> None:
    from torch.distributed.tensor import Replicate, Shard

    from hetplan.runtime.models import Experts, GPTConfig
    from hetplan.runtime.parallelize import _expert_placements, check_expert_tp

    holder = Experts(GPTConfig(hidden=8, num_experts=4, expert_ffn=6))
    dims = ("edp", "ep", "tp")
    assert _expert_placements(dims, holder, "fc_weight") == [Replicate(), Shard(0), Shard(2)]
    assert _expert_placements(dims, holder, "proj_weight") == [Replicate(), Shard(0), Shard(1)]
    assert _expert_placements(dims, holder, "proj_bias") == [Replicate(), Shard(0), Replicate()]
    assert _expert_placements(("tp",), holder, "fc_bias") == [Shard(1)]
    check_expert_tp(holder, "layers.1", 3)
    with pytest.raises(HetplanError, match="tp=4 does not divide the expert width 6 of layer 'layers.1'"):
        check_expert_tp(holder, "layers.1", 4)
    with pytest.raises(HetplanError, match="say nothing of how tensor parallelism splits them"):
        check_expert_tp(torch.nn.Linear(2, 2), "layers.1", 2)
