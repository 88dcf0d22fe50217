"""Choose the GPUs too (``hetplan choose``): from a pool of offers (GPU type,
node shape, zone, price), the allocation and plan that trains cheapest by a
deadline, fastest within a budget, or the frontier of time to train vs $.

Each allocation (a node count per offer, ``cluster.pool``) is planned with a
hetplan planner (default ``auto``; its best plan hetplan's runtime runs,
``app.planning.runnable_best``) and costed as

    time to train = steps x the plan's iteration time (the shared cost model),
    $ = every allocated GPU's price x time + egress,

where egress is the bytes the plan sends out of a zone each step
(``cross_zone_bytes``) x steps x that zone's $/GB.

The search is exact and prunes only by proven bounds:

* a lower bound on each allocation's iteration time, the cost model's own
  (``cost/bounds.py``: the larger of compute at each GPU type's best rate and
  the runtime's host time of a micro-batch, + the optimizer step), computed for every allocation at once from per-type numbers
  (``AllocationBounds``; ``tests/test_choose.py`` checks it equals
  ``iteration_lower_bound`` of each allocation's cluster). Time and $ of an
  allocation are at least its bound x steps and that x its price per hour
  (egress >= 0);
* an allocation whose weights, gradients and optimizer states exceed its
  memory has no plan (``search.base.states_refusal``).

Allocations are planned in order of their bound ($ for the frontier and
``--deadline``, time for ``--budget``); one is skipped when a planned point
already beats its bound (frontier: dominates it; deadline: cheaper; budget:
faster) or its bound misses the deadline or budget (``useful_hours``: the
time to train past which that is so). The planner of one that is not skipped
is told that time as the iteration time to beat (``beat_s``): a planner that
prunes by it (``auto``) never solves what its bounds show cannot beat it and
says when nothing can (``search.base.NoPlanFaster``: counted as outrun); its
best plan when that is faster is the one it finds without being told
(``tests/test_choose.py`` checks the answer against planning every allocation
without it). Nothing else is pruned:
hetplan's planners use every GPU of a cluster, so more GPUs may give a slower
best plan and no monotonicity in counts holds. The work is counted in planner
calls (``max_plans``); when that budget cuts the search, the answer is a
named heuristic, **least-bound-first, cut** (``HEURISTIC``): the ``max_plans``
allocations of least bound that no point rules out are planned, the rest are
not, and the result says so (``ChooseResult.search``: CLI header and note,
JSON, report) as the best found, not proven. Its measured quality on the
256-GPU pool is in ``docs/choose.md``.
"""

from __future__ import annotations

import itertools
import math
import os
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from hetplan.app.planning import runnable_best
from hetplan.app.records import ranked_record, write_json, write_text
from hetplan.app.rounds import Rounds
from hetplan.app.training import SECONDS_PER_HOUR
from hetplan.cluster.io import dump_cluster_yaml
from hetplan.cluster.pool import Pool, allocation_cluster, allocation_label, allocation_zones
from hetplan.cost.bounds import bound_table
from hetplan.cost.calibration import effective_calibration
from hetplan.cost.kernel import CostKernel
from hetplan.cost.model import CostModel
from hetplan.errors import HetplanError
from hetplan.io import fields
from hetplan.io.userfiles import read_json
from hetplan.limits import check_at_most
from hetplan.plan.file import workload_record
from hetplan.plan.spec import Plan, RankedPlan
from hetplan.plan.workload import Workload
from hetplan.progress import Progress
from hetplan.search.base import NoPlanFaster, states_refusal
from hetplan.simulate.plan import SIMULATION_TOLERANCE, simulated_over_closed

