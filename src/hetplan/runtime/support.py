"""What hetplan's runtime can run of a model, found by the runtime's own code.

:func:`inspect_model` looks at the model the runtime would build (a HF class on
the meta device, a ``pkg.mod:build`` module) with the runtime's own rules --
the TP plans ``apply_tp`` would apply, the HF staged forwards,
``set_context_parallel``, the MoE modules ``apply_ep`` splits, the
selective-recompute targets -- when the model is imported, and records the
result in ``ModelSpec.runtime`` (:class:`~hetplan.model.spec.RuntimeSupport`)
and each layer's ``tp_replicated`` (a layer with parameters and no TP plan runs
whole on every TP rank: the cost kernel costs it so). Everyone reads those
facts torch-free through :mod:`hetplan.plan.support`.

Importing this module does not import torch; :func:`inspect_model` does.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Sequence

from hetplan.errors import HetplanError
from hetplan.model.origin import HFSource
from hetplan.model.spec import ModelSpec, RuntimeSupport
from hetplan.plan.support import HF_SEQUENCE_PARALLEL, moe_sequence_parallel
from hetplan.runtime import tp as tpr


# --- finding the facts on the model the runtime builds (imports torch) -----------------------------
def inspect_model(model: Any, spec: ModelSpec, pipeline: str = "") -> ModelSpec:
    """``spec`` with what the runtime can run of ``model`` (the module it
    builds for ``spec``, on the meta device): ``runtime`` set, and
    ``tp_replicated`` on the layers with parameters that no TP plan covers.
    ``pipeline``: why it cannot pipeline the model ("" if it can)."""
    names = [layer.name for layer in spec.layers]
    tensor_parallel, replicated = _tp_facts(model, names)
    expert_parallel, expert_tp = _expert_facts(model, names)
    whole = {} if tensor_parallel or expert_tp else measured_tp_whole(model, spec)
    layers = [_as_tp_runs(layer, layer.name in replicated, whole.get(layer.name)) for layer in spec.layers]
    moe = next((layer.name for layer in spec.layers if layer.is_moe), "")
    hf = isinstance(spec.source, HFSource)
    sequence = _sequence_parallel_refusal(model, names, moe, hf, replicated)
    support = RuntimeSupport(
        pipeline=pipeline,
        tensor_parallel=tensor_parallel or expert_tp,
        sequence_parallel=sequence,
        context_parallel="" if callable(getattr(model, "set_context_parallel", None)) else (
            f"{type(model).__name__} does not declare context-parallel support (a set_context_parallel(shard) "
            "method; hetplan's GPT has one, see docs/runtime.md); plan with cp=1"),
        expert_parallel=expert_parallel if moe else "",
        selective_recompute=_selective_refusal(model, spec),
    )
    return replace(spec, layers=tuple(layers), runtime=support)


def _as_tp_runs(layer: Any, unplanned: bool, whole: int | None) -> Any:
    """``layer`` with what TP leaves whole as the runtime splits it: all of a
    layer without TP plan, or ``whole`` parameters measured on the split model."""
    if unplanned or (whole is not None and whole >= layer.params > 0):
        return replace(layer, tp_replicated=True)
    if whole is not None and whole != layer.params_tp_replicated:
        return replace(layer, params_tp_replicated=whole)
    return layer


# TP degree of the measuring split: the smallest; every TP plan splits a tensor
# evenly or (vocabularies) within one row of it (runtime.hf_tp), so what stays
# whole is the same at any tp.
MEASURE_TP = 2


def measured_tp_whole(model: Any, spec: ModelSpec) -> dict[str, int]:
    """Per layer, the parameters the runtime's TP plans leave whole on every TP
    rank, counted on ``model`` (meta tensors) split by ``parallelize.apply_tp``
    itself over a fake process group of ``MEASURE_TP`` ranks (torch's "fake"
    backend: no communication, no memory): ``2 x held - all``. A norm, a
    position table, a bias a row-parallel layer adds after its all-reduce, a
    classifier a family's plan keeps whole -- whatever the plans do, counted,
    not assumed. Empty where it cannot be measured here (a process group is
    already up, a plan refuses tp=2): the analytic counts stand."""
    import copy

    import torch
    import torch.distributed as dist

    if not dist.is_available() or dist.is_initialized():
        return {}
    from torch.distributed.device_mesh import DeviceMesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from hetplan.runtime import parallelize as par  # lazy: torch (this module's top is torch-free)
    from hetplan.runtime.preflight import model_tp_plan

    modules = {k: list(v) for k, v in (spec.meta.get("layer_modules") or {}).items()}
    names = [layer.name for layer in spec.layers]
    with torch.device("meta"):
        split = copy.deepcopy(model).to("meta")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=MEASURE_TP)
    try:
        # a dim name no real mesh has: DTensor caches sharding decisions by mesh equality, and a
        # real TP mesh equal to this one would reuse them -- with this fake group's no-op collectives
        mesh = DeviceMesh("cpu", torch.arange(MEASURE_TP), mesh_dim_names=("hetplan-measure-tp",))
        par.apply_tp(split, names, mesh, False, [], model_tp_plan(split))
    except (HetplanError, ValueError, RuntimeError):
        return {}
    finally:
        dist.destroy_process_group()
    out = {}
    for name in names:
        params = {id(p): p for path in modules.get(name) or [name] for p in split.get_submodule(path).parameters()}
        held = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in params.values())
        total = sum(p.numel() for p in params.values())
        out[name] = max(0, min(total, MEASURE_TP * held - (MEASURE_TP - 1) * total))
    return out


def _expert_facts(model: Any, names: Sequence[str]) -> tuple[str, str]:
    """(why the runtime cannot split the model's experts over EP ranks, why
    not over TP ranks), by the rules of ``preflight.check_model_cp_ep``: its
    own MoE modules split both ways; HF's fused experts of the classes it
    adapts (``runtime.ep.HF_EXPERTS``) over EP ranks only."""
    from hetplan.runtime import ep  # lazy: torch (this module's top is torch-free)
    from hetplan.runtime import parallelize as par  # lazy: torch (this module's top is torch-free)

    hf = ep.hf_fused_experts(model)
    if not hf and not par.moe_modules(model):
        return (f"hetplan's runtime has no expert parallelism for the mixture-of-experts layers of "
                f"{type(model).__name__}; plan with ep=1"), ""
    no_ep = next((why for why in (ep.hf_experts_refusal(fqn, m) for fqn, m in hf) if why), "")
    no_tp = ""
    if hf:
        fqn, module = hf[0]
        no_tp = ep.hf_tp_refusal(par.owner_layer(fqn, names) or fqn, type(module).__name__, None)
    return no_ep, no_tp


def _tp_facts(model: Any, names: Sequence[str]) -> tuple[str, set[str]]:
    """(why TP cannot run at all, the layers TP would leave whole), by the
    rules ``parallelize.apply_tp`` applies to each layer's module."""
    from hetplan.runtime import parallelize as par  # lazy: torch (this module's top is torch-free)
    from hetplan.runtime.preflight import model_tp_plan

    try:
        whole_plan = model_tp_plan(model)
    except HetplanError as exc:
        return str(exc), set()
    replicated = set()
    for name in names:
        layer = model.get_submodule(name)
        if any(True for _ in layer.parameters()) and not par.has_tp_plan(layer, name, whole_plan):
            replicated.add(name)
    return "", replicated


