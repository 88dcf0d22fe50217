"""Lower bounds that let the Metis search skip work without changing its answer.

Metis's own prunings (group-size bound, permutation length) decide *which*
stage mappings exist. Among those, most cannot come near the best plan found
so far; :class:`Bounds` proves it cheaply — for a multiset of group sizes
before any mapping is cut from the node lines, and for a mapping before its
DFS — so the search returns the same best plan in far less time
(``MetisOptions.prune``; off for the plain search).

The argument. Metis's cost (eq. 1 as the shared model computes it) is at
least ``(B − 1)·max t_j + Σ t_j + Σ_j c_j``, with ``t_j`` the compute (+ TP
communication) of stage j's layers and ``c_j`` its two pipeline transfers.
For it to stay below a threshold T, the bottleneck must satisfy
``max t_j <= M = min(T / B, (T − F) / (B − 1))``, where F is a lower bound on
``Σ t_j + Σ c_j``. At any TP degree it may still reach, stage j can then run
at most

* ``n_j(M)`` big layers: the most layers whose *cheapest* per-layer times add
  up to at most ``M``, and
* ``K_j`` big layers: the most layers whose *smallest* memory footprints
  (model states, plus activations of ``min(S − j, B)`` micro-batches at the
  stage's smallest possible largest per-replica share) fit its GPUs.

"Big" layers are all but the model's few cheap ones (embeddings, small
heads: under 5% of the median layer's reference time). Every stage runs at
least one layer and only the cheap ones can spare a stage a big one. If the
stages cannot cover the big layers this way — or F alone reaches T, F being
the least total time in which they can run them at all (every stage taking
at least one, none more than its memory holds) — no assignment reaches T.

For a multiset of sizes the groups are not known yet: each stage is credited
with the fastest GPU type at every TP degree its size allows, the largest
memory in the cluster and, for each size, the best positions in the
pipeline. :meth:`Bounds.type_bottleneck` adds what the GPU counts force:
the slow GPUs must sit somewhere, and most groups are of one type.

Assumptions (true of the analytic cost model; documented for profiles):
raising TP never makes a stage faster than its start (the DFS only raises
TP), a replica's per-layer time does not drop when its share grows, and the
memory-bounded data split does not beat the speed-proportional one.
"""

from __future__ import annotations

import bisect
import heapq
import math
from typing import Any, Callable, Sequence

import numpy as np

from hetplan.search.metis.groups import DeviceGroup
from hetplan.search.metis.stage_costs import Intra, MetisCosts