# Allocations a pool may have (the product of nodes + 1 over its offers): each
# costs a few microseconds to bound and 8 bytes per offer to hold, so 10^7 is
# seconds and ~1 GB; a larger pool is a typo or wants a coarser pool file.
MAX_ALLOCATIONS = 10_000_000
# Planner calls one search may make by default: auto plans a 128-GPU
# allocation of the issue-35 pool in ~0.8 CPU s on this project's machines,
# so 200 calls stay within a few minutes; --max-plans changes it.
DEFAULT_MAX_PLANS = 200
# Bounds are taken this much lower before pruning, so that a difference in the
# last bits between the vectorised bound and cost/bounds.py's (summation order)
# can never prune an allocation the exact bound would keep.
BOUND_ROUNDING = 1e-9
# The time a planner is told to beat is this much above the answer's need
# (``useful_hours``), so that a plan exactly at it (a tie the label breaks) is still found.
BEAT_MARGIN = 1e-9
BYTES_PER_GB = 1e9  # clouds bill egress per decimal GB
OBJECTIVES = ("frontier", "deadline", "budget")
# How an allocation's best plan is found: (planner, workload, beat_s) -> its best plan (``app.planning``'s
# ``runnable_best``, ``replica_tp_best``); ``beat_s``: only plans faster matter (``search.base.NoPlanFaster``)
BestOf = Callable[[Any, Workload, float], RankedPlan]
NOTE_ROUND_TRIPS = ("the event simulator runs the pipelines of {labels} {low:.0%}-{high:.0%} longer than the "
                    "estimate: over links comparable to the stages their schedules wait longer than the closed form "
                    "charges (GPipe's one-way phases; docs/cost-model.md, Known limits); "
                    "their times and $ are optimistic by up to that much, and the frontier may differ")
# The two searches ``choose`` may have run, as every output names them.
EXACT = "exact: every allocation planned or pruned by a proven bound"
HEURISTIC = "heuristic (least-bound-first, cut)"
NOTE_ONE_TYPE_PER_GROUP = ("each stage's replicas are of one GPU type per replica group, as hetplan's planners "
                           "build them; stages mixing GPU types and TP degrees inside (Sailor's) are searched "
                           "only with --mixed-tp")


@dataclass(frozen=True)
class Allocation:
    """Node counts per offer, with its price and bounds."""

    counts: tuple[int, ...]
    label: str
    gpus: int
    usd_per_hour: float
    bound_iteration_s: float
    zones: tuple[str, ...] = ()

    @property
    def spans_zones(self) -> bool:
        """Whether its nodes lie in two or more zones (information: its
        cluster prices each link by its zones, ``cluster/pool.py``, so its
        time and $ are as exact as those of one zone)."""
        return len(self.zones) > 1


@dataclass(frozen=True)
class Point:
    """An allocation with its best plan: time to train and $ (GPUs + egress)."""

    allocation: Allocation
    workload: Workload
    best: RankedPlan
    steps: float
    egress_bytes_per_step: Mapping[str, float]
    egress_usd: float
    # how much longer the event simulator runs its pipeline than the estimate (SIMULATION_TOLERANCE)
    simulated_over_estimate: float = 0.0

    @property
    def iteration_s(self) -> float:
        return self.best.estimate.iteration_time_s

    @property
    def hours(self) -> float:
        return self.steps * self.iteration_s / SECONDS_PER_HOUR

    @property
    def gpu_usd(self) -> float:
        return self.hours * self.allocation.usd_per_hour

    @property
    def usd(self) -> float:
        return self.gpu_usd + self.egress_usd

    def key(self) -> tuple[float, float, str]:
        return (self.hours, self.usd, self.allocation.label)

    def record(self) -> dict[str, Any]:
        """The point as JSON (``choose --json``)."""
        a = self.allocation
        return {"allocation": a.label, "counts": list(a.counts), "gpus": a.gpus, "cluster": self.workload.cluster.name,
                "usd_per_hour": a.usd_per_hour, "iteration_s": self.iteration_s, "steps": self.steps,
                "hours": self.hours, "gpu_usd": self.gpu_usd, "egress_usd": self.egress_usd,
                "spans_zones": a.spans_zones, "simulated_pipeline_over_estimate": self.simulated_over_estimate,
                "egress_gb_per_step": {z: b / BYTES_PER_GB for z, b in sorted(self.egress_bytes_per_step.items())},
                "usd": self.usd, "plan": self.best.plan.describe(), "plan_record": self.best.to_dict()}


