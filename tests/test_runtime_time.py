"""The operators hetplan's runtime dispatches per layer and micro-batch
(``hetplan.model.runtime_time``: what the host-dispatch floor of each pass
multiplies by ``HOST_OP_S``) equal what its modules really dispatch, counted by
a ``TorchDispatchMode`` on CPU under bf16 autocast: the built-in GPT, Llama and
MoE blocks, head with the runtime's loss and embedding, and a tiny HF Llama;
and what full recomputation (the runtime's ``apply_recompute``) reruns: the
operators it adds to the backward and the share of the matmul FLOPs.
A change to the runtime's models (or to torch's decompositions) that the cost
model misses fails here. Also: the runtime's time columns reach the kernel only
under target "hetplan"."""

from __future__ import annotations

import dataclasses

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from torch.utils._python_dispatch import TorchDispatchMode

from hetplan.cluster.presets import get_cluster
from hetplan.cost.kernel import CostKernel
from hetplan.model.families import moe_decoder
from hetplan.model.hf import model_from_hf_config
from hetplan.model.presets import get_model, gpt_decoder
from hetplan.model.runtime_time import MOE_EXPERT_OPS, runtime_time
from hetplan.plan.workload import Workload
from hetplan.runtime.models import build_preset_model, cross_entropy_loss
from hetplan.runtime.parallelize import apply_recompute

BATCH = 2
# the MoE's per-expert loop skips no expert here (every expert gets tokens), but its
# routing ops depend on the data a little (``bincount``, empty slices): within 5%
MOE_TOLERANCE = 0.05
TINY_LLAMA = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1000, "head_dim": 16,
              "max_position_embeddings": 64, "tie_word_embeddings": True}


_MATMULS = {"mm": 0, "bmm": 0, "addmm": 1, "baddbmm": 1}  # operator -> where its two matrices start


class _Count(TorchDispatchMode):
    """Counts every ATen operator dispatched while it is active, and the FLOPs of its matmuls."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0
        self.matmul_flops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        first = _MATMULS.get(func.__name__.split(".")[0])
        if first is not None:
            a, b = args[first], args[first + 1]
            self.matmul_flops += 2 * a.numel() * b.shape[-1]
        return func(*args, **(kwargs or {}))


def _counted(run) -> tuple[_Count, _Count]:
    """The counts of ``run()``'s forward and of its backward (seeded outside the count)."""
    with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False), _Count() as forward:
        out = run()
    seed = torch.ones_like(out)
    with _Count() as backward:
        out.backward(seed)
    return forward, backward


def _passes(run) -> tuple[int, int]:
    """Operators of ``run()``'s forward and of its backward."""
    forward, backward = _counted(run)
    return forward.ops, backward.ops


def _recomputed(model, name: str, run) -> tuple[int, float]:
    """What full recomputation of layer ``name`` adds to ``run()``'s backward, as the
    runtime applies it: (operators, matmul FLOPs over the forward's)."""
    forward, plain = _counted(run)
    apply_recompute(model, {name: "full"}, [], [])
    _, checkpointed = _counted(run)
    flops = checkpointed.matmul_flops - plain.matmul_flops
    return checkpointed.ops - plain.ops, flops / forward.matmul_flops if forward.matmul_flops else 0.0


def _builtin_counts(spec, block: str) -> dict[str, tuple[int, int]]:
    """Per layer kind, the operators of the built-in model of ``spec``: one
    block (``block``), the head with the runtime's loss, the embedding."""
    torch.manual_seed(0)
    model = build_preset_model(spec)
    for p in model.parameters():  # real tensors: the MoE routes by data
        torch.nn.init.normal_(p, 0.0, 0.02)
    x = torch.randn(BATCH, spec.seq_len, spec.hidden_size, requires_grad=True)
    ids = torch.randint(0, spec.vocab_size, (BATCH, spec.seq_len))
    head = model.get_submodule(spec.layers[-1].name)
    return {"decoder": _passes(lambda: model.get_submodule(block)(x)),
            "head": _passes(lambda: cross_entropy_loss(head(x), ids)),
            "embedding": _passes(lambda: model.get_submodule(spec.layers[0].name)(ids))}


def _expected(spec, index: int) -> tuple[int, int]:
    run = runtime_time(spec, cuda=False)
    assert run is not None
    return run[index].ops_fwd, run[index].ops_bwd


def _expected_recompute(spec, index: int) -> tuple[int, float]:
    run = runtime_time(spec, cuda=False)
    assert run is not None
    return run[index].ops_recompute, run[index].recompute_gemm_share


def _builtin_recompute(spec, index: int) -> tuple[int, float]:
    """Full recomputation of layer ``index`` of the built-in model of ``spec``
    (the head with the runtime's loss after it, outside the checkpoint)."""
    torch.manual_seed(0)
    model = build_preset_model(spec)
    for p in model.parameters():  # real tensors: the MoE routes by data
        torch.nn.init.normal_(p, 0.0, 0.02)
    layer = spec.layers[index]
    module = model.get_submodule(layer.name)
    ids = torch.randint(0, spec.vocab_size, (BATCH, spec.seq_len))
    x = torch.randn(BATCH, spec.seq_len, spec.hidden_size, requires_grad=True)
    if layer.kind == "embedding":
        return _recomputed(model, layer.name, lambda: module(ids))
    if layer.kind == "head":
        return _recomputed(model, layer.name, lambda: cross_entropy_loss(module(x), ids))
    return _recomputed(model, layer.name, lambda: module(x))


