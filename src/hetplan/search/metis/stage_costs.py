"""Metis's stage costs, data load balancing and capacity-aware layer balancing.

:class:`MetisCosts` answers, from the shared kernel, what Metis's search asks
again and again: how long a stage takes for a range of layers on its device
group with a given (dp, tp) and per-replica micro-batch split, whether every
GPU of it holds those layers, and what its gradient all-reduce, optimizer
step and pipeline transfers cost. A stage of Metis is a
:class:`hetplan.cost.kernel.StageOption` without ZeRO or recomputation; its
numbers are the kernel's ``StageCosts`` — the estimate's — from prefix sums,
O(1) per range of layers. Memory is the kernel's: the analytic model, or
Metis's profiled layer-composition memory (§4.3) when the workload carries a
:class:`hetplan.profile.metis.MetisProfileDB` with memory measurements.

:class:`StageHandle` is one group with one intra-stage plan, the object the
search's inner loops use.

:func:`data_balance` splits a stage's micro-batch over its dp replicas in
proportion to their speed (Metis §4.1 data load balancing; each replica gets
at least one sample and, when asked, no more than its memory holds), then
evens out the slowest replica. :func:`proportional_bounds` cuts the layers so
that each stage's share of the load follows its capacity (Metis §4.2.2,
capacity-aware layer balancing); the planner then refines the cuts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import bisect

import numpy as np

from hetplan.cluster.catalog import GPUSpec
from hetplan.cost.stage import SegmentTables, StageCosts, StageOption
from hetplan.cost.model import CostModel
from hetplan.search.metis.groups import DeviceGroup


@dataclass(frozen=True)
class Intra:
    """A stage's intra-stage plan: (dp, tp) and the per-replica micro-batch split."""

    dp: int
    tp: int
    split: tuple[int, ...]


@dataclass(frozen=True)
class Replica:
    """One TP group of a stage: its devices, the GPU that sets its pace, and the
    smallest capacity and largest overhead among its GPUs."""

    devices: tuple[int, ...]
    gpu: GPUSpec
    capacity_bytes: int
    overhead_bytes: int


@dataclass(frozen=True)
class ReplicaArrays:
    """The replicas of a group at one TP degree, as arrays over the replicas."""

    gpu: np.ndarray  # slowest GPU type (index into ``CostKernel.cluster_arrays.gpus``)
    capacity: np.ndarray  # smallest capacity among the replica's GPUs
    overhead: np.ndarray  # largest framework overhead among them


