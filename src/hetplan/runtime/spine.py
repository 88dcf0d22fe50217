"""The parallelisation spine: what ``RuntimeContext.parallelize`` applies, in order.

``parallelize`` (hetplan.runtime.context) builds the whole model, checks it
(hetplan.runtime.preflight), declares context parallelism on it
(:func:`apply_cp`: the model's ``set_context_parallel`` reaches every module,
so it comes before the split), splits it into this rank's pipeline parts
(:func:`split_pipeline`) and runs :func:`parallelize_part` on each part:

    TP -> EP -> recompute / offload -> compile -> expert ZeRO -> ZeRO / FSDP

one named call per step, as torchtitan's ``parallelize_llama`` reads. The
order matters (hetplan.runtime.parallelize says why): TP finds submodules by
name before anything wraps them, FSDP comes last so that it shards the
DTensors TP and EP made. Then ``parallelize`` materialises the parts and makes
the pipeline stages (:func:`pipeline_stages`).

Nothing here reads the RuntimeContext: what the plan asks of this rank's
layers, and the meshes to do it on, come in a :class:`PartSettings`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from hetplan.errors import HetplanError
from hetplan.plan.spec import Plan
from hetplan.runtime import dropout as rng
from hetplan.runtime import microbatch
from hetplan.runtime import parallelize as par
from hetplan.runtime.cp import ContextShard
from hetplan.runtime.hetero import HeteroPipeline
from hetplan.plan.layout import PlanLayout, RankPosition, tied_layer_groups
from hetplan.runtime.offload import apply_offload


@dataclass(frozen=True)
class PartSettings:
    """What the plan asks of this rank's layers, and the meshes to do it on.

    Attributes:
        tp, tp_mesh, tp_index: the stage's tensor-parallel degree, mesh and this rank's index in it.
        sequence_parallel: the plan's sequence parallelism (with tp > 1).
        tp_plan: the whole-model TP plan (``preflight.model_tp_plan``), for layers without a registered one.
        ep_mesh: the ``("pp", "edp", "ep", "tp")`` mesh of an expert-parallel plan, else None.
        expert_zero_sharded: ZeRO-2/3 shards the experts over their expert-data-parallel ranks (there are some).
        recompute, zero: each layer's recomputation ("none", "selective", "full") and ZeRO stage.
        core_layers: the layers the cost model charges an attention core for (selective recomputation).
        offloaded: the layers whose saved activations go to host memory.
        offload_pool: the host pool they go to (made on first use).
        compile: ``torch.compile`` each layer.
        dp, dp_mesh: ``dp * cp``, the ranks dense gradients are averaged over, and their mesh.
    """

    recompute: dict[str, str]
    zero: dict[str, int]
    offload_pool: Callable[[], Any]
    tp: int = 1
    tp_mesh: Any = None
    tp_index: int = 0
    sequence_parallel: bool = False
    tp_plan: dict[str, Any] | None = None
    ep_mesh: Any = None
    expert_zero_sharded: bool = False
    core_layers: frozenset[str] = frozenset()
    offloaded: frozenset[str] = frozenset()
    compile: bool = False
    dp: int = 1
    dp_mesh: Any = None
    plain_ddp: bool = False  # plain data parallelism: DDP (parallelize.apply_ddp), not FSDP2 replicate


@dataclass
class PartResult:
    """What :func:`parallelize_part` made of a part: the modules the data-parallel
    wrappers sync (with whether each reduces on every micro-batch) and the
    expert-parallel experts the step syncs itself."""

    sync_modules: list[tuple[nn.Module, bool]] = field(default_factory=list)
    experts: set[nn.Parameter] = field(default_factory=set)


def parallelize_part(part: nn.Module, chunk_names: list[str], how: PartSettings, notes: list[str]) -> PartResult:
    """Apply the plan to one pipeline part (its layers ``chunk_names``), in order;
    ``notes`` gets what ran differently from the plan's letter, and why."""
    apply_tensor_parallel(part, chunk_names, how, notes)
    experts = apply_expert_parallel(part, chunk_names, how)
    par.apply_recompute(part, {n: how.recompute[n] for n in chunk_names}, notes, how.core_layers)
    offload_activations(part, chunk_names, how)
    if how.compile:
        par.apply_compile(part, chunk_names)
    synced = apply_expert_zero(part, chunk_names, how)
    synced += apply_data_parallel(part, chunk_names, how, experts, notes)
    return PartResult(synced, experts)


# --- the steps ------------------------------------------------------------------------------------
def apply_cp(full: nn.Module, group: Any, cp_index: int, cp: int) -> None:
    """Context parallelism: the whole model runs on this rank's chunk of every
    sequence (``set_context_parallel``, hetplan.runtime.cp)."""
    full.set_context_parallel(ContextShard(group, cp_index, cp))


