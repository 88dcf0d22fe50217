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

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Callable, Mapping, NamedTuple, cast

import numpy as np

from hetplan.cost.constants import OFFLOAD_RESIDENT_LAYERS
from hetplan.cost.memory import (
    accumulated_grad_bytes, peak_memory_bytes, runtime_uses_ddp, state_bytes_per_param, state_bytes_split,
    step_temporary_bytes, zero1_gather_bytes,
)
from hetplan.cost.pipeline import stage_micro_batch_time
from hetplan.cost.pipeline_memory import holds_new_gradient, received_per_sample
from hetplan.cost.ranges import Index, positions
from hetplan.cost.zero3 import Zero3Layers, runs_zero3_moments, zero3_layers, zero3_moment, zero3_moment_table
from hetplan.errors import HetplanError
from hetplan.plan.spec import LayerStrategy, Stage

if TYPE_CHECKING:  # the kernel builds StageCosts; this module only needs its type
    from hetplan.cost.kernel import CostKernel


class _MemoryLine(NamedTuple):
    """One GPU's analytic memory for a range of layers, in its replica's samples
    (``memory.PeakTerms``): the backward peak is ``base + fixed + per_sample ·
    batch``, the optimizer step's ``base + step``."""

    base: float  # kept throughout: states (gradients included), ZeRO-3's gathered layers, overhead
    fixed: float  # what the backward peak holds whatever the batch: weight copies, indices, reduce buffer
    per_sample: float  # activations of the micro-batches in flight and the backward's working set, per sample
    step: float  # the optimizer step's temporaries
    grads: float  # the gradients, part of ``base``
    micro_batch_fixed: float  # what one micro-batch in flight keeps whatever the batch (weight copies, indices)
    micro_batch_per_sample: float  # and per sample (its activations)
    accumulated: float = 0.0  # gradients a backward after the first holds beyond ``grads`` (PeakTerms.accumulated)
    grads_held: bool = False  # gradients held before the first backward (DDP's buckets: PeakTerms.grads_held)


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
            ``devices[r*tp:(r+1)*tp]``, as in :class:`hetplan.plan.spec.Stage`).
        dp, tp: degrees.
        split: samples of one micro-batch per replica (sums to the micro-batch).
        zero, recompute, sequence_parallel, offload: as in :class:`hetplan.plan.spec.LayerStrategy`.
        cp, ep: context- and expert-parallel degrees (:class:`hetplan.plan.spec.Stage`;
            ``devices`` then holds ``dp * cp * tp`` ids).
    """

    devices: tuple[int, ...]
    dp: int
    tp: int
    split: tuple[int, ...]
    zero: int = 0
    recompute: str = "none"
    sequence_parallel: bool = False
    offload: bool = False
    cp: int = 1
    ep: int = 1
    ep_split: tuple[int, ...] | None = None  # experts per EP rank (``plan.Stage.ep_split``)

    @staticmethod
    def of_stage(stage: Stage) -> StageOption | None:
        """The option a Plan stage runs, or None when its layers or its
        replicas' TP degrees differ."""
        if stage.replica_tp is not None:
            return None
        first = stage.strategies[0]
        if stage.strategies.count(first) == len(stage.strategies):  # one strategy throughout (fast when shared)
            if first.tp and first.tp != stage.tp:
                return None
        elif stage.has_layer_degrees or any(s.zero != first.zero or s.recompute != first.recompute
                                            or s.offload != first.offload for s in stage.strategies):
            return None
        return StageOption(stage.devices, stage.dp, stage.tp, stage.dp_split, first.zero, first.recompute,
                           stage.sequence_parallel, first.offload, stage.cp, stage.ep, stage.ep_split)

    def stage(self, layers: range) -> Stage:
        """The Plan stage of this option running ``layers``."""
        return Stage(tuple(layers), self.devices, self.dp, self.tp, self.split,
                     (LayerStrategy(self.zero, self.recompute, offload=self.offload),) * len(layers),
                     self.sequence_parallel, self.cp, self.ep, self.ep_split)

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
    offload_s: float = 0.0  # part of recompute_s: offloaded activations' host transfers compute does not hide

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
    # routed-expert parameters held (part of ``held``) and what their per-step
    # rates add to the dense ones' (expert data parallelism: ``StageCosts._build_comm``)
    expert_held: np.ndarray | float = 0.0
    expert_sync_extra: float = 0.0
    expert_post_extra: float = 0.0
    expert_optimizer_extra: float = 0.0

    @property
    def grad_sync_s(self) -> np.ndarray:
        return self.held * self.sync_per_param + self.expert_held * self.expert_sync_extra

    @property
    def post_step_s(self) -> np.ndarray:
        return self.held * self.post_per_param + self.expert_held * self.expert_post_extra

    @property
    def optimizer_s(self) -> np.ndarray:
        return self.held * self.optimizer_per_param + self.expert_held * self.expert_optimizer_extra


