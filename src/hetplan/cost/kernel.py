"""The cost kernel: the one implementation of hetplan's cost model.

One :class:`CostKernel` per workload holds the tables every consumer reads:
per-layer compute times per (GPU type, micro-batch share, TP degree,
recomputation, sequence parallelism), per-layer parameter and activation
bytes, and seconds-per-byte rates of the collectives of each device group.
They are numpy vectors over the model's layers, computed once and cached.

On top of them sit the stage-level numbers. A :class:`StageOption` is a stage
that runs every layer the same way (devices, ``dp x tp``, how a micro-batch is
split over the replicas, ZeRO stage, recomputation, sequence parallelism);
its :class:`StageCosts` answers, for any contiguous range of layers
``[a, b)``, what :meth:`hetplan.cost.CostModel.estimate` charges a stage
running those layers — the time of one micro-batch (slowest replica, TP
communication, exposed ZeRO-3 traffic), the end-of-step gradient sync, the
ZeRO-1/2 parameter all-gather, the optimizer step, and the peak memory of
every GPU — from prefix sums in O(replica classes), or for every ``[a, b)``
at once as ``(L+1) x (L+1)`` matrices for the exact pipeline partition.

``CostModel.estimate`` costs a uniform stage with the same ``StageCosts``,
and a stage whose layers differ in (tp, ZeRO, recomputation) — Galvatron's —
with :meth:`CostKernel.mixed_stage`, from the same tables and the same
combining formulas (``cost/pipeline.py``, ``cost/memory.py``). Planners read
these objects; none re-derives a formula.

Collectives are linear in their bytes in this model (``cost/comm.py``), so a
group's collective is cached as a rate and applied to any byte count
(:meth:`CostKernel.collective_time`).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Generic, Sequence, TypeVar

import numpy as np

from hetplan.cluster.catalog import GPUSpec
from hetplan.cost.comm import allgather_time, allreduce_time, p2p_time, reduce_scatter_time
from hetplan.cost.compute import LayerTimes, layer_times
from hetplan.cost.constants import (
    MEMORY_BANDWIDTH_EFFICIENCY,
    OPTIMIZER_STEP_BYTES_PER_PARAM,
    TP_COMM_PASSES,
)
from hetplan.cost.layers import LayerArrays, layer_arrays
from hetplan.cost.memory import (
    activation_bytes,
    framework_overhead_bytes,
    peak_memory_bytes,
    recompute_working_bytes,
    state_bytes_per_param,
)
from hetplan.cost.pipeline import stage_micro_batch_time
from hetplan.cost.workload import Workload
from hetplan.errors import HetplanError
from hetplan.plan import LayerStrategy, Stage
from hetplan.profile.metis import MetisProfileDB

COLLECTIVES: dict[str, Callable[..., float]] = {
    "allreduce": allreduce_time,
    "allgather": allgather_time,
    "reduce_scatter": reduce_scatter_time,
}


@dataclass(frozen=True)
class StageOption:
    """A stage that runs all its layers the same way.

    Attributes:
        devices: ``dp * tp`` GPU ids, TP innermost (replica ``r`` owns
            ``devices[r*tp:(r+1)*tp]``, as in :class:`hetplan.plan.Stage`).
        dp, tp: degrees.
        split: samples of one micro-batch per replica (sums to the micro-batch).
        zero, recompute, sequence_parallel: as in :class:`hetplan.plan.LayerStrategy`.
    """

    devices: tuple[int, ...]
    dp: int
    tp: int
    split: tuple[int, ...]
    zero: int = 0
    recompute: str = "none"
    sequence_parallel: bool = False

    @staticmethod
    def of_stage(stage: Stage) -> StageOption | None:
        """The option a Plan stage runs, or None when its layers differ."""
        first = stage.strategies[0]
        if stage.has_layer_degrees or any(s.zero != first.zero or s.recompute != first.recompute
                                          for s in stage.strategies):
            return None
        return StageOption(stage.devices, stage.dp, stage.tp, stage.dp_split, first.zero, first.recompute,
                           stage.sequence_parallel)

    def stage(self, layers: range) -> Stage:
        """The Plan stage of this option running ``layers``."""
        return Stage(tuple(layers), self.devices, self.dp, self.tp, self.split,
                     (LayerStrategy(self.zero, self.recompute),) * len(layers), self.sequence_parallel)

    @property
    def micro_batch_size(self) -> int:
        return sum(self.split)


@dataclass(frozen=True)
class SegmentTiming:
    """What a stage charges for its layers (one micro-batch unless said)."""

    fwd_s: float
    bwd_s: float
    recompute_s: float
    tp_comm_s: float  # TP all-reduces (and layout transformations of mixed stages)
    zero3_exposed_s: float  # ZeRO-3 gathers/scatters not hidden behind compute
    grad_sync_s: float  # end-of-step gradient reduction, before overlap (once per step)
    post_step_s: float  # ZeRO-1/2 parameter all-gather after the optimizer step
    optimizer_s: float  # the optimizer step (once per step)

    @property
    def back_s(self) -> float:
        return self.bwd_s + self.recompute_s

    @property
    def per_micro_batch_s(self) -> float:
        return self.fwd_s + self.back_s + self.tp_comm_s + self.zero3_exposed_s


@dataclass(frozen=True)
class SegmentTables:
    """Every ``[a, b)`` of one StageCosts at once: ``(L+1) x (L+1)`` matrices,
    meaningful where ``a < b`` (elsewhere time is inf and ``fits`` False)."""

    per_micro_batch_s: np.ndarray
    back_s: np.ndarray
    grad_sync_s: np.ndarray
    post_step_s: np.ndarray
    optimizer_s: np.ndarray
    fits: np.ndarray


@dataclass(frozen=True)
class _TimeClass:
    """Replicas of a stage that cost the same: prefix sums over the layers."""

    fwd: np.ndarray
    bwd: np.ndarray
    rec: np.ndarray
    tpc: np.ndarray
    total: np.ndarray


@dataclass(frozen=True)
class _MemoryClass:
    """Replicas of a stage with the same per-replica batch, capacity and overhead."""

    batch: int
    capacity: int
    overhead: int


@dataclass(frozen=True)
class _Layout:
    """What a stage's devices, degrees and split decide, whatever its ZeRO stage
    or recomputation: the replicas that cost alike, the memory classes of its
    GPUs, and its data-parallel and optimizer rates."""

    time_classes: tuple[tuple[GPUSpec, int, float], ...]  # (slowest GPU, share, TP all-reduce s/byte)
    memory_classes: tuple[_MemoryClass, ...]
    device_class: np.ndarray  # memory class of each device of the stage, in device order
    dp_rate: Callable[[str], float]  # per collective: s/byte on the slowest data-parallel group
    optimizer_rate: float  # s/parameter of the optimizer step


# Segment tables kept per kernel (each is a few (L+1)^2 matrices; searches ask
# for the same stages again and again, but a 1,000-GPU search would not fit
# them all in memory).
RECENT_TABLES = 128

T = TypeVar("T")


class _Recent(Generic[T]):
    """A small least-recently-used cache."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._items: OrderedDict[object, T] = OrderedDict()

    def get(self, key: object) -> T | None:
        found = self._items.get(key)
        if found is not None:
            self._items.move_to_end(key)
        return found

    def put(self, key: object, value: T) -> T:
        self._items[key] = value
        if len(self._items) > self.size:
            self._items.popitem(last=False)
        return value


