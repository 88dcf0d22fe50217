"""The `auto` planner: hetplan's own — every paper's best plan, then better, with a bound.

1. **Seeds.** The papers' planners (uniform 3D, Megatron, AMP, Metis,
   Galvatron-BMW) run on the same CostModel (one kernel, shared tables); their
   best plans join the pool. So auto is never worse than any of them.
2. **Layouts.** A layout fixes the pipeline's stage device groups, each
   stage's (dp, tp) and data split, and the micro-batching. Auto takes the
   layouts of every seed plan (Metis's uneven groups and splits, Galvatron's
   stage shapes) and of AMP's whole space: every (pp, dp, tp) with TP inside
   nodes, every micro-batch size, the Megatron placement and — where there are
   at most ``max_placements`` of them — every placement up to symmetry.
3. **Exact solve.** For each layout, ``common.stage_partition`` finds the
   layer split and every stage's ZeRO stage and recomputation (sequence
   parallelism wherever tp > 1: it never costs more) that minimise the shared
   model's iteration time; the answer is certified optimal for the layout, or
   its gap to the layout's bound is known. Layouts are solved cheapest lower
   bound first and skipped once their bound cannot beat the best plan; the
   number of solves is a work budget (``max_solves``), never seconds.
4. **Rank** everything by the shared model; the estimate carries the workload's
   lower bound (``cost/bounds.py``) and the notes say how close the plan is.

The space where auto is exact: every layout above × every contiguous layer
split × per-stage ZeRO ∈ {0, 2, 3} and recomputation ∈ {none, selective, full}.
It contains the ``exhaustive`` planner's space (AMP's, without ZeRO or
recomputation) whenever the placements are enumerated, so auto is never worse
than ``exhaustive``; and it contains every seed's layout, so its exact solve
only improves on the seeds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Iterable

import numpy as np

from hetplan.cost.kernel import StageOption
from hetplan.cost.model import CostModel
from hetplan.cost.workload import Workload
from hetplan.errors import HetplanError
from hetplan.plan import Plan, RankedPlan
from hetplan.progress import Progress
from hetplan.search.base import cost_model_for, no_fit_error
from hetplan.search.common.budget import WorkBudget
from hetplan.search.common.degrees import divisors, enumerate_degrees, micro_batch_sizes
from hetplan.search.common.placement import canonical_placements, count_canonical_placements, heuristic_placement
from hetplan.search.common.stage_partition import PipelinePartitioner, PipelineSolution

SOURCE_PLANNERS = ("uniform", "megatron", "amp", "metis", "galvatron-bmw")
SEEDS_PER_PLANNER = 3
MAX_PLACEMENTS = 24  # placements up to symmetry per (pp, dp, tp) beyond the Megatron one
MAX_SOLVES = 300  # exact layout solves per search (work budget)
ZERO_OPTIONS = (0, 2, 3)  # ZeRO-1 never beats ZeRO-2 in the cost model
RECOMPUTE_OPTIONS = ("none", "selective", "full")

StageShape = tuple[tuple[int, ...], int, int, tuple[int, ...]]  # devices, dp, tp, split


@dataclass(frozen=True)
class Layout:
    """Stage shapes (devices, dp, tp, split) and the micro-batching."""

    stages: tuple[StageShape, ...]
    micro_batch_size: int
    num_micro_batches: int
    source: str

    @property
    def key(self) -> tuple[object, ...]:
        return (self.stages, self.num_micro_batches)

    def options(self) -> list[list[StageOption]]:
        """Per stage, the ways to run its layers the exact solve chooses from."""
        out = []
        for devices, dp, tp, split in self.stages:
            zeros = ZERO_OPTIONS if dp > 1 else (0,)
            out.append([StageOption(devices, dp, tp, split, zero, recompute, tp > 1)
                        for zero in zeros for recompute in RECOMPUTE_OPTIONS])
        return out


class AutoPlanner:
    """hetplan's own planner (see the module docstring)."""

    name = "auto"

    def __init__(self, sources: tuple[str, ...] = SOURCE_PLANNERS, max_solves: int = MAX_SOLVES,
                 max_placements: int = MAX_PLACEMENTS) -> None:
        self.sources = sources
        self.max_solves = max_solves
        self.max_placements = max_placements

    def plan(self, workload: Workload, top_k: int = 5, cost: CostModel | None = None) -> list[RankedPlan]:
        return _AutoSearch(self, workload, cost_model_for(workload, cost)).run(top_k)


