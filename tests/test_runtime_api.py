"""The runtime API in one process (no process group): recomputation really
recomputes, batches are checked, registration works, plan-independent init."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from hetplan.errors import HetplanError
from hetplan.model.presets import get_model
from hetplan.plan.spec import LayerStrategy, Plan, uniform_stage
from hetplan.runtime import tp as tpr
from hetplan.runtime.context import init
from hetplan.runtime.models import GPT, GPTConfig, build_preset_model, config_from_spec, cross_entropy_loss
from hetplan.runtime.reference import (
    build_reference,
    compare,
    make_optimizer,
    synthetic_batch,
    train_reference,
)

SPEC = get_model("tiny-gpt")


@pytest.fixture(autouse=True)
def _single_process(monkeypatch):
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "GROUP_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    torch.set_num_threads(1)


def one_device_plan(micro=4, gbs=8, strategies=None) -> Plan:
    stage = uniform_stage(range(6), [0], 1, 1, micro)
    if strategies:
        stage = stage.__class__(**{**stage.__dict__, "strategies": tuple(strategies.get(i, LayerStrategy())
                                                                         for i in range(6))})
    return Plan("tiny-gpt", "local-cpu-1", gbs, micro, gbs // micro, "1f1b", (stage,))


def test_preset_model_matches_its_spec():
    cfg = config_from_spec(SPEC)
    assert (cfg.hidden, cfg.heads, cfg.num_layers, cfg.vocab_size, cfg.ffn_size) == (64, 4, 4, 256, 256)
    model = build_preset_model(SPEC)
    assert model.head.proj.weight is model.embed.tok.weight


def test_one_process_plan_equals_plain_training():
    plan = one_device_plan(micro=2)  # 4 micro-batches, gradient accumulation
    ctx = init(plan, SPEC)
    assert not ctx.distributed
    model = ctx.parallelize(lambda: build_preset_model(SPEC))
    opt = make_optimizer(model.parameters())
    ref = build_reference(lambda: build_preset_model(SPEC))
    ref_opt = make_optimizer(ref.parameters())
    batches = [synthetic_batch(256, 32, 8, s) for s in range(2)]
    losses = []
    for b in batches:
        losses.append(ctx.train_step(model, b, cross_entropy_loss))
        ctx.clip_grad_norm_(model, 1.0)
        opt.step()
        opt.zero_grad()
    ref_losses = train_reference(ref, batches, cross_entropy_loss, ref_opt, clip=1.0)
    cmp = compare(losses, ref_losses, model.state_dict(), ref.state_dict())
    assert cmp["loss_rel_diff"] < 1e-6 and cmp["param_rel_diff"] < 1e-6, cmp


def test_model_info_is_what_parallelize_recorded():
    """The public record checkpoints read (ctx.model_info): the model parallelize
    returned, also through a torch.compile wrapper of it; None for another model."""
    ctx = init(one_device_plan(), SPEC)
    model = ctx.parallelize(lambda: build_preset_model(SPEC))
    info = ctx.model_info(model)
    assert info is not None and info.model is model and info.parts == [model]
    assert info.aliases["head.proj.weight"] == "embed.tok.weight"
    assert ctx.model_info(torch.compile(model)) is info
    assert ctx.model_info(build_preset_model(SPEC)) is None
    ctx.close()


def _count_calls(module):
    calls = []
    module.register_forward_hook(lambda *a: calls.append(1))
    return calls


def test_recompute_full_and_selective_rerun_forward_in_backward(monkeypatch):
    from hetplan.runtime import models

    plan = one_device_plan(micro=8, strategies={2: LayerStrategy(0, "full"), 3: LayerStrategy(0, "selective")})
    ctx = init(plan, SPEC)
    model = ctx.parallelize(lambda: build_preset_model(SPEC))
    plain = _count_calls(model.layers["0"].attn.q)
    full = _count_calls(model.layers["1"].attn.q)
    sel_q = _count_calls(model.layers["2"].attn.q)
    sdpa = []
    real = models.F.scaled_dot_product_attention
    monkeypatch.setattr(models.F, "scaled_dot_product_attention", lambda *a, **k: sdpa.append(1) or real(*a, **k))
    ctx.train_step(model, synthetic_batch(256, 32, 8, 0), cross_entropy_loss)
    # layer indices are ModelSpec indices (0 = embed): blocks 1 and 2 are recomputed in backward,
    # block 1 whole, block 2 only its attention core
    assert (len(plain), len(full), len(sel_q)) == (1, 2, 1)
    assert len(sdpa) == 4 + 2
    # names are unchanged by recomputation (checkpoints stay loadable without it)
    assert "layers.1.attn.q.weight" in dict(model.named_parameters())


def test_batch_of_wrong_size_is_rejected():
    ctx = init(one_device_plan(), SPEC)
    model = ctx.parallelize(lambda: build_preset_model(SPEC))
    with pytest.raises(HetplanError, match="fits neither the plan's global batch"):
        ctx.train_step(model, synthetic_batch(256, 32, 6, 0), cross_entropy_loss)
    with pytest.raises(HetplanError, match="model returned by ctx.parallelize"):
        ctx.train_step(torch.nn.Linear(2, 2), synthetic_batch(256, 32, 8, 0), cross_entropy_loss)


def test_initial_values_do_not_depend_on_the_split():
    """The same parameter gets the same initial value whatever else is built."""
    from hetplan.runtime.parallelize import InitialValues

    with torch.device("meta"):
        a = GPT(GPTConfig(num_layers=4))
        b = GPT(GPTConfig(num_layers=2))
    va, vb = InitialValues(a, 0, GPT.init_parameter), InitialValues(b, 0, GPT.init_parameter)
    assert torch.equal(va.value("layers.1.attn.q.weight"), vb.value("layers.1.attn.q.weight"))
    assert torch.equal(va.value("head.proj.weight"), va.value("embed.tok.weight"))  # tied
    assert not torch.equal(va.value("layers.0.attn.q.weight"), va.value("layers.1.attn.q.weight"))
    # a module without init_parameter: PyTorch's reset_parameters, seeded by module name
    with torch.device("meta"):
        seq = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    v1, v2 = InitialValues(seq, 3, None), InitialValues(seq, 3, None)
    assert torch.equal(v1.value("1.weight"), v2.value("1.weight"))
    assert v1.value("1.weight").abs().max() <= 0.5 + 1e-6  # kaiming-uniform bound 1/sqrt(4)


def test_missing_module_name_is_reported():
    ctx = init(one_device_plan(), SPEC)
    with pytest.raises(HetplanError, match="'layers.3' is not a module of the model"):
        ctx.parallelize(lambda: GPT(GPTConfig(num_layers=3)))


def test_world_size_mismatch_before_any_process_group(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(HetplanError, match="runs on 1 processes .* but 2 were started"):
        init(one_device_plan(), SPEC)


def test_tp_plan_registration_matches_subclasses():
    class MyBlock(torch.nn.Module):
        pass

    class Sub(MyBlock):
        pass

    def plan_fn(module, settings):
        return {}

    tpr.register_tp_plan(MyBlock, plan_fn)
    try:
        assert tpr.tp_plan_for(Sub()) is plan_fn
        assert tpr.tp_plan_for(torch.nn.Linear(1, 1)) is None
    finally:
        tpr.unregister_tp_plan(MyBlock)


def test_hf_tp_plan_translation():
    transformers = pytest.importorskip("transformers")
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from hetplan.runtime.parallelize import plan_inside

    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    plan = tpr.hf_tp_plan(model)
    assert isinstance(plan["model.layers.*.self_attn.q_proj"], ColwiseParallel)
    assert isinstance(plan["model.layers.*.self_attn.o_proj"], RowwiseParallel)
    assert "lm_head" in plan
    inside = plan_inside(plan, "model.layers.0")
    assert set(inside) >= {"self_attn.q_proj", "mlp.down_proj"}
    assert set(plan_inside(plan, "lm_head")) == {""}


def test_processes_must_run_where_the_plan_puts_them(monkeypatch):
    """On several nodes, torchrun's node rank / local rank must match the plan's GPUs."""
    from hetplan.cluster.io import load_cluster
    from hetplan.runtime.setup import check_node_placement
    from hetplan.plan.layout import PlanLayout

    cluster = load_cluster("amp-heterogeneous")  # nodes of 4 GPUs
    stages = (uniform_stage(range(0, 3), [2, 3], 2, 1, 2), uniform_stage(range(3, 6), [4, 5], 2, 1, 2))
    plan = Plan("tiny-gpt", "amp-heterogeneous", 8, 2, 4, "1f1b", stages)
    layout = PlanLayout.from_plan(plan, [layer.name for layer in SPEC.layers])
    for rank, (node, local) in enumerate([(0, 0), (0, 1), (1, 0), (1, 1)]):
        monkeypatch.setenv("GROUP_RANK", str(node))
        monkeypatch.setenv("LOCAL_RANK", str(local))
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
        check_node_placement(layout, cluster, rank)
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # 4 processes started on a node where the plan uses 2 GPUs
    with pytest.raises(HetplanError, match="rank 2 runs as process 0 of 4 on launcher node 1"):
        check_node_placement(layout, cluster, 2)


def test_gpu_names_match_the_catalog():
    from hetplan.runtime.setup import gpu_matches

    for catalog, cuda in (("RTX-TITAN", "NVIDIA TITAN RTX"), ("A100-80GB", "NVIDIA A100-SXM4-80GB"),
                          ("T4", "Tesla T4"), ("RTX-3090", "NVIDIA GeForce RTX 3090"), ("H100", "NVIDIA H100 80GB HBM3")):
        assert gpu_matches(catalog, cuda), (catalog, cuda)
    assert not gpu_matches("A100-80GB", "Tesla V100-SXM2-32GB")
    assert not gpu_matches("T4", "NVIDIA L4")
