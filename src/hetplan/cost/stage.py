"""One pipeline stage under the cost kernel: what it charges for any range of layers.

A :class:`StageOption` is a stage that runs every layer the same way (devices,
``dp x tp``, how a micro-batch is split over the replicas, ZeRO stage,
recomputation, sequence parallelism). Its :class:`StageCosts` (built and
cached by ``CostKernel.stage``) answers, for any contiguous range of layers
``[a, b)``, what ``CostModel.estimate`` charges a stage running them — the
time of one micro-batch (slowest replica, TP communication, exposed ZeRO-3
traffic), the end-of-step gradient sync, the ZeRO-1/2 parameter all-gather,
the optimizer step and the peak memory of every GPU — from prefix sums, or for
every ``[a, b)`` at once as matrices for the exact pipeline partition.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np

from hetplan.cost.memory import peak_memory_bytes, state_bytes_per_param
from hetplan.cost.pipeline import stage_micro_batch_time
from hetplan.errors import HetplanError
from hetplan.plan import LayerStrategy, Stage

if TYPE_CHECKING:  # the kernel builds StageCosts; this module only needs its type
    from hetplan.cost.kernel import CostKernel


def zero12_gradient_collective(zero: int) -> str:
    """How ZeRO-1/2 reduce gradients (Rajbhandari et al. 2020 §5): stage 1 keeps
    whole gradients, so it all-reduces them; stage 2 keeps only its shard, so a
    reduce-scatter suffices. Both all-gather the updated parameters after the step."""
    return "allreduce" if zero == 1 else "reduce_scatter"


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
        if stage.strategies.count(first) == len(stage.strategies):  # one strategy throughout (fast when shared)
            if first.tp and first.tp != stage.tp:
                return None
        elif stage.has_layer_degrees or any(s.zero != first.zero or s.recompute != first.recompute
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
    meaningful where ``a < b`` (elsewhere time is inf and ``fits`` False). The
    per-step terms are proportional to the parameters held, so they are kept as
    rates on the kernel's shared held-parameter matrix (less memory per table)."""

    per_micro_batch_s: np.ndarray
    back_s: np.ndarray
    held: np.ndarray  # parameters held per device (a view of the kernel's matrix)
    sync_per_param: float
    post_per_param: float
    optimizer_per_param: float
    fits: np.ndarray

    @property
    def grad_sync_s(self) -> np.ndarray:
        return self.held * self.sync_per_param

    @property
    def post_step_s(self) -> np.ndarray:
        return self.held * self.post_per_param

    @property
    def optimizer_s(self) -> np.ndarray:
        return self.held * self.optimizer_per_param


def check_option(option: StageOption) -> None:
    """A stage's devices and shares must match its degrees."""
    if len(option.devices) != option.dp * option.tp or len(option.split) != option.dp:
        raise HetplanError(f"a stage of dp={option.dp} x tp={option.tp} needs {option.dp * option.tp} devices "
                           f"and {option.dp} shares, got {len(option.devices)} and {len(option.split)}")