class _AutoSearch:
    """One run of the auto planner."""

    def __init__(self, planner: AutoPlanner, workload: Workload, cost: CostModel) -> None:
        self.planner = planner
        self.workload = workload
        self.cost = cost
        self.budget = WorkBudget(planner.max_solves, "exact layout solves")
        self.pool: dict[tuple[object, ...], tuple[tuple[int, float, str], Plan]] = {}
        self.errors: list[str] = []
        self.best_s = math.inf
        self.solved: dict[tuple[object, ...], PipelineSolution | None] = {}

    # --- the steps -------------------------------------------------------------------------
    def run(self, top_k: int) -> list[RankedPlan]:
        with Progress("auto planner", total=len(self.planner.sources) + 1) as progress:
            seeds = self.seed(progress)
            progress.advance(note="exact layouts")
            layouts = self.layouts(seeds)
            self.solve_all(layouts)
        return self.ranked(top_k)

    def seed(self, progress: Progress) -> list[Plan]:
        """Every source planner's best plans, in the pool and as layouts."""
        from hetplan.search.registry import get_planner

        plans = []
        for name in self.planner.sources:
            progress.advance(note=name)
            try:
                ranked = get_planner(name).plan(self.workload, SEEDS_PER_PLANNER, self.cost)
            except HetplanError as exc:
                self.errors.append(f"{name}: {exc}")
                continue
            for r in ranked:
                self.add(r.plan)
                plans.append(r.plan)
        return plans

    def layouts(self, seeds: list[Plan]) -> list[Layout]:
        """The seeds' layouts, with every micro-batching their splits allow, and AMP's space."""
        found: dict[tuple[object, ...], Layout] = {}
        for layout in list(self._seed_layouts(seeds)) + list(self._grid_layouts()):
            found.setdefault(layout.key, layout)
        return list(found.values())

    def _seed_layouts(self, seeds: list[Plan]) -> Iterable[Layout]:
        gbs = self.workload.global_batch_size
        for plan in seeds:
            if plan.virtual_stages > 1 or plan.global_batch_size != gbs:
                continue
            stages = tuple((s.devices, s.dp, s.tp, s.dp_split) for s in plan.stages)
            yield Layout(stages, plan.micro_batch_size, plan.num_micro_batches, plan.planner)
            if any(len(set(s.dp_split)) > 1 for s in plan.stages):
                continue
            for m in divisors(gbs):
                mbs = gbs // m
                if m != plan.num_micro_batches and all(mbs % s.dp == 0 for s in plan.stages):
                    evened = tuple((s.devices, s.dp, s.tp, (mbs // s.dp,) * s.dp) for s in plan.stages)
                    yield Layout(evened, mbs, m, plan.planner)

    def _grid_layouts(self) -> Iterable[Layout]:
        """AMP's space: degrees × micro-batch × placements."""
        cluster, gbs = self.workload.cluster, self.workload.global_batch_size
        for pp, dp, tp in enumerate_degrees(self.workload):
            placements = [heuristic_placement(cluster.num_devices, pp, dp, tp)]
            if cluster.bandwidth_matrix_gbps is None and \
                    count_canonical_placements(cluster, pp, dp, tp) <= self.planner.max_placements:
                placements += list(canonical_placements(cluster, pp, dp, tp))
            for u in micro_batch_sizes(gbs, dp):
                mbs = dp * u
                for placement in placements:
                    stages = tuple((devices, dp, tp, (u,) * dp) for devices in placement)
                    yield Layout(stages, mbs, gbs // mbs, "amp-space")

    def solve_all(self, layouts: list[Layout]) -> None:
        """Solve layouts cheapest bound first; stop when no bound can beat the best plan."""
        bounded = sorted(((self.layout_bound(layout), i, layout) for i, layout in enumerate(layouts)),
                         key=lambda item: item[:2])
        for bound, _, layout in bounded:
            if bound >= self.best_s * (1 - 1e-12):
                break
            if not self.budget.spend():
                break
            solution = PipelinePartitioner(self.cost.kernel, layout.micro_batch_size,
                                           layout.num_micro_batches).solve(layout.options())
            if solution is not None:
                self.add(self.to_plan(layout, solution))

    def layout_bound(self, layout: Layout) -> float:
        """No plan of the layout is faster: ``m`` micro-batches through the
        slowest stage, each stage at least the sum of its layers' times on its
        slowest replica (``StageCosts.layer_totals``) with its fastest option."""
        totals = np.stack([self.cost.kernel.stage(options[0]).layer_totals() for options in layout.options()])
        cheapest = totals.min(axis=0)
        per_stage = max(float(cheapest.sum()) / len(layout.stages), float(cheapest.max()))
        return layout.num_micro_batches * per_stage

    # --- the pool ---------------------------------------------------------------------------
    def to_plan(self, layout: Layout, solution: PipelineSolution) -> Plan:
        how = "certified optimal" if solution.certified else \
            f"within {solution.iteration_s / solution.lower_bound_s - 1:.2%} of its optimum"
        note = (f"auto: exact layer split and per-stage ZeRO/recompute for a {layout.source} layout "
                f"({how} for that layout)")
        return Plan(model=self.workload.model.name, cluster=self.workload.cluster.name,
                    global_batch_size=self.workload.global_batch_size, micro_batch_size=layout.micro_batch_size,
                    num_micro_batches=layout.num_micro_batches, schedule="1f1b", stages=solution.stages,
                    planner="auto", notes=(note,))

    def add(self, plan: Plan) -> None:
        key = (plan.micro_batch_size, plan.num_micro_batches, plan.schedule, plan.virtual_stages, plan.stages)
        if key in self.pool:
            return
        time_s, fits = self.cost.quick(plan)
        self.pool[key] = ((0 if fits else 1, time_s, plan.describe()), plan)
        if fits:
            self.best_s = min(self.best_s, time_s)

    def ranked(self, top_k: int) -> list[RankedPlan]:
        if not self.pool:
            raise HetplanError("no planner found a plan: " + "; ".join(self.errors))
        ordered = sorted(self.pool.values(), key=lambda item: item[0])
        if ordered[0][0][0]:
            raise no_fit_error(self.workload, [RankedPlan(p, self.cost.estimate(p)) for _, p in ordered[:top_k]])
        out = []
        for _, plan in ordered[:top_k]:
            estimate = self.cost.estimate(plan)
            notes = plan.notes + self.notes(estimate.iteration_time_s, estimate.lower_bound_s)
            out.append(RankedPlan(replace(plan, notes=notes), estimate))
        return out

    def notes(self, time_s: float, bound_s: float) -> tuple[str, ...]:
        notes = [f"auto: within {time_s / bound_s - 1:.1%} of the lower bound {bound_s:.4g} s "
                 "(no plan of this workload can be faster; cost/bounds.py)"]
        if self.budget.exhausted:
            notes.append(self.budget.note("auto"))
        return tuple(notes)