def apply_tensor_parallel(part: nn.Module, chunk_names: list[str], how: PartSettings, notes: list[str]) -> None:
    """The layers' TP plans (hetplan.runtime.tp), and dropout told its TP rank."""
    if how.tp > 1:
        par.apply_tp(part, chunk_names, how.tp_mesh, how.sequence_parallel, notes, how.tp_plan)
        rng.set_tp(part, how.tp_index, how.tp, how.sequence_parallel)


def apply_expert_parallel(part: nn.Module, chunk_names: list[str], how: PartSettings) -> set[nn.Parameter]:
    """Experts split over the EP ranks (and the stage's TP ranks); returns those
    the step syncs itself. Expert TP alone (ep = 1): the experts are TP-sharded
    weights like the dense ones, synced by the data-parallel wrappers."""
    if how.ep_mesh is not None:
        return _shard_experts(part, chunk_names, how)
    if how.tp > 1:
        par.apply_ep(part, chunk_names, how.tp_mesh, None, how.tp_mesh.get_group())
    return set()


def _shard_experts(part: nn.Module, chunk_names: list[str], how: PartSettings) -> set[nn.Parameter]:
    """Experts as DTensors on ``(edp, ep[, tp])`` (expert TP = the stage's tp,
    Megatron-Core's default), synced by the step; those of ZeRO-2/3 layers on
    ``(ep[, tp])``, sharded over ``edp`` by FSDP later (:func:`apply_expert_zero`)."""
    etp = how.tp > 1
    tp_group = how.ep_mesh["tp"].get_group() if etp else None
    synced: set[nn.Parameter] = set()
    for name in chunk_names:
        by_fsdp = how.zero[name] >= 2 and how.expert_zero_sharded
        dims = ("ep", "tp") if etp else ("ep",)
        mesh = how.ep_mesh[dims if by_fsdp else ("edp", *dims)]
        params = par.apply_ep(part, [name], mesh, how.ep_mesh["ep"].get_group(), tp_group)
        if not by_fsdp:
            synced |= params
    return synced


def offload_activations(part: nn.Module, chunk_names: list[str], how: PartSettings) -> None:
    """The offloaded layers' saved activations to host memory (hetplan.runtime.offload)."""
    names = [n for n in chunk_names if n in how.offloaded]
    if names:
        apply_offload(part, names, how.offload_pool())


def apply_expert_zero(part: nn.Module, chunk_names: list[str], how: PartSettings) -> list[tuple[nn.Module, bool]]:
    """ZeRO-2/3 of expert-parallel experts over their expert-data-parallel ranks."""
    if how.ep_mesh is None or not how.expert_zero_sharded:
        return []
    return par.apply_expert_zero(part, chunk_names, how.zero, how.ep_mesh["edp"], how.dp)


def apply_data_parallel(part: nn.Module, chunk_names: list[str], how: PartSettings, experts: set[nn.Parameter],
                        notes: list[str]) -> list[tuple[nn.Module, bool]]:
    """Each layer's ZeRO stage as FSDP2 ``replicate`` / ``fully_shard`` over the
    ``dp * cp`` ranks, leaving the step's experts alone."""
    if how.dp == 1:
        return []
    if how.plain_ddp:
        return par.apply_ddp(part, how.dp_mesh)
    return par.apply_dp(part, {n: how.zero[n] for n in chunk_names}, how.dp_mesh, notes, ignored=experts or None)


# --- around the parts -----------------------------------------------------------------------------
def build_whole(build_model: Callable[[], nn.Module], meta_init: bool) -> nn.Module:
    """The whole model: on the meta device (it costs no memory; parallelize
    materialises each rank's shards) unless ``meta_init`` is False."""
    if meta_init:
        with torch.device("meta"):
            full = build_model()
    else:
        full = build_model()
    if not isinstance(full, nn.Module):
        raise HetplanError("build_model() must return a torch.nn.Module")
    return full


def move_to(module: nn.Module, device: torch.device) -> None:
    """Move a model built for real to ``device``, unless it is there already:
    ``Module.to`` swaps every fake-tensor parameter (torch 2.13,
    ``nn.Module._apply``), which fails for one a fake-tensor memo refers to
    (hetplan.runtime.replay builds the model under ``FakeTensorMode``)."""
    tensors = [*module.parameters(), *module.buffers()]
    if any(t.device != device for t in tensors):
        module.to(device)


def layer_strategies(plan: Plan, layout: PlanLayout, spec: Any) -> tuple[dict[str, str], dict[str, int]]:
    """Each layer's recomputation and ZeRO stage; a weight tied across stages
    needs the same sharding on both sides (the larger ZeRO stage of its layers)."""
    recompute: dict[str, str] = {}
    zero: dict[str, int] = {}
    for stage in plan.stages:
        for index, strategy in zip(stage.layers, stage.strategies):
            name = layout.layer_names[index]
            recompute[name] = strategy.recompute
            zero[name] = strategy.zero
    if layout.pp > 1:
        for group in tied_layer_groups(spec):
            z = max(zero[n] for n in group)
            for n in group:
                zero[n] = z
    return recompute, zero


