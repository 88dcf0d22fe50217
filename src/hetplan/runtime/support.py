"""What hetplan's runtime can run: one check for the runtime, the planners and ``estimate``.

A plan costed one way and run another is a wrong number, worse than an error
(a TP plan whose layers run replicated, a pipelined plan of a model the
runtime cannot split). So what the runtime can run of a model is found once,
by the runtime's own code, and read by everyone:

* :func:`inspect_model` looks at the model the runtime would build (a HF
  class on the meta device, a ``pkg.mod:build`` module) with the runtime's own
  rules -- the TP plans ``apply_tp`` would apply, the HF staged forwards,
  ``set_context_parallel``, the MoE modules ``apply_ep`` splits, the
  selective-recompute targets -- when the model is imported, and records the
  result in ``ModelSpec.runtime`` (:class:`~hetplan.model.spec.RuntimeSupport`)
  and each layer's ``tp_replicated`` (a layer with parameters and no TP plan
  runs whole on every TP rank: the cost kernel costs it so).
* :func:`support_of` gives those facts for any model, torch-free: presets are
  the runtime's built-in decoder (:func:`builtin_refusal` says which presets
  it builds).
* :func:`runtime_refusal` says why the runtime would refuse a plan ("" if it
  runs it as costed): the model's facts plus the plan-level rules of
  :class:`~hetplan.runtime.layout.PlanLayout`. ``hetplan.runtime.init`` raises
  it; ``hetplan plan`` keeps only plans it passes (``hetplan.export.target``, target
  "hetplan"); ``hetplan estimate`` refuses a plan it does not pass.

Importing this module does not import torch (the planner side uses it);
:func:`inspect_model` imports it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Sequence

from hetplan.errors import HetplanError
from hetplan.model.spec import ModelSpec, RuntimeSupport
from hetplan.plan.spec import Plan
from hetplan.runtime import tp as tpr
from hetplan.runtime.layout import PlanLayout

BUILTIN_FAMILIES = ("gpt", "llama", "moe")  # runtime.models: GPT/Llama decoders, GShard-style MoE decoders
HF_SEQUENCE_PARALLEL = ("hetplan's runtime splits a HF model from its config's TP plan, which has no sequence "
                        "parallelism; plan without sequence parallelism")


# --- the facts -----------------------------------------------------------------------------------
def moe_sequence_parallel(layer: str) -> str:
    """The runtime's MoE blocks run their router on whole sequences (``runtime.models.block_tp_plan``)."""
    return (f"sequence parallelism with the mixture-of-experts layer {layer!r} is not supported; "
            "turn sequence_parallel off")


def builtin_refusal(spec: ModelSpec) -> str:
    """Why the runtime's built-in model (``runtime.models.GPT``) cannot be
    ``spec`` ("" if its layer names and family are the built-in decoder's;
    ``config_from_spec`` then checks the sizes)."""
    names = [layer.name for layer in spec.layers]
    n = len(names) - 2
    if n < 1 or names != ["embed"] + [f"layers.{i}" for i in range(n)] + ["head"]:
        return (f"model {spec.name!r} has layers {names[:3]}...; the built-in runtime model needs 'embed', "
                "'layers.0'..'layers.N-1', 'head' -- pass your own build function to hetplan.runtime "
                "(ctx.parallelize(build_model)) for other models")
    if spec.family not in BUILTIN_FAMILIES:
        return (f"the built-in runtime model covers GPT- and Llama-style decoders and GShard-style MoE decoders, "
                f"not family {spec.family!r}; pass your own build function to hetplan.runtime")
    if not (spec.hidden_size and spec.num_heads and spec.vocab_size):
        return f"model {spec.name!r} lacks hidden size, heads or vocabulary"
    return ""


def support_of(spec: ModelSpec) -> RuntimeSupport:
    """What the runtime can run of ``spec``: the facts found at import, else
    (presets) the built-in model's; a model file written before the facts
    existed keeps the one it had (its pipeline blocker)."""
    if spec.runtime is not None:
        return spec.runtime
    if spec.meta.get("hf_class") or spec.meta.get("module_source"):
        blocker = spec.meta.get("runtime_pipeline") or spec.meta.get("pipeline_blocker") or ""
        return RuntimeSupport(pipeline=str(blocker))
    why = builtin_refusal(spec)
    if why:
        return RuntimeSupport(build=why)
    moe = next((layer.name for layer in spec.layers if layer.is_moe), "")
    return RuntimeSupport(sequence_parallel=moe_sequence_parallel(moe) if moe else "")