@dataclass(frozen=True)
class ChooseResult:
    """``points``: the frontier (fastest first), or the one answer of
    ``deadline``/``budget`` (empty: none meets it); the search's counts."""

    pool: Pool
    objective: str
    limit: float | None
    tokens: float
    points: tuple[Point, ...]
    allocations: int
    planned: int
    pruned: int
    no_plan: int
    unplanned: int
    notes: tuple[str, ...] = field(default=())
    # the allocations the planner-call budget left unplanned (``bound_shortfall`` says how far each bound is
    # from pruning it); not written to JSON
    left_unplanned: tuple[Allocation, ...] = field(default=(), repr=False)
    # of the planned, those whose planner proved no plan faster than the answer so far needs (``useful_hours``)
    outrun: int = 0
    jobs: int = 1  # allocations planned at once (``app.rounds``)
    # the CPU seconds each planned allocation took, by round (``app.rounds.Rounds.cpu_s``); not written to JSON
    round_cpu_s: tuple[tuple[float, ...], ...] = field(default=(), repr=False, compare=False)

    @property
    def proven(self) -> bool:
        """Every allocation was planned or pruned by a proven bound."""
        return self.unplanned == 0

    @property
    def search(self) -> str:
        """Which search gave the answer, in words (``EXACT``, or ``HEURISTIC`` with what it planned)."""
        if self.proven:
            return EXACT
        return (f"{HEURISTIC}: the {self.planned} allocations of least bound planned, {self.unplanned} left "
                "unplanned; the best found, not proven")

    def record(self) -> dict[str, Any]:
        return {"pool": self.pool.name, "objective": self.objective, "limit": self.limit, "tokens": self.tokens,
                "allocations": self.allocations, "planned": self.planned, "pruned": self.pruned,
                "no_plan": self.no_plan, "outrun": self.outrun, "unplanned": self.unplanned, "jobs": self.jobs,
                "proven": self.proven, "search": self.search,
                "notes": list(self.notes), "points": [p.record() for p in self.points]}


@dataclass(frozen=True)
class FrontierPoint:
    """What a chart of the answer needs of a point (``hetplan report --choose``)."""

    label: str
    gpus: int
    iteration_s: float
    hours: float
    usd: float
    plan: str
    spans_zones: bool = False  # its nodes lie in two or more zones (``Allocation.spans_zones``)


@dataclass(frozen=True)
class ChooseSummary:
    """The answer of a search as ``choose --json`` keeps it: enough to draw and tabulate."""

    pool: str
    objective: str
    proven: bool
    points: tuple[FrontierPoint, ...]
    search: str = ""  # ``ChooseResult.search`` (empty in files written before it was kept)


def summary(result: ChooseResult) -> ChooseSummary:
    """``result`` as a :class:`ChooseSummary`."""
    return ChooseSummary(result.pool.name, result.objective, result.proven, tuple(
        FrontierPoint(p.allocation.label, p.allocation.gpus, p.iteration_s, p.hours, p.usd, p.best.plan.describe(),
                      p.allocation.spans_zones)
        for p in result.points), result.search)


_RESULT_KEYS = ("pool", "objective", "limit", "tokens", "allocations", "planned", "pruned", "no_plan", "outrun",
                "unplanned", "jobs",
                "proven", "search", "notes", "points")
_POINT_KEYS = ("allocation", "counts", "gpus", "cluster", "usd_per_hour", "iteration_s", "steps", "hours", "gpu_usd",
               "egress_usd", "spans_zones", "simulated_pipeline_over_estimate", "egress_gb_per_step", "usd", "plan",
               "plan_record")


def read_choose_json(path: str) -> ChooseSummary:
    """A ``hetplan choose --json`` file, every field a chart reads checked (one-line errors)."""
    data = fields.mapping(path, read_json(path, "choose result", "write it with 'hetplan choose --json'"),
                          _RESULT_KEYS, ("pool", "objective", "proven", "points"))
    points = []
    for i, raw in enumerate(fields.listing(f"{path}: points", data["points"], MAX_ALLOCATIONS)):
        where = f"{path}: points[{i}]"
        entry = fields.mapping(where, raw, _POINT_KEYS, ("allocation", "gpus", "iteration_s", "hours", "usd", "plan"))
        points.append(FrontierPoint(fields.text(f"{where}.allocation", entry["allocation"]),
                                    fields.whole(f"{where}.gpus", entry["gpus"]),
                                    fields.number(f"{where}.iteration_s", entry["iteration_s"]),
                                    fields.number(f"{where}.hours", entry["hours"]),
                                    fields.number(f"{where}.usd", entry["usd"], strict=False),
                                    fields.text(f"{where}.plan", entry["plan"]),
                                    fields.flag(f"{where}.spans_zones", entry.get("spans_zones", False))))
    return ChooseSummary(fields.text(f"{path}: pool", data["pool"]),
                         fields.text(f"{path}: objective", data["objective"], OBJECTIVES),
                         fields.flag(f"{path}: proven", data["proven"]), tuple(points),
                         fields.text(f"{path}: search", data.get("search", "")))