class MetisCosts:
    """Cached stage-level costs for one workload (see the module docstring)."""

    def __init__(self, cost_model: CostModel) -> None:
        self.cm = cost_model
        self.kernel = cost_model.kernel
        self.workload = cost_model.workload
        self.model = cost_model.model
        self.cluster = cost_model.cluster
        self.num_layers = self.model.num_layers
        self.metis_memory = self.kernel.memory_profile
        self._time: dict[tuple[str, int, int], list[float]] = {}
        self._replicas: dict[tuple[int, int], list[Replica]] = {}
        self._replica_arrays: dict[tuple[int, int], ReplicaArrays] = {}
        self._classes: dict[object, int] = {}
        self._class_of: dict[int, int] = {}
        self._handles: dict[tuple[int, Intra], StageHandle] = {}

    def time_prefix(self, gpu: GPUSpec, tp: int, batch: int) -> list[float]:
        """Prefix sums of forward + backward time per layer on one GPU."""
        key = (gpu.name, tp, batch)
        table = self._time.get(key)
        if table is None:
            t = self.kernel.layer_times(gpu, batch, tp)
            table = self._time[key] = [0.0] + list((t.fwd_s + t.bwd_s).cumsum())
        return table

    def group_class(self, group: DeviceGroup) -> int:
        """A number shared by the groups that cost alike on their own
        (``groups.ClusterArrays.group_class``): what the search works out for
        one group alone — its intra-stage plans, their stage costs and layer
        bounds — is cached under it, so the many identical groups of a large
        homogeneous cluster are worked out once."""
        found = self._class_of.get(group.uid)
        if found is None:
            key = self.kernel.cluster_arrays.group_class(group.devices)
            found = self._class_of[group.uid] = self._classes.setdefault(key, len(self._classes))
        return found

    def replica_arrays(self, group: DeviceGroup, tp: int) -> ReplicaArrays:
        """Per replica (TP group) of ``group``: slowest GPU type, smallest
        capacity and largest overhead, as arrays (cached; no loop over GPUs)."""
        key = (self.group_class(group), tp)
        found = self._replica_arrays.get(key)
        if found is None:
            arrays = self.kernel.cluster_arrays
            grid = self.kernel.device_array(group.devices).reshape(-1, tp)
            found = self._replica_arrays[key] = ReplicaArrays(self.kernel.replica_classes(grid)[0],
                                                              arrays.capacity[grid].min(axis=1),
                                                              arrays.overhead[grid].max(axis=1))
        return found

    def replicas(self, group: DeviceGroup, tp: int) -> list[Replica]:
        key = (group.uid, tp)
        reps = self._replicas.get(key)
        if reps is None:
            found = self.replica_arrays(group, tp)
            gpus = self.kernel.cluster_arrays.gpus
            reps = [Replica(group.devices[r * tp:(r + 1) * tp], gpus[g], capacity, overhead)
                    for r, (g, capacity, overhead) in enumerate(zip(found.gpu.tolist(), found.capacity.tolist(),
                                                                   found.overhead.tolist()))]
            self._replicas[key] = reps
        return reps

    def stage(self, group: DeviceGroup, intra: Intra) -> StageCosts:
        """The kernel's costs of this stage (plain data parallel, no recomputation)."""
        return self.kernel.stage(StageOption(group.devices, intra.dp, intra.tp, intra.split))

    def stage_time(self, group: DeviceGroup, intra: Intra, a: int, b: int) -> float:
        """Per-micro-batch time of the stage: its slowest replica."""
        return self.stage(group, intra).per_micro_batch(a, b)

    def handle(self, group: DeviceGroup, intra: Intra) -> StageHandle:
        """The cached :class:`StageHandle` of ``group`` running ``intra``."""
        key = (group.uid, intra)
        h = self._handles.get(key)
        if h is None:
            h = self._handles[key] = StageHandle(len(self._handles), self, group, intra)
        return h

    def p2p_time(self, sender: DeviceGroup, receiver: DeviceGroup, last_layer: int, micro_batch: int) -> float:
        """One-way activation transfer between consecutive stages."""
        return self.kernel.p2p_time(sender.devices, receiver.devices, last_layer, micro_batch)

    def p2p_time_bytes(self, sender: DeviceGroup, receiver: DeviceGroup, num_bytes: float) -> float:
        return self.kernel.p2p_rate(sender.devices, receiver.devices) * num_bytes

    def max_batch(self, group: DeviceGroup, tp: int, a: int, b: int, in_flight: float) -> list[int]:
        """Largest per-replica batch that fits each replica's memory for layers [a, b)."""
        dp = group.size // tp
        costs = self.stage(group, Intra(dp, tp, (1,) * dp))
        found: dict[tuple[int, int], int] = {}
        out = []
        reps = self.replica_arrays(group, tp)
        for key in zip(reps.overhead.tolist(), reps.capacity.tolist()):
            if key not in found:
                found[key] = costs.max_batch(a, b, in_flight, *key)
            out.append(found[key])
        return out


class StageHandle:
    """One device group with one intra-stage plan: range queries over the kernel's stage costs."""

    __slots__ = ("key", "group", "intra", "costs", "whole")

    def __init__(self, key: int, metis: MetisCosts, group: DeviceGroup, intra: Intra) -> None:
        self.key = key
        self.group = group
        self.intra = intra
        self.costs = metis.stage(group, intra)
        self.whole = self.time(0, metis.num_layers)

    def time(self, a: int, b: int) -> float:
        """Per-micro-batch time of layers [a, b): the slowest replica."""
        return self.costs.per_micro_batch(a, b)

    def sync(self, a: int, b: int) -> float:
        """Gradient all-reduce time of layers [a, b) over the slowest dp group."""
        return self.costs.timing(a, b).grad_sync_s

    def fits(self, a: int, b: int, in_flight: float, micro_batches: int = 0) -> bool:
        """Every GPU of the stage holds layers [a, b) and its micro-batches (``micro_batches``:
        the step's, for a pipelined stage's own buffers: ``StageCosts.pipeline_terms``)."""
        return self.costs.fits(a, b, in_flight, micro_batches=micro_batches)

    def tables(self, in_flight: float, micro_batches: int = 0) -> SegmentTables:
        """Every range of layers at once (for the exact partition; ``micro_batches`` as ``fits``)."""
        return self.costs.tables(in_flight, micro_batches=micro_batches)


