"""Helpers for the runtime's distributed tests: plans for tiny-gpt, workers, the reference.

Workers run in processes forked by hetplan.runtime.launch.run_local (cheap:
torch is imported once by the fork server); they must be module-level
functions of an importable module, hence this file.
"""

from __future__ import annotations

import functools
import os
from dataclasses import replace
from typing import Any, Sequence

from hetplan.plan.file import save_plan
from hetplan.plan.spec import LayerStrategy, Plan, uniform_stage
from hetplan.search.common.layer_splits import even_split

MODEL = "tiny-gpt"
NUM_LAYERS = 6  # embed, 4 blocks, head
TOL = 1e-5
STEPS = 3
GBS = 8


def make_plan(dp: int = 1, tp: int = 1, pp: int = 1, micro: int | None = None, *, zero: int = 0,
              recompute: str = "none", schedule: str = "1f1b", split: Sequence[Sequence[int]] | None = None,
              dp_split: Sequence[int] | None = None, sp: bool = False, virtual: int = 1, gbs: int = GBS,
              strategies: dict[int, LayerStrategy] | None = None, cluster: str | None = None,
              model: str = MODEL, num_layers: int = NUM_LAYERS) -> Plan:
    """A plan for tiny-gpt: devices 0.. in order (TP innermost, then DP, then PP).

    ``micro`` is the micro-batch size summed over the dp replicas (default:
    ``dp`` samples, one per replica); ``dp_split`` makes the split uneven.
    """
    micro = micro or (sum(dp_split) if dp_split else dp)
    layers = [list(r) for r in (split or even_split(num_layers, pp))]
    stages = []
    for j, ls in enumerate(layers):
        devices = list(range(j * dp * tp, (j + 1) * dp * tp))
        stage = uniform_stage(ls, devices, dp, tp, dp * (micro // dp) if not dp_split else dp, zero, recompute, sp)
        stage = replace(stage, dp_split=tuple(dp_split) if dp_split else (micro // dp,) * dp)
        if strategies:
            stage = replace(stage, strategies=tuple(strategies.get(i, stage.strategies[0]) for i in ls))
        stages.append(stage)
    return Plan(model, cluster or f"local-cpu-{dp * tp * pp}", gbs, micro, gbs // micro, schedule, tuple(stages),
                planner="test", virtual_stages=virtual)


def write_plan(directory: Any, plan: Plan, name: str = "plan.json") -> str:
    path = os.path.join(str(directory), name)
    save_plan(path, plan)
    return path


def train_worker(plan_path: str, steps: int = STEPS, cfg: dict[str, Any] | None = None) -> dict[str, Any]:
    """Train tiny-gpt under the plan in this (forked) process; rank 0 returns the
    full state. ``cfg``: more TrainConfig fields (checkpoint_dir, resume, ...)."""
    from hetplan.runtime.trainer import TrainConfig, train

    cfg = dict(cfg or {})
    return train(TrainConfig(plan_path, steps=steps, export=cfg.pop("export", True), quiet=True, **cfg))


def tiny_llama_spec() -> Any:
    """A Llama-style decoder (RMSNorm, SwiGLU, rotary positions, 4 heads / 2 KV heads, untied head)."""
    from hetplan.model.families import llama_decoder

    return llama_decoder("tiny-llama", 2, 64, 4, 2, 128, 256, 32, dtype_bytes=4)


def spec_worker(plan_path: str, spec_name: str, steps: int = STEPS) -> dict[str, Any]:
    from hetplan.runtime.trainer import TrainConfig, train

    spec = {"tiny-llama": tiny_llama_spec}[spec_name]()
    return train(TrainConfig(plan_path, steps=steps, export=True, quiet=True), spec)


@functools.lru_cache(maxsize=8)
def reference(steps: int = STEPS, gbs: int = GBS, seed: int = 0, spec_name: str = MODEL
              ) -> tuple[list[float], dict[str, Any]]:
    """The single-process run the distributed runs must reproduce."""
    from hetplan.model.presets import get_model
    from hetplan.runtime.models import build_preset_model, cross_entropy_loss
    from hetplan.runtime.reference import build_reference, make_optimizer, synthetic_batch, train_reference

    spec = tiny_llama_spec() if spec_name == "tiny-llama" else get_model(spec_name)
    model = build_reference(lambda: build_preset_model(spec), seed)
    opt = make_optimizer(model.parameters())
    batches = [synthetic_batch(spec.vocab_size, spec.seq_len, gbs, s, seed) for s in range(steps)]
    losses = train_reference(model, batches, cross_entropy_loss, opt, clip=1.0)
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_matches_reference(result: dict[str, Any], steps: int = STEPS, gbs: int = GBS,
                             tol: float = TOL, spec_name: str = MODEL) -> dict[str, Any]:
    from hetplan.runtime.reference import compare

    ref_losses, ref_state = reference(steps, gbs, 0, spec_name)
    cmp = compare(result["losses"], ref_losses, result["state"], ref_state)
    assert not cmp["missing"], f"parameters missing from the run: {cmp['missing']}"
    assert cmp["loss_rel_diff"] <= tol, f"losses {result['losses']} vs reference {ref_losses}: {cmp}"
    assert cmp["param_rel_diff"] <= tol, f"parameter {cmp['worst_param']} differs: {cmp}"
    return cmp


def run(fn: Any, world_size: int, *args: Any, timeout_s: float = 240.0) -> list[Any]:
    """Values returned by every rank (an AssertionError shows the first failure)."""
    from hetplan.runtime.launch import check_results

    return check_results(run_raw(fn, world_size, *args, timeout_s=timeout_s))


def run_raw(fn: Any, world_size: int, *args: Any, timeout_s: float = 240.0) -> list[Any]:
    """RankResults (exit code, value, error) of every rank; never raises."""
    from hetplan.runtime.launch import run_local

    return run_local(fn, world_size, args, timeout_s=timeout_s)


def assert_structure(plan: Plan, results: list[dict[str, Any]]) -> None:
    """Each rank holds exactly its chunks' layers; TP and ZeRO-3 shard what they should."""
    from hetplan.plan.layout import PlanLayout
    from hetplan.runtime.parallelize import owner_layer

    names = ["embed", *[f"layers.{i}" for i in range(NUM_LAYERS - 2)], "head"]
    layout = PlanLayout.from_plan(plan, names)
    for rank, result in enumerate(results):
        pos = layout.position(rank)
        expected = {n for c in pos.chunks for n in layout.chunk_names(c)}
        params = result["parameters"]
        held = {owner_layer(n, names) for n in params}
        assert held == expected, f"rank {rank} holds {sorted(held)}, expected {sorted(expected)}"
        zero = {names[i]: st.zero for s in plan.stages for i, st in zip(s.layers, s.strategies)}
        tp, dp = layout.stage_tp(pos.pp_index), layout.stage_dp(pos.pp_index)
        for name, (glob, local, _placements) in params.items():
            if tp > 1 and name.endswith(("attn.q.weight", "mlp.fc.weight")):
                assert local[0] * tp <= glob[0], f"{name} not split by TP: {glob} -> {local}"
            if dp > 1 and zero[owner_layer(name, names)] == 3:
                assert local[0] <= -(-glob[0] // dp), f"{name} not sharded by ZeRO-3: {glob} -> {local}"
            if layout.sequence_parallel and name.endswith("ln1.weight"):  # norms run on sequence shards
                assert "Replicate" in _placements, f"{name} not under SequenceParallel: {_placements!r}"


def build_worker(plan_path: str, model: str = "preset", steps: int = 1, change_shape: bool = False) -> list[float]:
    """init + parallelize + a few steps with a chosen (possibly wrong) model."""
    import torch

    from hetplan.model.presets import get_model
    from hetplan.runtime.context import init
    from hetplan.runtime.models import GPT, GPTConfig, build_preset_model, cross_entropy_loss
    from hetplan.runtime.reference import synthetic_batch

    spec = get_model(MODEL)
    builders = {
        "preset": lambda: build_preset_model(spec),
        "three-blocks": lambda: GPT(GPTConfig(num_layers=3)),  # no module 'layers.3'
        "three-heads": lambda: GPT(GPTConfig(hidden=60, heads=3)),  # tp=2 cannot split 3 heads
    }
    ctx = init(plan_path, spec)
    model_ = ctx.parallelize(builders[model])
    losses = []
    for step in range(steps):
        seq = spec.seq_len // 2 if change_shape and step == 1 else spec.seq_len
        x, y = synthetic_batch(spec.vocab_size, seq, ctx.plan.global_batch_size, step)
        losses.append(float(ctx.train_step(model_, (x, y), cross_entropy_loss)))
        for p in model_.parameters():
            p.grad = None
    ctx.close()
    del torch
    return losses


def _tiny_llama() -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    return config, LlamaForCausalLM


def hf_loss(output: Any, target: Any) -> Any:
    import torch.nn.functional as F

    logits = output.logits
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), target.reshape(-1))


def hf_worker(plan_path: str, steps: int = 2) -> dict[str, Any]:
    """Train a tiny HF Llama with the plan (TP from its config's base_model_tp_plan)."""
    import torch

    from hetplan.model.hf import model_from_hf_config
    from hetplan.runtime.context import init
    from hetplan.runtime.reference import make_optimizer, synthetic_batch

    config, cls = _tiny_llama()
    spec = model_from_hf_config(config, seq_len=16, dtype_bytes=4)
    ctx = init(plan_path, spec)
    model = ctx.parallelize(lambda: cls(config), seed=0, meta_init=False)
    opt = make_optimizer(model.parameters())
    losses = []
    for step in range(steps):
        x, y = synthetic_batch(128, 16, ctx.plan.global_batch_size, step)
        losses.append(float(ctx.train_step(model, (x, y), hf_loss)))
        opt.step()
        opt.zero_grad()
    state = ctx.full_state_dict(model)
    layout = ctx.parameter_layout(model)
    ctx.close()
    del torch
    return {"losses": losses, "state": state, "parameters": layout, "notes": ctx.notes}


def hf_reference(steps: int = 2, gbs: int = 4) -> tuple[list[float], dict[str, Any]]:
    import torch

    from hetplan.runtime.reference import make_optimizer, synthetic_batch, train_reference

    config, cls = _tiny_llama()
    torch.manual_seed(0)
    model = cls(config)
    opt = make_optimizer(model.parameters())
    batches = [synthetic_batch(128, 16, gbs, s) for s in range(steps)]
    losses = train_reference(model, batches, hf_loss, opt)
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def hf_plan(tp: int = 2, gbs: int = 4) -> Plan:
    from hetplan.model.hf import model_from_hf_config

    config, _ = _tiny_llama()
    spec = model_from_hf_config(config, seq_len=16, dtype_bytes=4)
    stage = uniform_stage(range(spec.num_layers), list(range(tp)), 1, tp, 2)
    return Plan(spec.name, f"local-cpu-{tp}", gbs, 2, gbs // 2, "1f1b", (stage,), planner="test")


def hetero_plan(stages: Sequence[tuple[Sequence[int], int, int, Sequence[int], int]], micro: int,
                schedule: str = "1f1b", gbs: int = GBS) -> Plan:
    """A Metis-style plan: per stage (layers, dp, tp, dp_split, zero); devices in order."""
    out, first = [], 0
    for layers, dp, tp, split, zero in stages:
        st = uniform_stage(layers, list(range(first, first + dp * tp)), dp, tp, dp, zero)
        out.append(replace(st, dp_split=tuple(split)))
        first += dp * tp
    return Plan(MODEL, f"local-cpu-{first}", gbs, micro, gbs // micro, schedule, tuple(out), planner="test")


def accumulate_worker(plan_path: str, steps: int = 2) -> dict[str, Any]:
    """Per optimizer step, two ``train_step`` calls on two batches before ``opt.step()``
    (gradient accumulation across calls), tiny-gpt with its embedding tied to the head."""
    import torch

    from hetplan.model.presets import get_model
    from hetplan.runtime.context import init
    from hetplan.runtime.models import build_preset_model, cross_entropy_loss
    from hetplan.runtime.reference import make_optimizer, synthetic_batch

    spec = get_model(MODEL)
    ctx = init(plan_path, spec)
    model = ctx.parallelize(lambda: build_preset_model(spec))
    opt = make_optimizer(model.parameters())
    losses = []
    for step in range(steps):
        for half in range(2):
            batch = synthetic_batch(spec.vocab_size, spec.seq_len, ctx.plan.global_batch_size, 2 * step + half)
            losses.append(float(ctx.train_step(model, batch, cross_entropy_loss)))
        opt.step()
        opt.zero_grad()
    state = ctx.full_state_dict(model)
    ctx.close()
    del torch
    return {"losses": losses, "state": state}


def accumulate_reference(steps: int = 2, gbs: int = GBS) -> tuple[list[float], dict[str, Any]]:
    """The single-process run of ``accumulate_worker``: backward twice, then one step."""
    from hetplan.model.presets import get_model
    from hetplan.runtime.models import build_preset_model, cross_entropy_loss
    from hetplan.runtime.reference import build_reference, make_optimizer, synthetic_batch

    spec = get_model(MODEL)
    model = build_reference(lambda: build_preset_model(spec))
    opt = make_optimizer(model.parameters())
    losses = []
    for step in range(steps):
        for half in range(2):
            x, y = synthetic_batch(spec.vocab_size, spec.seq_len, gbs, 2 * step + half)
            loss = cross_entropy_loss(model(x), y)
            loss.backward()
            losses.append(float(loss.detach()))
        opt.step()
        opt.zero_grad()
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def long_skip_worker(plan_path: str) -> float:
    """A user model whose forward adds the embedding output again before the head:
    not a chain of its layers, so a pipelined plan must refuse it."""
    import torch
    from torch import nn

    from hetplan.model.presets import get_model
    from hetplan.runtime.context import init
    from hetplan.runtime.models import build_preset_model, cross_entropy_loss
    from hetplan.runtime.reference import synthetic_batch

    spec = get_model(MODEL)

    class LongSkip(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            inner = build_preset_model(spec)
            self.embed, self.layers, self.head = inner.embed, inner.layers, inner.head

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            e = self.embed(x)
            h = e
            for layer in self.layers.values():
                h = layer(h)
            return self.head(h + e)

    ctx = init(plan_path, spec)
    model = ctx.parallelize(LongSkip)
    x, y = synthetic_batch(spec.vocab_size, spec.seq_len, ctx.plan.global_batch_size, 0)
    return float(ctx.train_step(model, (x, y), cross_entropy_loss))


def torch_clip_worker(plan_path: str) -> dict[str, Any]:
    """One step, then PyTorch's own clip_grad_norm_ on the parallelised model.
    Returns what happened, and the result of ctx.clip_grad_norm_ (the right way)."""
    import torch

    from hetplan.errors import HetplanError
    from hetplan.model.presets import get_model
    from hetplan.runtime.context import init
    from hetplan.runtime.models import build_preset_model, cross_entropy_loss
    from hetplan.runtime.reference import synthetic_batch

    spec = get_model(MODEL)
    ctx = init(plan_path, spec)
    model = ctx.parallelize(lambda: build_preset_model(spec))
    batch = synthetic_batch(spec.vocab_size, spec.seq_len, ctx.plan.global_batch_size, 0)
    ctx.train_step(model, batch, cross_entropy_loss)
    try:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)
        torch_clip = "ran"
    except HetplanError as e:
        torch_clip = str(e)
    norm = float(ctx.clip_grad_norm_(model, 1e9))
    ctx.close()
    plain = torch.nn.Linear(2, 2)
    plain.weight.grad = torch.ones(2, 2)
    torch.nn.utils.clip_grad_norm_(plain.parameters(), 1.0)  # other models: PyTorch's function unchanged
    return {"torch_clip": torch_clip, "norm": norm}


def compiled_whole_worker(plan_path: str) -> dict[str, Any]:
    """The user compiles the returned model themselves (torch.compile(model))."""
    import torch

    from hetplan.errors import HetplanError
    from hetplan.model.presets import get_model
    from hetplan.runtime.context import init
    from hetplan.runtime.models import build_preset_model, cross_entropy_loss
    from hetplan.runtime.reference import synthetic_batch

    spec = get_model(MODEL)
    ctx = init(plan_path, spec)
    model = torch.compile(ctx.parallelize(lambda: build_preset_model(spec)))
    batch = synthetic_batch(spec.vocab_size, spec.seq_len, ctx.plan.global_batch_size, 0)
    try:
        result = {"loss": float(ctx.train_step(model, batch, cross_entropy_loss)),
                  "norm": float(ctx.clip_grad_norm_(model, 1e9)),
                  "state": sorted(ctx.full_state_dict(model))}
    except HetplanError as e:
        result = {"error": str(e)}
    ctx.close()
    return result


def ep_dispatch_worker() -> dict[str, Any]:
    """``moe_dispatch_combine`` over 2 EP ranks (each holding 2 of 4 experts)
    whose experts return bf16 outputs of fp32 token rows, as under autocast:
    the max differences of the output and of the rows' gradient from the same
    experts run locally (elementwise experts, so any difference is the dispatch's)."""
    import torch
    import torch.distributed as dist

    from hetplan.runtime.ep import moe_dispatch_combine

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    scales = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))  # expert e: x * scales[e], in bf16
    g = torch.Generator().manual_seed(1 + rank)
    tokens = torch.randn(6, 8, generator=g, requires_grad=True)
    experts, weights = torch.randint(0, 4, (6, 2), generator=g), torch.rand(6, 2, generator=g)

    def experts_fn(held: torch.Tensor) -> Any:
        return lambda rows, counts: torch.cat([(r * s).to(torch.bfloat16) for r, s in zip(rows.split(counts), held)])

    out = moe_dispatch_combine(tokens, experts, weights, experts_fn(scales[2 * rank:2 * rank + 2]), 4,
                               dist.group.WORLD)
    local = moe_dispatch_combine(tokens, experts, weights, experts_fn(scales), 4)
    (grad,), (local_grad,) = torch.autograd.grad(out.sum(), tokens), torch.autograd.grad(local.sum(), tokens)
    dist.destroy_process_group()
    return {"dtype": str(out.dtype), "out": float((out - local).abs().max()),
            "grad": float((grad - local_grad).abs().max())}


def mixed_plan(stages: Sequence[tuple[Sequence[int], Sequence[int], Sequence[int]]], micro: int,
               schedule: str = "1f1b", gbs: int = GBS) -> Plan:
    """A plan whose stages may mix TP degrees across replicas (Sailor's):
    per stage (layers, replica_tp, dp_split); devices in order, replica after replica."""
    out, first = [], 0
    for layers, degrees, split in stages:
        dp, tp, count = len(degrees), max(degrees), sum(degrees)
        st = uniform_stage(layers, list(range(first, first + dp * tp)), dp, tp, dp, 0)
        mixed = tuple(degrees) if len(set(degrees)) > 1 else None
        out.append(replace(st, devices=tuple(range(first, first + count)), dp_split=tuple(split), replica_tp=mixed))
        first += count
    return Plan(MODEL, f"local-cpu-{first}", gbs, micro, gbs // micro, schedule, tuple(out), planner="test")


def replica_state_worker(plan_path: str, steps: int = 2) -> dict[str, Any]:
    """Train tiny-gpt under the plan as ``hetplan train`` does (clip 1.0, the
    reference optimizer); every rank returns the losses and its own replica's
    whole parameters (DTensor shards gathered over the replica's TP ranks only),
    before training ("start") and after ("state")."""
    from hetplan.model.presets import get_model
    from hetplan.runtime.context import init
    from hetplan.runtime.models import build_preset_model, cross_entropy_loss
    from hetplan.runtime.reference import make_optimizer, synthetic_batch

    spec = get_model(MODEL)
    ctx = init(plan_path, spec)
    model = ctx.parallelize(lambda: build_preset_model(spec))
    opt = make_optimizer(model.parameters())
    start = _replica_state(model)
    losses = []
    for step in range(steps):
        batch = synthetic_batch(spec.vocab_size, spec.seq_len, ctx.plan.global_batch_size, step)
        losses.append(float(ctx.train_step(model, batch, cross_entropy_loss)))
        ctx.clip_grad_norm_(model, 1.0)
        opt.step()
        opt.zero_grad()
    state = _replica_state(model)
    ctx.close()
    return {"losses": losses, "start": start, "state": state}


def _replica_state(model: Any) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor

    return {n: (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()
            for n, t in model.state_dict().items()}
