"""Several planners on the same workload (``hetplan compare``): each one's best
plan its target tool runs, how long it searched, or why it found none."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Sequence

from hetplan.app.planning import run_planner
from hetplan.app.workload import WorkloadOptions, load_workload
from hetplan.plan.workload import Workload
from hetplan.errors import HetplanError
from hetplan.export.tools import DEFAULT_TORCHTITAN_VERSION
from hetplan.plan.spec import RankedPlan
from hetplan.search import get_planner
from hetplan.export.target import TargetResult, runners, search_for_target

# The others' speed-up is against megatron's plan: the AMP paper's baseline (docs/planners/amp.md).
BASELINE_PLANNER = "megatron"


@dataclass(frozen=True)
class PlannerOutcome:
    """One planner's best plan (None: ``error`` says why there is none), its
    search time, and what the target restriction cost it."""

    planner: str
    best: RankedPlan | None
    search_time_s: float
    error: str = ""
    target: TargetResult | None = None


@dataclass(frozen=True)
class CompareResult:
    """Every planner's outcome, in the order asked; ``tool``: the target tool
    (None: every plan), ``explicit_target``: the user named it."""

    workload: Workload
    outcomes: tuple[PlannerOutcome, ...]
    tool: str | None
    explicit_target: bool

    def runs_on(self, outcome: PlannerOutcome) -> tuple[str, ...]:
        """The codes that run ``outcome``'s best plan (``export.target.runners``)."""
        return runners(outcome.best.plan, self.workload) if outcome.best is not None else ()

    @property
    def baseline(self) -> PlannerOutcome | None:
        """The outcome the others are measured against: megatron's, else the first with a plan."""
        found = [o for o in self.outcomes if o.best is not None]
        return next((o for o in found if o.planner == BASELINE_PLANNER), found[0] if found else None)

    def speedup(self, outcome: PlannerOutcome) -> float:
        """The baseline's step time over this planner's best plan's."""
        base = self.baseline
        if base is None or base.best is None or outcome.best is None:
            return 1.0
        return base.best.estimate.iteration_time_s / outcome.best.estimate.iteration_time_s

    def record(self) -> list[dict[str, Any]]:
        """The rows ``hetplan compare --json`` writes."""
        return [_outcome_record(o, self.speedup(o)) for o in self.outcomes]


def _outcome_record(o: PlannerOutcome, speedup: float) -> dict[str, Any]:
    if o.best is None:
        return {"planner": o.planner, "error": o.error, "search_time_s": o.search_time_s, "fits": False}
    e = o.best.estimate
    data = {"planner": o.planner, "iteration_time_s": e.iteration_time_s, "samples_per_s": e.samples_per_s,
            "speedup": speedup, "fits": e.fits, "search_time_s": o.search_time_s,
            "global_batch_size": o.best.plan.global_batch_size, "plan": o.best.plan.to_dict(),
            "estimate": e.to_dict()}
    if o.target is not None:  # what the tool costs this planner: its best plan overall, and why the tool refuses it
        t = o.target
        data.update({"target": t.tool, "source": t.source, "slowdown": t.slowdown,
                     "best_overall": {**t.best_overall.to_dict(), "refusal": t.best_overall_refusal}})
    return data


def compare_planners(options: WorkloadOptions, names: Sequence[str], auto_batch: bool = False,
                     torchtitan_version: str = DEFAULT_TORCHTITAN_VERSION) -> CompareResult:
    """Each named planner's best plan for the workload of ``options`` that its
    target tool runs (``hetplan.export.target``); a planner that finds none is an
    outcome with its error, not a failure of the comparison."""
    workload = load_workload(options, global_batch=1 if auto_batch else None)
    tool = workload.target or None  # hetplan's runtime by default (hetplan.export.target)
    outcomes = [_best_of(name, workload, tool, auto_batch, torchtitan_version) for name in names]
    return CompareResult(workload, tuple(outcomes), tool, tool is not None and bool(options.target))


def _best_of(name: str, workload: Workload, tool: str | None, auto_batch: bool,
             torchtitan_version: str) -> PlannerOutcome:
    planner = get_planner(name)
    start = time.perf_counter()
    try:
        batch = auto_batch and getattr(planner, "searches_batch_size", False)
        # its best plan the tool can run, of its candidate_count(1) best
        found, target = search_for_target(lambda k: run_planner(planner, workload, k, batch), workload, tool, 1,
                                          name, "fallback", torchtitan_version)
    except HetplanError as exc:
        return PlannerOutcome(name, None, time.perf_counter() - start, str(exc))
    return PlannerOutcome(name, found[0], time.perf_counter() - start, target=target)
