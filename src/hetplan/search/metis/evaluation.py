"""Metis's intra-stage search for one stage mapping and one number of
micro-batches (Algorithm 1, lines 5-22): the DP-first depth-first search,
capacity-aware layer balancing with boundary refinement, and Metis's cost of
a complete plan (eq. 1, as the shared model computes it)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, Sequence

from hetplan.cost.pipeline import StageTail, iteration_time
from hetplan.plan.workload import Workload
from hetplan.search.metis.groups import DeviceGroup
from hetplan.search.metis.stage_costs import Intra, MetisCosts, StageHandle, proportional_bounds

if TYPE_CHECKING:  # the planner imports this module
    from hetplan.search.metis.planner import MetisOptions


class SearchContext(Protocol):
    """What an evaluation needs from the search around it (``planner._Search``)."""

    workload: Workload
    costs: MetisCosts
    options: MetisOptions
    num_layers: int
    weights: list[float]

    def initial_intra(self, group: DeviceGroup, micro_batch: int) -> Intra | None: ...

    def split(self, group: DeviceGroup, dp: int, tp: int, micro_batch: int, layers: tuple[int, int] | None = None,
              in_flight: float = 1.0, memory_bound: bool = False) -> tuple[int, ...] | None: ...

    def next_tp(self, group: DeviceGroup, tp: int) -> int: ...

    def record(self, handles: Sequence[StageHandle], bounds: tuple[int, ...], micro_batch: int,
               num_micro_batches: int) -> None: ...


def metis_cost(handles: Sequence[StageHandle], bounds: Sequence[int], micro_batch: int, num_micro_batches: int,
               costs: MetisCosts, overlap_grad_sync: bool = True) -> float:
    """Metis eq. 1, ``Σ t_i + (B − 1)·max t_j + DP_all``, as the shared cost
    model computes it: the kernel's numbers of each stage (slowest replica, TP
    communication, gradient all-reduce, optimizer step) combined by
    ``iteration_time`` — the two pipeline transfers of each boundary outside
    the bottleneck term, each stage's gradient all-reduce overlapping its last
    backward pass, the optimizer step after."""
    timings = [h.costs.timing(bounds[j], bounds[j + 1]) for j, h in enumerate(handles)]
    p2p = [costs.p2p_time(handles[j].group, handles[j + 1].group, bounds[j + 1] - 1, micro_batch)
           for j in range(len(handles) - 1)]
    tails = [StageTail(t.back_s, t.grad_sync_s, t.post_step_s, t.optimizer_s) for t in timings]
    return iteration_time([t.per_micro_batch_s for t in timings], p2p, tails, num_micro_batches,
                          overlap_grad_sync, slowdown=costs.kernel.overlap_slowdown).total_s


class Evaluation:
    """Algorithm 1's intra-stage DFS for one mapping and one B. Stage j keeps
    activations of min(S − j, B) micro-batches (1F1B)."""

    def __init__(self, search: SearchContext, groups: tuple[DeviceGroup, ...], num_micro_batches: int) -> None:
        self.search = search
        self.costs = search.costs
        self.options = search.options
        self.groups = groups
        self.num_stages = len(groups)
        self.num_layers = search.num_layers
        self.weights = search.weights
        self.num_micro_batches = num_micro_batches
        self.micro_batch = search.workload.global_batch_size // num_micro_batches
        self.in_flight = tuple(float(min(self.num_stages - j, num_micro_batches)) for j in range(self.num_stages))
        self.leaves = 0
        self.states = 0
        self.seen: set[tuple[object, ...]] = set()
        self.lb_cache: dict[tuple[object, ...], tuple[int, ...] | None] = {}

    def handle(self, group: DeviceGroup, intra: Intra) -> StageHandle:
        return self.costs.handle(group, intra)

    def run(self) -> None:
        handles = []
        for g in self.groups:
            intra = self.search.initial_intra(g, self.micro_batch)
            if intra is None:
                return
            handles.append(self.handle(g, intra))
        hs = tuple(handles)
        bounds = self.layer_lb(hs, 0, ())
        if bounds is None:
            return
        if self.options.data_balance and any(h.group.is_hetero for h in hs):
            # DataLB on each heterogeneous stage's own layers, then LayerLB again
            resplit = list(hs)
            for j, h in enumerate(hs):
                if h.group.is_hetero:
                    split = self.search.split(h.group, h.intra.dp, h.intra.tp, self.micro_batch,
                                              (bounds[j], bounds[j + 1]))
                    if split is not None and split != h.intra.split:
                        resplit[j] = self.handle(h.group, Intra(h.intra.dp, h.intra.tp, split))
            if tuple(resplit) != hs:
                again = self.layer_lb(tuple(resplit), 0, ())
                if again is not None:
                    hs, bounds = tuple(resplit), again
        self.dfs(0, hs, bounds)

    # --- the DFS -----------------------------------------------------------------------------
    def dfs(self, i: int, hs: tuple[StageHandle, ...], bounds: tuple[int, ...]) -> None:
        """Stages before ``i`` are settled (they fit in memory)."""
        opts = self.options
        if self.leaves >= opts.max_leaves or self.states >= opts.max_dfs_states:
            return
        state = (i, tuple(h.key for h in hs[i:]), bounds)
        if state in self.seen:
            return
        self.seen.add(state)
        self.states += 1
        if i >= self.num_stages:
            self.leaves += 1
            self.search.record(hs, bounds, self.micro_batch, self.num_micro_batches)
            return
        h = hs[i]
        cap = opts.max_batch_per_replica
        if cap and max(h.intra.split) > cap:
            return  # InvalidIntraPlan
        a, b = bounds[i], bounds[i + 1]
        in_flight = self.in_flight[i]
        if not h.fits(a, b, in_flight, self.num_micro_batches):
            group, intra = h.group, h.intra
            # a heterogeneous group may fit by moving samples to GPUs with spare
            # memory (data balancing bounded by memory); rebalance the layers
            # of this and the remaining stages and look again
            if group.is_hetero and opts.data_balance:
                split = self.search.split(group, intra.dp, intra.tp, self.micro_batch, (a, b), in_flight, True)
                if split is not None and split != intra.split:
                    moved = hs[:i] + (self.handle(group, Intra(intra.dp, intra.tp, split)),) + hs[i + 1:]
                    new_bounds = self.layer_lb(moved, i, bounds[:i + 1])
                    if new_bounds is not None:
                        self.dfs(i, moved, new_bounds)
            # (a) increase TP, decrease DP; rebalance data, and layers over this
            # and the remaining stages; look at this stage again
            tp = self.search.next_tp(group, intra.tp)
            if tp:
                split = self.search.split(group, group.size // tp, tp, self.micro_batch)
                if split is not None:
                    raised = hs[:i] + (self.handle(group, Intra(group.size // tp, tp, split)),) + hs[i + 1:]
                    new_bounds = self.layer_lb(raised, i, bounds[:i + 1])
                    if new_bounds is not None:
                        self.dfs(i, raised, new_bounds)
            # (b) restore the plan; move layers off this stage to the remaining
            # ones, in proportion to their capacity, until it fits
            shed = self.shed(i, hs, bounds)
            if shed is None:
                return
            bounds = shed
        self.dfs(i + 1, hs, bounds)

    # --- layer balancing ---------------------------------------------------------------------
    def layer_lb(self, hs: tuple[StageHandle, ...], start: int, settled: tuple[int, ...]) -> tuple[int, ...] | None:
        """Capacity-aware layer balancing of stages ``start``.. over the layers
        after the settled prefix (``settled`` = bounds[0..start]), then
        boundary refinement; equal layer counts when layer balancing is off."""
        first = settled[start] if start > 0 else 0
        remaining = self.num_stages - start
        if remaining > self.num_layers - first:
            return None
        prefix = list(settled[:start])
        if remaining == 1:
            return tuple(prefix + [first, self.num_layers])
        if not self.options.layer_balance:
            base, extra = divmod(self.num_layers - first, remaining)
            bounds = prefix + [first]
            for j in range(remaining):
                bounds.append(bounds[-1] + base + (1 if j < extra else 0))
            return tuple(bounds)
        key = (tuple(h.key for h in hs[start:]), start, first)
        if key in self.lb_cache:
            cached = self.lb_cache[key]
            return None if cached is None else tuple(prefix) + cached[start:]
        capacity = [1.0 / max(h.whole, 1e-12) for h in hs[start:]]
        total = sum(capacity)
        base_weight = self.weights[first]
        weights = [w - base_weight for w in self.weights[first:]]
        tail = proportional_bounds(weights, [c / total for c in capacity])
        bounds = prefix + [first + x for x in tail]
        result = tuple(self.refine(hs, bounds, start))
        self.lb_cache[key] = result
        return result

    def refine(self, hs: tuple[StageHandle, ...], bounds: list[int], start: int) -> list[int]:
        """Move one boundary layer at a time from the slowest stage (from
        ``start`` on) to a neighbour while that lowers the slower of the two
        and the neighbour keeps fitting in memory."""
        n, m = self.num_stages, self.num_micro_batches
        in_flight = self.in_flight
        times = [hs[j].time(bounds[j], bounds[j + 1]) if j >= start else 0.0 for j in range(n)]
        for _ in range(2 * self.num_layers):
            k = start
            for j in range(start + 1, n):
                if times[j] > times[k]:
                    k = j
            if bounds[k + 1] - bounds[k] <= 1:
                break
            best = None
            if k > start:  # give the first layer to the previous stage
                t_k = hs[k].time(bounds[k] + 1, bounds[k + 1])
                t_nb = hs[k - 1].time(bounds[k - 1], bounds[k] + 1)
                worst = t_k if t_k > t_nb else t_nb
                if worst < times[k] - 1e-12 and (hs[k - 1].fits(bounds[k - 1], bounds[k] + 1, in_flight[k - 1], m)
                                                 or not hs[k - 1].fits(bounds[k - 1], bounds[k], in_flight[k - 1], m)):
                    best = (worst, k, k - 1, t_k, t_nb)
            if k + 1 < n:  # give the last layer to the next stage
                t_k = hs[k].time(bounds[k], bounds[k + 1] - 1)
                t_nb = hs[k + 1].time(bounds[k + 1] - 1, bounds[k + 2])
                worst = t_k if t_k > t_nb else t_nb
                if worst < times[k] - 1e-12 and (best is None or worst < best[0]) and \
                        (hs[k + 1].fits(bounds[k + 1] - 1, bounds[k + 2], in_flight[k + 1], m)
                         or not hs[k + 1].fits(bounds[k + 1], bounds[k + 2], in_flight[k + 1], m)):
                    best = (worst, k, k + 1, t_k, t_nb)
            if best is None:
                break
            _, k, nb, times[k], times[nb] = best
            if nb < k:
                bounds[k] += 1
            else:
                bounds[k + 1] -= 1
        return bounds

    def shed(self, i: int, hs: tuple[StageHandle, ...], bounds: tuple[int, ...]) -> tuple[int, ...] | None:
        """Stage i keeps the layers it can hold from where it starts; the rest
        go to the remaining stages in proportion to their capacity."""
        if i + 1 >= self.num_stages or not self.options.layer_balance:
            return None
        h = hs[i]
        a, b = bounds[i], bounds[i + 1]
        lo, hi = a, b  # the most layers [a, hold) that fit: memory only grows with more layers
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if h.fits(a, mid, self.in_flight[i], self.num_micro_batches) else (lo, mid)
        hold = lo
        if hold <= a:
            return None
        return self.layer_lb(hs, i + 1, tuple(bounds[:i + 1]) + (hold,))