def zero12_gradient_collective(zero: int) -> str:
    """How ZeRO-1/2 reduce gradients (Rajbhandari et al. 2020 §5): stage 1 keeps
    whole gradients, so it all-reduces them; stage 2 keeps only its shard, so a
    reduce-scatter suffices. Both all-gather the updated parameters after the step."""
    return "allreduce" if zero == 1 else "reduce_scatter"


class CostKernel:
    """Cached tables of one workload (see the module docstring)."""

    def __init__(self, workload: Workload) -> None:
        self.workload = workload
        self.model = workload.model
        self.cluster = workload.cluster
        self.arrays: LayerArrays = layer_arrays(workload.model)
        self.num_layers = self.arrays.num_layers
        self.dtype_bytes = workload.model.dtype_bytes
        self.weight_bytes, self.grad_bytes, _ = workload.state_bytes
        profile = workload.profile
        self.memory_profile = profile if isinstance(profile, MetisProfileDB) and profile.has_memory else None
        self._times: dict[tuple[object, ...], LayerTimes] = {}
        self._rates: dict[tuple[object, ...], float] = {}
        self._slowest: dict[tuple[int, ...], GPUSpec] = {}
        self._arrays: dict[tuple[object, ...], np.ndarray] = {}
        self._stages: dict[StageOption, StageCosts] = {}
        self._layouts: dict[tuple[object, ...], _Layout] = {}
        self._time_classes: dict[tuple[object, ...], _TimeClass] = {}
        self.recent_tables: _Recent[SegmentTables] = _Recent(RECENT_TABLES)
        self._supports: dict[int, np.ndarray] = {}
        self._corrections: dict[int, list[tuple[int, int, float]]] = {}
        self._params_prefix: dict[int, list[float]] = {}
        self._capacity = [workload.device_capacity_bytes(d.id) for d in self.cluster.devices]
        self._overhead = [framework_overhead_bytes(d.gpu.name == "CPU") for d in self.cluster.devices]

    # --- per-layer tables -------------------------------------------------------------
    def layer_times(self, gpu: GPUSpec, batch: float, tp: int = 1, recompute: str = "none",
                    sequence_parallel: bool = False) -> LayerTimes:
        """Compute time of every layer for ``batch`` samples on one GPU of a TP group."""
        key = (gpu.name, float(batch), tp, recompute, sequence_parallel)
        found = self._times.get(key)
        if found is None:
            found = self._times[key] = layer_times(self.arrays, gpu, float(batch), tp, recompute, self.dtype_bytes,
                                                    sequence_parallel, self.workload.profile)
        return found

    def layer_time(self, index: int, gpu: GPUSpec, batch: float, tp: int = 1, recompute: str = "none",
                   sequence_parallel: bool = False) -> tuple[float, float, float]:
        """(forward, backward, recompute) seconds of one layer: a view of ``layer_times``."""
        t = self.layer_times(gpu, batch, tp, recompute, sequence_parallel)
        return float(t.fwd_s[index]), float(t.bwd_s[index]), float(t.recompute_s[index])

    def _cached(self, key: tuple[object, ...], build: Callable[[], np.ndarray]) -> np.ndarray:
        found = self._arrays.get(key)
        if found is None:
            found = self._arrays[key] = build()
        return found

    def params_per_device(self, tp: int) -> np.ndarray:
        return self._cached(("params", tp), lambda: self.arrays.params_per_device(tp))

    def tied_share(self, tp: int) -> np.ndarray:
        return self._cached(("tied", tp), lambda: self.arrays.tied_share_per_device(tp))

    def activation_bytes(self, tp: int, recompute: str, sequence_parallel: bool) -> np.ndarray:
        """Per sample and layer, kept for backward."""
        return self._cached(("act", tp, recompute, sequence_parallel),
                            lambda: activation_bytes(self.arrays, tp, recompute, sequence_parallel))

    def recompute_working_bytes(self, tp: int, recompute: str, sequence_parallel: bool) -> np.ndarray:
        return self._cached(("work", tp, recompute, sequence_parallel),
                            lambda: recompute_working_bytes(self.arrays, tp, recompute, sequence_parallel))

    def tp_comm_bytes(self, recompute: str) -> np.ndarray:
        """TP all-reduce bytes per sample and layer over a whole step's passes."""
        return self._cached(("tpc", recompute), lambda: self.arrays.tp_comm_bytes * TP_COMM_PASSES[recompute])

    def supports_tp(self, tp: int) -> np.ndarray:
        """Per layer: ``LayerSpec.supports_tp`` (the one rule)."""
        found = self._supports.get(tp)
        if found is None:
            found = self._supports[tp] = np.array([layer.supports_tp(tp) for layer in self.model.layers])
        return found

    def all_support_tp(self, tp: int) -> bool:
        return bool(self.supports_tp(tp).all())

    # --- devices and links ---------------------------------------------------------------
    def slowest_gpu(self, devices: Sequence[int]) -> GPUSpec:
        """The GPU that sets the pace of a TP group (the lowest peak rate)."""
        key = tuple(devices)
        found = self._slowest.get(key)
        if found is None:
            gpus = (self.cluster.devices[d].gpu for d in key)
            found = self._slowest[key] = min(gpus, key=lambda g: g.peak_flops_for(self.dtype_bytes))
        return found

    def collective_rate(self, kind: str, group: Sequence[int], concurrent_groups: int = 1) -> float:
        """Seconds per byte of a collective (``COLLECTIVES``) over ``group``."""
        key = (kind, tuple(group), concurrent_groups)
        found = self._rates.get(key)
        if found is None:
            found = self._rates[key] = COLLECTIVES[kind](self.cluster, key[1], 1.0, concurrent_groups)
        return found

    def collective_time(self, kind: str, group: Sequence[int], num_bytes: np.ndarray | float,
                        concurrent_groups: int = 1) -> np.ndarray | float:
        """A collective of ``num_bytes`` (elementwise on arrays)."""
        return self.collective_rate(kind, group, concurrent_groups) * num_bytes

    def dp_collective_rate(self, kind: str, devices: Sequence[int], tp: int) -> float:
        """The slowest of a stage's ``tp`` data-parallel groups (TP rank t's
        devices in every replica), all running at once."""
        dp = len(devices) // tp
        if dp < 2:
            return 0.0
        key = ("dp", kind, tuple(devices), tp)
        found = self._rates.get(key)
        if found is None:
            found = self._rates[key] = max(
                self.collective_rate(kind, tuple(devices[r * tp + t] for r in range(dp)), tp) for t in range(tp))
        return found

    def p2p_rate(self, sender: Sequence[int], receiver: Sequence[int]) -> float:
        """Seconds per byte of one pipeline transfer between two device groups."""
        key = ("p2p", tuple(sender), tuple(receiver))
        found = self._rates.get(key)
        if found is None:
            found = self._rates[key] = p2p_time(self.cluster, key[1], key[2], 1.0)
        return found

    def p2p_time(self, sender: Sequence[int], receiver: Sequence[int], last_layer: int,
                 micro_batch_size: float) -> float:
        """One-way transfer of one micro-batch's output of ``last_layer``."""
        return self.p2p_rate(sender, receiver) * float(self.arrays.output_bytes[last_layer]) * micro_batch_size

    def optimizer_rate(self, devices: Sequence[int]) -> float:
        """Seconds per parameter of the (memory-bound) optimizer step on the
        stage's GPU with the least memory bandwidth."""
        bandwidth = min(self.cluster.devices[d].gpu.memory_bandwidth_bytes_per_s for d in devices)
        return OPTIMIZER_STEP_BYTES_PER_PARAM / (bandwidth * MEMORY_BANDWIDTH_EFFICIENCY)

    def capacity_bytes(self, device: int) -> int:
        return self._capacity[device]

    def overhead_bytes(self, device: int) -> int:
        return self._overhead[device]

    # --- stages -------------------------------------------------------------------------
    def stage(self, option: StageOption) -> StageCosts:
        """The StageCosts of ``option`` (cached)."""
        found = self._stages.get(option)
        if found is None:
            found = self._stages[option] = StageCosts(self, option)
        return found

    def time_class(self, gpu: GPUSpec, share: int, tp: int, recompute: str, sequence_parallel: bool,
                   tp_rate: float) -> _TimeClass:
        """Prefix sums of forward, backward, recompute and TP-comm time of a
        replica (its slowest GPU, its share of a micro-batch, its TP link), cached."""
        key = (gpu.name, share, tp, recompute, sequence_parallel, tp_rate)
        found = self._time_classes.get(key)
        if found is None:
            t = self.layer_times(gpu, share, tp, recompute, sequence_parallel)
            tpc = self.tp_comm_bytes(recompute) * share * tp_rate if share > 0 else np.zeros(self.num_layers)
            parts = [_prefix(x) for x in (t.fwd_s, t.bwd_s, t.recompute_s, tpc)]
            found = self._time_classes[key] = _TimeClass(*parts, total=parts[0] + parts[1] + parts[2] + parts[3])
        return found

    def activation_prefix(self, tp: int, recompute: str, sequence_parallel: bool) -> np.ndarray:
        return self._cached(("actprefix", tp, recompute, sequence_parallel),
                            lambda: _prefix(self.activation_bytes(tp, recompute, sequence_parallel)))

    def layout(self, devices: tuple[int, ...], dp: int, tp: int, split: tuple[int, ...]) -> _Layout:
        """The replica and memory classes and rates of a stage (cached)."""
        key = (devices, dp, tp, split)
        found = self._layouts.get(key)
        if found is None:
            found = self._layouts[key] = self._build_layout(devices, dp, tp, split)
        return found

    def _build_layout(self, devices: tuple[int, ...], dp: int, tp: int, split: tuple[int, ...]) -> _Layout:
        times: dict[tuple[object, ...], tuple[GPUSpec, int, float]] = {}
        memory: dict[tuple[int, int, int], list[int]] = {}
        for r in range(dp):
            group = devices[r * tp:(r + 1) * tp]
            gpu = self.slowest_gpu(group)
            rate = self.collective_rate("allreduce", group) if tp > 1 else 0.0
            times.setdefault((gpu.name, split[r], rate), (gpu, split[r], rate))
            for position in range(r * tp, (r + 1) * tp):
                key = (split[r], self.capacity_bytes(devices[position]), self.overhead_bytes(devices[position]))
                memory.setdefault(key, []).append(position)
        device_class = np.empty(len(devices), dtype=np.int64)
        for index, positions in enumerate(memory.values()):
            device_class[positions] = index
        return _Layout(tuple(times.values()), tuple(_MemoryClass(*key) for key in memory), device_class,
                       lambda kind: self.dp_collective_rate(kind, devices, tp), self.optimizer_rate(devices))

    def held_params(self, tp: int, a: int, b: int) -> float:
        """Parameters one device of a stage running layers [a, b) holds: a tied
        weight counted once when several layers of its group are on the stage."""
        prefix = self._params_prefix.get(tp)
        if prefix is None:
            prefix = self._params_prefix[tp] = _prefix(self.params_per_device(tp)).tolist()
        total = prefix[b] - prefix[a]
        for index, previous, share in self._tied_corrections(tp):
            if a <= previous and index < b:
                total -= share
        return total

    def held_params_matrix(self, tp: int) -> np.ndarray:
        """``held_params`` for every ``[a, b)`` (``(L+1) x (L+1)``)."""

        def build() -> np.ndarray:
            prefix = _prefix(self.params_per_device(tp))
            held = prefix[None, :] - prefix[:, None]
            bounds = np.arange(self.num_layers + 1)
            for index, previous, share in self._tied_corrections(tp):
                held = held - np.where((bounds[:, None] <= previous) & (bounds[None, :] > index), share, 0.0)
            return held

        return self._cached(("held", tp), build)

    def _tied_corrections(self, tp: int) -> list[tuple[int, int, float]]:
        """(layer, its nearest earlier tied layer, the tied share per device) of every tied copy."""
        found = self._corrections.get(tp)
        if found is None:
            share = self.tied_share(tp)
            previous = self.arrays.tied_previous
            found = self._corrections[tp] = [(int(i), int(previous[i]), float(share[i]))
                                             for i in np.nonzero(previous >= 0)[0]]
        return found

    def range_max_matrix(self, values: np.ndarray, key: tuple[object, ...]) -> np.ndarray:
        """``[a, b]``: the largest of ``values[a:b]`` (0 where empty)."""

        def build() -> np.ndarray:
            n = self.num_layers
            matrix = np.zeros((n + 1, n + 1))
            inside = np.where(np.arange(n)[None, :] >= np.arange(n)[:, None], values[None, :], 0.0)
            matrix[:n, 1:] = np.maximum.accumulate(inside, axis=1)
            return np.triu(matrix, 1)

        return self._cached(("rangemax",) + key, build)