class Bounds:
    """Cached feasibility bounds for one search (see the module docstring)."""

    def __init__(self, costs: MetisCosts, options_for: Callable[[DeviceGroup, int, int], list[Intra]],
                 max_tp: int) -> None:
        self.costs = costs
        self.model = costs.model
        self.cluster = costs.cluster
        self.num_layers = self.model.num_layers
        self.options_for = options_for  # (group, micro_batch, from_tp) -> intras the DFS may reach
        self.max_tp = max_tp
        kernel = costs.kernel
        self.kernel = kernel
        self.capacity_max = max(kernel.capacity_bytes(d.id) for d in self.cluster.devices)
        self.overhead = min(kernel.overhead_bytes(d.id) for d in self.cluster.devices)
        self.min_output = min((layer.output_bytes for layer in self.model.layers[:-1]), default=0.0)
        reference_gpu = min((d.gpu for d in self.cluster.devices), key=lambda g: g.name)
        ref = costs.time_prefix(reference_gpu, 1, 1)
        per_layer = [ref[i + 1] - ref[i] for i in range(self.num_layers)]
        median = sorted(per_layer)[self.num_layers // 2]
        self.big = [i for i in range(self.num_layers) if per_layer[i] >= 0.05 * median]
        self.num_big = len(self.big)
        self.num_small = self.num_layers - self.num_big
        counts: dict[str, int] = {}
        for d in self.cluster.devices:
            counts[d.gpu.name] = counts.get(d.gpu.name, 0) + 1
        self._type_counts = sorted(counts.items())
        speed = {d.gpu.name: d.gpu.peak_flops_for(self.model.dtype_bytes) for d in self.cluster.devices}
        self._types_by_speed = sorted(self._type_counts, key=lambda item: (speed[item[0]], item[0]))
        self._mem: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._cache: dict[tuple[object, ...], Any] = {}  # mixed values: prefixes, holds, stage bounds
        self._stage_cache: dict[tuple[int, int, int], StageBound] = {}
        self._flights: dict[tuple[int, int], tuple[int, ...]] = {}
        self._hold: dict[tuple[object, ...], int] = {}
        self._times: dict[object, list[float]] = {}
        self._fastest: dict[tuple[int, int], list[float]] = {}
        gpus = {d.gpu.name: d.gpu for d in self.cluster.devices}
        self._gpus = [gpus[n] for n in sorted(gpus)]

    # --- memory ---------------------------------------------------------------------
    def _layer_mem(self, tp: int) -> tuple[np.ndarray, np.ndarray]:
        """Per big layer: least model-state bytes and activation bytes per sample
        at this tp — a tied layer counted as if its group's weight were already held."""
        table = self._mem.get(tp)
        if table is None:
            k = self.kernel
            per_param = sum(self.costs.workload.state_bytes)
            params = k.params_per_device(tp) - k.tied_share(tp)
            act = k.activation_bytes(tp, "none", False)
            big = list(self.big)
            table = self._mem[tp] = (params[big] * per_param, act[big])
        return table

    def max_layers(self, tp: int, batch: int, in_flight: float, capacity: float) -> int:
        """Most big layers a GPU with this tp, share and in-flight count can
        hold in ``capacity`` bytes (smallest footprints first)."""
        if self.costs.metis_memory is not None:
            return self.num_big  # profiled memory is not additive per layer: no bound
        key = (tp, batch, in_flight, capacity)
        value = self._hold.get(key)
        if value is None:
            states, act = self._layer_mem(tp)
            used = np.cumsum(np.sort(states + act * (batch * in_flight)))
            budget = (capacity - self.overhead) * (1 + 1e-9)  # slack: rounding must not tighten a bound
            value = self._hold[key] = int(np.searchsorted(used, budget, side="right"))
        return value

    def max_layers_held(self, group: DeviceGroup, intra: Intra, in_flight: float) -> int:
        """Upper bound on the big layers a stage can hold: its busiest replica
        has at least an even share and at most the group's largest memory."""
        batch = -(-sum(intra.split) // intra.dp)
        capacity = int(self.costs.replica_arrays(group, intra.tp).capacity.max())
        return self.max_layers(intra.tp, batch, in_flight, capacity)

    # --- per-layer times, sorted ascending, as prefix sums --------------------------------
    def _sorted_prefix(self, values: Sequence[float]) -> list[float]:
        prefix = [0.0]
        for v in sorted(values):
            prefix.append(prefix[-1] + v)
        return prefix

    def intra_prefix(self, group: DeviceGroup, intra: Intra) -> list[float]:
        """Sorted big-layer times of the stage's slowest replica class: any range
        of layers costs the stage at least their sum (``StageCosts.layer_totals``)."""
        key = (self.costs.group_class(group), intra)
        prefix = self._times.get(key)
        if prefix is None:
            costs = self.costs.stage(group, intra)
            prefix = self._times.get(costs.key)  # symmetric groups share their stage costs
            if prefix is None:
                totals = costs.layer_totals()
                prefix = self._times[costs.key] = self._sorted_prefix([float(totals[i]) for i in self.big])
            self._times[key] = prefix
        return prefix

    def fastest_prefix(self, tp: int, batch: int) -> list[float]:
        """Sorted per-layer times of the fastest GPU type (per layer) at tp, batch."""
        key = (tp, batch)
        prefix = self._fastest.get(key)
        if prefix is None:
            tables = [self.costs.time_prefix(g, tp, batch) for g in self._gpus]
            per_layer = [min(t[i + 1] - t[i] for t in tables) for i in self.big]
            prefix = self._fastest[key] = self._sorted_prefix(per_layer)
        return prefix

    # --- the feasibility test ----------------------------------------------------------
    @staticmethod
    def _stage(options: list[tuple[list[float], int]]) -> "StageBound | None":
        return StageBound(options) if options else None

    def _covers(self, stages: Sequence["StageBound"], budget_max: float) -> bool:
        """Can the stages together run every big layer with none over
        budget? Every stage runs at least one layer and only the cheap layers
        can spare a stage from running a big one."""
        total = 0
        idle = 0
        for sb in stages:
            n = sb.count(budget_max)
            if n == 0:
                idle += 1
                if idle > self.num_small:
                    return False
            total += n
        return total >= self.num_big

    def _fill(self, stages: Sequence["StageBound"], transfers: float = 0.0) -> float:
        """Lower bound on Σ t_j: the pipeline transfers, plus the least total
        time in which the stages can run all big layers, each holding at most
        what its memory allows and — but for ``num_small`` of them, which may
        run only cheap layers — at least one big layer. Beyond each stage's
        first, the globally cheapest increments go first: exact for this
        relaxation because each stage's increments (its sorted per-layer
        times) do not decrease."""
        firsts = []
        for j, sb in enumerate(stages):
            if sb.cap > 0:
                firsts.append((sb.merged[1], j))
        idle = len(stages) - len(firsts)
        if idle > self.num_small:
            return math.inf
        firsts.sort()
        spare = self.num_small - idle  # stages that may still go without a big layer
        mandatory = firsts[:len(firsts) - spare] if spare > 0 else firsts
        need = self.num_big - len(mandatory)
        if need < 0:
            return math.inf  # more stages than big layers to go round
        work = 0.0
        heads = []
        taken = {j for _, j in mandatory}
        for cost, j in mandatory:
            work += cost
            sb = stages[j]
            if sb.cap > 1:
                heads.append((sb.merged[2] - sb.merged[1], j, 2))
        for cost, j in firsts:
            if j not in taken:
                heads.append((cost, j, 1))
        heapq.heapify(heads)
        while need > 0 and heads:
            cost, j, k = heapq.heappop(heads)
            work += cost
            need -= 1
            sb = stages[j]
            if k < sb.cap:
                heapq.heappush(heads, (sb.merged[k + 1] - sb.merged[k], j, k + 1))
        if need > 0:
            return math.inf  # the stages cannot hold the big layers at all
        return transfers + work

    def beaten(self, stages: Sequence["StageBound"], num_micro_batches: int, threshold: float,
               min_bottleneck: float = 0.0, transfers: Callable[[], float] | None = None) -> bool:
        """True when no layer assignment can bring the cost under ``threshold``
        (``min_bottleneck``: a known lower bound on max t_j; ``transfers``:
        gives a lower bound on the pipeline transfers Σ c_j)."""
        if not math.isfinite(threshold):
            return False
        if num_micro_batches * min_bottleneck >= threshold:
            return True
        if not self._covers(stages, threshold / max(num_micro_batches, 1)):
            return True
        fill = self._fill(stages, transfers() if transfers is not None else 0.0)
        if fill >= threshold:
            return True
        # cost >= (B − 1)·M + Σ t_j + Σ c_j with that sum >= max(M, fill):
        # cost < T needs M < T / B and M < (T − fill) / (B − 1)
        budget = threshold / max(num_micro_batches, 1)
        if num_micro_batches > 1:
            budget = min(budget, (threshold - fill) / (num_micro_batches - 1))
        return not self._covers(stages, budget)

    # --- the three levels ------------------------------------------------------------------
    def type_bottleneck(self, sizes: Sequence[int], micro_batch: int) -> float:
        """Lower bound on max t_j from where the GPUs must go.

        Groups are cut from node lines in which each GPU type is one run, so
        at most (types − 1) groups mix types; every other group is of one
        type. The GPUs of the slowest types (the slowest one, the slowest two,
        ...) fill at least k groups (the fewest of the largest whose sizes add
        up to their count); of those, at most (types − 1) are mixed and at
        most ``num_small`` run no big layer, so some pure group of one of
        those types among the m = k − (types − 1) − num_small largest runs a
        big layer, each of its replicas on at least an even share of the
        micro-batch."""
        ordered = sorted(sizes, reverse=True)
        mixed = len(self._type_counts) - 1
        bound = 0.0
        for k_types in range(1, len(self._types_by_speed) + 1):
            chosen = self._types_by_speed[:k_types]
            count = sum(c for _, c in chosen)
            total = 0
            k = 0
            while total < count and k < len(ordered):
                total += ordered[k]
                k += 1
            m = k - self.num_small - mixed
            if m <= 0:
                continue
            size = ordered[m - 1]
            bound = max(bound, min(self._type_layer_time(name, size, micro_batch) for name, _ in chosen))
        return bound

    def _type_layer_time(self, gpu_name: str, size: int, micro_batch: int) -> float:
        """Cheapest big-layer time of a pure group of ``size`` GPUs of one
        type, over the TP degrees that size allows."""
        key = ("type", gpu_name, size, micro_batch)
        value = self._cache.get(key)
        if value is None:
            gpu = next(d.gpu for d in self.cluster.devices if d.gpu.name == gpu_name)
            value = math.inf
            tp = 1
            while tp <= min(size, self.max_tp):
                if size % tp == 0 and size // tp <= micro_batch:
                    prefix = self.costs.time_prefix(gpu, tp, math.ceil(micro_batch / (size // tp)))
                    value = min(value, min(prefix[i + 1] - prefix[i] for i in self.big))
                tp *= 2
            if not math.isfinite(value):
                value = 0.0
            self._cache[key] = value
        return value

    def multiset_options(self, sizes: Sequence[int], micro_batch: int,
                         num_micro_batches: int) -> list["StageBound"] | None:
        """Best case for every ordering of a multiset of group sizes: the
        k-th group of each size is credited with the k-th smallest in-flight
        count (positions may be shared between sizes, so this over-estimates
        what any single ordering can hold)."""
        num_stages = len(sizes)
        flights = sorted(float(min(num_stages - j, num_micro_batches)) for j in range(num_stages))
        counts: dict[int, int] = {}
        for size in sizes:
            counts[size] = counts.get(size, 0) + 1
        stages = [(size, flights[k]) for size in sorted(counts) for k in range(counts[size])]
        return self._size_options(stages, micro_batch)

    def _size_options(self, stages: Sequence[tuple[int, float]], micro_batch: int) -> list["StageBound"] | None:
        result: list[StageBound] = []
        total_hold = 0
        for size, in_flight in stages:
            key = ("size", size, in_flight, micro_batch)
            sb = self._cache.get(key, False)
            if sb is False:
                options = []
                tp = 1
                while tp <= min(size, self.max_tp):
                    if size % tp == 0 and size // tp <= micro_batch:
                        batch = math.ceil(micro_batch / (size // tp))
                        hold = self.max_layers(tp, batch, in_flight, self.capacity_max)
                        options.append((self.fastest_prefix(tp, batch), hold))
                    tp *= 2
                sb = self._cache[key] = self._stage(options)
            if sb is None:
                return None
            total_hold += sb.cap
            result.append(sb)
        if total_hold < self.num_big:
            return None
        return result

    def mapping_options(self, groups: Sequence[DeviceGroup], micro_batch: int,
                        num_micro_batches: int) -> list["StageBound"] | None:
        """Per stage of a concrete mapping, at every TP degree the DFS may
        reach; None if the memory alone rules the mapping out (see
        :meth:`transfers` for its pipeline transfers)."""
        num_stages = len(groups)
        flights = self._flights.get((num_stages, num_micro_batches))
        if flights is None:
            flights = self._flights[(num_stages, num_micro_batches)] = tuple(
                min(num_stages - j, num_micro_batches) for j in range(num_stages))
        cache = self._stage_cache
        need = self.num_big
        total_hold = 0
        result = []
        for g, in_flight in zip(groups, flights):
            key = (self.costs.group_class(g), micro_batch, in_flight)  # alike groups, alike bounds
            sb = cache.get(key)
            if sb is None:
                options = [(self.intra_prefix(g, intra), self.max_layers_held(g, intra, float(in_flight)))
                           for intra in self.options_for(g, micro_batch, 1)]
                sb = cache[key] = self._stage(options) or _NO_STAGE
            if sb is _NO_STAGE:
                return None
            hold = sb.cap
            total_hold += hold if hold < need else need
            result.append(sb)
        if total_hold < need:
            return None
        return result

    def transfers(self, groups: Sequence[DeviceGroup], micro_batch: int) -> float:
        """Lower bound on the pipeline transfers of a mapping: both directions
        of every boundary, for the smallest activation a layer passes on."""
        total = 0.0
        for a, b in zip(groups, groups[1:]):
            key = ("p2p", a.uid, b.uid)
            unit = self._cache.get(key)
            if unit is None:
                unit = self._cache[key] = self.costs.p2p_time_bytes(a, b, 1.0)
            total += 2.0 * unit * self.min_output * micro_batch
        return total


class StageBound:
    """One stage's best case: per option, sorted big-layer times (prefix
    sums) and how many big layers its memory holds."""

    __slots__ = ("options", "cap", "_merged")

    def __init__(self, options: list[tuple[list[float], int]]) -> None:
        self.options = options
        length = len(options[0][0]) - 1
        self.cap = min(max(hold for _, hold in options), length)
        self._merged: list[float] | None = options[0][0] if len(options) == 1 else None

    @property
    def merged(self) -> list[float]:
        """The cheapest k-th increment over the options, as prefix sums: a
        convex under-estimate of every option's cost of k layers."""
        if self._merged is None:
            diffs = [[p[k + 1] - p[k] for k in range(len(p) - 1)] for p, _ in self.options]
            merged = [0.0]
            for values in zip(*diffs):
                merged.append(merged[-1] + min(values))
            self._merged = merged
        return self._merged

    def count(self, budget: float) -> int:
        """Most big layers this stage can run within ``budget`` seconds."""
        if budget <= 0:
            return 0
        best = 0
        limit = budget * (1.0 + 1e-12)
        for prefix, hold in self.options:
            n = bisect.bisect_right(prefix, limit) - 1
            if n > hold:
                n = hold
            if n > best:
                best = n
        return best


_NO_STAGE = StageBound([([0.0], 0)])  # marks a group with no usable intra-stage plan