# --- allocations and bounds ---------------------------------------------------------
def all_counts(pool: Pool) -> list[tuple[int, ...]]:
    """Every allocation of the pool (not all zero), in lexicographic order."""
    total = math.prod(o.nodes + 1 for o in pool.offers) - 1
    check_at_most(f"allocations of pool {pool.name!r}", total, MAX_ALLOCATIONS,
                  "give fewer offers or fewer nodes per offer")
    return [c for c in itertools.product(*(range(o.nodes + 1) for o in pool.offers)) if any(c)]


class AllocationBounds:
    """``cost/bounds.py``'s ``iteration_lower_bound`` for any allocation: its
    ``BoundTable`` is built once for the pool's GPU types, and an allocation
    adds only its GPUs per type and the sum of their memory bandwidths."""

    def __init__(self, pool: Pool, workload: Workload) -> None:
        full = allocation_cluster(pool, [o.nodes for o in pool.offers])
        kernel = CostModel(replace(workload, cluster=full)).kernel
        self.table = bound_table(kernel, [o.gpu for o in pool.offers], workload.global_batch_size)
        self.type_of_offer = [self.table.types.index(o.gpu.name) for o in pool.offers]
        self.gpus_per_node = [o.gpus_per_node for o in pool.offers]
        self.bandwidth = [o.gpu.memory_bandwidth_bytes_per_s * o.gpus_per_node for o in pool.offers]

    def iteration_s(self, counts: Sequence[int]) -> float:
        """The least iteration time any plan on this allocation can have."""
        n = np.zeros(len(self.table.types))
        bandwidth = 0.0
        for i, count in enumerate(counts):
            n[self.type_of_offer[i]] += count * self.gpus_per_node[i]
            bandwidth += count * self.bandwidth[i]
        return self.table.iteration_s(n, bandwidth)


def allocations(pool: Pool, workload: Workload) -> list[Allocation]:
    """Every allocation of the pool with its price per hour and iteration bound."""
    bounds = AllocationBounds(pool, workload)
    out = []
    for counts in all_counts(pool):
        gpus = sum(n * o.gpus_per_node for n, o in zip(counts, pool.offers))
        price = sum(n * o.gpus_per_node * o.price_per_gpu_hour for n, o in zip(counts, pool.offers))
        zones = tuple(sorted(set(allocation_zones(pool, counts))))
        out.append(Allocation(counts, allocation_label(pool, counts), gpus, price, bounds.iteration_s(counts), zones))
    return out


# --- one allocation ------------------------------------------------------------------
def allocation_workload(pool: Pool, base: Workload, counts: Sequence[int]) -> Workload:
    """``base`` (its model and settings) on the allocation's cluster."""
    cluster = allocation_cluster(pool, counts)
    return replace(base, cluster=cluster, calibration=effective_calibration(base.profile, cluster, base.calibration))