class StageCosts:
    """Costs of one StageOption for any contiguous range of layers."""

    def __init__(self, kernel: CostKernel, option: StageOption) -> None:
        if len(option.devices) != option.dp * option.tp or len(option.split) != option.dp:
            raise HetplanError(f"a stage of dp={option.dp} x tp={option.tp} needs {option.dp * option.tp} devices "
                               f"and {option.dp} shares, got {len(option.devices)} and {len(option.split)}")
        self.kernel = kernel
        self.option = option
        self.num_layers = kernel.num_layers
        self._layout = kernel.layout(option.devices, option.dp, option.tp, option.split)
        self._build_time_classes()
        self._build_comm()
        self._build_memory()

    # --- construction ---------------------------------------------------------------------
    def _build_time_classes(self) -> None:
        """One prefix-sum table per distinct (slowest GPU, share, TP link) of the replicas."""
        o = self.option
        self._classes = [self.kernel.time_class(gpu, share, o.tp, o.recompute, o.sequence_parallel, rate)
                         for gpu, share, rate in self._layout.time_classes]

    def _build_comm(self) -> None:
        """Per-parameter rates of the data-parallel collectives and the optimizer."""
        k, o, rate = self.kernel, self.option, self._layout.dp_rate
        sharded = o.dp > 1
        self._gather = self._scatter = self._sync = self._post = 0.0
        if sharded and o.zero >= 3:
            self._gather = k.weight_bytes * rate("allgather")
            self._scatter = k.grad_bytes * rate("reduce_scatter")
        elif sharded and o.zero in (1, 2):
            self._sync = k.grad_bytes * rate(zero12_gradient_collective(o.zero))
            self._post = k.weight_bytes * rate("allgather")
        elif sharded:
            self._sync = k.grad_bytes * rate("allreduce")
        self._optimizer = self._layout.optimizer_rate / (o.dp if o.zero >= 1 else 1)

    def _build_memory(self) -> None:
        """Per-sample activation prefix sums and the per-layer maxima of the working sets."""
        k, o = self.kernel, self.option
        self._state_per_param = state_bytes_per_param(o.zero, o.dp, k.workload.state_bytes)
        self._act = k.activation_prefix(o.tp, o.recompute, o.sequence_parallel)
        self._work = k.recompute_working_bytes(o.tp, o.recompute, o.sequence_parallel) if o.recompute == "full" \
            else None
        self._gathered = k.params_per_device(o.tp) * k.weight_bytes if o.zero >= 3 and o.dp > 1 else None
        self._memory_classes = self._layout.memory_classes
        self._device_class = self._layout.device_class
        self._use_profile = (k.memory_profile is not None and o.zero == 0 and o.recompute == "none"
                             and not o.sequence_parallel)

    # --- one range -----------------------------------------------------------------------------
    def timing(self, a: int, b: int) -> SegmentTiming:
        """What the stage charges for layers [a, b) (a < b)."""
        worst = self._classes[0]
        if len(self._classes) > 1:
            totals = [c.total[b] - c.total[a] for c in self._classes]
            worst = self._classes[int(np.argmax(totals))]
        fwd, bwd, rec, tpc = (float(x[b] - x[a]) for x in (worst.fwd, worst.bwd, worst.rec, worst.tpc))
        held = self.kernel.held_params(self.option.tp, a, b)
        zero3 = float(stage_micro_batch_time(fwd, bwd + rec, 0.0, held * self._gather, held * self._scatter)
                      - fwd - bwd - rec)
        return SegmentTiming(fwd, bwd, rec, tpc, zero3, held * self._sync, held * self._post,
                             held * self._optimizer)

    def per_micro_batch(self, a: int, b: int) -> float:
        """Time of one micro-batch through layers [a, b) (fast path of ``timing``)."""
        if self._gather == 0.0:
            return max(float(c.total[b] - c.total[a]) for c in self._classes)
        return self.timing(a, b).per_micro_batch_s

    def layer_totals(self) -> np.ndarray:
        """Per layer, the time (compute + TP comm) of the replica class slowest on
        the whole model: for any range, their sum is at most the stage's time
        (the stage pays its slowest replica), so it is a valid per-layer bound."""
        worst = max(self._classes, key=lambda c: float(c.total[-1]))
        return np.diff(worst.total)

    def class_memory(self, a: int, b: int, in_flight: float) -> list[float]:
        """Peak bytes of a GPU of each memory class for layers [a, b)."""
        return [self.peak_bytes(a, b, c.batch, in_flight, c.overhead) for c in self._memory_classes]

    def peak_bytes(self, a: int, b: int, batch: float, in_flight: float, overhead: float) -> float:
        """Peak bytes of one GPU of this stage whose replica gets ``batch`` samples
        per micro-batch, for layers [a, b)."""
        measured = self._profiled_memory(a, b, batch, in_flight)
        if measured is not None:
            return measured + overhead
        fixed, per_sample = self._memory_line(a, b, in_flight, overhead)
        return fixed + per_sample * batch

    def _memory_line(self, a: int, b: int, in_flight: float, overhead: float) -> tuple[float, float]:
        """The analytic peak is linear in the replica's samples: (bytes at 0, bytes per sample)."""
        states = self.kernel.held_params(self.option.tp, a, b) * self._state_per_param
        work = float(self._work[a:b].max()) if self._work is not None else 0.0
        gathered = float(self._gathered[a:b].max()) if self._gathered is not None else 0.0
        act = float(self._act[b] - self._act[a])
        fixed = float(peak_memory_bytes(states, 0.0, in_flight, 0.0, gathered, overhead))
        return fixed, float(peak_memory_bytes(0.0, act, in_flight, work, 0.0, 0.0))

    def max_batch(self, a: int, b: int, in_flight: float, overhead: float, capacity: float,
                  limit: int = 1 << 20) -> int:
        """The most samples per micro-batch a replica's GPU holds for layers [a, b) (0: none)."""
        if self._profiled_memory(a, b, 1, in_flight) is None:
            fixed, per_sample = self._memory_line(a, b, in_flight, overhead)
            if fixed + per_sample > capacity:
                return 0
            if per_sample <= 0:
                return limit
            count = min(limit, int((capacity - fixed) // per_sample))
            while count > 1 and fixed + per_sample * count > capacity:  # rounding of the division
                count -= 1
            while count < limit and fixed + per_sample * (count + 1) <= capacity:
                count += 1
            return count
        lo, hi = 0, 1
        while hi <= limit and self.peak_bytes(a, b, hi, in_flight, overhead) <= capacity:
            lo, hi = hi, hi * 2
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if self.peak_bytes(a, b, mid, in_flight, overhead) <= capacity else (lo, mid)
        return min(lo, limit)

    def _profiled_memory(self, a: int, b: int, batch: float, in_flight: float) -> float | None:
        """Metis's measured layer-composition memory, where the profile covers this stage."""
        if not self._use_profile:
            return None
        return self.kernel.memory_profile.stage_memory(a, b, self.option.tp, batch, in_flight)  # type: ignore[union-attr]

    def device_memory(self, a: int, b: int, in_flight: float) -> list[int]:
        """Peak bytes of each device of the stage (in its device order)."""
        per_class = self.class_memory(a, b, in_flight)
        return [int(per_class[c]) for c in self._device_class]

    def fits(self, a: int, b: int, in_flight: float) -> bool:
        """Every GPU of the stage holds layers [a, b) and its micro-batches."""
        return all(m <= c.capacity for m, c in zip(self.class_memory(a, b, in_flight), self._memory_classes))

    # --- every range at once ----------------------------------------------------------------------
    def tables(self, in_flight: float, window: tuple[int, int] | None = None) -> SegmentTables:
        """Every ``[a, b)`` as matrices (see :class:`SegmentTables`). With
        ``window = (j, span)`` only stage ``j``'s window of a pipeline: rows
        ``a = j + x``, columns ``b = j + 1 + y`` for ``x, y < span``."""
        key = (self.option, in_flight, window)
        found = self.kernel.recent_tables.get(key)
        if found is None:
            found = self.kernel.recent_tables.put(key, self._tables(in_flight, window))
        return found

    def _tables(self, in_flight: float, window: tuple[int, int] | None) -> SegmentTables:
        n = self.num_layers
        rows, cols = (np.arange(n + 1), np.arange(n + 1)) if window is None else \
            (np.arange(window[0], window[0] + window[1]), np.arange(window[0] + 1, window[0] + 1 + window[1]))
        valid = cols[None, :] > rows[:, None]
        fwd, back, tpc = self._worst_replica_matrices(rows, cols)
        held = self.kernel.held_params_matrix(self.option.tp)[np.ix_(rows, cols)]
        per_mb = stage_micro_batch_time(fwd, back, tpc, held * self._gather, held * self._scatter)
        fits = valid & self._fits_matrix(held, in_flight, rows, cols)
        return SegmentTables(np.where(valid, per_mb, np.inf), back, held * self._sync, held * self._post,
                             held * self._optimizer, fits)

    def _worst_replica_matrices(self, rows: np.ndarray, cols: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Forward, backward (+ recompute) and TP comm of the slowest replica class per range."""

        def diff(x: np.ndarray) -> np.ndarray:
            return x[cols][None, :] - x[rows][:, None]

        if len(self._classes) == 1:
            c = self._classes[0]
            return diff(c.fwd), diff(c.bwd) + diff(c.rec), diff(c.tpc)
        totals = np.stack([diff(c.total) for c in self._classes])
        pick = np.argmax(totals, axis=0)[None]

        def take(parts: list[np.ndarray]) -> np.ndarray:
            return np.take_along_axis(np.stack([diff(x) for x in parts]), pick, axis=0)[0]

        fwd = take([c.fwd for c in self._classes])
        back = take([c.bwd + c.rec for c in self._classes])
        return fwd, back, take([c.tpc for c in self._classes])

    def _fits_matrix(self, held: np.ndarray, in_flight: float, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
        k, o = self.kernel, self.option
        ok = np.ones((len(rows), len(cols)), dtype=bool)
        if self._use_profile:
            for x, a in enumerate(rows):
                for y, b in enumerate(cols):
                    ok[x, y] = b > a and self.fits(int(a), int(b), in_flight)
            return ok
        states = held * self._state_per_param
        act = self._act[cols][None, :] - self._act[rows][:, None]
        cells = np.ix_(rows, cols)
        work = k.range_max_matrix(self._work, ("work", o.tp, o.sequence_parallel))[cells] \
            if self._work is not None else 0.0
        gathered = k.range_max_matrix(self._gathered, ("gathered", o.tp))[cells] if self._gathered is not None \
            else 0.0
        for c in self._memory_classes:
            peak = peak_memory_bytes(states, act * c.batch, in_flight, work * c.batch, gathered, c.overhead)
            ok &= peak <= c.capacity
        return ok


def _prefix(values: np.ndarray) -> np.ndarray:
    out = np.empty(len(values) + 1)
    out[0] = 0.0
    np.cumsum(values, out=out[1:])
    return out