@pytest.mark.parametrize("name", ["gpt-bf16", "tiny-llama-bf16"])
def test_full_recompute_reruns_what_the_model_says(name):
    """torch's checkpoint stops once the saved tensors are back: a block reruns
    all but its MLP's output projection (GPT 2/3 of its matmul FLOPs), the head
    none of its LM head, and each adds the operators ``runtime_time`` says."""
    spec = gpt_decoder("gpt-bf16", num_layers=2, hidden=64, heads=4, seq=32, vocab=512) if name == "gpt-bf16" \
        else get_model(name)
    for index in (0, 1, len(spec.layers) - 1):
        ops, share = _builtin_recompute(spec, index)
        expected_ops, expected_share = _expected_recompute(spec, index)
        assert ops == expected_ops, spec.layers[index].name
        assert share == pytest.approx(expected_share if spec.layers[index].kind == "decoder" else 0.0)
    if name == "gpt-bf16":
        assert _expected_recompute(spec, 1)[1] == pytest.approx(2 / 3)


@pytest.mark.parametrize("name", ["gpt-bf16", "tiny-llama-bf16"])
def test_builtin_layers_dispatch_what_the_model_says(name):
    spec = gpt_decoder("gpt-bf16", num_layers=2, hidden=64, heads=4, seq=32, vocab=512) if name == "gpt-bf16" \
        else get_model(name)
    counts = _builtin_counts(spec, spec.layers[1].name)
    assert counts["embedding"] == _expected(spec, 0)
    assert counts["decoder"] == _expected(spec, 1)
    assert counts["head"] == _expected(spec, -1)


@pytest.mark.parametrize("experts", [2, 4])
def test_builtin_moe_block_dispatches_what_the_model_says(experts):
    """Base operators plus ``MOE_EXPERT_OPS`` per expert (its loop in ``Experts.forward``)."""
    spec = moe_decoder("tiny-moe", 2, 64, heads=4, num_experts=experts, seq=16, vocab=256, ffn_mult=4, top_k=2,
                       dtype_bytes=2)
    moe = next(i for i, layer in enumerate(spec.layers) if layer.is_moe)
    forward, backward = _builtin_counts(spec, spec.layers[moe].name)["decoder"]
    assert (forward, backward) == pytest.approx(_expected(spec, moe), rel=MOE_TOLERANCE)
    assert MOE_EXPERT_OPS["gpt"][0] > 0 and MOE_EXPERT_OPS["gpt"][1] > 0
    ops, share = _builtin_recompute(spec, moe)
    assert ops == pytest.approx(_expected_recompute(spec, moe)[0], rel=MOE_TOLERANCE)
    assert share == pytest.approx(1.0) == _expected_recompute(spec, moe)[1]  # the experts run before the combine


def _hf_llama_passes(layers: int, recompute: bool = False) -> tuple[int, int]:
    """Operators of a tiny HF Llama of ``layers`` decoder layers, padded batch and
    loss (``recompute``: every layer fully recomputed, as the runtime does it)."""
    config = transformers.AutoConfig.for_model(**dict(TINY_LLAMA, num_hidden_layers=layers))
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    if recompute:
        spec = model_from_hf_config(dict(TINY_LLAMA, num_hidden_layers=layers), seq_len=32)
        apply_recompute(model, {layer.name: "full" for layer in spec.layers}, [], [])
    ids = torch.randint(0, config.vocab_size, (BATCH, 32))
    mask = torch.ones(BATCH, 32, dtype=torch.long)
    mask[0, 16:] = 0
    return _passes(lambda: cross_entropy_loss(model(ids, attention_mask=mask, use_cache=False).logits, ids))


def test_hf_llama_layers_dispatch_what_the_model_says():
    """A tiny HF Llama as ``hetplan train`` runs it (bf16 autocast, a padding
    mask, the runtime's loss): each decoder layer adds its block's operators,
    and the rest of the model (embedding, rotary table, mask, final norm,
    lm_head, loss) is what the embedding and head rows hold together."""
    totals = [_hf_llama_passes(layers) for layers in (1, 2)]
    spec = model_from_hf_config(dict(TINY_LLAMA), seq_len=32)
    block = _expected(spec, 1)
    assert (totals[1][0] - totals[0][0], totals[1][1] - totals[0][1]) == block
    rest = tuple(e + h for e, h in zip(_expected(spec, 0), _expected(spec, -1)))
    assert (totals[0][0] - block[0], totals[0][1] - block[1]) == rest
    added = [_hf_llama_passes(layers, recompute=True)[1] - plain[1] for layers, plain in zip((1, 2), totals)]
    assert added[1] - added[0] == _expected_recompute(spec, 1)[0]
    assert added[0] - added[1] + added[0] == _expected_recompute(spec, 0)[0] + _expected_recompute(spec, -1)[0]


def test_runtime_columns_only_for_the_runtime_target():
    """Target "hetplan" costs the runtime's work (SDPA on every attention
    layer, its operators); the papers' target "" keeps the ModelSpec's
    unfused attention and no host floor."""
    workload = Workload(get_model("gpt3-1.3b"), get_cluster("1xH100"), 16, target="hetplan")
    runtime = CostKernel(workload).arrays
    papers = CostKernel(dataclasses.replace(workload, target="")).arrays
    attention = runtime.attention_flops > 0
    assert runtime.attention_fused[attention].all() and not papers.attention_fused[attention].any()
    assert runtime.host_ops_fwd is not None and papers.host_ops_fwd is None
