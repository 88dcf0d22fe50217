"""What hetplan's runtime can run, torch-free: one check for the runtime, the planners and ``estimate``.

A plan costed one way and run another is a wrong number, worse than an error
(a TP plan whose layers run replicated, a pipelined plan of a model the
runtime cannot split). So what the runtime can run of a model is found once,
by the runtime's own code (``hetplan.runtime.support.inspect_model``, when a
HF class or a ``pkg.mod:build`` model is imported: it records
``ModelSpec.runtime`` and each layer's ``tp_replicated``), and read by everyone
from here:

* :func:`support_of` gives those facts for any model: presets are the
  runtime's built-in decoder (:func:`builtin_refusal` says which presets it
  builds).
* :func:`runtime_refusal` says why the runtime would refuse a plan ("" if it
  runs it as costed): the model's facts plus the plan-level rules of
  :class:`~hetplan.plan.layout.PlanLayout`. ``hetplan.runtime.init`` raises
  it; ``hetplan plan`` keeps only plans it passes (``hetplan.export.target``,
  target "hetplan"); ``hetplan estimate`` refuses a plan it does not pass.
* :func:`search_limits` tells the planners what they may try for a target.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from hetplan.errors import HetplanError
from hetplan.model.spec import ModelSpec, RuntimeSupport
from hetplan.plan.spec import Plan
from hetplan.plan.layout import PlanLayout

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
    if spec.source is not None:
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
        return tied_span_refusal(spec, {spec.layers[i].name: j for j, s in enumerate(stages) for i in s.layers
                                        if i < spec.num_layers})
    return ""


def check_runs(plan: Plan, spec: ModelSpec) -> None:
    """Raise the refusal as a one-line HetplanError (the runtime's entry points)."""
    why = runtime_refusal(plan, spec)
    if why:
        raise HetplanError(why)


def tied_span_refusal(spec: ModelSpec, stage_of_layer: dict[str, int]) -> str:
    """Why hetplan's runtime refuses a split of ``spec`` (layer name -> pipeline
    stage): a weight tied over three or more stages (T5's shared embedding at
    pp >= 3), whose gradient it sums between two. "" if none."""
    groups: dict[str, list[str]] = {}
    for layer in spec.layers:
        if layer.tied_group:
            groups.setdefault(layer.tied_group, []).append(layer.name)
    for group in groups.values():
        stages = {stage_of_layer[n] for n in group if n in stage_of_layer}
        if len(stages) > 2:
            return (f"layers {', '.join(group)} share one weight and this plan puts them on {len(stages)} pipeline "
                    "stages, but hetplan sums a tied weight's gradient between two; use a split that keeps them on "
                    "at most two stages")
    return ""