def offloaded_layers(plan: Plan, layout: PlanLayout) -> frozenset[str]:
    """Names of the layers whose saved activations go to host memory (``hetplan.runtime.offload``)."""
    return frozenset(layout.layer_names[index] for stage in plan.stages
                     for index, strategy in zip(stage.layers, stage.strategies) if strategy.offload)


def split_pipeline(full: nn.Module, layout: PlanLayout, position: RankPosition, spec: Any,
                   staged: Any) -> tuple[nn.Module, list[nn.Module]]:
    """(this rank's model, its pipeline parts: one per chunk it runs). One
    chunk in the plan: the whole model; else a ``PipelinePart`` of the rank's
    layers at their original paths, and one per chunk inside it."""
    if layout.num_chunks == 1:
        return full, [full]
    chunks = list(position.chunks)
    modules = par.spec_layer_modules(spec)
    local = par.PipelinePart(full, [n for c in chunks for n in layout.chunk_names(c)], modules, staged)
    parts = [par.PipelinePart(local, layout.chunk_names(c), modules, staged) for c in chunks]
    return local, parts if len(parts) > 1 else [local]


def tied_pairs(full: nn.Module, layout: PlanLayout) -> list[tuple[str, str]]:
    """The (canonical, alias) names of weights tied across pipeline stages, whose gradients the step sums."""
    if layout.pp == 1:
        return []
    return one_pair_per_stage_pair(par.tied_layer_pairs(full, list(layout.layer_names)), layout)


def one_pair_per_stage_pair(pairs: list[tuple[str, str]], layout: PlanLayout) -> list[tuple[str, str]]:
    """A weight tied three ways (T5: encoder and decoder embeddings, LM head) with
    two copies on one stage is one tensor there: its gradient is summed with
    the other stage's once, so keep one pair per (weight, pair of stages)."""
    seen: set[tuple[str, int, int]] = set()
    out = []
    for canon, alias in pairs:
        a, b = (layout.pp_index_of_layer(par.owner_layer(f, layout.layer_names)) for f in (canon, alias))
        if (canon, a, b) not in seen:
            seen.add((canon, a, b))
            out.append((canon, alias))
    return out


def pipeline_stages(parts: list[nn.Module], layout: PlanLayout, position: RankPosition, device: torch.device,
                    pp_group: Any, sync_modules: list[tuple[nn.Module, bool]]) -> list[Any]:
    """The pipeline stages of this rank's parts: hetplan's executor for stages of
    different (dp, tp) (hetplan.runtime.hetero), else torch's ``PipelineStage``
    per chunk, each micro-batch's forward in its own autocast region and with
    its own dropout rows (hetplan.runtime.microbatch); none with one stage."""
    if layout.heterogeneous:
        return [HeteroPipeline(layout, position, parts[0], device, sync_modules)]
    if layout.pp == 1:
        return []
    from torch.distributed.pipelining import PipelineStage  # lazy: only pipelined runs need it

    stages = []
    for part, chunk in zip(parts, position.chunks):
        stages.append(PipelineStage(part, chunk, layout.num_chunks, device, group=pp_group))
        microbatch.wrap_stage(stages[-1])
        inside = {id(m) for m in part.modules()}
        keep_plan_sharding(stages[-1], [(m, every) for m, every in sync_modules if id(m) in inside])
    return stages


def keep_plan_sharding(stage: Any, sync_modules: list[tuple[nn.Module, bool]]) -> None:
    """A pipelined stage's ZeRO as the plan says and the cost model charges: each
    micro-batch's backward under ``parallelize.set_accumulating`` (ZeRO-3 layers
    reduce-scatter and reshard on every micro-batch, the others on the last), as in
    the one-stage loop. torch's ``backward_maybe_with_nosync`` instead turns off
    gradient sync and reshard-after-backward on the whole FSDP part for every
    micro-batch (torch/distributed/pipelining/stage.py:844-847, torch 2.13): a
    ZeRO-3 stage then held whole gradients and gathered weights through the step
    (found by the replay check: a 70B pp2 ZeRO-3 stage at 301 GiB, 55 costed). The
    schedule's final gradient reduction (stage.py:1173) then finds nothing left
    unreduced. Split backwards (zero-bubble schedules) keep torch's path."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.pipelining._backward import stage_backward

    original = stage.backward_maybe_with_nosync

    def backward_maybe_with_nosync(backward_type: str, bwd_kwargs: dict, last_backward: bool = False) -> Any:
        if backward_type != "full" or not isinstance(stage.submod, FSDPModule):
            return original(backward_type, bwd_kwargs, last_backward)
        par.set_accumulating(sync_modules, last_backward)
        return stage_backward(bwd_kwargs["stage_output"], bwd_kwargs["output_grads"], bwd_kwargs["input_values"]), None

    stage.backward_maybe_with_nosync = backward_maybe_with_nosync