def check_option(option: StageOption) -> None:
    """A stage's devices and shares must match its degrees."""
    size = option.dp * option.cp * option.tp
    if len(option.devices) != size or len(option.split) != option.dp:
        raise HetplanError(f"a stage of dp={option.dp} x cp={option.cp} x tp={option.tp} needs {size} devices "
                           f"and {option.dp} shares, got {len(option.devices)} and {len(option.split)}")
    if option.ep < 1 or (option.dp * option.cp) % option.ep:
        raise HetplanError(f"ep={option.ep} must divide dp x cp = {option.dp * option.cp}")


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
        self._layout = kernel.layout(option.devices, option.dp, option.tp, option.split, option.cp, option.ep,
                                     option.ep_split)
        self._layer_totals: np.ndarray | None = None
        self._fits: dict[tuple[int, int, float, bool, int], bool] = {}
        self._time_classes: list[Any] | None = None  # built on first use: a fit check needs none
        self._build_comm()
        self._build_memory()

    # --- construction ---------------------------------------------------------------------
    @property
    def _classes(self) -> list[Any]:
        """One prefix-sum table per distinct (slowest GPU, share, TP link) of the replicas."""
        if self._time_classes is None:
            o = self.option
            self._time_classes = [self.kernel.time_class(gpu, share, o.tp, o.recompute, o.sequence_parallel,
                                                         tp_link, o.offload, self._layout.parallel, expert)
                                  for gpu, share, tp_link, expert in self._layout.time_classes]
        return self._time_classes

    def _build_comm(self) -> None:
        """Per-parameter rates of the data-parallel collectives and the optimizer:
        dense parameters over the dp·cp devices holding the same shard, routed
        experts (with ep > 1) over the dp·cp/ep holding the same experts; the
        experts' rates are kept as what they add to the dense ones."""
        o = self.option
        group = o.dp * o.cp
        self._gather, self._scatter, self._sync, self._post, self._optimizer = \
            self._rates(self._layout.dp_rate, group, self._layout.measured_dp)
        self._expert: tuple[float, ...] = (0.0,) * 5
        if o.ep > 1:
            rate = self._layout.expert_rate or (lambda kind: 0.0)
            # the device holding the most experts (``Stage.ep_split``) sets the expert terms' pace
            scale = self._layout.expert_scale
            self._expert = tuple(scale * e - d for e, d in zip(self._rates(rate, group // o.ep),
                                                                (self._gather, self._scatter, self._sync, self._post,
                                                                 self._optimizer)))

    def _rates(self, rate: Callable[[str], float], group: int,
               measured: Mapping[int, tuple[float, float]] | None = None) -> tuple[float, float, float, float, float]:
        """(ZeRO-3 gather, scatter, gradient sync, ZeRO-1/2 post-step gather,
        optimizer) seconds per parameter held, over data-parallel groups of ``group`` devices.

        ``measured`` (ZeRO stage -> fwd, bwd s/parameter, from a profile):
        what the runtime's wrapper added to a lone layer, whose collectives
        nothing hides, taken as the collectives' time in place of the
        alpha-beta estimate: ZeRO-3's forward extra as its gather, the rest of
        its backward extra as the reduce-scatter; ZeRO-2's forward extra (its
        one gather a step) as the parameter all-gather and its backward extra
        as the gradient reduce-scatter; ZeRO-0's (the all-reduce ZeRO-1 runs
        too) as the gradient sync."""
        k, o = self.kernel, self.option
        measured = measured or {}
        gather = scatter = sync = post = 0.0
        if group > 1 and o.zero >= 3:
            if 3 in measured:
                fwd, bwd = measured[3]
                gather, scatter = fwd, max(0.0, bwd - fwd)
            else:
                gather = k.weight_bytes * rate("allgather")
                scatter = k.grad_bytes * rate("reduce_scatter")
        elif group > 1 and o.zero == 2 and 2 in measured:
            post, sync = measured[2]  # the forward's gather of the step, the backward's reduce-scatter
        elif group > 1 and o.zero in (1, 2):
            sync = sum(measured[0]) if o.zero == 1 and 0 in measured \
                else k.grad_bytes * rate(zero12_gradient_collective(o.zero))
            post = k.weight_bytes * rate("allgather")
        elif group > 1:
            sync = sum(measured[0]) if 0 in measured else k.grad_bytes * rate("allreduce")
        return gather, scatter, sync, post, self._layout.optimizer_rate / (group if o.zero >= 1 else 1)

    def _held(self, a: int, b: int) -> tuple[float, float]:
        """(parameters, of which routed experts) one device holds for layers [a, b)."""
        o = self.option
        held = self.kernel.held_params(o.tp, a, b, o.ep)
        return held, (self.kernel.expert_held(o.tp, o.ep, a, b) if o.ep > 1 else 0.0)

    def _build_memory(self) -> None:
        """Per-sample activation prefix sums and, per range of layers, the
        backward working set at its peak (``CostKernel.recompute_peak_matrix``);
        the per-micro-batch weight copies, the reduce buffer and the optimizer
        step's temporaries of the code that trains (``memory.PeakTerms``)."""
        k, o = self.kernel, self.option
        implementation = k.state_implementation
        self._state_per_param = state_bytes_per_param(o.zero, o.dp * o.cp, k.workload.state_bytes, implementation)
        self._grad_per_param = state_bytes_split(o.zero, o.dp * o.cp, k.workload.state_bytes, implementation)[1]
        self._acc_per_param = accumulated_grad_bytes(o.zero, o.dp * o.cp, k.workload.state_bytes, implementation,
                                                     False)
        # routed experts shard their states over the dp·cp/ep devices holding the same experts
        self._expert_state = self._expert_grad = self._expert_acc = 0.0
        if o.ep > 1:
            dense = (self._state_per_param, self._grad_per_param)
            experts = state_bytes_split(o.zero, o.dp * o.cp // o.ep, k.workload.state_bytes, implementation)
            self._expert_state, self._expert_grad = sum(experts) - dense[0], experts[1] - dense[1]
            self._expert_acc = accumulated_grad_bytes(o.zero, o.dp * o.cp // o.ep, k.workload.state_bytes,
                                                      implementation, False) - self._acc_per_param
        self._build_ddp_memory()
        # offloaded: what would be kept per micro-batch in flight goes to host memory
        self._host_act = k.activation_prefix(o.tp, o.recompute, o.sequence_parallel, o.cp) if o.offload else None
        if o.offload:  # nothing kept per micro-batch in flight; a working set once (kernel.offload_working_bytes)
            self._act = np.zeros(self.num_layers + 1)
            work = k.offload_working_bytes(o.tp, o.recompute, o.sequence_parallel)
        else:
            self._act = k.activation_prefix(o.tp, o.recompute, o.sequence_parallel, o.cp)
            work = k.backward_working_bytes(o.tp, o.recompute, o.sequence_parallel, o.cp)
        self._work: np.ndarray | None = work if work.any() else None
        # ZeRO-3 on hetplan's runtime: the peak is per-layer moments (cost/zero3.py), gathered layers included
        self._zero3 = runs_zero3_moments(k, (o.zero,), o.dp * o.cp, o.offload, o.split)
        self._zero3_cache: dict[tuple[int, int], Zero3Layers] = {}
        self._zero3_model: Zero3Layers | None = None  # every layer on its own, for the range tables
        self._gathered = k.params_per_device(o.tp, o.ep) * k.weight_bytes \
            if o.zero >= 3 and o.dp * o.cp > 1 and not self._zero3 else None
        self._act_list = self._act.tolist()  # scalar lookups (one range) are faster on lists
        if self._work is None or self._zero3:
            self._work_max = None
        elif o.offload:  # nothing stored on the GPU that backward could free: the largest working set
            self._work_max = k.range_max_matrix(self._work, ("offwork", o.tp, o.recompute, o.sequence_parallel))
        else:
            self._work_max = k.recompute_peak_matrix(o.tp, o.recompute, o.sequence_parallel, o.cp)
        self._gathered_max = None if self._gathered is None else \
            k.range_max_matrix(self._gathered, ("gathered", o.tp, o.ep))
        self._build_runtime_memory()
        self._memory_classes = self._layout.memory_classes
        self._device_class = self._layout.device_class
        self._use_profile = (k.memory_profile is not None and o.zero == 0 and o.recompute == "none"
                             and not o.sequence_parallel and not o.offload and o.cp == 1 and o.ep == 1)

    def _build_ddp_memory(self) -> None:
        """Plain data parallelism's per-parameter states: the runtime trains a stage
        of the whole model on DDP (``memory.runtime_uses_ddp``), which keeps the
        weights once, its gradients in buckets from the start and no reduce
        buffer; ``_ddp_states`` is None where no range of this stage runs so."""
        k, o = self.kernel, self.option
        self._ddp_states: tuple[float, float] | None = None
        if k.runtime and runtime_uses_ddp(o.zero, o.dp, o.tp, o.cp, o.ep, True):
            split = state_bytes_split(0, o.dp, k.workload.state_bytes, k.state_implementation, True)
            self._ddp_states = (sum(split), accumulated_grad_bytes(0, o.dp, k.workload.state_bytes,
                                                                   k.state_implementation, True))

    def _ddp(self, a: int, b: int) -> bool:
        """Layers [a, b) run on DDP: the whole model, on a stage that may (``_build_ddp_memory``)."""
        return self._ddp_states is not None and a == 0 and b == self.num_layers

    def _build_runtime_memory(self) -> None:
        """Range tables of what the batch does not scale: what each micro-batch
        keeps whatever its size (``CostKernel.micro_batch_bytes``: weight
        copies, indices), for every micro-batch in flight (``_per_mb``) or
        for the one layer being rebuilt (recomputed or offloaded layers:
        ``_per_mb_max``), the reduce buffer of the largest layer, and the
        largest tensor the optimizer step updates (``_largest_max``). Empty
        (None) for code that has none of them."""
        k, o = self.kernel, self.option
        per_mb = k.micro_batch_bytes(o.tp, o.ep)
        rebuilt = o.recompute == "full" or o.offload
        self._per_mb = None if rebuilt or not per_mb.any() else k.micro_batch_prefix(o.tp, o.ep)
        self._per_mb_max = None if not rebuilt or not per_mb.any() or self._zero3 else \
            (OFFLOAD_RESIDENT_LAYERS if o.offload else 1) * k.range_max_matrix(per_mb, ("permb", o.tp, o.ep))
        buffers = k.reduce_peak_bytes(o.tp, o.ep, o.zero, o.recompute, o.sequence_parallel, o.cp) \
            if o.dp * o.cp > 1 and not self._zero3 else np.zeros(self.num_layers)
        self._reduce_max = k.range_max_matrix(
            buffers, ("reducepeak", o.tp, o.ep, o.zero, o.recompute, o.sequence_parallel, o.cp)) \
            if buffers.any() else None
        # a pipelined stage's receive buffers and new gradient (CostModel.stage_terms, cost/pipeline_memory.py)
        self._boundary = k.memory_arrays.input_bytes if k.runtime and k.memory_profile is None else None
        self._new_grad_max = None if self._boundary is None else \
            k.range_max_matrix(k.largest_tensor(o.tp, o.ep), ("largest", o.tp, o.ep)) * k.grad_bytes
        largest = k.largest_tensor(o.tp, o.ep)
        self._largest_max = k.range_max_matrix(largest, ("largest", o.tp, o.ep)) if largest.any() else None

    def _step_bytes(self, held: np.ndarray | float, largest: np.ndarray | float) -> np.ndarray | float:
        """The optimizer step's temporaries for ``held`` parameters whose largest
        tensor has ``largest`` elements (``memory.step_temporary_bytes``; under
        ZeRO each rank updates its 1/dp shard, and the runtime's ZeRO-1 gathers
        the slices after: ``memory.zero1_gather_bytes``)."""
        o, k = self.option, self.kernel
        dp = o.dp * o.cp
        step = step_temporary_bytes(k.workload.runtime_optimizer, largest / dp if o.zero >= 1 else largest)
        if o.zero == 1 and k.runtime:
            step = step + zero1_gather_bytes(held, dp)
        return step

    # --- one range -----------------------------------------------------------------------------
    def timing(self, a: int, b: int) -> SegmentTiming:
        """What the stage charges for layers [a, b) (a < b)."""
        worst = self._classes[0]
        if len(self._classes) > 1:
            totals = [c.total[b] - c.total[a] for c in self._classes]
            worst = self._classes[int(np.argmax(totals))]
        fwd, bwd, rec, tpc = (float(x[b] - x[a]) for x in (worst.fwd, worst.bwd, worst.rec, worst.tpc))
        held, experts = self._held(a, b)
        gather, scatter, sync, post, optimizer = (held * d + experts * e for d, e in zip(
            (self._gather, self._scatter, self._sync, self._post, self._optimizer), self._expert))
        zero3 = 0.0
        if self._gather:  # ZeRO-3: its gathers and scatters, as far as compute does not hide them
            zero3 = float(stage_micro_batch_time(fwd, bwd + rec, 0.0, gather, scatter, self.kernel.overlap_slowdown)
                          - fwd - bwd - rec)
        return SegmentTiming(fwd, bwd, rec, tpc, zero3, sync, post, optimizer, float(worst.off[b] - worst.off[a]))

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

    def class_memory(self, a: int, b: int, in_flight: float, first_backward: bool = False,
                     micro_batches: int = 0) -> list[float]:
        """Peak bytes of a GPU of each memory class for layers [a, b)
        (``first_backward``: as ``memory.PeakTerms``; ``micro_batches``: as ``peak_bytes``)."""
        return [self.peak_bytes(a, b, c.batch, in_flight, c.overhead, c.expert_scale, first_backward, micro_batches)
                for c in self._memory_classes]

    def pipeline_terms(self, rows: Index, cols: Index, micro_batches: int) -> tuple[Any, Any]:
        """(receive buffers per sample of a replica's micro-batch share, new gradient) that
        hetplan's runtime holds on a pipelined stage of layers [a, b), in a step of
        ``micro_batches`` (``pipeline_memory``, as ``CostModel.stage_terms`` adds them);
        nothing for the whole model (one stage, no pipeline), without ``micro_batches``
        or for other code. Scalars for one range, the table's block for slices."""
        if self._boundary is None or micro_batches <= 0:
            return 0.0, 0.0
        one = isinstance(rows, (int, np.integer)) and isinstance(cols, (int, np.integer))
        starts, ends = (np.asarray(rows), np.asarray(cols)) if one else \
            (positions(rows)[:, None], positions(cols)[None, :])
        pipelined = (starts > 0) | (ends < self.num_layers)
        o = self.option
        received = np.where(pipelined, received_per_sample(self._boundary, starts, ends), 0.0) / o.cp * micro_batches
        new_grad = np.where(pipelined, self._new_grad_max[rows, cols], 0.0) \
            if self._new_grad_max is not None and holds_new_gradient(micro_batches, o.dp * o.cp, o.zero) else 0.0
        return (float(received), float(new_grad)) if one else (received, new_grad)

    def peak_bytes(self, a: int, b: int, batch: float, in_flight: float, overhead: float,
                   expert_scale: float = 1.0, first_backward: bool = False, micro_batches: int = 0) -> float:
        """Peak bytes of one GPU of this stage whose replica gets ``batch`` samples
        per micro-batch, for layers [a, b) (``expert_scale``: its routed experts
        over an even 1/ep share, ``Stage.ep_split``; ``first_backward``: every
        micro-batch is in flight before the first backward, and the code that
        trains makes its gradients then: ``memory.PeakTerms``). Searches ask
        without ``first_backward``, which counts the gradients at every
        backward: never less. ``micro_batches``: the step's, for a pipelined
        stage's own buffers (``pipeline_terms``)."""
        measured = self._profiled_memory(a, b, batch, in_flight)
        if measured is not None:
            return measured + overhead
        received, new_grad = self.pipeline_terms(a, b, micro_batches)
        line = self._memory_line(a, b, in_flight, overhead + received * batch, expert_scale)
        backward = line.fixed + new_grad + line.per_sample * batch + self._zero3_moment_bytes(a, b, batch)
        # gradients accumulate over several micro-batches (with first_backward all of them are in flight)
        accumulated = line.accumulated if not first_backward or in_flight > 1 else 0.0
        if not (first_backward and self.kernel.runtime):
            return line.base + max(backward + accumulated, line.step)
        one = line.micro_batch_fixed + line.micro_batch_per_sample * batch
        first = backward - (0.0 if line.grads_held else line.grads)
        return line.base + max(first, accumulated + backward - one, line.step)

    def _zero3_fits_matrix(self, held: np.ndarray, in_flight: float, rows: slice, cols: slice,
                           experts: np.ndarray | float, micro_batches: int) -> np.ndarray:
        """``_fits_matrix`` of a ZeRO-3 stage: its moments for every range at once
        (``zero3.zero3_moment_table``), the ranges holding two layers of a tied group
        (wrapped with the root) one by one (``fits``)."""
        starts, ends = np.arange(rows.start, rows.stop), np.arange(cols.start, cols.stop)
        layers = self._zero3_model
        if layers is None:
            o = self.option
            layers = self._zero3_model = zero3_layers(self.kernel, 0, self.num_layers, o.tp, o.ep, (o.recompute,),
                                                      o.sequence_parallel, o.cp, tied=False)
        states = held * self._state_per_param + experts * self._expert_state
        act = self._act[cols][None, :] - self._act[rows][:, None]
        per_mb = (self._per_mb[cols][None, :] - self._per_mb[rows][:, None]) if self._per_mb is not None else 0.0
        step = self._step_bytes(held, self._largest_max[rows, cols] if self._largest_max is not None else 0.0)
        received, new_grad = self.pipeline_terms(rows, cols, micro_batches)  # as peak_bytes
        ok = self._valid(rows, cols)
        for c in self._memory_classes:
            held_states = states + (c.expert_scale - 1.0) * experts * (self._state_per_param + self._expert_state)
            backward = (act * c.batch + per_mb) * (in_flight - 1.0) + zero3_moment_table(layers, c.batch, starts, ends)
            ok &= held_states + c.overhead + received * c.batch + np.maximum(backward + new_grad, step) <= c.capacity
        for later, first, _ in self.kernel.tied_pairs():  # ranges holding both: the root's layers
            for x in np.nonzero(starts <= first)[0]:
                for y in np.nonzero(ends > later)[0]:
                    ok[x, y] = self.fits(int(starts[x]), int(ends[y]), in_flight, micro_batches=micro_batches)
        return ok

    def _zero3_layers(self, a: int, b: int) -> Zero3Layers:
        """Layers [a, b) as ZeRO-3's moments see them (``zero3.zero3_layers``), memoised."""
        found = self._zero3_cache.get((a, b))
        if found is None:
            o = self.option
            found = self._zero3_cache[(a, b)] = zero3_layers(self.kernel, a, b, o.tp, o.ep, (o.recompute,),
                                                              o.sequence_parallel, o.cp)
        return found

    def _zero3_moment_bytes(self, a: int, b: int, batch: float) -> float:
        """What the micro-batch in backward holds at ZeRO-3's peak moment of layers [a, b)
        (``zero3.zero3_moment``; 0 for other stages, whose working set ``_memory_line`` has)."""
        if not self._zero3:
            return 0.0
        moment = zero3_moment(self._zero3_layers(a, b), batch)
        return moment.activations + moment.gathered + moment.grads

    def _memory_line(self, a: int, b: int, in_flight: float, overhead: float,
                     expert_scale: float = 1.0) -> _MemoryLine:
        """The analytic memory of layers [a, b) in the replica's samples (``_MemoryLine``);
        on a ZeRO-3 stage without the micro-batch in backward (``_zero3_moment_bytes``)."""
        held, experts = self._held(a, b)
        ddp = self._ddp(a, b)
        per_param, acc_per_param = self._ddp_states if self._ddp_states is not None and ddp else \
            (self._state_per_param, self._acc_per_param)
        states = held * per_param + experts * self._expert_state
        states += (expert_scale - 1.0) * experts * (per_param + self._expert_state)
        work = float(self._work_max[a, b]) if self._work_max is not None else 0.0
        gathered = float(self._gathered_max[a, b]) if self._gathered_max is not None else 0.0
        act = self._act_list[b] - self._act_list[a]
        per_mb = float(self._per_mb[b] - self._per_mb[a]) if self._per_mb is not None else 0.0
        rebuilt = float(self._per_mb_max[a, b]) if self._per_mb_max is not None else 0.0
        reduce = float(self._reduce_max[a, b]) if self._reduce_max is not None and not ddp else 0.0
        largest = float(self._largest_max[a, b]) if self._largest_max is not None else 0.0
        stored = in_flight
        if self._zero3:  # the micro-batch in backward is at its moment; the root's layers stay gathered
            stored = in_flight - 1.0
            states += self._zero3_layers(a, b).root_weights
        grads = (held + (expert_scale - 1.0) * experts) * self._grad_per_param \
            + expert_scale * experts * self._expert_grad
        accumulated = (held + (expert_scale - 1.0) * experts) * acc_per_param \
            + expert_scale * experts * self._expert_acc
        return _MemoryLine(base=float(peak_memory_bytes(states, 0.0, in_flight, 0.0, gathered, overhead)),
                           fixed=per_mb * stored + rebuilt + reduce,
                           per_sample=float(peak_memory_bytes(0.0, act, stored, work, 0.0, 0.0)),
                           step=float(self._step_bytes(held, largest)), grads=grads,
                           micro_batch_fixed=per_mb, micro_batch_per_sample=act, accumulated=accumulated,
                           grads_held=ddp)

    def host_bytes(self, a: int, b: int, batch: float, in_flight: float) -> float:
        """Offloaded activations one GPU keeps in host memory for layers [a, b):
        what the device no longer holds, for every micro-batch in flight (0
        without offloading)."""
        if self._host_act is None:
            return 0.0
        return float(self._host_act[b] - self._host_act[a]) * batch * in_flight

    def device_host_bytes(self, a: int, b: int, in_flight: float) -> list[int]:
        """``host_bytes`` of each device of the stage (in its device order)."""
        per_class = [int(self.host_bytes(a, b, c.batch, in_flight)) for c in self._memory_classes]
        return [per_class[c] for c in self._device_class.tolist()]

    def max_batch(self, a: int, b: int, in_flight: float, overhead: float, capacity: float,
                  limit: int = 1 << 20, host_capacity: float = math.inf) -> int:
        """The most samples per micro-batch a replica's GPU holds for layers [a, b)
        (0: none), its offloaded activations within ``host_capacity``."""
        host_per_sample = self.host_bytes(a, b, 1.0, in_flight)
        if host_per_sample > 0 and math.isfinite(host_capacity):
            limit = min(limit, int(host_capacity // host_per_sample))
            while limit > 0 and host_per_sample * limit > host_capacity:  # rounding of the division
                limit -= 1
            if limit == 0:
                return 0
        if self._profiled_memory(a, b, 1, in_flight) is None and not self._zero3:
            line = self._memory_line(a, b, in_flight, overhead)
            fixed, per_sample = line.base + line.fixed, line.per_sample
            if fixed + per_sample > capacity or line.base + line.step > capacity:
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
        profile = self.kernel.memory_profile
        if not self._use_profile or profile is None:
            return None
        return profile.stage_memory(a, b, self.option.tp, batch, in_flight)

    def device_memory(self, a: int, b: int, in_flight: float, first_backward: bool = False) -> list[int]:
        """Peak bytes of each device of the stage (in its device order)."""
        per_class = np.array([int(m) for m in self.class_memory(a, b, in_flight, first_backward)], dtype=np.int64)
        return per_class[self._device_class].tolist()

    def fits(self, a: int, b: int, in_flight: float, first_backward: bool = False, micro_batches: int = 0) -> bool:
        """Every GPU of the stage holds layers [a, b) and its micro-batches
        (memoised: searches such as Metis's DFS ask about the same ranges again;
        ``micro_batches``: as ``peak_bytes``)."""
        key = (a, b, in_flight, first_backward, micro_batches)
        found = self._fits.get(key)
        if found is None:
            found = self._fits[key] = all(
                m <= c.capacity and self.host_bytes(a, b, c.batch, in_flight) <= c.host_capacity
                for m, c in zip(self.class_memory(a, b, in_flight, first_backward, micro_batches),
                                self._memory_classes))
        return found

    # --- every range at once ----------------------------------------------------------------------
    def tables(self, in_flight: float, window: tuple[int, int] | None = None,
               micro_batches: int = 0) -> SegmentTables:
        """Every ``[a, b)`` as matrices (see :class:`SegmentTables`). With
        ``window = (j, span)`` only stage ``j``'s window of a pipeline: rows
        ``a = j + x``, columns ``b = j + 1 + y`` for ``x, y < span``.
        ``micro_batches``: the step's, for a pipelined stage's own buffers
        (``pipeline_terms``)."""
        recent = self.kernel.recent_tables
        times = recent.get((self.key, window))
        if times is None:  # the times do not depend on the micro-batches in flight: shared
            times = recent.put((self.key, window), self._time_tables(window))
        fits = recent.get((self.key, window, in_flight, micro_batches))
        if fits is None:
            fits = recent.put((self.key, window, in_flight, micro_batches),
                              self._fits_table(in_flight, window, micro_batches))
        # one cache holds both kinds of entry, under different keys
        return replace(cast(SegmentTables, times), fits=cast(np.ndarray, fits))

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
        held, experts = self._held_matrices(rows, cols)
        per_mb = stage_micro_batch_time(fwd, back, tpc, held * self._gather + experts * self._expert[0],
                                        held * self._scatter + experts * self._expert[1],
                                        self.kernel.overlap_slowdown) \
            if self._gather else fwd + back + tpc  # no ZeRO-3 traffic: nothing to expose
        return SegmentTables(np.where(valid, per_mb, np.inf), back, held, self._sync, self._post, self._optimizer,
                             valid, experts, *self._expert[2:])

    def _held_matrices(self, rows: slice, cols: slice) -> tuple[np.ndarray, np.ndarray | float]:
        """``_held`` for every cell of the table."""
        o = self.option
        held = np.asarray(self.kernel.held_params_matrix(o.tp, o.ep)[rows, cols])
        return held, (np.asarray(self.kernel.expert_held_matrix(o.tp, o.ep)[rows, cols]) if o.ep > 1 else 0.0)

    def _fits_table(self, in_flight: float, window: tuple[int, int] | None, micro_batches: int) -> np.ndarray:
        rows, cols = self._cells(window)
        held, experts = self._held_matrices(rows, cols)
        return self._valid(rows, cols) & self._fits_matrix(held, in_flight, rows, cols, experts, micro_batches)

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

    def _fits_matrix(self, held: np.ndarray, in_flight: float, rows: slice, cols: slice,
                     experts: np.ndarray | float = 0.0, micro_batches: int = 0) -> np.ndarray:
        ok = np.ones((rows.stop - rows.start, cols.stop - cols.start), dtype=bool)
        if self._zero3:
            return self._zero3_fits_matrix(held, in_flight, rows, cols, experts, micro_batches)
        if self._use_profile:
            for x, a in enumerate(range(rows.start, rows.stop)):
                for y, b in enumerate(range(cols.start, cols.stop)):
                    ok[x, y] = b > a and self.fits(a, b, in_flight, micro_batches=micro_batches)
            return ok
        states = held * self._state_per_param + experts * self._expert_state
        act = self._act[cols][None, :] - self._act[rows][:, None]
        work = self._work_max[rows, cols] if self._work_max is not None else 0.0
        gathered = self._gathered_max[rows, cols] if self._gathered_max is not None else 0.0
        fixed: np.ndarray | float = 0.0
        if self._per_mb is not None:
            fixed = (self._per_mb[cols][None, :] - self._per_mb[rows][:, None]) * in_flight
        if self._per_mb_max is not None:
            fixed = fixed + self._per_mb_max[rows, cols]
        if self._reduce_max is not None:
            fixed = fixed + self._reduce_max[rows, cols]
        received, new_grad = self.pipeline_terms(rows, cols, micro_batches)
        fixed = fixed + new_grad
        step = self._step_bytes(held, self._largest_max[rows, cols] if self._largest_max is not None else 0.0)
        for c in self._memory_classes:
            held_states = states + (c.expert_scale - 1.0) * experts * (self._state_per_param + self._expert_state)
            accumulated = (held + (c.expert_scale - 1.0) * experts) * self._acc_per_param \
                + c.expert_scale * experts * self._expert_acc  # searches count it at every backward (peak_bytes)
            peak = peak_memory_bytes(held_states, act * c.batch, in_flight, work * c.batch, gathered,
                                     c.overhead + received * c.batch, fixed + accumulated, step)
            ok &= peak <= c.capacity
        whole = (0 - rows.start, self.num_layers - cols.start)  # the one range DDP trains (``_ddp``)
        if self._ddp_states is not None and 0 <= whole[0] < ok.shape[0] and 0 <= whole[1] < ok.shape[1]:
            ok[whole] = self.fits(0, self.num_layers, in_flight)
        if self._host_act is not None:  # offloaded activations within each GPU's host share (``host_bytes``)
            host = self._host_act[cols][None, :] - self._host_act[rows][:, None]
            for c in self._memory_classes:
                ok &= host * c.batch * in_flight <= c.host_capacity
        return ok
