"""The `auto` planner: hetplan's own — every paper's best plan, then better, with a bound.

1. **Seeds.** The papers' planners (uniform 3D, Megatron, AMP, Metis,
   Galvatron-BMW) run on the same CostModel (one kernel, shared tables); their
   best plans join the pool. So auto is never worse than any of them.
2. **Shapes.** A shape fixes the pipeline's stage device groups, each
   stage's (dp, tp) and data split, and the micro-batching — and its context-
   and expert-parallel degrees (cp for long sequences, ep for MoE models:
   ``common.degrees.enumerate_parallel_degrees``). Auto takes the
   shapes of every seed plan (Metis's uneven groups and splits, Galvatron's
   stage shapes) and of AMP's whole space: every (pp, dp, tp) with TP inside
   nodes, every micro-batch size, the Megatron placement and — where there are
   at most ``max_placements`` of them — every placement up to symmetry.
3. **Exact solve.** For each shape, ``common.stage_partition`` finds the
   layer split and every stage's ZeRO stage, recomputation and activation
   offloading (the latter two only where memory is short; sequence
   parallelism wherever tp > 1: it never costs more) that minimise the shared
   model's iteration time; the answer is certified optimal for the shape, or
   its gap to the shape's bound is known. Shapes are solved cheapest lower
   bound first and skipped once their bound cannot beat the best plan (or a
   time the caller says must be beaten, ``plan(beat_s=...)``); the
   number of solves is a work budget (``max_solves``), never seconds.
4. **Rank** everything by the shared model; the estimate carries the workload's
   lower bound (``cost/bounds.py``) and the notes say how close the plan is.

The space where auto is exact: every shape above × every contiguous layer
split × per-stage ZeRO ∈ {0, 2, 3}, recomputation ∈ {none, selective, full}
and activation offloading ∈ {no, yes} (``Workload.search_offload``).
It contains the ``exhaustive`` planner's space (AMP's, without ZeRO or
recomputation) whenever the placements are enumerated, so auto is never worse
than ``exhaustive``; and it contains every seed's shape, so its exact solve
only improves on the seeds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable, Iterable

import numpy as np

from hetplan.cost.constants import P2P_PASSES
from hetplan.cost.stage import StageOption
from hetplan.cost.memory import in_flight_micro_batches
from hetplan.cost.model import CostModel
from hetplan.plan.workload import Workload
from hetplan.errors import HetplanError
from hetplan.plan.spec import Plan, RankedPlan
from hetplan.progress import Progress
from hetplan.plan.support import NO_LIMITS, SearchLimits, search_limits
from hetplan.search.amp import AMPPlanner
from hetplan.search.base import NoPlanFaster, Planner, cost_model_for, no_fit_error
from hetplan.search.baselines.megatron import MegatronPlanner
from hetplan.search.baselines.uniform import UniformPlanner
from hetplan.search.common.budget import WorkBudget
from hetplan.search.common.degrees import divisors, enumerate_parallel_degrees, micro_batch_sizes
from hetplan.search.common.expert_split import speed_expert_split
from hetplan.search.common.partition import PartitionProblem, fast_partition
from hetplan.search.common.placement import canonical_placements, count_canonical_placements, heuristic_placement
from hetplan.search.common.stage_partition import PipelinePartitioner, PipelineSolution
from hetplan.search.galvatron import get_variant
from hetplan.search.metis import MetisOptions, MetisPlanner

# Planners whose plans auto's own space does not contain: always run, their plans seed the pool.
# Metis without its exact-layer polish: auto solves every seed shape exactly anyway;
# 250 evaluations (Metis alone: 300) find the same seeds from 16 to 4,096 mixed GPUs
# of benchmarks/bench_search_scale.py (200 lose 13% at 4,096) in less time.
# (Galvatron-BMW runs whole: its per-layer strategies are outside auto's exact space.)
AUTO_METIS_EVALUATIONS = 250
SOURCE_PLANNERS: tuple[Callable[[], Planner], ...] = (
    lambda: MetisPlanner(MetisOptions(exact_layers=False, max_evaluations=AUTO_METIS_EVALUATIONS)),
    lambda: get_variant("galvatron-bmw"))
# Planners whose whole space auto's exact solve of AMP's shapes contains (uniform
# plans, Megatron's, AMP's: heuristic placement, one (dp, tp), zero 0-3 without
# sequence parallelism, which never costs less): run only when that containment
# is not proven — the shape search was cut by its budget or a solve could not
# certify its optimum.
CONTAINED_PLANNERS: tuple[Callable[[], Planner], ...] = (UniformPlanner, MegatronPlanner, AMPPlanner)
SEEDS_PER_PLANNER = 3
MAX_PLACEMENTS = 24  # placements up to symmetry per (pp, dp, tp) beyond the Megatron one
MAX_SOLVES = 300  # exact shape solves per search (work budget)
SETTLE_DUAL_STEPS = 2  # dual steps of the second, exact solve of a shape left uncertified (settle_open)
ZERO_OPTIONS = (0, 2, 3)  # ZeRO-1 never beats ZeRO-2 in the cost model
RECOMPUTE_OPTIONS = ("none", "selective", "full")
OFFLOAD_OPTIONS = (False, True)  # activation offloading, searched where memory is short (useful_options)

# devices, dp, tp, split, cp, ep, ep_split (None: even experts)
StageShape = tuple[tuple[int, ...], int, int, tuple[int, ...], int, int, tuple[int, ...] | None]
GRID = "amp-space"  # the source of the shapes of AMP's space


@dataclass(frozen=True)
class PlanShape:
    """Stage shapes (devices, dp, tp, split) and the micro-batching."""

    stages: tuple[StageShape, ...]
    micro_batch_size: int
    num_micro_batches: int
    source: str

    @property
    def key(self) -> tuple[object, ...]:
        return (self.stages, self.num_micro_batches)

    def options(self, offload: bool = False, limits: SearchLimits = NO_LIMITS) -> list[list[StageOption]]:
        """Per stage, the ways to run its layers the exact solve chooses from;
        with ``offload`` each recomputation also with its saved activations in
        host memory (listed after those without: ties keep them on the GPU).
        Sequence parallelism wherever TP splits a stage and ``limits`` (what the
        workload's target runs) allow it; recomputations ``limits`` allow."""
        offloads = OFFLOAD_OPTIONS if offload else (False,)
        recomputes = limits.recompute_choices(RECOMPUTE_OPTIONS)
        mixed = len({(dp, tp, split) for _, dp, tp, split, *_ in self.stages}) > 1
        out = []
        for devices, dp, tp, split, cp, ep, ep_split in self.stages:
            zeros = ZERO_OPTIONS if dp * cp > 1 else (0,)
            sp = limits.sequence_parallel_choices((True,), tp, cp, ep)[0] and (
                not mixed or limits.mixed_stage_sequence_parallel)
            out.append([StageOption(devices, dp, tp, split, zero, recompute, sp, off, cp=cp, ep=ep,
                                    ep_split=ep_split)
                        for zero in zeros for off in offloads for recompute in recomputes])
        return out


@dataclass
class AutoStats:
    """What the last search did."""

    shapes: int = 0  # shapes considered
    solves: int = 0  # exact shape solves
    certified: int = 0  # solves that are the shape's proven optimum
    budget_hit: bool = False
    grid_uncertified: bool = False  # a shape of AMP's space may hold a plan faster than auto's best
    ran_contained: bool = False  # uniform/megatron/amp had to run as seeds


class AutoPlanner:
    """hetplan's own planner (see the module docstring)."""

    name = "auto"

    def __init__(self, sources: tuple[Callable[[], Planner], ...] = SOURCE_PLANNERS, max_solves: int = MAX_SOLVES,
                 max_placements: int = MAX_PLACEMENTS,
                 contained: tuple[Callable[[], Planner], ...] = CONTAINED_PLANNERS) -> None:
        self.sources = sources
        self.contained = contained
        self.max_solves = max_solves
        self.max_placements = max_placements
        self.stats = AutoStats()

    # ``plan`` takes ``beat_s``: it prunes by it (``search.base.NoPlanFaster``)
    prunes_by_beat = True

    def plan(self, workload: Workload, top_k: int = 5, cost: CostModel | None = None,
             beat_s: float = math.inf) -> list[RankedPlan]:
        """The ``top_k`` best plans; with a finite ``beat_s``, only plans faster
        than it matter (a caller that has a plan that good elsewhere:
        ``hetplan choose``): it starts as the best plan's time, so the shapes
        whose bounds reach it are never solved, and the answer is the plans
        faster than it or ``NoPlanFaster``. The seeds run as without it; a
        shape is skipped only by the bounds that skip it against a best plan
        that fast, so where the shapes' solves certify, the best plan is the
        one found without ``beat_s`` whenever that is faster than it
        (``tests/test_choose.py`` checks a pool of allocations)."""
        self.stats = AutoStats()
        return _AutoSearch(self, workload, cost_model_for(workload, cost), beat_s).run(top_k)


class _AutoSearch:
    """One run of the auto planner."""

    def __init__(self, planner: AutoPlanner, workload: Workload, cost: CostModel, beat_s: float = math.inf) -> None:
        self.planner = planner
        self.workload = workload
        self.cost = cost
        self.budget = WorkBudget(planner.max_solves, "exact shape solves")
        self.pool: dict[tuple[object, ...], tuple[tuple[int, float, str], Plan]] = {}
        self.errors: list[str] = []
        self.beat_s = beat_s
        self.best_s = beat_s  # the time to beat: the best plan's, or the caller's where that is faster
        # shapes solved without a certificate: (bound, answer, shape)
        self._open: list[tuple[float, float, PlanShape]] = []
        # the open shapes' partitioners and options: settling solves them again on the same tables
        self._open_solvers: dict[tuple[object, ...], tuple[PipelinePartitioner, list[list[StageOption]]]] = {}
        self._floors: dict[tuple[object, ...], np.ndarray] = {}

    # --- the steps -------------------------------------------------------------------------
    def run(self, top_k: int) -> list[RankedPlan]:
        stats = self.planner.stats
        with Progress("auto planner", total=len(self.planner.sources)) as progress:
            seeds = self.seed(progress, self.planner.sources)
            shapes = self.shapes(seeds)
            progress.expect(len(shapes))  # one step per shape, those the bounds rule out at once
            self.solve_all(shapes, progress)
            if stats.budget_hit or stats.grid_uncertified or not self.pool and self.beat_s == math.inf:
                stats.ran_contained = True
                progress.expect(len(self.planner.contained))
                self.seed(progress, self.planner.contained)
        return self.ranked(top_k)

    def seed(self, progress: Progress, factories: Iterable[Callable[[], Planner]]) -> list[Plan]:
        """These planners' best plans, in the pool and returned for their shapes."""
        plans = []
        for factory in factories:
            planner = factory()
            progress.advance(note=planner.name)
            try:
                ranked = planner.plan(self.workload, SEEDS_PER_PLANNER, self.cost)
            except HetplanError as exc:
                self.errors.append(f"{planner.name}: {exc}")
                continue
            for r in ranked:
                self.add(r.plan)
                plans.append(r.plan)
        return plans

    def shapes(self, seeds: list[Plan]) -> list[PlanShape]:
        """AMP's space, and the seeds' shapes with every micro-batching their splits allow."""
        found: dict[tuple[object, ...], PlanShape] = {}
        for shape in list(self._grid_shapes()) + list(self._seed_shapes(seeds)):
            found.setdefault(shape.key, shape)
        return list(found.values())

    def _seed_shapes(self, seeds: list[Plan]) -> Iterable[PlanShape]:
        gbs = self.workload.global_batch_size
        for plan in seeds:
            if plan.virtual_stages > 1 or plan.global_batch_size != gbs:
                continue
            stages = tuple((s.devices, s.dp, s.tp, s.dp_split, s.cp, s.ep, s.ep_split) for s in plan.stages)
            yield PlanShape(stages, plan.micro_batch_size, plan.num_micro_batches, plan.planner)
            if any(len(set(s.dp_split)) > 1 for s in plan.stages):
                continue
            for m in divisors(gbs):
                mbs = gbs // m
                if m != plan.num_micro_batches and all(mbs % s.dp == 0 for s in plan.stages):
                    evened = tuple((s.devices, s.dp, s.tp, (mbs // s.dp,) * s.dp, s.cp, s.ep, s.ep_split)
                                   for s in plan.stages)
                    yield PlanShape(evened, mbs, m, plan.planner)

    def _grid_shapes(self) -> Iterable[PlanShape]:
        """AMP's space: degrees × micro-batch × placements, with context and
        expert parallelism where ``enumerate_parallel_degrees`` allows them
        (a replica's cp·tp GPUs placed as a TP group of AMP's of dp·cp replicas)."""
        cluster, gbs = self.workload.cluster, self.workload.global_batch_size
        counts: dict[int, int] = {}  # placements up to symmetry: their number depends on tp alone
        for pp, dp, cp, tp, ep in enumerate_parallel_degrees(self.workload):
            placements = [heuristic_placement(cluster.num_devices, pp, dp * cp, tp)]
            if cluster.bandwidth_matrix_gbps is None and cp == 1:
                if tp not in counts:
                    counts[tp] = count_canonical_placements(cluster, pp, dp, tp)
                if counts[tp] <= self.planner.max_placements:
                    placements += list(canonical_placements(cluster, pp, dp, tp))
            for u in micro_batch_sizes(gbs, dp):
                mbs = dp * u
                for placement in placements:
                    stages = tuple((devices, dp, tp, (u,) * dp, cp, ep, None) for devices in placement)
                    yield PlanShape(stages, mbs, gbs // mbs, GRID)
                    by_speed = tuple((devices, dp, tp, (u,) * dp, cp, ep,
                                      speed_expert_split(self.workload, devices, dp * cp, tp, ep))
                                     for devices in placement)
                    if any(stage[-1] for stage in by_speed) and search_limits(self.workload).uneven_experts:
                        # mixed GPUs: experts by speed too
                        yield PlanShape(by_speed, mbs, gbs // mbs, GRID)

    def solve_all(self, shapes: list[PlanShape], progress: Progress | None = None) -> None:
        """Solve shapes cheapest bound first; stop when no bound can beat the best plan."""
        stats = self.planner.stats
        stats.shapes = len(shapes)
        bounded = sorted(((self.quick_bound(shape), i, shape) for i, shape in enumerate(shapes)),
                         key=lambda item: item[:2])
        for seen, (bound, _, shape) in enumerate(bounded):
            if progress is not None:
                progress.advance(note=f"exact shapes, {stats.solves} solved")
            if bound >= self.best_s * (1 - 1e-12):
                if progress is not None:  # the rest cannot beat the best plan: done with them
                    progress.advance(len(bounded) - seen - 1)
                break
            if self.pipeline_bound(shape, self.best_s * (1 - 1e-12)) >= self.best_s * (1 - 1e-12):
                continue
            if not self.budget.spend():
                stats.budget_hit = True
                break
            stats.solves += 1
            partitioner = PipelinePartitioner(self.cost.kernel, shape.micro_batch_size, shape.num_micro_batches)
            options = self.useful_options(shape)
            solution = partitioner.solve(options, self.best_s)
            if solution is not None:
                stats.certified += solution.certified
                if not solution.certified:
                    self._open.append((solution.lower_bound_s, solution.iteration_s, shape))
                    self._open_solvers[shape.key] = (partitioner, options)
                self.add(self.to_plan(shape, solution))
        self.settle_open()
        # a shape whose bound reaches the best plan holds nothing faster, certified or not
        stats.grid_uncertified = any(bound < self.best_s * (1 - 1e-12) and shape.source == GRID
                                     for bound, _, shape in self._open)

    def settle_open(self) -> None:
        """Solve again, exactly (more dual steps, exact staircases), the shapes
        left uncertified whose bound is under the best plan: the one with the
        best answer first (it may hide a better plan), then least bound first.
        A shape so certified, or whose new bound reaches the best plan, holds
        nothing better; once no AMP-space shape stays open, auto's containment
        of the uniform, Megatron and AMP planners is proven (``CONTAINED_PLANNERS``
        run only otherwise), so settling stops at the first AMP-space shape
        that stays open: the planners it contains run then anyway."""
        by_answer = sorted(self._open, key=lambda item: (item[1], item[0]))
        queue = by_answer[:1] + sorted(by_answer[1:], key=lambda item: item[0])
        settled: list[tuple[float, float, PlanShape]] = []
        for index, (bound, _, shape) in enumerate(queue):
            if bound >= self.best_s * (1 - 1e-12):
                continue
            partitioner, options = self._open_solvers.get(shape.key) or (
                PipelinePartitioner(self.cost.kernel, shape.micro_batch_size, shape.num_micro_batches),
                self.useful_options(shape))
            solution = partitioner.solve(options, self.best_s, SETTLE_DUAL_STEPS, None, 0.0)
            if solution is None:  # nothing of the shape beats the best plan
                continue
            self.add(self.to_plan(shape, solution))
            if not solution.certified:
                settled.append((solution.lower_bound_s, solution.iteration_s, shape))
                if shape.source == GRID:
                    self._open = settled + queue[index + 1:]
                    return
        self._open = settled

    def _layer_floor(self, shape: PlanShape) -> np.ndarray:
        """(stages, layers): a time per layer and stage that no option undercuts —
        the fastest option's slowest replica (``StageCosts.layer_totals``)."""
        found = self._floors.get(shape.key)
        if found is None:
            fastest = (StageOption(devices, dp, tp, split, 0, "none", tp > 1, cp=cp, ep=ep, ep_split=ep_split)
                       for devices, dp, tp, split, cp, ep, ep_split in shape.stages)
            found = self._floors[shape.key] = np.stack([self.cost.kernel.stage(o).layer_totals() for o in fastest])
        return found

    def quick_bound(self, shape: PlanShape) -> float:
        """No plan of the shape is faster: ``m`` micro-batches through its
        slowest stage, which runs at least its share of the layers' floors."""
        cheapest = self._layer_floor(shape).min(axis=0)
        per_stage = max(float(cheapest.sum()) / len(shape.stages), float(cheapest.max()))
        return shape.num_micro_batches * per_stage

    def pipeline_bound(self, shape: PlanShape, beat: float = math.inf) -> float:
        """A tighter bound, for every split with every stage at its layers'
        floors and no memory limit: the least pipeline time of those floors
        under 1F1B's pace (``fast_partition``). Solved only when a quick bound
        is below ``beat``: ``(m − 1)`` times the least pace plus the least sum
        ``X`` of stage and link times, the pace being at least the slowest
        stage (or its outgoing link where that is slower) and the whole
        pipeline's round trip ``X / k`` (``cost.pipeline.one_f_one_b_period``'s
        run of every stage)."""
        floors = self._layer_floor(shape)
        k, n = floors.shape
        if k > n:
            return math.inf
        kernel = self.cost.kernel
        links = pace = None
        if k > 1:
            rates = [kernel.p2p_rate(a[0], b[0]) for a, b in zip(shape.stages, shape.stages[1:])]
            pace = np.zeros((k - 1, n + 1))  # one way, by cut position: a slow link paces the pipeline
            pace[:, 1:n] = np.outer(rates, kernel.arrays.output_bytes[:n - 1]) * shape.micro_batch_size
            links = P2P_PASSES * pace[:, 1:n]
        problem = PartitionProblem(floors, shape.num_micro_batches, links, link_pace=pace, one_f_one_b=True)
        least_sum = problem._min_sum(math.inf)
        if least_sum is None:
            return math.inf
        sum_part = problem.evaluate(*least_sum)
        w = shape.num_micro_batches - 1
        least = sum_part.cost_s - w * sum_part.bottleneck_s
        quick = w * max(problem.min_bottleneck(), least / k) + least
        if quick >= beat:
            return quick
        best = fast_partition(problem)  # the floors' own optimum under 1F1B's pace
        return math.inf if best is None else best.cost_s

    def useful_options(self, shape: PlanShape) -> list[list[StageOption]]:
        """The shape's options less those that cannot help: recomputation and
        activation offloading only save memory (offloading's exposed transfers
        are never negative), so where running without either fits every layer
        range of the stage's window they are dropped for that ZeRO stage
        (slower, nothing saved); and offloading with a recomputation is dropped
        where that recomputation alone fits everywhere. Offloading is searched
        only with ``Workload.search_offload``."""
        options = shape.options(self.workload.search_offload, search_limits(self.workload))
        k, n = len(options), self.cost.kernel.num_layers
        span = n - k + 1
        out = []
        for j, stage_options in enumerate(options):
            in_flight = in_flight_micro_batches("1f1b", j, k, shape.num_micro_batches)
            window = (j, span)
            roomy = {o.zero for o in stage_options if o.recompute == "none" and not o.offload
                     and self._fits_everywhere(o, in_flight, window, shape.num_micro_batches)}
            kept = [o for o in stage_options if o.recompute == "none" and not o.offload or o.zero not in roomy]
            m = shape.num_micro_batches
            enough = {(o.zero, o.recompute) for o in kept if not o.offload and o.zero not in roomy
                      and self._fits_everywhere(o, in_flight, window, m)} if any(o.offload for o in kept) else set()
            out.append([o for o in kept if not o.offload or (o.zero, o.recompute) not in enough])
        return out

    def _fits_everywhere(self, option: StageOption, in_flight: float, window: tuple[int, int],
                         micro_batches: int) -> bool:
        tables = self.cost.kernel.stage(option).tables(in_flight, window, micro_batches)
        valid = np.triu(np.ones(tables.fits.shape, dtype=bool))
        return bool(tables.fits[valid].all())

    # --- the pool ---------------------------------------------------------------------------
    def to_plan(self, shape: PlanShape, solution: PipelineSolution) -> Plan:
        how = "certified optimal" if solution.certified else \
            f"within {solution.iteration_s / solution.lower_bound_s - 1:.2%} of its optimum"
        note = (f"auto: exact layer split and per-stage ZeRO/recompute/offload for a shape from {shape.source} "
                f"({how} for that shape)")
        return Plan(model=self.workload.model.name, cluster=self.workload.cluster.name,
                    global_batch_size=self.workload.global_batch_size, micro_batch_size=shape.micro_batch_size,
                    num_micro_batches=shape.num_micro_batches, schedule="1f1b", stages=solution.stages,
                    planner="auto", notes=(note,))

    def add(self, plan: Plan) -> None:
        # a layer's tp written out equal to its stage's (Galvatron's per-layer plans) is the
        # same plan as one that leaves it at 0: listed once
        stages = tuple(replace(st, strategies=tuple(replace(ls, tp=0) if ls.tp == st.tp else ls
                                                    for ls in st.strategies)) for st in plan.stages)
        key = (plan.micro_batch_size, plan.num_micro_batches, plan.schedule, plan.virtual_stages, stages)
        if key in self.pool:
            return
        time_s, fits = self.cost.quick(plan)
        self.pool[key] = ((0 if fits else 1, time_s, plan.describe()), plan)
        if fits:
            self.best_s = min(self.best_s, time_s)

    def ranked(self, top_k: int) -> list[RankedPlan]:
        if self.beat_s < math.inf:
            faster = {key: item for key, item in self.pool.items() if not item[0][0] and item[0][1] < self.beat_s}
            if not faster:
                raise NoPlanFaster(f"auto: no plan of {self.workload.cluster.name} is faster than "
                                   f"{self.beat_s * 1e3:.6g} ms per step")
            self.pool = faster
        if not self.pool:
            # the uniform planner's reason is the plainest (e.g. a batch no dp divides)
            plainest = sorted(self.errors, key=lambda e: not e.startswith("uniform:"))
            raise HetplanError(plainest[0].split(": ", 1)[1] if plainest else "no planner found a plan")
        ordered = sorted(self.pool.values(), key=lambda item: item[0])
        if ordered[0][0][0]:
            raise no_fit_error(self.workload, [RankedPlan(p, self.cost.estimate(p)) for _, p in ordered[:top_k]])
        out = []
        for key, plan in ordered[:top_k]:
            estimate = self.cost.estimate(plan)
            notes = plan.notes + self.notes(estimate.iteration_time_s, estimate.lower_bound_s)
            out.append(RankedPlan(replace(plan, notes=notes), estimate, key[1]))
        return out

    def notes(self, time_s: float, bound_s: float) -> tuple[str, ...]:
        notes = [f"auto: {time_s / bound_s - 1:.1%} above the lower bound "
                 "(no plan of this workload can be faster; cost/bounds.py)"]
        if self.budget.exhausted:
            notes.append(self.budget.note("auto"))
        return tuple(notes)
