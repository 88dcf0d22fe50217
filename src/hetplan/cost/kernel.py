"""The cost kernel: the one implementation of hetplan's cost model.

One :class:`CostKernel` per workload holds the tables every consumer reads:
per-layer compute times per (GPU type, micro-batch share, TP degree,
recomputation, sequence parallelism), per-layer parameter and activation
bytes, and seconds-per-byte rates of the collectives of each device group.
They are numpy vectors over the model's layers, computed once and cached.

On top of them sit the stage-level numbers (``cost/stage.py``): the
``StageCosts`` of a ``StageOption`` answers, for any contiguous range of
layers, what :meth:`hetplan.cost.CostModel.estimate` charges a stage running
them; the kernel builds and caches them, with what they share — per-replica
prefix sums, a stage's replica and memory classes, its collective rates.

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

import functools
import math
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Generic, Mapping, Sequence, TypeVar, cast

import numpy as np

from hetplan.cluster.catalog import GPUSpec
from hetplan.cost.calibration import calibrated_cluster
from hetplan.cost.comm import (
    allgather_time,
    allreduce_time,
    alltoall_time,
    collective_latency,
    p2p_time,
    reduce_scatter_time,
)
from hetplan.cost.cp_ep import cp_activation_bytes, cp_exposed_time, cp_gather_bytes, expert_groups
from hetplan.cost.compute import LayerTimes, Work, layer_times, matmul_rate, per_sample_work, run_detail
from hetplan.cost.constants import (
    ALLREDUCE_BUCKET_BYTES,
    CP_KV_METHOD,
    CP_KV_PASSES,
    EP_ALLTOALL_PASSES,
    DEFAULT_HOST_LINK,
    FSDP_REDUCE_BUFFER_LAYERS,
    GPU_HOST_LINK,
    HOST_OP_S,
    HOST_LINK_BYTES_PER_S,
    MEMORY_BANDWIDTH_EFFICIENCY,
    OFFLOAD_RESIDENT_LAYERS,
    OPTIMIZER_STEP_BYTES_BY_IMPLEMENTATION,
    OPTIMIZER_STEP_BYTES_PER_PARAM,
    TP_COMM_PASSES,
)
from hetplan.model.runtime_memory import backward_gradients, runtime_memory
from hetplan.errors import HetplanError
from hetplan.model.runtime_time import compiled_refusal, runtime_time
from hetplan.cost.groups import ClusterArrays, first_appearance
from hetplan.cost.layers import LayerArrays, layer_arrays, runtime_arrays, runtime_time_arrays
from hetplan.cost.pipeline import overlap_slowdown, overlapped_exposure
from hetplan.cost.memory import (
    activation_bytes, backward_working_bytes, fp8_linear_input_scale, framework_overhead_bytes,
    host_offload_capacity_bytes,
)
from hetplan.cost.ranges import RangeMax, RangeSum
from hetplan.cost.stage import SegmentTables, StageCosts, StageOption, check_option
from hetplan.cost.targets import target_arrays
from hetplan.plan.runtime_facts import OPTIMIZER_IMPLEMENTATION
from hetplan.plan.workload import Workload
from hetplan.profile.db import DATA_PARALLEL_ZERO
from hetplan.profile.metis import MetisProfileDB

COLLECTIVES: dict[str, Callable[..., float]] = {
    "allreduce": allreduce_time,
    "allgather": allgather_time,
    "reduce_scatter": reduce_scatter_time,
    "alltoall": alltoall_time,
}


@dataclass(frozen=True)
class _TimeClass:
    """Replicas of a stage that cost the same: prefix sums over the layers."""

    fwd: np.ndarray
    bwd: np.ndarray
    rec: np.ndarray  # recompute, and the exposed host transfers of offloading
    tpc: np.ndarray
    total: np.ndarray
    off: np.ndarray  # the exposed host transfers alone (part of ``rec``: the breakdown's own row)
    total_list: list[float] = field(compare=False, repr=False)  # ``total`` for fast scalar lookups


@dataclass(frozen=True)
class _MemoryClass:
    """Replicas of a stage with the same per-replica batch, capacity and overhead."""

    batch: int
    capacity: int
    overhead: int
    expert_scale: float = 1.0  # routed experts held over an even 1/ep share (``Stage.ep_split``)
    host_capacity: float = math.inf  # offloaded-activation bytes its host share holds (``host_capacity_bytes``)


@dataclass(frozen=True)
class _StagePlacement:
    """What a stage's devices, degrees and split decide, whatever its ZeRO stage
    or recomputation: the replicas that cost alike, the memory classes of its
    GPUs, and its data-parallel and optimizer rates.

    ``signature`` holds everything else here depends on, with the devices
    themselves left out: stages with equal signatures (a uniform plan's
    stages, on identical nodes) cost the same, so they share one
    ``StageCosts`` (``CostKernel.stage``); ``index`` numbers the kernel's
    distinct signatures."""

    # (slowest GPU, share, TP link, (expert work, expert tokens): ``CostKernel.row_experts``)
    time_classes: tuple[tuple[GPUSpec, int, tuple[float, float], tuple[float, float]], ...]
    memory_classes: tuple[_MemoryClass, ...]
    device_class: np.ndarray  # memory class of each device of the stage, in device order
    dp_rate: Callable[[str], float]  # per collective: s/byte on the slowest data-parallel group
    optimizer_rate: float  # s/parameter of the optimizer step
    signature: tuple[object, ...]
    index: int
    cp: int = 1
    ep: int = 1
    parallel: tuple[Any, ...] = ()  # (cp, ep, CP link, EP link) when cp or ep > 1 (``CostKernel.cp_ep_links``)
    expert_rate: Callable[[str], float] | None = None  # s/byte on the slowest expert-data-parallel group
    expert_scale: float = 1.0  # the most routed experts a device holds, over an even 1/ep share
    # ZeRO stage -> (fwd, bwd) s/parameter the runtime's data-parallel wrapper adds, as
    # ``hetplan profile`` measured it over groups of this stage's size (``CostKernel.measured_dp``)
    measured_dp: Mapping[int, tuple[float, float]] = field(default_factory=dict)


@dataclass(frozen=True)
class _DataParallelGroups:
    """A stage's data-parallel groups up to symmetry: a representative group of
    each distinct shape (``groups.ClusterArrays.shape``), and the shape of the
    first group (its GPUs per node decide DeepSpeed's NIC sharing)."""

    representatives: tuple[tuple[int, ...], ...]
    key: tuple[tuple[object, ...], object]  # (the distinct shapes, the first group's shape)


# Segment tables kept per kernel (each is a few (L+1)^2 matrices; searches ask
# for the same stages again and again, but a 1,000-GPU search would not fit
# them all in memory).
RECENT_TABLES = 256

# Stage costs kept per kernel: a StageCosts holds per-layer arrays and lists of
# about 80 bytes a layer (measured: 6.7 GB for 8,608 of them at 10,000 layers,
# the uniform planner on 64 H100, ``benchmarks/bench_layer_scale.py``), so the
# kernel keeps RECENT_STAGE_LAYERS / L of them (about 160 MB) and at least
# RECENT_STAGES_MIN; an evicted one is rebuilt (~1 ms at 10,000 layers).
RECENT_STAGE_LAYERS = 2_000_000
RECENT_STAGES_MIN = 64

# Device tuples the kernel finds by identity, and keeps as arrays (``CostKernel.device_set``).
RECENT_DEVICE_TUPLES = 4096

T = TypeVar("T")
R = TypeVar("R", RangeMax, RangeSum)


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


class CostKernel:
    """Cached tables of one workload (see the module docstring)."""

    def __init__(self, workload: Workload) -> None:
        self.workload = workload
        self.model = workload.model
        self.calibration = workload.calibration
        self.cluster = calibrated_cluster(workload.cluster, workload.calibration)  # links at calibrated rates
        self.overlap_slowdown = overlap_slowdown(g.catalog_name for g in self.cluster.gpu_specs)
        self.arrays: LayerArrays = layer_arrays(workload.model)
        self.num_layers = self.arrays.num_layers
        self.dtype_bytes = workload.model.dtype_bytes
        # the code that trains: hetplan's runtime (its tensors: model.runtime_memory; its work:
        # model.runtime_time), or what the model counts
        self.runtime = workload.target == "hetplan"
        cuda = any(d.gpu.catalog_name != "CPU" for d in workload.cluster.devices)
        if workload.compile and compiled_refusal(workload.model, cuda):
            raise HetplanError(compiled_refusal(workload.model, cuda))
        runs = runtime_time(workload.model, cuda=cuda, compiled=workload.compile) if self.runtime else None
        if runs is not None:
            self.arrays = runtime_time_arrays(self.arrays, runs)
        # what a tool's own recomputation keeps and redoes (cost.targets: torchtitan's op AC)
        self.arrays = target_arrays(workload.target, self.arrays, workload.model)
        # bytes per parameter of the optimizer step: as the runtime's implementation runs it on this cluster
        self.optimizer_step_bytes = OPTIMIZER_STEP_BYTES_BY_IMPLEMENTATION[
            OPTIMIZER_IMPLEMENTATION["cuda" if cuda else "cpu"]] if self.runtime else OPTIMIZER_STEP_BYTES_PER_PARAM
        memory = runtime_memory(workload.model, cuda=any(d.gpu.catalog_name != "CPU" for d in self.cluster.devices)) \
            if self.runtime else None
        self.memory_arrays: LayerArrays = self.arrays if memory is None else runtime_arrays(self.arrays, memory)
        # per layer and sample, the activation gradients its backward holds (TP-divided part, whole part)
        gradients = backward_gradients(workload.model, cuda=cuda) if self.runtime else None
        self.backward_gradients = np.zeros((self.num_layers, 2)) if gradients is None else np.array(gradients)
        # how ZeRO shards are kept: the runtime's own ways (cost.memory.resident_bytes_split), else the workload's
        self.state_implementation = "hetplan" if self.runtime else workload.zero_implementation
        # the size a linear layer's saved input keeps (FP8 training: one byte an element)
        self.linear_input_scale = fp8_linear_input_scale(workload.fp8, self.dtype_bytes)
        self.weight_bytes, held_grad_bytes, _ = workload.state_bytes
        # bytes per gradient the collectives move: the widest copy held, at most
        # fp32 (DeepSpeed's BF16 optimizer holds bf16 + fp32 and reduces the fp32)
        self.grad_bytes = min(held_grad_bytes, 4)
        profile = workload.profile
        self.memory_profile = profile if isinstance(profile, MetisProfileDB) and profile.has_memory else None
        self._times: dict[tuple[object, ...], LayerTimes] = {}
        self._units: dict[tuple[object, ...], Work] = {}
        self._rates: dict[tuple[object, ...], float] = {}
        self._slowest: dict[tuple[int, ...], GPUSpec] = {}
        self._arrays: dict[tuple[object, ...], np.ndarray] = {}
        self._range_tables: dict[tuple[object, ...], RangeMax | RangeSum] = {}
        # by layout index and strategy; each holds a few per-layer arrays, so fewer are kept for longer models
        self._stages: _Recent[StageCosts] = _Recent(max(RECENT_STAGES_MIN,
                                                        RECENT_STAGE_LAYERS // max(self.num_layers, 1)))
        self._signatures: dict[tuple[object, ...], int] = {}
        self._layouts: dict[tuple[object, ...], _StagePlacement] = {}
        self._sets: dict[tuple[int, ...], int] = {}  # device tuples, numbered (``device_set``)
        self._sets_by_id: dict[int, tuple[tuple[int, ...], int]] = {}
        self._set_arrays: _Recent[np.ndarray] = _Recent(RECENT_DEVICE_TUPLES)
        self._time_classes: dict[tuple[object, ...], _TimeClass] = {}
        self.recent_tables: _Recent[SegmentTables | np.ndarray] = _Recent(RECENT_TABLES)
        self._supports: dict[int, np.ndarray] = {}
        self._corrections: dict[int, list[tuple[int, int, float]]] = {}
        self._params_prefix: dict[tuple[int, int], list[float]] = {}
        self._capacity = [workload.device_capacity_bytes(d.id) for d in self.cluster.devices]
        self._overhead = [framework_overhead_bytes(d.gpu.catalog_name == "CPU") for d in self.cluster.devices]
        host_per_node = [host_offload_capacity_bytes(node) for node in self.cluster.nodes]
        self._host = [host_per_node[d.node] for d in self.cluster.devices]
        self._cluster_arrays: ClusterArrays | None = None
        self._matmul: dict[str, float] = {}  # sustained matmul FLOP/s per GPU type
        self._type_rate_array: np.ndarray | None = None  # the same per ``cluster_arrays.gpus``, once all are known
        self._messages: dict[tuple[str, int], float] = {}
        self._dp_groups: dict[tuple[int, int], _DataParallelGroups] = {}  # by device set and tp

    # --- per-layer tables -------------------------------------------------------------
    def layer_times(self, gpu: GPUSpec, batch: float, tp: int = 1, recompute: str = "none",
                    sequence_parallel: bool = False, expert_load: float = 1.0, cp: int = 1,
                    expert_batch: float = 1.0) -> LayerTimes:
        """Compute time of every layer for ``batch`` samples on one GPU of a TP
        group (a CP rank passes its 1/cp of a sample as ``batch``; ``expert_load``,
        ``expert_batch`` and ``cp`` as in ``compute.per_sample_work``)."""
        key = (gpu.name, float(batch), tp, recompute, sequence_parallel, expert_load, cp, expert_batch)
        found = self._times.get(key)
        if found is None:
            found = layer_times(self.arrays, gpu, float(batch), tp, recompute, self.dtype_bytes,
                                sequence_parallel, self.workload.profile,
                                self.unit_work(gpu, tp, sequence_parallel, expert_load, cp, expert_batch))
            scale = self.calibration.compute(gpu.name) if self.calibration is not None else 1.0
            if scale != 1.0:
                found = LayerTimes(found.fwd_s * scale, found.bwd_s * scale, found.recompute_s * scale,
                                   found.tp_comm_inside)
            self._times[key] = found
        return found

    def unit_work(self, gpu: GPUSpec, tp: int, sequence_parallel: bool, expert_load: float = 1.0,
                  cp: int = 1, expert_batch: float = 1.0) -> Work:
        """One sample's work per layer (``compute.per_sample_work``), cached per GPU type."""
        key = (gpu.name, tp, sequence_parallel, expert_load, cp, expert_batch)
        found = self._units.get(key)
        if found is None:
            found = self._units[key] = per_sample_work(self.arrays, gpu, tp, self.dtype_bytes, sequence_parallel,
                                                       self.workload.fp8, expert_load, cp, expert_batch,
                                                       self.workload.attention_kernel, self.host_op_s(gpu))
        return found

    def host_op_s(self, gpu: GPUSpec) -> float:
        """Host seconds per dispatched operator on ``gpu``: what ``hetplan profile``
        measured there (``ProfileDB.host_op_s``), else the fitted default ``HOST_OP_S``."""
        read = getattr(self.workload.profile, "host_op_s", None)
        measured = read(gpu.name) if read is not None else None
        return measured if measured is not None else HOST_OP_S

    def run_detail(self, gpu: GPUSpec, batch: float, tp: int, first: int, end: int) -> tuple[float, float]:
        """Seconds of one micro-batch of ``batch`` samples on layers ``first``..``end-1``
        (one GPU of a TP group, no sequence parallelism) that wait for the host, and
        that the loss's fp32 passes take (``compute.run_detail``): what the breakdown shows."""
        host, loss = run_detail(self.arrays, self.unit_work(gpu, tp, False), gpu, float(batch))
        return float(host[first:end].sum()), float(loss[first:end].sum())

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

    def params_per_device(self, tp: int, ep: int = 1) -> np.ndarray:
        return self._cached(("params", tp, ep), lambda: self.arrays.params_per_device(tp, ep))

    def expert_params_per_device(self, tp: int, ep: int) -> np.ndarray:
        """Routed-expert parameters one device holds per layer (part of ``params_per_device``)."""
        return self._cached(("experts", tp, ep), lambda: self.arrays.expert_params_per_device(tp, ep))

    def tied_share(self, tp: int) -> np.ndarray:
        return self._cached(("tied", tp), lambda: self.arrays.tied_share_per_device(tp))

    def activation_bytes(self, tp: int, recompute: str, sequence_parallel: bool) -> np.ndarray:
        """Per sample and layer, kept for backward (by the code that trains: ``memory_arrays``)."""
        return self._cached(("act", tp, recompute, sequence_parallel),
                            lambda: activation_bytes(self.memory_arrays, tp, recompute, sequence_parallel,
                                                     self.linear_input_scale))

    def rank_activation_bytes(self, tp: int, recompute: str, sequence_parallel: bool, cp: int) -> np.ndarray:
        """Per sample and layer, what one CP rank keeps for backward
        (``cp_ep.cp_activation_bytes``: its 1/cp plus the gathered K/V, which
        full recomputation does not keep)."""
        if cp <= 1:
            return self.activation_bytes(tp, recompute, sequence_parallel)
        kv = self.arrays.column("kv_bytes") / tp if recompute != "full" else np.zeros(self.num_layers)
        return self._cached(("actcp", tp, recompute, sequence_parallel, cp),
                            lambda: cp_activation_bytes(self.activation_bytes(tp, recompute, sequence_parallel),
                                                        kv, cp))

    def backward_working_bytes(self, tp: int, recompute: str, sequence_parallel: bool, cp: int = 1) -> np.ndarray:
        """Per sample and layer, what a layer's backward holds on one CP rank
        beyond what it stored (``memory.backward_working_bytes``: the loss's
        gradients, a checkpointed layer's rebuilt activations)."""
        if cp <= 1:
            return self._cached(("work", tp, recompute, sequence_parallel),
                                lambda: backward_working_bytes(self.memory_arrays, tp, recompute, sequence_parallel,
                                                               self.linear_input_scale))
        transient = self.memory_arrays.column("working_bytes") / cp  # the rank's 1/cp of the tokens
        if recompute != "full":
            return transient
        return self._cached(("workcp", tp, sequence_parallel, cp), lambda: np.maximum(
            self.rank_activation_bytes(tp, "none", sequence_parallel, cp)
            - self.rank_activation_bytes(tp, "full", sequence_parallel, cp), 0.0) + transient)

    def offload_working_bytes(self, tp: int, recompute: str, sequence_parallel: bool) -> np.ndarray:
        """Per sample: what an offloaded layer still holds on the GPU, paid once
        per stage (not per micro-batch in flight): its own activations while it
        runs and the next one's fetched back ahead of backward
        (``OFFLOAD_RESIDENT_LAYERS``), plus its backward's working set and the
        activation gradients its backward holds (``runtime_memory.backward_gradients``:
        with nothing stored after an offloaded layer, they make its peak)."""
        return self._cached(("offwork", tp, recompute, sequence_parallel),
                            lambda: OFFLOAD_RESIDENT_LAYERS * self.activation_bytes(tp, recompute, sequence_parallel)
                            + self.backward_working_bytes(tp, recompute, sequence_parallel)
                            + self.activation_gradient_bytes(tp, sequence_parallel))

    def activation_gradient_bytes(self, tp: int, sequence_parallel: bool, cp: int = 1) -> np.ndarray:
        """Per sample and layer, the activation gradients a layer's backward holds at
        once beyond what it saved, on one TP and CP rank (``runtime_memory.backward_gradients``:
        its MLP's and the residual stream's; sequence parallelism divides the latter)."""
        return (self.backward_gradients[:, 0] / tp
                + self.backward_gradients[:, 1] / (tp if sequence_parallel else 1)) / cp

    def loss_bytes(self, cp: int = 1) -> tuple[np.ndarray, np.ndarray]:
        """Per sample and layer, the loss's part of what a layer keeps (the
        logits and log-softmax the runtime holds: ``act_outside_bytes``) and of
        its backward's working set (``working_bytes``), on one CP rank (whole
        on every TP rank): the "loss" category of ``memory.PeakTerms``."""
        a = self.memory_arrays
        return a.column("act_outside_bytes") / cp, a.column("working_bytes") / cp

    def micro_batch_bytes(self, tp: int, ep: int = 1) -> np.ndarray:
        """Per layer: what one device keeps for a micro-batch's backward
        whatever its size (the code that trains: ``runtime_arrays``): the
        16-bit weight copies autocast made in its forward (``cast_params``)
        and indices or tables made once per micro-batch (``act_fixed_bytes``)."""
        a = self.memory_arrays
        if a.cast_params is None:
            return np.zeros(self.num_layers)
        return self._cached(("permb", tp, ep), lambda: self.dtype_bytes * (
            a.cast_params * a.tp_share(tp) + a.column("cast_expert_params") / (tp * ep))
            + a.column("act_fixed_bytes"))

    def micro_batch_prefix(self, tp: int, ep: int = 1) -> np.ndarray:
        """Prefix sums of ``micro_batch_bytes``: a range's as a difference."""
        return self._cached(("permbprefix", tp, ep), lambda: _prefix(self.micro_batch_bytes(tp, ep)))

    def largest_tensor(self, tp: int, ep: int = 1) -> np.ndarray:
        """Per layer: elements of the largest parameter tensor one device holds
        (``LayerArrays.largest_param``; 0 where the code that trains is not known)."""
        a = self.memory_arrays
        if a.largest_param is None:
            return np.zeros(self.num_layers)
        return self._cached(("largest", tp, ep), lambda: np.maximum(
            a.largest_param * a.tp_share(tp), a.column("largest_expert_param") / (tp * ep)))

    def reduce_buffer_bytes(self, tp: int, ep: int = 1) -> np.ndarray:
        """Per layer: the buffer FSDP2 reduces the layer's gradients through
        under data parallelism (``FSDP_REDUCE_BUFFER_LAYERS`` of its fp32
        gradients); 0 for code other than hetplan's runtime."""
        if not self.runtime:
            return np.zeros(self.num_layers)
        return self._cached(("reducebuf", tp, ep), lambda: FSDP_REDUCE_BUFFER_LAYERS * self.grad_bytes
                            * self.params_per_device(tp, ep))

    def reduce_peak_bytes(self, tp: int, ep: int, zero: int, recompute: str, sequence_parallel: bool,
                          cp: int) -> np.ndarray:
        """Per layer: what its reduce buffer (``reduce_buffer_bytes``) adds to
        the backward's peak. FSDP2 reduces a layer's gradients in its
        post-backward hook, after autograd has run the layer's backward and
        released what it saved (a node frees its saved tensors once it has
        run), and keeps the buffer until the next layer's reduce
        (``_fully_shard/_fsdp_param_group.py`` ``post_backward``:
        ``comm_ctx.reduce_scatter_state``), through the backward of the layer
        before it: the buffer takes the place of what the layer stored
        (``rank_activation_bytes`` under its recomputation) and the loss's
        gradients it freed, so only what it exceeds them by counts, at one
        sample (a micro-batch has at least one; never less). Replayed:
        tiny-gpt/tiny-llama dp2 ZeRO-1/2 and CP2 peak at the loss's backward
        without it. ZeRO-3 (``zero`` 3) reduces on every micro-batch, and
        each layer's backward makes its unsharded fp32 gradients, the buffer's
        size, beside the previous layer's buffer (replayed: tiny-gpt ZeRO-3
        with full recompute peaks inside a block's backward holding both): the
        whole buffer counts there."""
        if zero >= 3:
            return self.reduce_buffer_bytes(tp, ep)
        freed = self.rank_activation_bytes(tp, recompute, sequence_parallel, cp) + self.arrays.column("working_bytes")
        return np.maximum(self.reduce_buffer_bytes(tp, ep) - freed, 0.0)

    def host_link_rate(self, gpu: GPUSpec) -> float:
        """Bytes/s one GPU copies to or from host memory (``GPU_HOST_LINK``); a
        CPU "device" copies within its own memory."""
        if gpu.catalog_name == "CPU":
            return gpu.memory_bandwidth_bytes_per_s * MEMORY_BANDWIDTH_EFFICIENCY
        kind = GPU_HOST_LINK.get(gpu.catalog_name or gpu.name, DEFAULT_HOST_LINK)
        return HOST_LINK_BYTES_PER_S[kind]

    def offload_exposed_time(self, gpu: GPUSpec, batch: float, tp: int, recompute: str,
                             sequence_parallel: bool) -> np.ndarray:
        """Per layer: the part of offloading ``batch`` samples' saved activations
        that compute does not hide. Each layer's bytes go to the host during its
        forward and come back during the backward before its own (one layer of
        prefetch), on a copy stream beside compute, so per pass only
        ``max(0, transfer - compute)`` shows (the overlap rule of
        ``pipeline.stage_micro_batch_time``; the layer's own backward stands
        for its neighbour's, equal in a stack of identical blocks)."""
        t = self.layer_times(gpu, batch, tp, recompute, sequence_parallel)
        moved = self.activation_bytes(tp, recompute, sequence_parallel) * float(batch)
        transfer = moved / self.host_link_rate(gpu)
        return np.maximum(transfer - t.fwd_s, 0.0) + np.maximum(transfer - (t.bwd_s + t.recompute_s), 0.0)

    def tp_comm_bytes(self, recompute: str) -> np.ndarray:
        """TP all-reduce bytes per sample and layer over a whole step's passes."""
        return self._cached(("tpc", recompute), lambda: self.arrays.tp_comm_bytes * TP_COMM_PASSES[recompute])

    def tp_collective_counts(self, recompute: str) -> np.ndarray:
        """TP all-reduces per layer and micro-batch over a step's passes: each
        of Megatron's f/g all-reduces moves one activation of the layer's output
        size (Shoeybi et al. 2019, Fig. 4: two per block and pass), so a layer
        runs ``tp_comm_bytes / output_bytes`` of them per pass."""
        def counts() -> np.ndarray:
            a = self.arrays
            per_pass = np.where(a.tp_comm_bytes > 0,
                                np.maximum(1.0, np.round(a.tp_comm_bytes / np.maximum(a.output_bytes, 1.0))), 0.0)
            return per_pass * TP_COMM_PASSES[recompute]
        return self._cached(("tpn", recompute), counts)

    def tp_link(self, group: Sequence[int]) -> tuple[float, float]:
        """(seconds per byte, seconds per collective) of TP all-reduces over
        ``group``: its bandwidth and the latency of one all-reduce
        (``comm.collective_latency``, calibrated)."""
        if len(group) < 2:
            return 0.0, 0.0
        latency = collective_latency(self.cluster, group, "allreduce")
        if self.calibration is not None:
            latency *= self.calibration.latency_scale
        return self.collective_rate("allreduce", tuple(group)), latency

    def tp_comm_time(self, recompute: str, batch: float, link: tuple[float, float],
                     times: LayerTimes | None = None) -> np.ndarray:
        """Per layer: a replica's TP all-reduces of ``batch`` samples over one
        micro-batch's passes, bandwidth and latency; none for layers whose
        measured ``times`` already hold them (``compute._apply_profile``). With
        ``Workload.tp_comm_overlap`` only the part its forward and backward
        compute cannot hide (``pipeline.overlapped_exposure``)."""
        rate, latency = link
        if batch <= 0 or (rate == 0.0 and latency == 0.0):
            return np.zeros(self.num_layers)
        comm = self.tp_comm_bytes(recompute) * batch * rate + self.tp_collective_counts(recompute) * latency
        if times is not None and times.tp_comm_inside is not None:
            comm = np.where(times.tp_comm_inside, 0.0, comm)
        if self.workload.tp_comm_overlap and times is not None:
            # split under the layer's own matmuls (Megatron-LM --tp-comm-overlap, torchtitan async TP):
            # only what outlasts its compute, and the slowdown of sharing the GPU, stays exposed
            comm = np.asarray(overlapped_exposure(comm, times.fwd_s + times.bwd_s + times.recompute_s,
                                                  self.overlap_slowdown))
        return comm

    def supports_tp(self, tp: int) -> np.ndarray:
        """Per layer: ``LayerSpec.supports_tp`` (the one rule)."""
        found = self._supports.get(tp)
        if found is None:
            found = self._supports[tp] = np.array([layer.supports_tp(tp) for layer in self.model.layers])
        return found

    def all_support_tp(self, tp: int) -> bool:
        return bool(self.supports_tp(tp).all())

    # --- devices and links ---------------------------------------------------------------
    @property
    def cluster_arrays(self) -> ClusterArrays:
        """The cluster's per-device numbers as numpy arrays (built on first use)."""
        if self._cluster_arrays is None:
            self._cluster_arrays = ClusterArrays(self.cluster, self._capacity, self._overhead, self._host)
        return self._cluster_arrays

    def device_set(self, devices: Sequence[int]) -> int:
        """A number naming ``devices`` (in their order) in the kernel's caches.
        A tuple is found by its identity first: planners pass one stage's
        tuple again and again, and hashing a stage's thousands of ids at every
        lookup was much of the cost of ranking plans on 4,096 GPUs. (The entry
        keeps the tuple alive, so its id is not reused while it is there;
        other sequences may change, so they are looked up by value.)"""
        seen = self._sets_by_id.get(id(devices))
        if seen is not None and seen[0] is devices:
            return seen[1]
        number = self._sets.setdefault(tuple(devices), len(self._sets))
        if type(devices) is not tuple:
            return number
        if len(self._sets_by_id) >= RECENT_DEVICE_TUPLES:
            self._sets_by_id.clear()
        self._sets_by_id[id(devices)] = (devices, number)
        return number

    def device_array(self, devices: Sequence[int] | np.ndarray) -> np.ndarray:
        """``devices`` as a read-only numpy array (cached: converting thousands
        of ids at every use showed up on 16,384 GPUs)."""
        if isinstance(devices, np.ndarray):
            return devices
        number = self.device_set(devices)
        found = self._set_arrays.get(number)
        if found is None:
            found = np.asarray(devices, dtype=np.int64)
            found.flags.writeable = False
            self._set_arrays.put(number, found)
        return found

    def matmul_rate(self, gpu: GPUSpec) -> float:
        """``compute.matmul_rate`` of a GPU type, cached (it ranks GPUs by speed)."""
        found = self._matmul.get(gpu.name)
        if found is None:
            found = self._matmul[gpu.name] = matmul_rate(gpu, self.dtype_bytes)
        return found

    def slowest_gpu(self, devices: Sequence[int]) -> GPUSpec:
        """The GPU that sets the pace of a TP group (the lowest sustained matmul rate)."""
        key = tuple(devices)
        found = self._slowest.get(key)
        if found is None:
            gpus = (self.cluster.devices[d].gpu for d in key)
            found = self._slowest[key] = min(gpus, key=self.matmul_rate)
        return found

    def _type_rates(self, types: np.ndarray) -> np.ndarray:
        """``matmul_rate`` per GPU type index of ``cluster_arrays`` (those in
        ``types`` at least: a type the workload cannot run raises only once a
        stage uses it, as ``slowest_gpu`` does)."""
        if self._type_rate_array is not None:
            return self._type_rate_array
        gpus = self.cluster_arrays.gpus
        for index in np.unique(types).tolist():
            self.matmul_rate(gpus[index])
        rates = np.array([self._matmul.get(g.name, np.inf) for g in gpus])
        if all(g.name in self._matmul for g in gpus):
            self._type_rate_array = rates
        return rates

    def collective_rate(self, kind: str, group: Sequence[int], concurrent_groups: int = 1) -> float:
        """Seconds per byte of a collective (``COLLECTIVES``) over ``group``:
        computed once per group shape (``groups.ClusterArrays.shape``)."""
        key = (kind, tuple(group), concurrent_groups)
        found = self._rates.get(key)
        if found is None:
            found = self._rates[key] = self._shape_rate(kind, key[1], concurrent_groups)
        return found

    def _shape_rate(self, kind: str, group: tuple[int, ...], concurrent_groups: int,
                    shape: object = None) -> float:
        """``collective_rate`` for every group of ``group``'s shape."""
        if shape is None:
            shape = self.cluster_arrays.shape(group)
        key = ("shape", kind, shape, concurrent_groups)
        found = self._rates.get(key)
        if found is None:
            found = COLLECTIVES[kind](self.cluster, group, 1.0, concurrent_groups)
            if self.calibration is not None:
                found /= self.calibration.op_bandwidth(kind)
            self._rates[key] = found
        return found

    def collective_time(self, kind: str, group: Sequence[int], num_bytes: np.ndarray | float,
                        concurrent_groups: int = 1) -> np.ndarray | float:
        """A collective of ``num_bytes`` (elementwise on arrays)."""
        return self.collective_rate(kind, group, concurrent_groups) * num_bytes

    def dp_collective_rate(self, kind: str, devices: Sequence[int], tp: int) -> float:
        """The slowest of a stage's ``tp`` data-parallel groups (TP rank t's
        devices in every replica), all running at once."""
        if len(devices) // tp < 2:
            return 0.0
        return self._dp_rate(kind, tp, self.dp_groups(devices, tp))

    def dp_groups(self, devices: Sequence[int], tp: int, grid: np.ndarray | None = None) -> _DataParallelGroups:
        """The data-parallel groups of a stage up to symmetry (cached). When
        every TP group lies in one node, TP rank t's group sits on the same
        nodes for every t: all groups have one shape."""
        key = (self.device_set(devices), tp)
        found = self._dp_groups.get(key)
        if found is None:
            devices = tuple(devices)
            arrays = self.cluster_arrays
            if grid is None:
                grid = self.device_array(devices).reshape(-1, tp)
            rows = arrays.row_nodes(grid)
            if rows is not None:
                shape = arrays.nodes_shape(rows)
                found = _DataParallelGroups((devices[0::tp],), ((shape,), shape))
            else:
                ids, shapes = arrays.column_classes(grid)
                firsts = first_appearance(ids)[0].tolist()
                found = _DataParallelGroups(tuple(devices[t::tp] for t in firsts), (tuple(shapes), shapes[0]))
            self._dp_groups[key] = found
        return found

    def slowest_run_rate(self, kind: str, devices: Sequence[int], size: int) -> float:
        """Seconds per byte of a collective over the slowest run of ``size``
        consecutive devices (a TP group of that size), one run of each shape
        costed (cached)."""
        key = ("runs", kind, self.device_set(devices), size)
        found = self._rates.get(key)
        if found is None:
            grid = self.device_array(devices).reshape(-1, size)
            found = self._rates[key] = max(self.collective_rate(kind, tuple(grid[r].tolist()))
                                           for r in self.replica_classes(grid)[2])
        return found

    def _dp_rate(self, kind: str, tp: int, groups: _DataParallelGroups) -> float:
        """``dp_collective_rate`` for every stage whose groups have these shapes:
        latency and bandwidth of the slowest group, the groups of the ``tp``
        ranks sharing the nodes' NICs."""
        key = ("dp", kind, tp, groups.key)
        found = self._rates.get(key)
        if found is None:
            latency = max(collective_latency(self.cluster, g, kind) for g in groups.representatives)
            if self.calibration is not None:
                latency *= self.calibration.latency_scale * self.calibration.op_latency(kind)
            latency_per_byte = latency / self.message_bytes(kind, tp)
            share = tp * self._nic_sharers(kind, groups.representatives[0])
            found = self._rates[key] = max(self._shape_rate(kind, g, share, shape) for g, shape
                                           in zip(groups.representatives, groups.key[0])) + latency_per_byte
        return found

    def _nic_sharers(self, kind: str, group: Sequence[int]) -> int:
        """How many of ``group``'s GPUs on one node push their own copy of a
        sharded collective through that node's NICs: 1 for a topology-aware
        ring, the group's GPUs per node for DeepSpeed's per-GPU traffic
        (``ZERO_IMPLEMENTATIONS``). All-reduce of gradient buckets is a
        topology-aware NCCL ring in every framework."""
        if kind == "allreduce" or self.workload.zero_implementation != "deepspeed":
            return 1
        by_node = self.cluster.nodes_of(group)
        if self.cluster.bandwidth_matrix_gbps is not None or len(by_node) < 2:
            return 1
        return max(len(members) for members in by_node.values())

    def message_bytes(self, kind: str, tp: int) -> float:
        """Bytes of one data-parallel collective: a gradient bucket for an
        all-reduce, one layer's parameters (per TP rank) for the per-layer
        gathers and reduce-scatters of sharded data parallelism. Latency is
        charged per message, so a collective of G bytes costs G/message of them."""
        if kind == "allreduce":
            return float(ALLREDUCE_BUCKET_BYTES)
        found = self._messages.get((kind, tp))
        if found is None:
            per_layer = self.params_per_device(tp)
            typical = float(np.median(per_layer[per_layer > 0])) if np.any(per_layer > 0) else 1.0
            found = self._messages[(kind, tp)] = typical * (self.weight_bytes if kind == "allgather"
                                                            else self.grad_bytes)
        return found

    def p2p_rate(self, sender: Sequence[int], receiver: Sequence[int]) -> float:
        """Seconds per byte of one pipeline transfer between two device groups."""
        key = ("p2p", self.device_set(sender), self.device_set(receiver))
        found = self._rates.get(key)
        if found is None:
            arrays = self.cluster_arrays
            found = self._rates[key] = p2p_time(self.cluster, sender, receiver, 1.0) if arrays.matrix else \
                arrays.p2p_seconds_per_byte(sender, receiver)
        return found

    def p2p_time(self, sender: Sequence[int], receiver: Sequence[int], last_layer: int,
                 micro_batch_size: float) -> float:
        """One-way transfer of one micro-batch's output of ``last_layer``."""
        return self.p2p_rate(sender, receiver) * float(self.arrays.output_bytes[last_layer]) * micro_batch_size

    def optimizer_rate(self, devices: Sequence[int] | np.ndarray) -> float:
        """Seconds per parameter of the (memory-bound) optimizer step on the
        stage's GPU with the least memory bandwidth."""
        array = self.device_array(devices)
        bandwidth = float(self.cluster_arrays.memory_bandwidth[array].min())
        rate = self.optimizer_step_bytes / (bandwidth * MEMORY_BANDWIDTH_EFFICIENCY)
        if self.calibration is not None:  # the factor of the stage's slowest calibrated GPU type
            gpus = self.cluster_arrays.gpus
            rate *= max(self.calibration.compute(gpus[i].name) for i in np.unique(self.cluster_arrays.gpu[array]))
        return rate

    def capacity_bytes(self, device: int) -> int:
        return self._capacity[device]

    def overhead_bytes(self, device: int) -> int:
        return self._overhead[device]

    def host_capacity_bytes(self, device: int) -> float:
        """Offloaded-activation bytes the device's share of host memory holds
        (``memory.host_offload_capacity_bytes``; inf for a CPU "device")."""
        return self._host[device]

    # --- stages -------------------------------------------------------------------------
    def stage(self, option: StageOption) -> StageCosts:
        """The StageCosts of ``option`` (cached). Options whose stage placements have one
        signature (symmetric device groups) share one StageCosts."""
        check_option(option)
        layout = self.layout(option.devices, option.dp, option.tp, option.split, option.cp, option.ep,
                             option.ep_split)
        key = (layout.index, option.zero, option.recompute, option.sequence_parallel, option.offload)
        found = self._stages.get(key)
        if found is None:
            found = self._stages.put(key, StageCosts(self, option, key))
        return found

    def time_class(self, gpu: GPUSpec, share: int, tp: int, recompute: str, sequence_parallel: bool,
                   tp_link: tuple[float, float], offload: bool = False,
                   parallel: tuple[Any, ...] = (), expert: tuple[float, float] | None = None) -> _TimeClass:
        """Prefix sums of forward, backward, recompute and TP-comm time of a
        replica (its slowest GPU, its share of a micro-batch, its TP link), cached.
        With ``offload`` the recompute time also holds the exposed host transfers
        (``offload_exposed_time``): both are what a memory saving costs.
        ``parallel`` (``_StagePlacement.parallel``): each of the replica's ``cp`` ranks
        runs 1/cp of its tokens, and its CP/EP communication joins the TP
        communication (``cp_ep_comm_time``). ``expert``: (expert work, expert
        tokens) of the rank over what its own tokens give (``row_experts``;
        None: an even split, the busiest rank's)."""
        key = (gpu.name, share, tp, recompute, sequence_parallel, tp_link, offload, parallel, expert)
        found = self._time_classes.get(key)
        if found is None:
            cp, ep = (int(parallel[0]), int(parallel[1])) if parallel else (1, 1)
            batch = share / cp
            load, tokens = expert if expert is not None else self.even_experts(ep)
            t = self.layer_times(gpu, batch, tp, recompute, sequence_parallel, load, cp, tokens)
            tpc = self.tp_comm_time(recompute, batch, tp_link, t)
            if parallel:
                work = self.unit_work(gpu, tp, sequence_parallel, load, cp, tokens)
                attention = (work.attention_s + work.attention_backward_s) * batch
                tpc = tpc + self.cp_ep_comm_time(recompute, share, tp, parallel, attention, max(1.0, load))
            off = self.offload_exposed_time(gpu, batch, tp, recompute, sequence_parallel) if offload \
                else np.zeros_like(t.recompute_s)
            fwd, bwd, rec_sum, tpc_sum = (_prefix(x) for x in (t.fwd_s, t.bwd_s, t.recompute_s + off, tpc))
            total = fwd + bwd + rec_sum + tpc_sum
            found = self._time_classes[key] = _TimeClass(fwd, bwd, rec_sum, tpc_sum, total=total,
                                                         total_list=total.tolist(), off=_prefix(off))
        return found

    def activation_prefix(self, tp: int, recompute: str, sequence_parallel: bool, cp: int = 1) -> np.ndarray:
        return self._cached(("actprefix", tp, recompute, sequence_parallel, cp),
                            lambda: _prefix(self.rank_activation_bytes(tp, recompute, sequence_parallel, cp)))

    def layout(self, devices: tuple[int, ...], dp: int, tp: int, split: tuple[int, ...], cp: int = 1,
               ep: int = 1, ep_split: tuple[int, ...] | None = None) -> _StagePlacement:
        """The replica and memory classes and rates of a stage (cached)."""
        key = (self.device_set(devices), dp, tp, split, cp, ep, ep_split)
        found = self._layouts.get(key)
        if found is None:
            found = self._layouts[key] = self._symmetric_layout(devices, dp, tp, split, cp, ep, ep_split)
        return found

    def _symmetric_layout(self, devices: tuple[int, ...], dp: int, tp: int, split: tuple[int, ...], cp: int = 1,
                          ep: int = 1, ep_split: tuple[int, ...] | None = None) -> _StagePlacement:
        """The layout of a run of consecutive GPUs is that of every run like it
        (``groups.ClusterArrays.range_class``): the stages of a uniform plan on
        identical nodes share one, built once."""
        run = self.cluster_arrays.range_class(self.device_array(devices))
        if run is None:
            return self._build_layout(devices, dp, tp, split, cp, ep, ep_split)
        key = (run, dp, tp, split, cp, ep, ep_split)
        found = self._layouts.get(key)
        if found is None:
            found = self._layouts[key] = self._build_layout(devices, dp, tp, split, cp, ep, ep_split)
        return found

    def _build_layout(self, devices: tuple[int, ...], dp: int, tp: int, split: tuple[int, ...], cp: int = 1,
                      ep: int = 1, ep_split: tuple[int, ...] | None = None) -> _StagePlacement:
        """Replica and memory classes, numbered in order of first appearance,
        from the stage's ``(dp·cp, tp)`` device grid (a row per TP group: the
        ``cp`` rows of a replica share its samples) without a loop over devices."""
        arrays = self.cluster_arrays
        grid = self.device_array(devices).reshape(dp * cp, tp)
        shares = np.repeat(np.asarray(split, dtype=np.int64), cp)
        gpu, link, link_rates = self._replica_kinds(grid)
        work, tokens, held = self.row_experts(shares / cp, ep, ep_split)
        expert_kind = first_appearance(np.stack([work, tokens], axis=1))[1]
        times: dict[tuple[object, ...], tuple[GPUSpec, int, tuple[float, float], tuple[float, float]]] = {}
        code = ((gpu * len(link_rates) + link) * (int(shares.max()) + 1) + shares) * (int(expert_kind.max()) + 1) \
            + expert_kind
        for r in first_appearance(code)[0].tolist():
            g, share, rate = arrays.gpus[gpu[r]], int(shares[r]), link_rates[link[r]]
            expert = (float(work[r]), float(tokens[r]))
            times.setdefault((g.name, share, rate, expert), (g, share, rate, expert))
        kinds = arrays.memory_kind[grid.reshape(-1)]
        held_kind = np.repeat(first_appearance(held)[1], tp)
        firsts, device_class = first_appearance((np.repeat(shares, tp) * len(arrays.memory_kinds) + kinds)
                                                * (int(held_kind.max()) + 1) + held_kind)
        kind_of = arrays.memory_kinds
        memory = tuple(_MemoryClass(int(shares[i // tp]), kind_of[kinds[i]][0], kind_of[kinds[i]][1], float(held[i // tp]),
                                    kind_of[kinds[i]][2])
                       for i in firsts.tolist())
        optimizer = self.optimizer_rate(grid.reshape(-1))
        groups = self.dp_groups(devices, tp, grid) if dp * cp > 1 else None
        parallel = (cp, ep, *self.cp_ep_links(grid, cp, ep)) if cp > 1 or ep > 1 else ()
        experts = self._expert_dp_groups(grid, ep) if ep > 1 and dp * cp > ep else None
        measured = self.measured_dp(grid, tp, dp * cp) if groups is not None and ep == 1 else {}
        signature = (dp, tp, tuple(times), memory, device_class.tobytes(), groups and groups.key, optimizer,
                     parallel, experts and experts.key, tuple(sorted(measured.items())))
        return _StagePlacement(tuple(times.values()), memory, device_class,
                       lambda kind: self._dp_rate(kind, tp, groups) if groups else 0.0, optimizer, signature,
                       self._signatures.setdefault(signature, len(self._signatures)), cp, ep, parallel,
                       lambda kind: self._dp_rate(kind, tp * ep, experts) if experts else 0.0, float(held.max()),
                       measured)

    @functools.cached_property
    def core_sharing(self) -> tuple[int, int] | None:
        """(cores, processes the profile timed at once) when a profile of this
        CPU cluster was measured with its processes sharing fewer cores than
        they are (``cost/shared_cores.py``); None otherwise."""
        machine = getattr(self.workload.profile, "machine", None) or {}
        cores, processes = machine.get("cores"), machine.get("processes")
        if not cores or not processes or any(d.gpu.catalog_name != "CPU" for d in self.cluster.devices):
            return None
        return (int(cores), int(processes)) if cores < self.cluster.num_devices else None

    def measured_dp(self, grid: np.ndarray, tp: int, ranks: int) -> dict[int, tuple[float, float]]:
        """ZeRO stage -> (fwd, bwd) seconds per parameter that the runtime's
        data-parallel wrapper adds over groups of ``ranks`` processes at TP degree ``tp``, from a
        profile that measured it on every GPU type of the stage (the slowest
        type's), for the stages it measured (``ProfileDB.data_parallel_rate``)."""
        rate_of = getattr(self.workload.profile, "data_parallel_rate", None)
        if rate_of is None:
            return {}
        names = sorted({self.cluster.devices[int(d)].gpu.name for d in grid.reshape(-1).tolist()})
        found = {}
        for zero in DATA_PARALLEL_ZERO:
            rates = [rate_of(name, tp, ranks, zero) for name in names]
            if all(r is not None for r in rates):
                found[zero] = (max(r[0] for r in rates), max(r[1] for r in rates))
        return found

    def even_experts(self, ep: int) -> tuple[float, float]:
        """(expert work, expert tokens) of the busiest rank of an even EP split
        (``row_experts``): the imbalance, and ep · imbalance tokens per expert."""
        if ep <= 1:
            return 1.0, 1.0
        load = self.workload.expert_imbalance
        return load, load * ep

    def row_experts(self, tokens: np.ndarray, ep: int,
                    ep_split: tuple[int, ...] | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per row of a stage's ``(dp·cp, tp)`` grid with ``tokens`` samples of
        a micro-batch each: (routed-expert work, tokens per expert) over what
        its own tokens would give without EP, and routed experts held over an
        even 1/ep share. EP rank ``i % ep`` of the group of ``ep`` consecutive
        rows holds ``ep_split[i % ep]`` of the E experts (E/ep each when
        None); with routing spread evenly over experts, each expert gets E⁻¹
        of the group's tokens' copies, times the imbalance (the busiest rank),
        so the rank runs its share of the group's work."""
        rows = len(tokens)
        if ep <= 1:
            ones = np.ones(rows)
            return ones, ones, ones
        even = ep_split is None or len(set(ep_split)) == 1
        if even and bool((tokens == tokens[0]).all()):
            load, per_expert = self.even_experts(ep)
            return np.full(rows, load), np.full(rows, per_expert), np.ones(rows)
        share = np.full(ep, 1.0 / ep) if even or ep_split is None else np.asarray(ep_split, dtype=float) / sum(ep_split)
        held = np.tile(share * ep, rows // ep)
        group = np.repeat(tokens.reshape(-1, ep).sum(axis=1), ep)
        load = self.workload.expert_imbalance
        own = np.where(tokens > 0, tokens, 1.0)  # a rank with no samples still runs its experts' tokens
        fraction = np.tile(share, rows // ep)
        return load * group * fraction / own, load * group / own, held

    # --- context and expert parallelism (cost/cp_ep.py) ------------------------------------
    def cp_ep_links(self, grid: np.ndarray, cp: int, ep: int) -> tuple[tuple[float, float], tuple[float, float]]:
        """((s/byte, latency) of a K/V all-gather on the slowest CP group,
        (s/byte, latency) of an all-to-all on the slowest EP group) of a
        stage's ``(dp·cp, tp)`` grid. The ``tp`` groups of each kind run at
        once (one per TP rank), sharing the nodes' NICs."""
        tp = grid.shape[1]
        cp_link = ep_link = (0.0, 0.0)
        if cp > 1:
            blocks = grid.reshape(-1, cp, tp)  # replica, CP rank, TP rank
            groups = {tuple(blocks[r, :, t].tolist()) for r in range(blocks.shape[0]) for t in range(tp)}
            cp_link = self._slowest_link("allgather", sorted(groups), tp)
        if ep > 1:
            groups = {tuple(row.tolist()) for t in range(tp) for row in expert_groups(grid[:, t], ep)[0]}
            ep_link = self._slowest_link("alltoall", sorted(groups), tp)
        return cp_link, ep_link

    def _slowest_link(self, kind: str, groups: list[tuple[int, ...]], concurrent: int) -> tuple[float, float]:
        """(s/byte, latency) of ``kind`` on the slowest of ``groups``, ``concurrent`` of which share NICs.
        An all-to-all pays one ring all-gather's latency (n−1 peer steps)."""
        shapes: dict[object, tuple[int, ...]] = {}
        for group in groups:
            shapes.setdefault(self.cluster_arrays.shape(group), group)
        rate = max(self._shape_rate(kind, g, concurrent, shape) for shape, g in shapes.items())
        latency = max(collective_latency(self.cluster, g, "allgather" if kind == "alltoall" else kind)
                      for g in shapes.values())
        if self.calibration is not None:
            latency *= self.calibration.latency_scale * self.calibration.op_latency(kind)
        return rate, latency

    def _expert_dp_groups(self, grid: np.ndarray, ep: int) -> _DataParallelGroups:
        """The expert-data-parallel groups of a stage up to symmetry: per TP
        rank, the dp·cp/ep devices holding the same experts (``cp_ep.expert_groups``)."""
        return self._groups_by_shape([tuple(row.tolist()) for t in range(grid.shape[1])
                                      for row in expert_groups(grid[:, t], ep)[1]])

    def _groups_by_shape(self, groups: Sequence[tuple[int, ...]]) -> _DataParallelGroups:
        """Explicit data-parallel groups up to symmetry: the first group of each shape."""
        shapes = [self.cluster_arrays.shape(g) for g in groups]
        firsts: dict[object, tuple[int, ...]] = {}
        for shape, group in zip(shapes, groups):
            firsts.setdefault(shape, group)
        return _DataParallelGroups(tuple(firsts.values()), (tuple(firsts), shapes[0]))

    def holder_groups_rate(self, kind: str, groups: Sequence[tuple[int, ...]], tp: int) -> float:
        """``dp_collective_rate`` over explicit groups, ``tp`` of them at once: the
        shard-chunk holders of a stage whose replicas run their own TP degree
        (``Stage.shard_holders``). 0 for groups of one device."""
        if len(groups[0]) < 2:
            return 0.0
        return self._dp_rate(kind, tp, self._groups_by_shape(groups))

    def cp_ep_comm_time(self, recompute: str, share: float, tp: int, parallel: tuple[Any, ...],
                        attention_s: np.ndarray, send_scale: float | None = None) -> np.ndarray:
        """Per layer: a CP/EP rank's K/V exchanges and all-to-alls for a
        replica's ``share`` samples over one micro-batch's passes
        (``cp_ep``): the exposed part of the K/V all-gathers of the whole
        samples' K/V (per TP rank), and the all-to-alls of the rank's 1/cp of
        the tokens, scaled by ``send_scale``: the larger of what the rank
        sends (its own tokens' copies) and receives (its experts' tokens, the
        expert work of ``row_experts``) over its own; None: the expert load
        imbalance of an even split."""
        if not parallel or share <= 0:
            return np.zeros(self.num_layers)
        cp, ep, (cp_rate, cp_latency), (ep_rate, ep_latency) = parallel
        a = self.arrays
        out = np.zeros(self.num_layers)
        if cp > 1:
            kv = a.column("kv_bytes")
            gathered = cp_gather_bytes(kv, cp, a.column("attention_window"), a.seq_len) / tp
            comm = CP_KV_PASSES[recompute] * (gathered * share * cp_rate + np.where(kv > 0, cp_latency, 0.0))
            out += cp_exposed_time(comm, attention_s, CP_KV_METHOD, self.overlap_slowdown)
        if ep > 1:
            dispatch = a.column("dispatch_bytes")
            scale = self.workload.expert_imbalance if send_scale is None else send_scale
            buffer = dispatch * (share / cp) / tp * scale  # send buffer of the busiest rank
            out += EP_ALLTOALL_PASSES[recompute] * (buffer * ep_rate + np.where(dispatch > 0, ep_latency, 0.0))
        return out

    def _replica_kinds(self, grid: np.ndarray) -> tuple[np.ndarray, np.ndarray, list[tuple[float, float]]]:
        """Per replica (row of the grid): its slowest GPU, the index of its TP
        link, and those links (``tp_link``)."""
        gpu, link, representatives = self.replica_classes(grid)
        if grid.shape[1] == 1:
            return gpu, link, [(0.0, 0.0)]
        return gpu, link, [self.tp_link(tuple(grid[r].tolist())) for r in representatives]

    def replica_classes(self, grid: np.ndarray) -> tuple[np.ndarray, np.ndarray, list[int]]:
        """The TP groups (rows) of a stage's ``(dp, tp)`` device grid up to
        symmetry: per row, its slowest GPU (index into ``cluster_arrays.gpus``;
        the first of the slowest, as ``slowest_gpu``) and its link class (rows
        of one class have one group shape, so any collective over them costs
        the same), and a representative row of each link class."""
        arrays = self.cluster_arrays
        dp, tp = grid.shape
        types = arrays.gpu[grid]
        if len(arrays.gpus) == 1:
            gpu = types[:, 0]
        else:
            gpu = types[np.arange(dp), self._type_rates(types)[types].argmin(axis=1)]
        if tp == 1:
            return gpu, np.zeros(dp, dtype=np.int64), [0]
        nodes = arrays.row_nodes(grid)
        if nodes is not None:  # every TP group in one node: that node's links are its shape
            firsts, link = first_appearance(arrays.node_links[nodes])
            return gpu, link, firsts.tolist()
        link = arrays.column_classes(grid.T)[0]
        return gpu, link, first_appearance(link)[0].tolist()

    def held_params(self, tp: int, a: int, b: int, ep: int = 1) -> float:
        """Parameters one device of a stage running layers [a, b) holds: a tied
        weight counted once when several layers of its group are on the stage;
        1/ep of the routed experts."""
        prefix = self._params_prefix.get((tp, ep))
        if prefix is None:
            prefix = self._params_prefix[(tp, ep)] = _prefix(self.params_per_device(tp, ep)).tolist()
        total = prefix[b] - prefix[a]
        for index, previous, share in self._tied_corrections(tp):
            if a <= previous and index < b:
                total -= share
        return total

    def expert_held(self, tp: int, ep: int, a: int, b: int) -> float:
        """Routed-expert parameters one device of a stage running layers [a, b) holds (part of ``held_params``)."""
        prefix = self._cached(("expertprefix", tp, ep), lambda: _prefix(self.expert_params_per_device(tp, ep)))
        return float(prefix[b] - prefix[a])

    def expert_held_matrix(self, tp: int, ep: int) -> RangeSum:
        """``expert_held`` for every ``[a, b)`` (a range table: ``cost/ranges.py``)."""
        return self._ranges(("expertheld", tp, ep), lambda: RangeSum(_prefix(self.expert_params_per_device(tp, ep))))

    def held_params_matrix(self, tp: int, ep: int = 1) -> RangeSum:
        """``held_params`` for every ``[a, b)`` (a range table: ``cost/ranges.py``)."""
        return self._ranges(("held", tp, ep), lambda: RangeSum(_prefix(self.params_per_device(tp, ep)),
                                                               self._tied_corrections(tp)))

    def tied_pairs(self) -> list[tuple[int, int, float]]:
        """(layer, its nearest earlier tied layer, the tied parameters) of every tied copy."""
        return self._tied_corrections(1)

    def _tied_corrections(self, tp: int) -> list[tuple[int, int, float]]:
        """(layer, its nearest earlier tied layer, the tied share per device) of every tied copy."""
        found = self._corrections.get(tp)
        if found is None:
            share = self.tied_share(tp)
            previous = self.arrays.tied_previous
            found = self._corrections[tp] = [(int(i), int(previous[i]), float(share[i]))
                                             for i in np.nonzero(previous >= 0)[0]]
        return found

    def recompute_peak_matrix(self, tp: int, recompute: str, sequence_parallel: bool, cp: int = 1) -> RangeMax:
        """``[a, b]``: per sample, what the backward working sets of a stage of
        layers ``[a, b)`` add to one micro-batch's stored activations
        (``memory.working_beyond_stored`` over the range, from the prefix sums
        ``P``: ``max_{a≤i<b} (P[i+1] + working_i) − P[b]``)."""

        def build() -> RangeMax:
            prefix = self.activation_prefix(tp, recompute, sequence_parallel, cp)
            return RangeMax(prefix[1:] + self.backward_working_bytes(tp, recompute, sequence_parallel, cp), prefix)

        return self._ranges(("recpeak", tp, recompute, sequence_parallel, cp), build)

    def range_max_matrix(self, values: np.ndarray, key: tuple[object, ...]) -> RangeMax:
        """``[a, b]``: the largest of ``values[a:b]`` (0 where empty), cached under ``key``."""
        return self._ranges(("rangemax",) + key, lambda: RangeMax(values))

    def _ranges(self, key: tuple[object, ...], build: Callable[[], R]) -> R:
        """A range table, built once per workload."""
        found = self._range_tables.get(key)
        if found is None:
            found = self._range_tables[key] = build()
        return cast(R, found)  # one cache for both kinds of table, keyed apart


def _prefix(values: np.ndarray) -> np.ndarray:
    out = np.empty(len(values) + 1)
    out[0] = 0.0
    np.cumsum(values, out=out[1:])
    return out

