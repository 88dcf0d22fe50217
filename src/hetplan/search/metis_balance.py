"""Metis's stage cost, data load balancing and capacity-aware layer balancing.

:class:`StageCosts` answers, fast and from the shared cost model's building
blocks, what Metis's search asks again and again: how long a stage takes for
a range of layers on its device group with a given (dp, tp) and per-replica
micro-batch split, how much memory each of its GPUs needs, and what its
gradient all-reduce and pipeline transfers cost. Layer times come from
``CostModel.layer_time`` (a measured profile where the workload has one, the
analytic model otherwise); collectives from ``hetplan.cost.comm``, which uses
the real link between two GPUs (inside a node: the node's fabric; between
nodes: the nodes' network) — the authors' code returned the intra-node
bandwidth for inter-node links. Per-layer numbers are kept as prefix sums so a
range of layers costs O(1).

Memory is the shared cost model's formula for plain data parallelism without
recomputation (weights + gradients + optimizer states, activations of the
micro-batches in flight under 1F1B, framework overhead), or Metis's profiled
layer-composition memory (§4.3) when the workload carries a
:class:`hetplan.profile.metis.MetisProfileDB` with memory measurements.

:class:`StageHandle` is one group with one intra-stage plan, the object the
search's inner loops use (no hashing of device tuples per query).

:func:`data_balance` splits a stage's micro-batch over its dp replicas in
proportion to their speed (Metis §4.1 data load balancing; each replica gets
at least one sample and, when asked, no more than its memory holds), then
evens out the slowest replica. :func:`proportional_bounds` cuts the layers so
that each stage's share of the load follows its capacity (Metis §4.2.2,
capacity-aware layer balancing); the planner then refines the cuts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import numpy as np

from hetplan.cluster.catalog import GPUSpec
from hetplan.cost import comm
from hetplan.cost.constants import MEMORY_BANDWIDTH_EFFICIENCY, OPTIMIZER_STEP_BYTES_PER_PARAM
from hetplan.cost.memory import framework_overhead_bytes, layer_activation_bytes, layer_params_per_device
from hetplan.cost.model import CostModel
from hetplan.profile.metis import MetisProfileDB
from hetplan.search.metis_groups import DeviceGroup

if TYPE_CHECKING:  # pragma: no cover
    from hetplan.search.metis_bounds import Bounds


@dataclass(frozen=True)
class Intra:
    """A stage's intra-stage plan: (dp, tp) and the per-replica micro-batch split."""

    dp: int
    tp: int
    split: tuple[int, ...]


@dataclass(frozen=True)
class _Replica:
    devices: tuple[int, ...]
    gpu: GPUSpec
    capacity_bytes: int
    is_cpu: bool