def cross_zone_bytes(plan: Plan, workload: Workload, device_zones: Sequence[str]) -> dict[str, float]:
    """Bytes one step sends out of each zone, from the cost kernel's volumes:

    * pipeline: each boundary sends ``output_bytes`` of its last layer x the
      micro-batch forward and its gradient back (``P2P_PASSES``), split over
      ``min(senders, receivers)`` streams paired in order as ``cost/comm.py``'s
      ``p2p_time`` pairs them; a stream whose ends are in two zones leaves the
      sender's zone;
    * data parallelism: each layer's dp groups run a ring in group order;
      each link carries (n-1)/n x the held parameters x the bytes per
      parameter of its ZeRO stage (all-reduce 2 x gradient bytes; ZeRO-1 + a
      weight all-gather; ZeRO-2 a gradient reduce-scatter + weight all-gather;
      ZeRO-3 two weight gathers and a reduce-scatter per micro-batch), and a
      link between zones sends it out of its sender's zone.

    TP groups lie inside nodes, so inside zones; context- and expert-parallel
    groups across zones are refused (their traffic is not counted here)."""
    kernel = CostModel(workload).kernel
    out: dict[str, float] = {}

    def send(a: int, b: int, num_bytes: float) -> None:
        if device_zones[a] != device_zones[b]:
            out[device_zones[a]] = out.get(device_zones[a], 0.0) + num_bytes

    for j in range(plan.pp - 1):
        src, dst = plan.stages[j].devices, plan.stages[j + 1].devices
        streams = max(1, min(len(src), len(dst)))
        per_stream = float(kernel.arrays.output_bytes[plan.stages[j].layers[-1]]) * plan.micro_batch_size / streams
        for i in range(streams):
            a, b = src[i % len(src)], dst[i % len(dst)]
            send(a, b, per_stream * plan.num_micro_batches)  # forward
            send(b, a, per_stream * plan.num_micro_batches)  # backward
    for stage in plan.stages:
        if len({device_zones[d] for d in stage.devices}) < 2:
            continue
        if stage.cp > 1 or stage.ep > 1:
            raise HetplanError(f"a stage with context or expert parallelism spans zones ({plan.describe()}); "
                               "choose counts no egress for it: use a pool in one zone for this model")
        for position, layer in enumerate(stage.layers):
            _, tp = stage.layer_degrees(position)
            held = kernel.held_params(tp, layer, layer + 1)
            per_param = _ring_bytes_per_param(kernel, stage.strategies[position].zero, plan.num_micro_batches)
            # the stage's own groups (per shard chunk with ``replica_tp``), or a layer's own tp's
            groups = stage.dp_groups() if tp == stage.tp else [stage.devices[t::tp] for t in range(tp)]
            for group in groups:
                n = len(group)
                for i in range(n):
                    send(group[i], group[(i + 1) % n], (n - 1) / n * held * per_param)
    return out


def _ring_bytes_per_param(kernel: CostKernel, zero: int, micro_batches: int) -> float:
    """Bytes per held parameter one ring link carries in a step, before (n-1)/n (``cost/stage.py``'s collectives)."""
    grad, weight = kernel.grad_bytes, kernel.weight_bytes
    return {0: 2 * grad, 1: 2 * grad + weight, 2: grad + weight}.get(zero, (2 * weight + grad) * micro_batches)


def plan_allocation(pool: Pool, base: Workload, allocation: Allocation, planner: Any, steps: float,
                    best_of: BestOf = runnable_best, beat_s: float = math.inf) -> Point | str | None:
    """The allocation's best plan as a Point, why it has none (nothing fits),
    or None: its planner proved no plan of it is faster than ``beat_s``."""
    workload = allocation_workload(pool, base, allocation.counts)
    why = states_refusal(workload)
    if why:
        return why
    try:
        best = best_of(planner, workload, beat_s)
    except NoPlanFaster:
        return None
    except HetplanError as exc:
        return str(exc)
    node_zones = allocation_zones(pool, allocation.counts)
    device_zones = [node_zones[d.node] for d in workload.cluster.devices]
    egress = cross_zone_bytes(best.plan, workload, device_zones)
    usd = sum(b / BYTES_PER_GB * pool.egress_usd_per_gb[z] for z, b in egress.items()) * steps
    simulated = simulated_over_closed(best.plan, best.estimate)
    return Point(allocation, workload, best, steps, egress, usd, simulated)


def round_trips_note(points: Sequence[Point]) -> str | None:
    """The note naming the points whose pipeline the event simulator runs
    more than ``SIMULATION_TOLERANCE`` longer than their estimate (None: none)."""
    late = [p for p in points if p.simulated_over_estimate > SIMULATION_TOLERANCE]
    if not late:
        return None
    over = [p.simulated_over_estimate for p in late]
    return NOTE_ROUND_TRIPS.format(labels=", ".join(p.allocation.label for p in late), low=min(over), high=max(over))