# --- data load balancing ---------------------------------------------------------------
def even_split(micro_batch: int, dp: int) -> tuple[int, ...]:
    """Equal shares (the first replicas take one more when it does not divide)."""
    base, extra = divmod(micro_batch, dp)
    return (base + 1,) * extra + (base,) * (dp - extra)


def data_balance(costs: MetisCosts, group: DeviceGroup, dp: int, tp: int, micro_batch: int,
                 layers: tuple[int, int] | None = None, in_flight: float = 1.0,
                 memory_bound: bool = False) -> tuple[int, ...] | None:
    """Split ``micro_batch`` samples over the stage's dp replicas (Metis §4.1):
    the split that minimises the slowest replica's time on the stage's layers.

    Every replica gets at least one sample; then each further sample goes to
    the replica that would finish it first (optimal for the slowest replica,
    as replica times do not fall with more samples). Replicas of one GPU type
    (and memory) form a class and get equal shares (±1, the first ones the
    extra sample), so the greedy walks the classes, not the replicas. With
    ``memory_bound`` no replica gets more samples than its GPUs hold; None
    when the memory of the whole group cannot hold the micro-batch.
    """
    if micro_batch < dp:
        return None
    a, b = layers if layers is not None else (0, costs.num_layers)
    reps = costs.replicas(group, tp)
    caps = [micro_batch] * dp
    if memory_bound:
        caps = [min(micro_batch, c) for c in costs.max_batch(group, tp, a, b, in_flight)]
        if min(caps) < 1 or sum(caps) < micro_batch:
            return None
    if len({rep.gpu.name for rep in reps}) == 1 and not memory_bound:
        return even_split(micro_batch, dp)
    classes: dict[tuple[str, int], list[int]] = {}
    for r, rep in enumerate(reps):
        classes.setdefault((rep.gpu.name, caps[r]), []).append(r)
    members = list(classes.values())
    loads = [len(m) for m in members]  # one sample each to start
    remaining = micro_batch - dp
    while remaining > 0:
        best = _next_class(costs, reps, members, loads, caps, tp, (a, b))
        if best is None:
            return None
        size = len(members[best])
        step = min(remaining, size - loads[best] % size)  # the class's members still at the lower share
        loads[best] += step
        remaining -= step
    split = [0] * dp
    for rows, load in zip(members, loads):
        base, extra = divmod(load, len(rows))
        for position, r in enumerate(rows):
            split[r] = base + (1 if position < extra else 0)
    return tuple(split)


def _next_class(costs: MetisCosts, reps: list[Replica], members: list[list[int]], loads: list[int],
                caps: list[int], tp: int, layers: tuple[int, int]) -> int | None:
    """The class whose next sample would finish first (lowest class on ties); None if all are full."""
    best, best_time = None, 0.0
    for c, rows in enumerate(members):
        share = loads[c] // len(rows) + 1
        if share > caps[rows[0]]:
            continue
        t = _replica_time(costs, reps[rows[0]], tp, share, *layers)
        if best is None or t < best_time:
            best, best_time = c, t
    return best


def _replica_time(costs: MetisCosts, rep: Replica, tp: int, batch: int, a: int, b: int) -> float:
    prefix = costs.time_prefix(rep.gpu, tp, batch)
    return prefix[b] - prefix[a]


# --- capacity-aware layer balancing ------------------------------------------------------
def proportional_bounds(weights_prefix: Sequence[float], fractions: Sequence[float]) -> list[int]:
    """Cut points (S+1 of them, from 0 to L) so that stage j gets a share of the
    total layer load close to ``fractions[j]``, every stage at least one layer."""
    num_layers = len(weights_prefix) - 1
    stages = len(fractions)
    total = weights_prefix[-1] or 1.0
    bounds = [0]
    cumulative = 0.0
    for j in range(stages - 1):
        cumulative += fractions[j]
        target = cumulative * total
        lo = bounds[-1] + 1
        hi = num_layers - (stages - 1 - j)
        # closest prefix to the target within [lo, hi]
        best = lo
        best_gap = abs(weights_prefix[lo] - target)
        left = bisect.bisect_left(weights_prefix, target, lo, hi + 1)  # the first prefix >= target (they ascend)
        for cand in (left - 1, left):
            if lo <= cand <= hi:
                gap = abs(weights_prefix[cand] - target)
                if gap < best_gap - 1e-15:
                    best, best_gap = cand, gap
        bounds.append(best)
    bounds.append(num_layers)
    return bounds
