"""Plans a given tool can run: ``hetplan plan/compare --target TOOL``.

A planner's search runs as usual; its ranking then keeps only the plans the
tool can run: hetplan's own runtime (``"hetplan"``, the default target of
``plan``, ``compare``, ``whatif`` and ``tune`` for every model the runtime
builds), decided by the runtime's own check
(``hetplan.plan.support.runtime_refusal``), or torchtitan, Megatron-LM or
DeepSpeed, decided by the export itself (``hetplan.export.tools.exportable``: the
plans ``hetplan export`` refuses are the ones dropped). A heterogeneity-aware planner's best plans often mix
per-layer strategies or uneven splits no tool expresses, so the planner is
asked for more candidates (``candidate_count``), and the uniform planner's
plans (every uniform 3D setting, which the tools run) filtered the same way
join them (``uniform="merge"``) or stand in when none of the planner's can run
(``uniform="fallback"``). The result says how much slower the best plan the
tool can run is than the best plan found overall.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence

from hetplan.plan.workload import Workload
from hetplan.errors import HetplanError, did_you_mean
from hetplan.export.tools import DEFAULT_TORCHTITAN_VERSION, TARGETS, TOOL_NAMES, exportable, try_render
from hetplan.model.spec import ModelSpec
from hetplan.cost.model import CostModel
from hetplan.plan.file import PlanFile
from hetplan.plan.spec import Plan, RankedPlan
from hetplan.units import format_time
from hetplan.search.baselines.uniform import (
    ALL_SEQUENCE_PARALLEL, ALL_ZERO_STAGES, INTERLEAVE_CHOICES, UniformPlanner,
)
from hetplan.search.base import cost_model_for, rank_plans
from hetplan.plan.support import runtime_refusal
from hetplan.plan.support import support_of

# How many of a planner's best plans to look at, per plan asked for, and at most.
CANDIDATES_PER_PLAN = 20
MAX_CANDIDATES = 200
UNIFORM_MODES = ("merge", "fallback")
RUNTIME = "hetplan"  # hetplan's own runtime (hetplan train / run / tune)
ANY = "any"  # no target: every plan the cost model costs, as the papers' planners search them
PLAN_TARGETS = (RUNTIME, *TARGETS, ANY)


def candidate_count(top_k: int) -> int:
    """How many plans to ask a planner for when ``top_k`` the tool can run are wanted."""
    return max(top_k, min(top_k * CANDIDATES_PER_PLAN, MAX_CANDIDATES))


def tool_name(tool: str) -> str:
    return "hetplan's runtime" if tool == RUNTIME else TOOL_NAMES.get(tool, tool)


def refusal(plan: Plan, workload: Workload, tool: str,
            torchtitan_version: str = DEFAULT_TORCHTITAN_VERSION) -> str:
    """Why ``tool`` cannot run ``plan`` as costed ("" if it can)."""
    if tool == RUNTIME:
        return runtime_refusal(plan, workload.model)
    return exportable(plan, workload.model, tool, workload.cluster, torchtitan_version)


RUNNERS = (RUNTIME, *TARGETS)  # the code a plan can run on, as the "runs on" column lists it


def runners(plan: Plan, workload: Workload, torchtitan_version: str = DEFAULT_TORCHTITAN_VERSION) -> tuple[str, ...]:
    """The codes of ``RUNNERS`` that run ``plan`` as costed (``refusal`` says "" for them)."""
    return tuple(tool for tool in RUNNERS if not refusal(plan, workload, tool, torchtitan_version))


def export_way_out(plan_file: PlanFile, index: int, tool: str,
                   torchtitan_version: str = DEFAULT_TORCHTITAN_VERSION) -> str:
    """Said after ``hetplan export``'s refusal of plan ``index`` of ``plan_file``:
    the first plan of the file ``tool`` runs and its step time against plan
    ``index``'s (each costed with the workload it was made for), and the
    ``--target`` that plans for the tool."""
    how = f"make plans {tool_name(tool)} runs with 'hetplan plan ... --target {tool}'"
    workload = plan_file.workload(index)
    for k in range(1, len(plan_file.plans) + 1):
        other = plan_file.plan(k)
        if k != index and not refusal(other, plan_file.workload(k), tool, torchtitan_version):
            ratio = (CostModel(plan_file.workload(k)).estimate(other).iteration_time_s
                     / CostModel(workload).estimate(plan_file.plan(index)).iteration_time_s)
            return f"plan {k} of this file runs on it at {ratio:.2f}x the step time (--index {k}), or {how}"
    return how


def plan_target(model: ModelSpec, given: str | None = None) -> str:
    """The code plans are made for (``Workload.target``): ``given``
    (``--target``, or a plan file's; "any": none, ""), else hetplan's runtime
    for every model it builds, else none (a model it cannot build, a CNN
    preset: the papers' and the tools' plans, which ``runtime_note`` says)."""

    if given:
        return "" if given == ANY else given
    return "" if support_of(model).build else RUNTIME


def runtime_note(workload: Workload) -> str:
    """Said where plans are made for no target: the runtime cannot train the model."""

    why = support_of(workload.model).build
    return f"hetplan's runtime cannot train this model ({why}); these plans are for the tools it exports to" \
        if why else ""


@dataclass(frozen=True)
class TargetResult:
    """The plans ``tool`` can run, best first, and the best plan found overall."""

    tool: str
    plans: tuple[RankedPlan, ...]
    best_overall: RankedPlan
    best_overall_refusal: str  # why the tool cannot run best_overall; "" if it can
    slowdown: float  # predicted time per sample of plans[0] / best_overall's, minus 1
    notes: tuple[str, ...]
    source: str  # the planner of plans[0]: the one searched, or "uniform" (merged or fallen back to)
    torchtitan_version: str = DEFAULT_TORCHTITAN_VERSION

    @property
    def best(self) -> RankedPlan:
        return self.plans[0]

    def summary(self) -> str:
        """One line: the best plan the tool can run, and what the restriction costs."""
        name = tool_name(self.tool)
        here = f"best plan {name} can run: {format_time(self.best.estimate.iteration_time_s)}/step"
        if not self.best_overall_refusal:
            return f"{here}, the best plan overall (0.0% slower)"
        overall = self.best_overall.estimate.iteration_time_s
        return (f"{here}, {100 * self.slowdown:.1f}% slower than the best plan overall ({format_time(overall)}, "
                f"{'the runtime cannot run it' if self.tool == RUNTIME else 'not exportable'}: "
                f"{self.best_overall_refusal})")


def _time_per_sample(r: RankedPlan) -> float:
    return r.estimate.iteration_time_s / r.plan.global_batch_size


def _key(r: RankedPlan) -> tuple[int, float, str]:
    """Fitting plans first, then fastest per sample (per step: every plan of a
    search has the same batch, unless the planner chose it), then by text."""
    return (0 if r.estimate.fits else 1, _time_per_sample(r), r.plan.describe())


def slowdown(best: RankedPlan, overall: RankedPlan) -> float:
    """How much slower ``best`` is than ``overall``: the ratio of their predicted
    step times minus 1 (of times per sample when their batches differ)."""
    if best.plan.global_batch_size == overall.plan.global_batch_size:
        return best.estimate.iteration_time_s / overall.estimate.iteration_time_s - 1
    return _time_per_sample(best) / _time_per_sample(overall) - 1


def _tool_settings(r: RankedPlan, workload: Workload, tool: str, torchtitan_version: str) -> tuple[object, ...]:
    """What the tool is given for the plan: plans with the same export are one
    plan to the tool (e.g. a layer's tp written out or left to its stage's)."""
    if tool == RUNTIME:  # the runtime runs what the plan says: every plan is its own
        return (r.plan.describe(), repr(r.plan.to_dict()))
    export = try_render(r.plan, workload.model, tool, workload.cluster, torchtitan_version)[0]
    assert export is not None, "only plans the tool can run are compared"
    return (export.text, tuple(sorted(export.files.items())))


def uniform_plans_for(workload: Workload, tool: str, top_k: int,
                      torchtitan_version: str = DEFAULT_TORCHTITAN_VERSION) -> tuple[list[RankedPlan], int, int]:
    """The uniform planner's candidates (every uniform 3D setting) that ``tool``
    can run, ranked by the cost model: (best ``top_k``, how many it can run, how
    many there are). A one-line HetplanError when it can run none, or none fits."""
    # every ZeRO stage (Megatron-LM shards by ZeRO-1 only), TP without sequence parallelism
    # (DeepSpeed) and interleaved 1F1B (Megatron-LM's virtual pipeline)
    planner = UniformPlanner(zero_choices=ALL_ZERO_STAGES, sequence_parallel_choices=ALL_SEQUENCE_PARALLEL,
                             interleave_choices=INTERLEAVE_CHOICES)
    cost = cost_model_for(workload, None)
    candidates = list(planner.candidates(workload, cost))  # offloaded variants only where memory is short
    if not candidates:
        planner.plan(workload, top_k)  # raises its own reason (no data-parallel degree divides the batch)
    refusals: Counter[str] = Counter()
    kept = []
    for plan in candidates:
        why = refusal(plan, workload, tool, torchtitan_version)
        if why:
            refusals[why] += 1
        else:
            kept.append(plan)
    name = tool_name(tool)
    if not kept:
        reason, count = refusals.most_common(1)[0]
        raise HetplanError(f"{name} can run none of the {len(candidates)} uniform 3D plans ({count} refused with: "
                           f"{reason})")
    try:
        ranked = rank_plans(cost, kept, top_k)
    except HetplanError as exc:
        raise HetplanError(f"none of the {len(kept)} uniform 3D plans {name} can run fits: {exc}") from None
    return ranked, len(kept), len(candidates)


def plans_for_target(ranked: Sequence[RankedPlan], workload: Workload, tool: str, top_k: int, planner: str,
                     uniform: str = "merge",
                     torchtitan_version: str = DEFAULT_TORCHTITAN_VERSION) -> TargetResult:
    """Keep the plans of ``ranked`` (a planner's best, best first) that ``tool``
    can run; with ``uniform="merge"`` rank them with the uniform 3D plans it can
    run, with ``"fallback"`` use those only when none of ``ranked`` can run.
    The best plan overall is the best of ``ranked`` and those uniform plans.
    A one-line HetplanError when the tool can run no plan."""
    if tool not in PLAN_TARGETS or tool == ANY:
        known = (RUNTIME, *TARGETS)
        raise HetplanError(f"unknown target {tool!r}{did_you_mean(tool, known)}; choose one of {', '.join(known)}")
    if uniform not in UNIFORM_MODES:
        raise ValueError(f"uniform must be one of {UNIFORM_MODES}, not {uniform!r}")
    if not ranked:
        raise HetplanError(f"planner {planner!r} returned no plan")
    name = tool_name(tool)
    refusals = [refusal(r.plan, workload, tool, torchtitan_version) for r in ranked]
    own = [r for r, why in zip(ranked, refusals) if not why]
    first_refusal = next((why for why in refusals if why), "")
    examined = f"{planner}'s {len(ranked)} best plan{'s' if len(ranked) > 1 else ''}"
    notes = []
    uniform_ranked: list[RankedPlan] = []
    uniform_error = ""
    if uniform == "merge" or not own:
        best_batch = min(ranked, key=_key).plan.global_batch_size  # a batch-searching planner's choice
        w = workload if best_batch == workload.global_batch_size else replace(workload, global_batch_size=best_batch)
        try:
            uniform_ranked, can, total = uniform_plans_for(w, tool, top_k, torchtitan_version)
            uniform_note = f"{can} of the {total} uniform 3D plans"
        except HetplanError as exc:
            uniform_error = str(exc)
    if not own and not uniform_ranked:
        raise HetplanError(f"no plan {name} can run: none of {examined} (the best refused with: {first_refusal}); "
                           f"{uniform_error}")
    seen: set[tuple[object, ...]] = set()
    merged = []
    # merged: ranked by the cost model (stable: the planner's own plan first on a tie); else in the
    # planner's own order (AMP ranks by its own objective)
    pool = sorted(own + uniform_ranked, key=_key) if uniform == "merge" else own + uniform_ranked
    for r in pool:
        settings = _tool_settings(r, workload, tool, torchtitan_version)
        if settings not in seen:
            seen.add(settings)
            merged.append(r)
    kept = tuple(merged[:top_k])
    overall = min([*ranked, *uniform_ranked], key=_key)
    overall_refusal = next((why for r, why in zip(ranked, refusals) if r is overall), "")
    from_uniform = not any(r is kept[0] for r in own)
    if not own:
        notes.append(f"{name} can run none of {examined} (the best refused with: {first_refusal}); these are the "
                     f"uniform planner's plans it can run ({uniform_note}), ranked the same way")
    else:
        line = f"{name} can run {len(own)} of {examined}"
        if uniform == "merge":
            line += f", ranked with the {uniform_note} it can run" if uniform_ranked else \
                f" (and no uniform 3D plan: {uniform_error})"
            if from_uniform and planner != "uniform":
                line += f"; the best is the uniform planner's, faster than any of {planner}'s it can run"
        notes.append(line)
    return TargetResult(tool, kept, overall, overall_refusal, slowdown(kept[0], overall), tuple(notes),
                        "uniform" if from_uniform else planner, torchtitan_version)


def target_json(result: TargetResult, overall: dict[str, Any]) -> dict[str, Any]:
    """What ``--json`` adds with ``--target``: the tool, the slowdown, the best
    plan overall (``overall``: its ranked JSON) and why the tool cannot run it."""
    data: dict[str, Any] = {"target": result.tool, "slowdown": result.slowdown,
                            "best_overall": {**overall, "refusal": result.best_overall_refusal},
                            "target_notes": list(result.notes)}
    if result.tool == "torchtitan":
        data["torchtitan_version"] = result.torchtitan_version
    return data


def search_for_target(search: Callable[[int], list[RankedPlan]], workload: Workload, tool: str | None, top_k: int,
                      planner: str, uniform: str = "fallback",
                      torchtitan_version: str = DEFAULT_TORCHTITAN_VERSION
                      ) -> tuple[list[RankedPlan], TargetResult | None]:
    """The ``top_k`` best plans ``tool`` can run, from ``search(k)`` (a
    planner's ``k`` best: asked for ``candidate_count(top_k)``) and the
    uniform planner's (``uniform``: "merge" or "fallback", see
    ``plans_for_target``), with what the restriction cost; every plan of
    ``search(top_k)`` and None with no ``tool``."""
    if tool is None:
        return search(top_k), None
    result = plans_for_target(search(candidate_count(top_k)), workload, tool, top_k, planner, uniform,
                              torchtitan_version)
    return list(result.plans), result


def default_notes(result: TargetResult | None, workload: Workload) -> list[str]:
    """What a plan made for the default target says about it: nothing when the
    runtime runs the planner's best plans; else which plan it could not run
    and what that costs, or that the runtime cannot train the model at all."""
    if result is None:
        note = runtime_note(workload)
        return [note] if note else []
    notes = [result.summary()] if result.best_overall_refusal else []
    return notes + [n for n in result.notes if "can run none of" in n]  # fell back to the uniform planner