class StageCosts:
    """Costs of one StageOption for any contiguous range of layers — and of
    every option the kernel finds symmetric to it (same layout signature,
    ``CostKernel.stage``): ``option`` is the first of them, ``key`` what they share."""

    def __init__(self, kernel: CostKernel, option: StageOption, key: object = None) -> None:
        check_option(option)
        self.kernel = kernel
        self.option = option
        self.key = option if key is None else key
        self.num_layers = kernel.num_layers
        self._layout = kernel.layout(option.devices, option.dp, option.tp, option.split)
        self._layer_totals: np.ndarray | None = None
        self._fits: dict[tuple[int, int, float], bool] = {}
        self._build_time_classes()
        self._build_comm()
        self._build_memory()

    # --- construction ---------------------------------------------------------------------
    def _build_time_classes(self) -> None:
        """One prefix-sum table per distinct (slowest GPU, share, TP link) of the replicas."""
        o = self.option
        self._classes = [self.kernel.time_class(gpu, share, o.tp, o.recompute, o.sequence_parallel, tp_link)
                         for gpu, share, tp_link in self._layout.time_classes]

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
        self._act_list = self._act.tolist()  # scalar lookups (one range) are faster on lists
        self._work_max = None if self._work is None else \
            k.range_max_matrix(self._work, ("work", o.tp, o.sequence_parallel))
        self._gathered_max = None if self._gathered is None else k.range_max_matrix(self._gathered, ("gathered", o.tp))
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
        zero3 = 0.0
        if self._gather:  # ZeRO-3: its gathers and scatters, as far as compute does not hide them
            zero3 = float(stage_micro_batch_time(fwd, bwd + rec, 0.0, held * self._gather, held * self._scatter,
                                                 self.kernel.overlap_slowdown)
                          - fwd - bwd - rec)
        return SegmentTiming(fwd, bwd, rec, tpc, zero3, held * self._sync, held * self._post,
                             held * self._optimizer)

    def per_micro_batch(self, a: int, b: int) -> float:
        """Time of one micro-batch through layers [a, b) (fast path of ``timing``)."""
        if self._gather == 0.0:
            if len(self._classes) == 1:
                total = self._classes[0].total_list
                return total[b] - total[a]
            return max(c.total_list[b] - c.total_list[a] for c in self._classes)
        return self.timing(a, b).per_micro_batch_s

    def layer_totals(self) -> np.ndarray:
        """Per layer, the time (compute + TP comm) of the replica class slowest on
        the whole model: for any range, their sum is at most the stage's time
        (the stage pays its slowest replica), so it is a valid per-layer bound."""
        if self._layer_totals is None:
            worst = max(self._classes, key=lambda c: float(c.total[-1]))
            self._layer_totals = np.diff(worst.total)
        return self._layer_totals

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
        work = float(self._work_max[a, b]) if self._work_max is not None else 0.0
        gathered = float(self._gathered_max[a, b]) if self._gathered_max is not None else 0.0
        act = self._act_list[b] - self._act_list[a]
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
        per_class = np.array([int(m) for m in self.class_memory(a, b, in_flight)], dtype=np.int64)
        return per_class[self._device_class].tolist()

    def fits(self, a: int, b: int, in_flight: float) -> bool:
        """Every GPU of the stage holds layers [a, b) and its micro-batches
        (memoised: searches such as Metis's DFS ask about the same ranges again)."""
        key = (a, b, in_flight)
        found = self._fits.get(key)
        if found is None:
            found = self._fits[key] = all(m <= c.capacity for m, c in zip(self.class_memory(a, b, in_flight),
                                                                          self._memory_classes))
        return found

    # --- every range at once ----------------------------------------------------------------------
    def tables(self, in_flight: float, window: tuple[int, int] | None = None) -> SegmentTables:
        """Every ``[a, b)`` as matrices (see :class:`SegmentTables`). With
        ``window = (j, span)`` only stage ``j``'s window of a pipeline: rows
        ``a = j + x``, columns ``b = j + 1 + y`` for ``x, y < span``."""
        recent = self.kernel.recent_tables
        times = recent.get((self.key, window))
        if times is None:  # the times do not depend on the micro-batches in flight: shared
            times = recent.put((self.key, window), self._time_tables(window))
        fits = recent.get((self.key, window, in_flight))
        if fits is None:
            fits = recent.put((self.key, window, in_flight), self._fits_table(in_flight, window))
        return replace(times, fits=fits)

    def _cells(self, window: tuple[int, int] | None) -> tuple[slice, slice]:
        """Rows (``a``) and columns (``b``) of the table: contiguous, so slicing gives views."""
        n = self.num_layers
        if window is None:
            return slice(0, n + 1), slice(0, n + 1)
        return slice(window[0], window[0] + window[1]), slice(window[0] + 1, window[0] + 1 + window[1])

    @staticmethod
    def _valid(rows: slice, cols: slice) -> np.ndarray:
        """``a < b`` over the table's cells."""
        return np.arange(cols.start, cols.stop)[None, :] > np.arange(rows.start, rows.stop)[:, None]

    def _time_tables(self, window: tuple[int, int] | None) -> SegmentTables:
        rows, cols = self._cells(window)
        valid = self._valid(rows, cols)
        fwd, back, tpc = self._worst_replica_matrices(rows, cols)
        held = self.kernel.held_params_matrix(self.option.tp)[rows, cols]
        per_mb = stage_micro_batch_time(fwd, back, tpc, held * self._gather, held * self._scatter,
                                        self.kernel.overlap_slowdown) \
            if self._gather else fwd + back + tpc  # no ZeRO-3 traffic: nothing to expose
        return SegmentTables(np.where(valid, per_mb, np.inf), back, held, self._sync, self._post, self._optimizer,
                             valid)

    def _fits_table(self, in_flight: float, window: tuple[int, int] | None) -> np.ndarray:
        rows, cols = self._cells(window)
        held = self.kernel.held_params_matrix(self.option.tp)[rows, cols]
        return self._valid(rows, cols) & self._fits_matrix(held, in_flight, rows, cols)

    def _worst_replica_matrices(self, rows: slice, cols: slice) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Forward, backward (+ recompute) and TP comm of the slowest replica class per range."""

        def diff(x: np.ndarray) -> np.ndarray:
            return x[cols][None, :] - x[rows][:, None]

        if len(self._classes) == 1:
            c = self._classes[0]
            return diff(c.fwd), diff(c.bwd) + diff(c.rec), diff(c.tpc)
        pick = np.argmax(np.stack([diff(c.total) for c in self._classes]), axis=0)

        def take(parts: list[np.ndarray]) -> np.ndarray:
            out = diff(parts[0])
            for index, part in enumerate(parts[1:], start=1):  # np.choose takes at most 32 choices
                out = np.where(pick == index, diff(part), out)
            return out

        fwd = take([c.fwd for c in self._classes])
        back = take([c.bwd + c.rec for c in self._classes])
        return fwd, back, take([c.tpc for c in self._classes])

    def _fits_matrix(self, held: np.ndarray, in_flight: float, rows: slice, cols: slice) -> np.ndarray:
        ok = np.ones((rows.stop - rows.start, cols.stop - cols.start), dtype=bool)
        if self._use_profile:
            for x, a in enumerate(range(rows.start, rows.stop)):
                for y, b in enumerate(range(cols.start, cols.stop)):
                    ok[x, y] = b > a and self.fits(a, b, in_flight)
            return ok
        states = held * self._state_per_param
        act = self._act[cols][None, :] - self._act[rows][:, None]
        work = self._work_max[rows, cols] if self._work_max is not None else 0.0
        gathered = self._gathered_max[rows, cols] if self._gathered_max is not None else 0.0
        for c in self._memory_classes:
            peak = peak_memory_bytes(states, act * c.batch, in_flight, work * c.batch, gathered, c.overhead)
            ok &= peak <= c.capacity
        return ok