def _sequence_parallel_refusal(model: Any, names: Sequence[str], moe: str, hf: bool, replicated: set[str]) -> str:
    """Why the runtime cannot run ``model`` with sequence parallelism (``moe``: its first MoE layer, if any)."""
    if replicated:
        return (f"layer {sorted(replicated)[0]!r} has no TP plan, and with sequence parallelism it would see only a "
                "slice of the sequence; register one with hetplan.runtime.register_tp_plan or plan without "
                "sequence parallelism")
    if moe:
        return moe_sequence_parallel(moe)
    for name in names:
        layer = model.get_submodule(name)
        if tpr.registered_plan_in(layer):
            try:
                tpr.dry_run(layer, name, 1, True)
            except HetplanError as exc:
                return str(exc)
        elif hf and any(True for _ in layer.parameters()):
            return HF_SEQUENCE_PARALLEL
    return ""


def _selective_refusal(model: Any, spec: ModelSpec) -> str:
    """Selective recomputation recomputes each attention layer's core; the
    first layer with a costed core the runtime cannot checkpoint alone says why
    (``parallelize.selective_refusal``, the rule ``apply_recompute`` follows)."""
    from hetplan.runtime import parallelize as par  # lazy: torch (this module's top is torch-free)

    for layer in spec.layers:
        if layer.attention_flops > 0:
            why = par.selective_refusal(model.get_submodule(layer.name), layer.name)
            if why:
                return why
    return ""