# --- the answer ---------------------------------------------------------------------
def pareto_front(points: Sequence[Point]) -> list[Point]:
    """The points no other beats in both time and $ (fastest first; of equal
    points, the allocation whose label sorts first)."""
    front: list[Point] = []
    for point in sorted(points, key=Point.key):
        if not front or point.usd < front[-1].usd:
            front.append(point)
    return front


def best_point(points: Sequence[Point], objective: str, limit: float) -> Point | None:
    """The cheapest within ``limit`` hours (deadline) or the fastest within ``limit`` $ (budget)."""
    if objective == "deadline":
        ok = [p for p in points if p.hours <= limit]
        return min(ok, key=lambda p: (p.usd, p.hours, p.allocation.label), default=None)
    ok = [p for p in points if p.usd <= limit]
    return min(ok, key=Point.key, default=None)


def _bound_point(a: Allocation, steps: float) -> tuple[float, float]:
    """(hours, $) no plan of ``a`` can beat."""
    hours = a.bound_iteration_s * (1 - BOUND_ROUNDING) * steps / SECONDS_PER_HOUR
    return hours, hours * a.usd_per_hour


def useful_hours(usd_per_hour: float, points: Sequence[Point], objective: str, limit: float | None) -> float:
    """The time to train past which no plan of an allocation at this price
    can be in the answer, given these points (each a plan that runs): the
    frontier's ``max(q.hours, q.usd / price)`` of a point ``q`` (slower and,
    egress being >= 0, dearer than ``q``), a deadline's limit and a cheaper
    point within it, or a budget's limit and a faster point within it."""
    def at_price(usd: float) -> float:
        return usd / usd_per_hour if usd_per_hour > 0 else math.inf

    if objective == "deadline" and limit is not None:
        return min([limit] + [at_price(p.usd) for p in points if p.hours <= limit])
    if objective == "budget" and limit is not None:
        return min([at_price(limit)] + [p.hours for p in points if p.usd <= limit])
    return min((max(p.hours, at_price(p.usd)) for p in points), default=math.inf)


def _beaten(allocation: Allocation, points: Sequence[Point], objective: str, limit: float | None,
            steps: float) -> bool:
    """Whether no plan of the allocation can be in the answer: its bound is past ``useful_hours``."""
    hours, _ = _bound_point(allocation, steps)
    return hours > useful_hours(allocation.usd_per_hour, points, objective, limit)


def bound_shortfall(allocation: Allocation, points: Sequence[Point], steps: float) -> float:
    """By how much the allocation's lower bound would have to rise to be
    pruned for the frontier: the least ``k`` such that some point is no slower
    than ``k`` x its bound time and no dearer than ``k`` x its bound $ (inf
    without points). Below 1 it is pruned already (``_beaten``); a bound
    ``k`` times tighter would prune every allocation whose shortfall is at most
    ``k``, which is how ``benchmarks/bench_choose.py`` measures what a tighter
    bound would buy before anyone proves one: the frontier's ``useful_hours``
    over the bound's hours."""
    hours, _ = _bound_point(allocation, steps)
    return useful_hours(allocation.usd_per_hour, points, "frontier", None) / hours


def search_order(candidates: Sequence[Allocation], objective: str, steps: float) -> list[Allocation]:
    """Least bound first: by $ (frontier, deadline) or by time (budget); ties by label."""
    def key(a: Allocation) -> tuple[float, float, str]:
        hours, usd = _bound_point(a, steps)
        return (hours, usd, a.label) if objective == "budget" else (usd, hours, a.label)
    return sorted(candidates, key=key)