class StageCosts:
    """Cached stage-level costs for one workload (see the module docstring)."""

    def __init__(self, cost_model: CostModel) -> None:
        self.cm = cost_model
        self.workload = cost_model.workload
        self.model = cost_model.model
        self.cluster = cost_model.cluster
        self.num_layers = self.model.num_layers
        weight_b, grad_b, opt_b = self.workload.state_bytes
        self.state_bytes_per_param = weight_b + grad_b + opt_b
        self.grad_bytes = grad_b
        layers = self.model.layers
        self._keys = [layer.profile_key for layer in layers]
        self._time: dict[tuple[str, int, int], list[float]] = {}
        self._states: dict[int, list[float]] = {}
        self._params: dict[int, list[float]] = {}
        self._act: dict[int, list[float]] = {}
        self._tpc = _prefix([layer.tp_comm_bytes for layer in layers])
        self._out = [layer.output_bytes for layer in layers]
        self._replicas: dict[tuple[tuple[int, ...], int], list[_Replica]] = {}
        self._unit: dict[tuple[object, ...], float] = {}
        self._desc: dict[tuple[object, ...], tuple] = {}
        self._handles: dict[tuple[tuple[int, ...], Intra], StageHandle] = {}
        self._gpu_by_name = {d.gpu.name: d.gpu for d in self.cluster.devices}
        # tied parameters: a stage holding several layers of a group keeps one copy
        tied: dict[str, list[int]] = {}
        for i, layer in enumerate(layers):
            if layer.tied_group:
                tied.setdefault(layer.tied_group, []).append(i)
        self._tied = [members for members in tied.values() if len(members) > 1]
        profile = self.workload.profile
        self.metis_memory = profile if isinstance(profile, MetisProfileDB) and profile.has_memory else None

    # --- per-layer prefix sums ------------------------------------------------------
    def time_prefix(self, gpu: GPUSpec, tp: int, batch: int) -> list[float]:
        """Prefix sums of forward + backward time per layer on one GPU."""
        key = (gpu.name, tp, batch)
        table = self._time.get(key)
        if table is None:
            per_key: dict[str, float] = {}
            values = []
            for i, k in enumerate(self._keys):
                if k not in per_key:
                    t = self.cm.layer_time(i, gpu, batch, tp)
                    per_key[k] = t.fwd_s + t.bwd_s
                values.append(per_key[k])
            table = self._time[key] = _prefix(values)
        return table

    def bwd_prefix(self, gpu: GPUSpec, tp: int, batch: int) -> list[float]:
        """Prefix sums of backward time per layer on one GPU."""
        key = ("bwd", gpu.name, tp, batch)
        table = self._time.get(key)  # type: ignore[arg-type]
        if table is None:
            values = []
            for i in range(self.num_layers):
                values.append(self.cm.layer_time(i, gpu, batch, tp).bwd_s)
            table = self._time[key] = _prefix(values)  # type: ignore[index]
        return table

    def _params_prefix(self, tp: int) -> list[float]:
        table = self._params.get(tp)
        if table is None:
            table = self._params[tp] = _prefix([layer_params_per_device(layer, tp) for layer in self.model.layers])
        return table

    def _act_prefix(self, tp: int) -> list[float]:
        table = self._act.get(tp)
        if table is None:
            table = self._act[tp] = _prefix([layer_activation_bytes(layer, tp, "none", False)
                                             for layer in self.model.layers])
        return table

    def stage_params(self, a: int, b: int, tp: int) -> float:
        """Parameters one GPU of the stage holds for layers [a, b) (tied once)."""
        prefix = self._params_prefix(tp)
        params = prefix[b] - prefix[a]
        for members in self._tied:
            inside = [m for m in members if a <= m < b]
            for m in inside[1:]:
                params -= layer_params_per_device(self.model.layers[m], tp)
        return params

    # --- replicas -----------------------------------------------------------------
    def replicas(self, group: DeviceGroup, tp: int) -> list[_Replica]:
        key = (group.devices, tp)
        reps = self._replicas.get(key)
        if reps is None:
            reps = []
            dtype = self.model.dtype_bytes
            for r in range(group.size // tp):
                devs = group.devices[r * tp:(r + 1) * tp]
                gpu = min((self.cluster.devices[d].gpu for d in devs), key=lambda g: g.peak_flops_for(dtype))
                capacity = min(self.workload.device_capacity_bytes(d) for d in devs)
                reps.append(_Replica(devs, gpu, capacity, gpu.name == "CPU"))
            self._replicas[key] = reps
        return reps

    def _allreduce_unit(self, devices: tuple[int, ...], concurrent: int) -> float:
        """Seconds per byte of an all-reduce over ``devices`` (linear in bytes)."""
        key = ("ar", devices, concurrent)
        unit = self._unit.get(key)
        if unit is None:
            unit = self._unit[key] = comm.allreduce_time(self.cluster, devices, 1e9, concurrent) / 1e9
        return unit

    def _p2p_unit(self, src: tuple[int, ...], dst: tuple[int, ...]) -> float:
        key = ("p2p", src, dst)
        unit = self._unit.get(key)
        if unit is None:
            unit = self._unit[key] = comm.p2p_time(self.cluster, src, dst, 1e9) / 1e9
        return unit

    # --- stage costs ----------------------------------------------------------------
    def _descriptor(self, group: DeviceGroup, intra: Intra) -> tuple[tuple[list[float], float, list[float]], ...]:
        """The distinct (time prefix, TP-communication seconds per TP byte,
        backward-time prefix) of the stage's replicas: replicas of one GPU
        type and share cost the same."""
        key = (group.devices, intra)
        desc = self._desc.get(key)
        if desc is None:
            seen: dict[tuple[str, int, float], tuple[list[float], float, list[float]]] = {}
            for rep, batch in zip(self.replicas(group, intra.tp), intra.split):
                coef = 2.0 * self._allreduce_unit(rep.devices, 1) * batch if intra.tp > 1 else 0.0
                k = (rep.gpu.name, batch, coef)
                if k not in seen:
                    seen[k] = (self.time_prefix(rep.gpu, intra.tp, batch), coef,
                               self.bwd_prefix(rep.gpu, intra.tp, batch))
            desc = self._desc[key] = tuple(seen[k] for k in sorted(seen))
        return desc

    def stage_time(self, group: DeviceGroup, intra: Intra, a: int, b: int) -> float:
        """Per-micro-batch time of the stage: its slowest replica."""
        tpc = self._tpc[b] - self._tpc[a]
        return max(p[b] - p[a] + c * tpc for p, c, _ in self._descriptor(group, intra))

    def dp_sync_unit(self, group: DeviceGroup, intra: Intra) -> float:
        """Seconds per byte of the stage's gradient all-reduce (slowest dp group)."""
        if intra.dp < 2:
            return 0.0
        key = ("dpu", group.devices, intra.dp, intra.tp)
        unit = self._unit.get(key)
        if unit is None:
            unit = 0.0
            for t in range(intra.tp):
                devices = tuple(group.devices[r * intra.tp + t] for r in range(intra.dp))
                unit = max(unit, self._allreduce_unit(devices, intra.tp))
            self._unit[key] = unit
        return unit

    def dp_sync_time(self, group: DeviceGroup, intra: Intra, a: int, b: int) -> float:
        """Gradient all-reduce of the stage over its slowest dp group."""
        if intra.dp < 2:
            return 0.0
        return self.dp_sync_unit(group, intra) * self.stage_params(a, b, intra.tp) * self.grad_bytes

    def handle(self, group: DeviceGroup, intra: Intra) -> StageHandle:
        """The cached :class:`StageHandle` of ``group`` running ``intra``."""
        key = (group.devices, intra)
        h = self._handles.get(key)
        if h is None:
            h = self._handles[key] = StageHandle(len(self._handles), self, group, intra)
        return h

    def p2p_time(self, sender: DeviceGroup, receiver: DeviceGroup, last_layer: int, micro_batch: int) -> float:
        """One-way activation transfer between consecutive stages."""
        return self._p2p_unit(sender.devices, receiver.devices) * self._out[last_layer] * micro_batch

    def p2p_time_bytes(self, sender: DeviceGroup, receiver: DeviceGroup, num_bytes: float) -> float:
        return self._p2p_unit(sender.devices, receiver.devices) * num_bytes

    def max_layers_held(self, group: DeviceGroup, intra: Intra, in_flight: float,
                        bounds: "Bounds") -> int:
        """Upper bound on the layers this stage can hold: its busiest replica
        has at least an even share and at most the group's largest memory."""
        batch = -(-sum(intra.split) // intra.dp)
        capacity = max(rep.capacity_bytes for rep in self.replicas(group, intra.tp))
        return bounds.max_layers(intra.tp, batch, in_flight, capacity)

    def _memory_classes(self, group: DeviceGroup, intra: Intra) -> tuple[tuple[int, int, bool], ...]:
        """Distinct (per-replica batch, capacity, is_cpu) of the stage's replicas."""
        key = ("mem", group.devices, intra)
        classes = self._desc.get(key)
        if classes is None:
            found = {(batch, rep.capacity_bytes, rep.is_cpu)
                     for rep, batch in zip(self.replicas(group, intra.tp), intra.split)}
            classes = self._desc[key] = tuple(sorted(found))
        return classes  # type: ignore[return-value]

    def _memory(self, a: int, b: int, tp: int, batch: int, in_flight: float, is_cpu: bool) -> float:
        overhead = framework_overhead_bytes(is_cpu)
        if self.metis_memory is not None:
            value = self.metis_memory.stage_memory(a, b, tp, batch, in_flight)
            if value is not None:
                return value + overhead
        act = self._act_prefix(tp)
        return (self.stage_params(a, b, tp) * self.state_bytes_per_param
                + (act[b] - act[a]) * in_flight * batch + overhead)

    def replica_memory(self, group: DeviceGroup, intra: Intra, a: int, b: int, in_flight: float) -> list[float]:
        """Peak bytes on a GPU of each replica for layers [a, b)."""
        reps = self.replicas(group, intra.tp)
        return [self._memory(a, b, intra.tp, batch, in_flight, rep.is_cpu) for rep, batch in zip(reps, intra.split)]

    def fits(self, group: DeviceGroup, intra: Intra, a: int, b: int, in_flight: float) -> bool:
        """Every GPU of the stage holds layers [a, b) in memory."""
        for batch, capacity, is_cpu in self._memory_classes(group, intra):
            if self._memory(a, b, intra.tp, batch, in_flight, is_cpu) > capacity:
                return False
        return True

    def max_batch(self, group: DeviceGroup, tp: int, a: int, b: int, in_flight: float) -> list[int]:
        """Largest per-replica batch that fits each replica's memory for layers [a, b)."""
        result = []
        for rep in self.replicas(group, tp):
            def fits(batch: int) -> bool:
                return self._memory(a, b, tp, batch, in_flight, rep.is_cpu) <= rep.capacity_bytes

            if not fits(1):
                result.append(0)
                continue
            lo, hi = 1, 2
            while fits(hi) and hi < (1 << 20):
                lo, hi = hi, hi * 2
            while hi - lo > 1:
                mid = (lo + hi) // 2
                if fits(mid):
                    lo = mid
                else:
                    hi = mid
            result.append(lo)
        return result


class StageHandle:
    """One device group with one intra-stage plan, answering range queries
    (time, memory fit, gradient sync of layers [a, b)) without hashing."""

    __slots__ = ("key", "group", "intra", "whole", "_desc", "_mem", "_tpc", "_act", "_params",
                 "_spp", "_tied", "_costs", "_sync_unit", "_grad", "_opt_unit")

    def __init__(self, key: int, costs: "StageCosts", group: DeviceGroup, intra: Intra) -> None:
        self.key = key
        self.group = group
        self.intra = intra
        self._costs = costs
        self._desc = costs._descriptor(group, intra)
        self._mem = tuple((batch, capacity, framework_overhead_bytes(is_cpu))
                          for batch, capacity, is_cpu in costs._memory_classes(group, intra))
        self._tpc = costs._tpc
        self._act = costs._act_prefix(intra.tp)
        self._params = costs._params_prefix(intra.tp)
        self._spp = costs.state_bytes_per_param
        self._tied = [[(m, layer_params_per_device(costs.model.layers[m], intra.tp)) for m in members]
                      for members in costs._tied]
        self._grad = costs.grad_bytes
        self._sync_unit = -1.0
        slowest = costs.cm.slowest_gpu(group.devices)
        self._opt_unit = OPTIMIZER_STEP_BYTES_PER_PARAM / (slowest.memory_bandwidth_bytes_per_s
                                                            * MEMORY_BANDWIDTH_EFFICIENCY)
        self.whole = self.time(0, costs.num_layers)

    def time(self, a: int, b: int) -> float:
        """Per-micro-batch time of layers [a, b): the slowest replica."""
        tpc = self._tpc[b] - self._tpc[a]
        best = 0.0
        for p, c, _ in self._desc:
            v = p[b] - p[a] + c * tpc
            if v > best:
                best = v
        return best

    def time_bwd(self, a: int, b: int) -> tuple[float, float]:
        """(time, backward time) of layers [a, b) on the slowest replica."""
        tpc = self._tpc[b] - self._tpc[a]
        best, bwd = -1.0, 0.0
        for p, c, q in self._desc:
            v = p[b] - p[a] + c * tpc
            if v > best:
                best, bwd = v, q[b] - q[a]
        return max(best, 0.0), bwd

    def optimizer_time(self, a: int, b: int) -> float:
        """The optimizer step of layers [a, b): memory-bound, on the stage's
        slowest GPU (as the shared cost model)."""
        return self.params(a, b) * self._opt_unit

    def time_matrix(self) -> np.ndarray:
        """``[a, b]``: time of layers [a, b) (only a < b is meaningful)."""
        tpc = np.asarray(self._tpc)
        best = None
        for p, c, _ in self._desc:
            arr = np.asarray(p)
            m = arr[None, :] - arr[:, None] + c * (tpc[None, :] - tpc[:, None])
            best = m if best is None else np.maximum(best, m)
        assert best is not None
        return np.maximum(best, 0.0)

    def fits_matrix(self, in_flight: float) -> np.ndarray:
        """``[a, b]``: layers [a, b) fit every GPU of the stage."""
        n = len(self._params)
        if self._costs.metis_memory is not None:
            out = np.zeros((n, n), dtype=bool)
            for a in range(n):
                for b in range(a + 1, n):
                    out[a, b] = self.fits(a, b, in_flight)
            return out
        params = np.asarray(self._params)
        states = (params[None, :] - params[:, None])
        idx = np.arange(n)
        for members in self._tied:
            first = members[0][0]
            for m, p in members[1:]:
                mask = (idx[:, None] <= first) & (idx[None, :] > m)
                states = states - np.where(mask, p, 0.0)
        states = states * self._spp
        act = np.asarray(self._act)
        act = (act[None, :] - act[:, None]) * in_flight
        ok = np.ones((n, n), dtype=bool)
        for batch, capacity, overhead in self._mem:
            ok &= states + act * batch + overhead <= capacity
        return ok

    def params(self, a: int, b: int) -> float:
        params = self._params[b] - self._params[a]
        for members in self._tied:
            first = True
            for m, p in members:
                if a <= m < b:
                    if first:
                        first = False
                    else:
                        params -= p
        return params

    def fits(self, a: int, b: int, in_flight: float) -> bool:
        """Every GPU of the stage holds layers [a, b) and its micro-batches."""
        costs = self._costs
        if costs.metis_memory is not None:
            return costs.fits(self.group, self.intra, a, b, in_flight)
        states = self.params(a, b) * self._spp
        act = (self._act[b] - self._act[a]) * in_flight
        for batch, capacity, overhead in self._mem:
            if states + act * batch + overhead > capacity:
                return False
        return True

    def sync(self, a: int, b: int) -> float:
        """Gradient all-reduce time of layers [a, b) over the slowest dp group."""
        if self.intra.dp < 2:
            return 0.0
        if self._sync_unit < 0:
            self._sync_unit = self._costs.dp_sync_unit(self.group, self.intra)
        return self._sync_unit * self.params(a, b) * self._grad


def _prefix(values: Sequence[float]) -> list[float]:
    out = [0.0]
    total = 0.0
    for v in values:
        total += v
        out.append(total)
    return out


# --- data load balancing ---------------------------------------------------------------
def even_split(micro_batch: int, dp: int) -> tuple[int, ...]:
    """Equal shares (the first replicas take one more when it does not divide)."""
    base, extra = divmod(micro_batch, dp)
    return tuple(base + (1 if r < extra else 0) for r in range(dp))


def data_balance(costs: StageCosts, group: DeviceGroup, dp: int, tp: int, micro_batch: int,
                 layers: tuple[int, int] | None = None, in_flight: float = 1.0,
                 memory_bound: bool = False) -> tuple[int, ...] | None:
    """Split ``micro_batch`` samples over the stage's dp replicas (Metis §4.1).

    Shares are proportional to each replica's speed (its time per sample on
    the stage's layers at the even share), every replica gets at least one
    sample, then single samples move from the slowest replica to the one that
    would finish first while that lowers the stage time. With
    ``memory_bound`` no replica gets more samples than its GPUs hold; None
    when the memory of the whole group cannot hold the micro-batch.
    Replicas of one GPU type get equal shares (±1).
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
    share = max(1, micro_batch // dp)
    speed = []
    for rep in reps:
        prefix = costs.time_prefix(rep.gpu, tp, share)
        t = prefix[b] - prefix[a]
        speed.append(share / t if t > 0 else 1.0)
    total = sum(speed)
    ideal = [micro_batch * s / total for s in speed]
    split = [max(1, min(caps[r], int(ideal[r]))) for r in range(dp)]
    # largest remainder first, within the memory caps
    order = sorted(range(dp), key=lambda r: (-(ideal[r] - int(ideal[r])), r))
    while sum(split) < micro_batch:
        placed = False
        for r in order:
            if split[r] < caps[r]:
                split[r] += 1
                placed = True
                if sum(split) == micro_batch:
                    break
        if not placed:
            return None
    while sum(split) > micro_batch:
        r = max((r for r in range(dp) if split[r] > 1), key=lambda r: (split[r] - ideal[r], r))
        split[r] -= 1
    # even out the slowest replica
    for _ in range(micro_batch):
        times = [_replica_time(costs, reps[r], tp, split[r], a, b) for r in range(dp)]
        slow = max(range(dp), key=lambda r: (times[r], -r))
        if split[slow] <= 1:
            break
        best, best_time = None, times[slow]
        for r in range(dp):
            if r == slow or split[r] >= caps[r]:
                continue
            after = max(_replica_time(costs, reps[slow], tp, split[slow] - 1, a, b),
                        _replica_time(costs, reps[r], tp, split[r] + 1, a, b))
            if after < best_time - 1e-12:
                best, best_time = r, after
        if best is None:
            break
        split[slow] -= 1
        split[best] += 1
    return tuple(split)


def _replica_time(costs: StageCosts, rep: _Replica, tp: int, batch: int, a: int, b: int) -> float:
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
        left, right = lo, hi
        while left <= right:  # binary search for the first prefix >= target
            mid = (left + right) // 2
            if weights_prefix[mid] < target:
                left = mid + 1
            else:
                right = mid - 1
        for cand in (left - 1, left):
            if lo <= cand <= hi:
                gap = abs(weights_prefix[cand] - target)
                if gap < best_gap - 1e-15:
                    best, best_gap = cand, gap
        bounds.append(best)
    bounds.append(num_layers)
    return bounds