# --- what a search may try --------------------------------------------------------------------------
@dataclass(frozen=True)
class SearchLimits:
    """The dimensions a planner may use for a workload: all of them without a
    target; for hetplan's runtime only what it runs (``support_of`` its model)
    and never what its layout refuses in any plan (sequence parallelism in
    stages of different (dp, tp) or with cp/ep, uneven expert splits). A
    layer's own tp inside a stage (Galvatron-BMW) is not limited here: the
    plans the runtime refuses are dropped after the search (``hetplan.export.target``)."""

    pipeline: bool = True
    sequence_parallel: bool = True
    context_parallel: bool = True
    expert_parallel: bool = True
    selective_recompute: bool = True
    mixed_stage_sequence_parallel: bool = True  # SP in a plan whose stages differ in (dp, tp)
    sequence_parallel_with_cp_ep: bool = True  # SP in a plan with context or expert parallelism
    uneven_experts: bool = True  # EP ranks holding different numbers of experts (by GPU speed)

    def recompute_choices(self, choices: Sequence[str]) -> tuple[str, ...]:
        return tuple(c for c in choices if c != "selective" or self.selective_recompute)

    def sequence_parallel_choices(self, choices: Sequence[bool], tp: int, cp: int = 1, ep: int = 1
                                  ) -> tuple[bool, ...]:
        """The SP settings of a uniform stage of (tp, cp, ep) a search may try."""
        allowed = tp > 1 and self.sequence_parallel and (cp == ep == 1 or self.sequence_parallel_with_cp_ep)
        return tuple(choices) if allowed else (False,)


NO_LIMITS = SearchLimits()


def search_limits(workload: Any) -> SearchLimits:
    """What the planners may try for ``workload`` (a ``Workload``: its target and model)."""
    if getattr(workload, "target", "") != "hetplan":
        return NO_LIMITS
    support = support_of(workload.model)
    if support.build:  # the runtime cannot train it at all: the plans are for the tools
        return NO_LIMITS
    return SearchLimits(pipeline=not support.pipeline, sequence_parallel=not support.sequence_parallel,
                        context_parallel=not support.context_parallel, expert_parallel=not support.expert_parallel,
                        selective_recompute=not support.selective_recompute, mixed_stage_sequence_parallel=False,
                        sequence_parallel_with_cp_ep=False, uneven_experts=False)


# --- the check -----------------------------------------------------------------------------------
def runtime_refusal(plan: Plan, spec: ModelSpec) -> str:
    """Why hetplan's runtime would not run ``plan`` of ``spec`` as costed; ""
    if it runs it. One line that says what to change."""
    support = support_of(spec)
    if support.build:
        return support.build
    try:
        PlanLayout.from_plan(plan, [layer.name for layer in spec.layers])
    except HetplanError as exc:
        return str(exc)
    return _model_refusal(plan, spec, support)


def _model_refusal(plan: Plan, spec: ModelSpec, support: RuntimeSupport) -> str:
    """The model's facts against what the plan uses."""
    stages = plan.stages
    recompute = {st.recompute for s in stages for st in s.strategies}
    uses = [
        (plan.pp > 1, support.pipeline),
        (any(s.tp > 1 for s in stages), support.tensor_parallel),
        (any(s.sequence_parallel and s.tp > 1 for s in stages), support.sequence_parallel),
        (any(s.cp > 1 for s in stages), support.context_parallel),
        (any(s.ep > 1 for s in stages), support.expert_parallel),
        ("selective" in recompute, support.selective_recompute),
    ]
    for used, why in uses:
        if used and why:
            return why
    if plan.pp > 1:
        from hetplan.model.hf import tied_span_refusal

        return tied_span_refusal(spec, {spec.layers[i].name: j for j, s in enumerate(stages) for i in s.layers
                                        if i < spec.num_layers})
    return ""


def check_runs(plan: Plan, spec: ModelSpec) -> None:
    """Raise the refusal as a one-line HetplanError (the runtime's entry points)."""
    why = runtime_refusal(plan, spec)
    if why:
        raise HetplanError(why)


# --- finding the facts on the model the runtime builds (imports torch) -----------------------------
def inspect_model(model: Any, spec: ModelSpec, pipeline: str = "") -> ModelSpec:
    """``spec`` with what the runtime can run of ``model`` (the module it
    builds for ``spec``, on the meta device): ``runtime`` set, and
    ``tp_replicated`` on the layers with parameters that no TP plan covers.
    ``pipeline``: why it cannot pipeline the model ("" if it can)."""
    from hetplan.runtime import parallelize as par  # lazy: torch (this module's top is torch-free)

    names = [layer.name for layer in spec.layers]
    tensor_parallel, replicated = _tp_facts(model, names)
    expert_parallel, expert_tp = _expert_facts(model, names)
    whole = {} if tensor_parallel or expert_tp else measured_tp_whole(model, spec)
    layers = [_as_tp_runs(layer, layer.name in replicated, whole.get(layer.name)) for layer in spec.layers]
    moe = next((layer.name for layer in spec.layers if layer.is_moe), "")
    hf = bool(spec.meta.get("hf_class"))
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