def choose(pool: Pool, base: Workload, planner: Any, tokens: float, objective: str = "frontier",
           limit: float | None = None, max_plans: int = DEFAULT_MAX_PLANS,
           best_of: BestOf = runnable_best, jobs: int = 1) -> ChooseResult:
    """The answer of ``hetplan choose`` (module docstring): ``objective``
    "frontier", "deadline" (``limit``: hours) or "budget" (``limit``: $);
    ``base``: the workload (model, global batch, settings) on any cluster;
    ``jobs``: allocations planned at once (``app.rounds``)."""
    if objective not in OBJECTIVES:
        raise HetplanError(f"objective must be one of {', '.join(OBJECTIVES)}, got {objective!r}")
    if (limit is None) != (objective == "frontier"):
        raise HetplanError("give a limit with the deadline or budget objective, and none for the frontier")
    steps = tokens / (base.global_batch_size * base.model.seq_len)
    candidates = allocations(pool, base)
    points: list[Point] = []
    reasons: list[str] = []
    planned = pruned = outrun = 0
    left: list[Allocation] = []
    order = search_order(candidates, objective, steps)
    with Rounds(lambda i, beat_s: plan_allocation(pool, base, order[i], planner, steps, best_of, beat_s),
                jobs) as rounds, Progress("choose: allocations", total=len(order)) as progress:
        index = 0
        while index < len(order):
            batch: list[tuple[int, float]] = []  # the next round: up to ``jobs`` allocations no point rules out
            while index < len(order) and len(batch) < rounds.jobs:
                allocation = order[index]
                if _beaten(allocation, points, objective, limit, steps):
                    pruned += 1
                elif planned >= max_plans:
                    left.append(allocation)
                else:
                    planned += 1
                    beat_s = useful_hours(allocation.usd_per_hour, points, objective, limit) * SECONDS_PER_HOUR / steps
                    batch.append((index, beat_s * (1 + BEAT_MARGIN)))
                index += 1
            for found in rounds.run(batch):
                if found is None:
                    outrun += 1
                elif isinstance(found, str):
                    reasons.append(found)
                else:
                    points.append(found)
            progress.advance(index - progress.done, note=f"{planned} planned, {pruned} pruned, {len(points)} points")
    if not points and (objective == "frontier" or not pruned):  # else: the limit ruled every allocation out
        first = f": the first said: {reasons[0]}" if reasons else ""
        raise HetplanError(f"no allocation of pool {pool.name!r} has a plan{first}")
    best = best_point(points, objective, limit) if objective != "frontier" and limit is not None else None
    chosen = pareto_front(points) if objective == "frontier" else [best] if best is not None else []
    notes = [NOTE_ONE_TYPE_PER_GROUP]
    late = round_trips_note(chosen)
    if late:
        notes.append(late)
    if left:
        notes.append(f"{HEURISTIC}: the search stopped at its budget of {max_plans} planner calls (--max-plans), "
                     f"having planned the allocations of least bound; {len(left)} allocations were not planned, so "
                     "the answer is the best found, not proven (docs/choose.md: its measured quality)")
    return ChooseResult(pool, objective, limit, tokens, tuple(chosen), len(candidates), planned, pruned,
                        len(reasons), len(left), tuple(notes), tuple(left), outrun, rounds.jobs,
                        tuple(rounds.cpu_s))


# --- exports ------------------------------------------------------------------------
def point_files(point: Point, planner: str, tokens: float) -> tuple[str, dict[str, Any]]:
    """A point as a cluster file (YAML text) and a plan file (its best plan,
    as ``hetplan plan --json`` writes one), which ``hetplan estimate``,
    ``export`` and ``train`` read."""
    workload = point.workload
    record = ranked_record(point.best, CostModel(workload), tokens, None)
    plan_file = {"planner": planner, "search_time_s": 0.0, "plans": [record], **workload_record(workload)}
    return dump_cluster_yaml(workload.cluster), plan_file


def write_points(result: ChooseResult, out_dir: str, planner: str) -> None:
    """Each point's cluster and plan file in ``out_dir`` (``point-N.cluster.yaml``, ``point-N.plan.json``)."""
    try:
        os.makedirs(out_dir, exist_ok=True)
    except OSError as exc:
        raise HetplanError(f"--out-dir {out_dir}: cannot create it: {exc.strerror}") from None
    for index, point in enumerate(result.points, 1):
        cluster_text, plan_file = point_files(point, planner, result.tokens)
        write_text(os.path.join(out_dir, f"point-{index}.cluster.yaml"), cluster_text)
        write_json(os.path.join(out_dir, f"point-{index}.plan.json"), plan_file)
