"""Compute time of every layer on one GPU: a measured profile where there is
one, else a roofline over FLOPs and memory traffic with a per-kernel overhead.

time = matmul FLOPs / (peak · matmul efficiency(GPU, matrix shape))
     + attention FLOPs run / (peak · attention efficiency(GPU, sequence length))
     + elementwise bytes / (memory bandwidth · MEMORY_BANDWIDTH_EFFICIENCY)
     + kernels · KERNEL_LAUNCH_S

The launch term is what makes small micro-batches and narrow layers (AMP's
TransGAN layers of width 16) cost more than their FLOPs say (AMP §3.4).
Everything here works on whole layer vectors (``LayerArrays``) at once.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hetplan.cluster.catalog import GPUSpec
from hetplan.cost.constants import (
    ATTENTION_BACKWARD_RATIO,
    ATTENTION_CORE_KERNELS,
    ATTENTION_CORE_PASSES,
    ATTENTION_HALF_SEQ,
    ATTENTION_KERNEL_EFFICIENCY,
    ATTENTION_TO_GEMM_DEFAULT,
    BACKWARD_FLOPS_RATIO,
    CAUSAL_EXECUTED_FRACTION,
    CP_CAUSAL_ZIGZAG,
    DEFAULT_ATTENTION_KERNEL,
    DEFAULT_SUSTAINED_MATMUL_FRACTION,
    ELEMENTWISE_BACKWARD_RATIO,
    ELEMENTWISE_KERNELS_PER_GEMM,
    FP8_MATMUL_RELATIVE_EFFICIENCY,
    GEMM_EFFICIENCY,
    GEMM_HALF_DIM,
    HOST_OP_S,
    KERNEL_LAUNCH_S,
    MEMORY_BANDWIDTH_EFFICIENCY,
    SUSTAINED_MATMUL_FRACTION,
)
from hetplan.cost.cp_ep import cp_attention_scale
from hetplan.cost.layers import LayerArrays
from hetplan.errors import HetplanError
from hetplan.profile.db import ProfileDB


@dataclass(frozen=True)
class LayerTimes:
    """Seconds per layer (arrays over the model's layers) for one pass over a
    replica's share of a micro-batch; communication not included."""

    fwd_s: np.ndarray
    bwd_s: np.ndarray
    recompute_s: np.ndarray  # extra forward work done during backward
    tp_comm_inside: np.ndarray | None = None  # per layer: its measured times hold its TP collectives

    @property
    def back_s(self) -> np.ndarray:
        """Backward plus recomputation: what runs in the backward pass."""
        return self.bwd_s + self.recompute_s


def gemm_efficiency(gpu: GPUSpec, gemm_dim: np.ndarray, tp: int) -> np.ndarray:
    """Fraction of ``gpu``'s peak its matmuls reach, per layer.

    The best-shape rate is the GPU's measured one (``matmul_efficiency``, from
    a max-achievable-matmul benchmark) or GEMM_EFFICIENCY. Smaller matrices
    run further below it (tile and wave quantisation, less reuse per byte:
    NVIDIA "Matrix Multiplication Background" guide §2-4): the per-rank
    weight side ``d`` (the layer's typical weight-matrix side divided among
    ``tp`` ranks) costs a factor ``d / (d + half)``. The token side (thousands
    of tokens per micro-batch in training) is large enough not to matter.
    """
    best = _sustained_matmul_efficiency(gpu)
    dim = gemm_dim / np.sqrt(tp)
    shape = np.divide(dim, dim + GEMM_HALF_DIM, out=np.ones_like(dim, dtype=float), where=gemm_dim > 0)
    return best * shape  # a layer whose weight shape is unknown (0) gets no shape penalty


def _sustained_matmul_efficiency(gpu: GPUSpec) -> float:
    """Best-shape matmul rate through a training run, as a fraction of peak
    (constants: SUSTAINED_MATMUL_FRACTION and its default)."""
    best = gpu.matmul_efficiency or GEMM_EFFICIENCY
    if gpu.catalog_name in SUSTAINED_MATMUL_FRACTION:
        return best * SUSTAINED_MATMUL_FRACTION[gpu.catalog_name]
    return best * DEFAULT_SUSTAINED_MATMUL_FRACTION if gpu.matmul_efficiency else best


def _gemm_peak(gpu: GPUSpec, dtype_bytes: int, fp8: bool) -> float:
    """The peak a layer's matmuls run against: FP8's (scaled by how much less
    of it FP8 GEMMs reach) or the training precision's."""
    if not fp8:
        return gpu.peak_flops_for(dtype_bytes)
    if gpu.peak_flops_fp8 <= 0:
        raise HetplanError(f"GPU type {gpu.name!r} has no FP8 tensor cores; train without --fp8 "
                           "(or give peak_tflops_fp8 in the cluster file's gpu_types)")
    return gpu.peak_flops_fp8 * FP8_MATMUL_RELATIVE_EFFICIENCY


def matmul_rate(gpu: GPUSpec, dtype_bytes: int) -> float:
    """FLOP/s ``gpu`` sustains on large matmuls: what ranks GPUs by speed."""
    return gpu.peak_flops_for(dtype_bytes) * float(gemm_efficiency(gpu, np.array([0.0]), 1)[0])


def attention_efficiency(gpu: GPUSpec, seq_len: int, kernel: str = DEFAULT_ATTENTION_KERNEL) -> float:
    """Fraction of peak the fused attention ``kernel`` (``ATTENTION_KERNELS``)
    reaches at ``seq_len`` tokens: its long-sequence rate on the GPU times
    ``s / (s + half)`` (short sequences give each thread block little work:
    Dao 2023, Fig. 4-6). A GPU without a kernel benchmark: its matmul rate's
    ``ATTENTION_TO_GEMM_DEFAULT``, times the kernel's mean ratio to
    FlashAttention-2 where both were measured."""
    table, flash2 = ATTENTION_KERNEL_EFFICIENCY[kernel], ATTENTION_KERNEL_EFFICIENCY["flash2"]
    best = table.get(gpu.catalog_name)
    if best is None:
        ratio = float(np.mean([table[g] / flash2[g] for g in table if g in flash2]))
        best = (gpu.matmul_efficiency or GEMM_EFFICIENCY) * ATTENTION_TO_GEMM_DEFAULT * ratio
    return best * seq_len / (seq_len + ATTENTION_HALF_SEQ) if seq_len > 0 else best


@dataclass(frozen=True)
class Work:
    """One pass's work per layer for one GPU: matmul and attention FLOPs at
    their own efficiencies, memory-bound bytes, kernel launches."""

    gemm_s: np.ndarray
    attention_s: np.ndarray
    attention_backward_s: np.ndarray
    memory_s: np.ndarray
    launch_s: np.ndarray
    # routed experts' matmuls at a long token side (``expert_time`` applies
    # their own), and the tokens each expert of the rank gets per sample
    expert_s: np.ndarray | None = None
    expert_tokens: np.ndarray | None = None
    # the training code's per-micro-batch costs (``RunOverhead``): none for a ModelSpec's accounting
    run: RunOverhead | None = None

    def expert_time(self) -> np.ndarray:
        """The routed experts' matmuls at the efficiency of their token side."""
        if self.expert_s is None or self.expert_tokens is None:
            return np.zeros_like(self.gemm_s)
        return self.expert_s / expert_token_efficiency(self.expert_tokens)

    def device_forward(self) -> np.ndarray:
        """The forward's kernels on the GPU, without the training code's per-micro-batch costs."""
        return self.gemm_s + self.expert_time() + self.attention_s + self.memory_s + self.launch_s

    def forward(self) -> np.ndarray:
        device = self.device_forward()
        return device if self.run is None else self.run.forward(device)

    def scaled(self, batch: float) -> Work:
        """The same layers for ``batch`` samples: everything but the launches
        grows with the batch (this is one sample's work), and so do the
        tokens each expert's matmuls get."""
        experts = (self.expert_s * batch, self.expert_tokens * batch) \
            if self.expert_s is not None and self.expert_tokens is not None else (None, None)
        return Work(self.gemm_s * batch, self.attention_s * batch, self.attention_backward_s * batch,
                    self.memory_s * batch, self.launch_s, expert_s=experts[0], expert_tokens=experts[1], run=self.run)

    def device_backward(self) -> np.ndarray:
        """Twice the forward matmuls (input and weight gradients), the attention
        core's backward, the elementwise kernels' backward traffic and twice the launches."""
        return (BACKWARD_FLOPS_RATIO * (self.gemm_s + self.expert_time() + self.launch_s)
                + ELEMENTWISE_BACKWARD_RATIO * self.memory_s + self.attention_backward_s)

    def backward(self) -> np.ndarray:
        """``device_backward``, and the training code's per-micro-batch costs where it has them."""
        device = self.device_backward()
        return device if self.run is None else self.run.backward(device)

    def device_recompute(self) -> np.ndarray:
        """The kernels full recomputation reruns: the whole forward, or where the
        training code is known (``RunOverhead``) its share of the matmuls and of
        the elementwise traffic, the attention core and the experts whole."""
        if self.run is None:
            return self.device_forward()
        return (self.gemm_s * self.run.recompute_gemm_share + self.expert_time() + self.attention_s
                + self.memory_s * self.run.recompute_traffic_share + self.launch_s)

    def recompute(self) -> np.ndarray:
        """``device_recompute``, and the training code's per-micro-batch costs where it has them."""
        device = self.device_recompute()
        return device if self.run is None else self.run.recompute(device)


@dataclass(frozen=True)
class RunOverhead:
    """What the training code pays per micro-batch, whatever its size, per
    layer (``hetplan.model.runtime_time``): the device time of its weight casts
    and gradient accumulation, and the host time of dispatching its operators
    one by one (eager PyTorch: ``HOST_OP_S`` each). The GPU runs a pass no
    faster than the host issues it: a pass takes the larger of the two."""

    weight_fwd_s: np.ndarray
    weight_bwd_s: np.ndarray
    host_fwd_s: np.ndarray
    host_bwd_s: np.ndarray
    # full recomputation (``runtime_time`` module docstring): the share of the matmuls and of the
    # elementwise traffic it reruns, and the host time of the operators it adds to the backward
    recompute_gemm_share: np.ndarray
    recompute_traffic_share: np.ndarray
    host_recompute_s: np.ndarray

    def forward(self, device: np.ndarray) -> np.ndarray:
        return np.maximum(device + self.weight_fwd_s, self.host_fwd_s)

    def recompute(self, device: np.ndarray) -> np.ndarray:
        """A recompute recasts every weight (each cast runs before the matmul that saves it)."""
        return np.maximum(device + self.weight_fwd_s, self.host_recompute_s)

    def backward(self, device: np.ndarray) -> np.ndarray:
        return np.maximum(device + self.weight_bwd_s, self.host_bwd_s)

    def host_excess(self, device_fwd: np.ndarray, device_bwd: np.ndarray) -> np.ndarray:
        """Per layer, the time a pass waits for the host beyond its device time."""
        return (np.maximum(self.host_fwd_s - device_fwd - self.weight_fwd_s, 0.0)
                + np.maximum(self.host_bwd_s - device_bwd - self.weight_bwd_s, 0.0))


def run_detail(arrays: LayerArrays, unit: Work, gpu: GPUSpec, batch: float) -> tuple[np.ndarray, np.ndarray]:
    """Per layer, two parts of a micro-batch's forward plus backward of
    ``batch`` samples (``unit``: the cached ``per_sample_work``): the time its
    passes wait for the host beyond their device time, and the loss's fp32
    passes over the logits (forward and ``ELEMENTWISE_BACKWARD_RATIO`` times
    that backward). Zeros where the arrays carry no run columns."""
    zero = np.zeros(arrays.num_layers)
    if unit.run is None:
        return zero, zero
    work = unit.scaled(batch)
    loss_forward, loss_backward = loss_time(arrays, work)
    return unit.run.host_excess(work.device_forward(), work.device_backward()), loss_forward + loss_backward


def loss_time(arrays: LayerArrays, work: Work) -> tuple[np.ndarray, np.ndarray]:
    """Per layer, forward and backward seconds of the loss's fp32 passes over the
    logits in ``work`` (a micro-batch's): its share of the elementwise traffic,
    ``ELEMENTWISE_BACKWARD_RATIO`` times that backward; zeros without run columns."""
    traffic = arrays.fwd_mem_bytes
    share = np.divide(arrays.column("loss_traffic_bytes"), traffic, out=np.zeros_like(traffic), where=traffic > 0)
    forward = work.memory_s * share
    return forward, ELEMENTWISE_BACKWARD_RATIO * forward


def run_overhead(arrays: LayerArrays, gpu: GPUSpec, tp: int, host_op_s: float = HOST_OP_S) -> RunOverhead | None:
    """The training code's per-micro-batch costs on one GPU of a TP group of
    ``tp`` (TP divides the weights each rank casts; every rank dispatches every
    operator, ``host_op_s`` each: a profile's measured value or the default; a compiled graph's
    kernels at their launch cost, ``host_seconds``); None where ``arrays`` carry no run columns
    (``runtime_time_arrays``)."""
    if arrays.host_ops_fwd is None or arrays.host_ops_bwd is None:
        return None
    bandwidth = gpu.memory_bandwidth_bytes_per_s * MEMORY_BANDWIDTH_EFFICIENCY
    share = arrays.tp_share(tp)
    traffic = arrays.fwd_mem_bytes
    rerun = np.divide(arrays.column("recompute_traffic_bytes"), traffic, out=np.zeros_like(traffic),
                      where=traffic > 0)
    return RunOverhead(arrays.column("weight_fwd_bytes") * share / bandwidth,
                       arrays.column("weight_bwd_bytes") * share / bandwidth,
                       host_seconds(arrays.host_ops_fwd, arrays.column("graph_kernels_fwd"), host_op_s),
                       host_seconds(arrays.host_ops_bwd, arrays.column("graph_kernels_bwd"), host_op_s),
                       arrays.column("recompute_gemm_share"), rerun,
                       host_seconds(arrays.column("host_ops_recompute"), arrays.column("graph_kernels_recompute"),
                                    host_op_s))


def host_seconds(ops: np.ndarray, graph_kernels: np.ndarray, host_op_s: float = HOST_OP_S) -> np.ndarray:
    """Host time of a pass: ``host_op_s`` (default ``HOST_OP_S``) per eager operator, and ``KERNEL_LAUNCH_S`` per
    kernel a compiled graph launches (its wrapper calls each kernel directly: no
    dispatcher, autocast or autograd work per operator; ``runtime_time``)."""
    return ops * host_op_s + graph_kernels * KERNEL_LAUNCH_S


def expert_token_efficiency(tokens: np.ndarray) -> np.ndarray:
    """Share of its best rate an expert's matmuls reach when it gets
    ``tokens`` tokens: the token side is the matrices' M (rows of the input,
    reduction of the weight gradient), and a short side costs what a short
    weight side does in ``gemm_efficiency`` (tile and wave quantisation, less
    reuse of each weight byte: NVIDIA "Matrix Multiplication Background"
    guide §2-4), ``m / (m + GEMM_HALF_DIM)``. Dense layers see thousands of
    tokens per micro-batch; a routed expert sees top_k/num_experts of them,
    times ep under expert parallelism. No tokens (dense layers): 1."""
    m = np.asarray(tokens, dtype=float)
    return np.divide(m, m + GEMM_HALF_DIM, out=np.ones_like(m), where=(m > 0) & np.isfinite(m))


def per_sample_work(arrays: LayerArrays, gpu: GPUSpec, tp: int, dtype_bytes: int,
                    sequence_parallel: bool, fp8: bool = False, expert_load: float = 1.0,
                    cp: int = 1, expert_batch: float = 1.0,
                    attention_kernel: str = DEFAULT_ATTENTION_KERNEL, host_op_s: float = HOST_OP_S) -> Work:
    """One sample's forward work per layer on one GPU of a TP group (the cost
    kernel caches it per GPU type and scales it to any micro-batch share).
    ``fp8``: the matmuls of linear layers run in FP8 (Transformer Engine
    style); attention and elementwise work stay 16-bit. ``expert_load``: the
    routed experts' matmuls this rank runs per sample of its own, over what
    its own tokens need (the busiest expert-parallel rank's, ``cp_ep``);
    ``expert_batch``: the tokens each of its experts gets per sample of its
    own, over the ``top_k / num_experts`` of them that stay without expert
    parallelism (ep · imbalance with ep > 1); ``cp``: the busiest
    context-parallel rank's attention over an even share (the kernel scales
    the sample to the rank's 1/cp); ``attention_kernel``: the fused attention
    implementation (``attention_efficiency``); ``host_op_s``: host seconds per
    dispatched operator (``run_overhead``)."""
    expert_flops = arrays.column("expert_flops")
    rate = _gemm_peak(gpu, dtype_bytes, fp8) * gemm_efficiency(gpu, _dims(arrays), tp)
    share = arrays.tp_share(tp)  # 1/tp, or 1 on layers that run whole on every TP rank
    gemm_s = (arrays.fwd_flops - arrays.attention_flops - expert_flops) * share / rate
    expert_s = expert_load * expert_flops * share / rate
    expert_tokens = arrays.column("expert_tokens") * expert_batch
    attention_s = attention_time(arrays, gpu, 1.0, tp, dtype_bytes, attention_kernel)
    if cp > 1:
        causal = arrays.attention_causal if arrays.attention_causal is not None else np.zeros(arrays.num_layers, bool)
        attention_s = attention_s * cp_attention_scale(cp, causal, CP_CAUSAL_ZIGZAG)
    # FlashAttention's backward recomputes the scores: 2.5x its forward; eager attention's is 2x
    backward_ratio = np.where(_fused(arrays), ATTENTION_BACKWARD_RATIO, BACKWARD_FLOPS_RATIO)
    mem = arrays.fwd_mem_bytes * tp_activation_fraction(arrays, tp, sequence_parallel)
    memory_s = mem / (gpu.memory_bandwidth_bytes_per_s * MEMORY_BANDWIDTH_EFFICIENCY)
    graph = arrays.column("graph_kernels_fwd")  # a compiled layer's kernels, counted (``runtime_time``)
    launch_s = np.where(graph > 0, graph, arrays.gemm_count * (1.0 + ELEMENTWISE_KERNELS_PER_GEMM)) * KERNEL_LAUNCH_S
    return Work(gemm_s, attention_s, attention_s * backward_ratio, memory_s, launch_s, expert_s, expert_tokens,
                run_overhead(arrays, gpu, tp, host_op_s))


def _fused(arrays: LayerArrays) -> np.ndarray:
    return arrays.attention_fused if arrays.attention_fused is not None else np.zeros(arrays.num_layers, bool)


def _dims(arrays: LayerArrays) -> np.ndarray:
    return arrays.gemm_dim if arrays.gemm_dim is not None else np.zeros(arrays.num_layers)  # 0: shape unknown


def attention_time(arrays: LayerArrays, gpu: GPUSpec, batch: float, tp: int, dtype_bytes: int,
                   kernel: str = DEFAULT_ATTENTION_KERNEL) -> np.ndarray:
    """Forward time of every layer's attention core (QK^T and scores·V).

    A fused kernel runs at the attention efficiency and skips the masked half
    of a causal score matrix (Dao 2023, §3.1.1); an eager one runs two batched
    matmuls at matmul efficiency over the whole matrix (its softmax traffic is
    in ``fwd_mem_bytes``)."""
    peak = gpu.peak_flops_for(dtype_bytes)
    flops = arrays.attention_flops * batch * arrays.tp_share(tp)
    fused = _fused(arrays)
    causal = arrays.attention_causal if arrays.attention_causal is not None else np.zeros(arrays.num_layers, bool)
    executed = np.where(fused & causal, CAUSAL_EXECUTED_FRACTION, 1.0) * flops
    eager_eff = gemm_efficiency(gpu, np.full(arrays.num_layers, float(max(arrays.seq_len, 1))), 1)
    efficiency = np.where(fused, attention_efficiency(gpu, arrays.seq_len, kernel), eager_eff)
    return executed / (peak * efficiency)


def pass_time(flops: np.ndarray | float, mem_bytes: np.ndarray | float, kernels: np.ndarray | float,
              gpu: GPUSpec, dtype_bytes: int) -> np.ndarray:
    """A plain roofline at the sustained large-matmul rate, for work with no
    layer shape (the memory-bound part of selective recomputation)."""
    peak = matmul_rate(gpu, dtype_bytes)
    bandwidth = gpu.memory_bandwidth_bytes_per_s * MEMORY_BANDWIDTH_EFFICIENCY
    return np.asarray(flops) / peak + np.asarray(mem_bytes) / bandwidth + np.asarray(kernels) * KERNEL_LAUNCH_S


def tp_activation_fraction(arrays: LayerArrays, tp: int, sequence_parallel: bool) -> np.ndarray:
    """Share of each layer's elementwise traffic one TP rank handles: TP splits
    all but the replicated activations; sequence parallelism splits those too."""
    if tp == 1 or sequence_parallel:
        return arrays.tp_share(tp)
    total = arrays.act_bytes
    replicated = np.divide(arrays.act_tp_replicated_bytes, total, out=np.zeros_like(total), where=total > 0)
    return np.where(total > 0, replicated + (1.0 - replicated) / tp, 1.0 / tp)


def roofline_passes(arrays: LayerArrays, gpu: GPUSpec, batch: float, tp: int, dtype_bytes: int,
                    sequence_parallel: bool = False, unit: Work | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Forward and backward time of every layer for ``batch`` samples on one
    GPU of a TP group of ``tp`` (module docstring); ``unit`` is the cached
    ``per_sample_work`` of the same GPU, tp and sequence parallelism."""
    work = (unit or per_sample_work(arrays, gpu, tp, dtype_bytes, sequence_parallel)).scaled(batch)
    return work.forward(), work.backward()


def recompute_time(arrays: LayerArrays, fwd: np.ndarray, gpu: GPUSpec, batch: float, tp: int, recompute: str,
                   dtype_bytes: int, measured: np.ndarray | None, unit: Work | None = None) -> np.ndarray:
    """Forward work redone in the backward pass: under full recomputation the
    forward (what the training code reruns of it where it is known,
    ``Work.recompute``; a measured layer its measured forward in the same share);
    under selective recomputation the attention core (Korthikanti
    et al. 2022 §5): its matmuls plus the softmax/dropout traffic over the
    stored scores — or, for measured layers, the core's share of the forward —
    except on the layers a tool recomputes per op (``op_ac_time``); nothing on
    the layers a tool does not checkpoint (``LayerArrays.checkpointed``).
    ``fwd``: the layers' forward without the loss (a measured head's as measured)."""
    redone = _redone_time(arrays, fwd, gpu, batch, tp, recompute, dtype_bytes, measured, unit)
    return redone if arrays.checkpointed is None else np.where(arrays.checkpointed, redone, 0.0)


def _redone_time(arrays: LayerArrays, fwd: np.ndarray, gpu: GPUSpec, batch: float, tp: int, recompute: str,
                 dtype_bytes: int, measured: np.ndarray | None, unit: Work | None) -> np.ndarray:
    if recompute == "full":
        if unit is None or unit.run is None:
            return fwd.copy()
        work = unit.scaled(batch)
        rerun = work.recompute()
        if measured is None:
            return rerun
        modelled = work.forward() - loss_time(arrays, work)[0]
        share = np.divide(rerun, modelled, out=np.ones_like(rerun), where=modelled > 0)
        return np.where(measured, fwd * share, rerun)
    if recompute != "selective":
        return np.zeros_like(fwd)
    extra = _core_recompute_time(arrays, fwd, gpu, batch, tp, dtype_bytes, measured, unit)
    if arrays.op_ac_gemm_share is None:
        return extra
    op_ac = ~np.isnan(arrays.op_ac_gemm_share)
    return np.where(op_ac, op_ac_time(arrays, fwd, gpu, batch, tp, dtype_bytes, measured, unit), extra)


def op_ac_time(arrays: LayerArrays, fwd: np.ndarray, gpu: GPUSpec, batch: float, tp: int, dtype_bytes: int,
               measured: np.ndarray | None, unit: Work | None) -> np.ndarray:
    """What per-op selective checkpointing (``cost.targets``: torchtitan's)
    redoes: its share of the linear matmuls and every memory-bound op and
    launch; the attention core and the kept matmuls come from the saved
    outputs. A measured layer redoes that share of its forward."""
    if arrays.op_ac_gemm_share is None:  # no tool's per-op policy on these layers
        return np.zeros_like(fwd)
    share = np.nan_to_num(arrays.op_ac_gemm_share)
    # without the kernel's cached unit: the layers' own work (sequence parallelism changes only norm traffic)
    work = (unit or per_sample_work(arrays, gpu, tp, dtype_bytes, False)).scaled(batch)
    analytic = work.gemm_s * share + work.memory_s + work.launch_s
    if measured is None:
        return analytic
    total = work.device_forward()
    share_of_forward = np.divide(analytic, total, out=np.zeros_like(fwd), where=total > 0)
    return np.where(measured, fwd * share_of_forward, analytic)


def _core_recompute_time(arrays: LayerArrays, fwd: np.ndarray, gpu: GPUSpec, batch: float, tp: int,
                         dtype_bytes: int, measured: np.ndarray | None, unit: Work | None) -> np.ndarray:
    """Korthikanti's selective recomputation: the attention core redone."""
    core_mem = ATTENTION_CORE_PASSES * arrays.act_attention_core_bytes * batch * arrays.tp_share(tp)
    core = unit.attention_s * batch if unit is not None else attention_time(arrays, gpu, batch, tp, dtype_bytes)
    analytic = core + pass_time(0.0, core_mem, ATTENTION_CORE_KERNELS, gpu, dtype_bytes)
    extra = np.where(arrays.attention_flops > 0, analytic, 0.0)
    if measured is not None:
        share = np.divide(arrays.attention_flops, arrays.fwd_flops, out=np.zeros_like(fwd),
                          where=arrays.fwd_flops > 0)
        extra = np.where(measured & (arrays.attention_flops > 0), fwd * share, extra)
    return extra


def layer_times(arrays: LayerArrays, gpu: GPUSpec, batch: float, tp: int, recompute: str, dtype_bytes: int,
                sequence_parallel: bool = False, profile: ProfileDB | None = None,
                unit: Work | None = None) -> LayerTimes:
    """Forward, backward and recompute time of every layer for ``batch``
    samples on one GPU of a TP group of size ``tp``: measured where the
    profile has the layer, the model elsewhere (``unit``: its cached
    ``per_sample_work``)."""
    if batch <= 0:
        zero = np.zeros(arrays.num_layers)
        return LayerTimes(zero, zero, zero)
    fwd, bwd = roofline_passes(arrays, gpu, batch, tp, dtype_bytes, sequence_parallel, unit)
    measured = comm_measured = None
    if profile is None:
        return LayerTimes(fwd, bwd, recompute_time(arrays, fwd, gpu, batch, tp, recompute, dtype_bytes, None, unit))
    fwd, bwd, measured, comm_measured = _apply_profile(arrays, profile, gpu, batch, tp, fwd, bwd)
    rerun = recompute_time(arrays, fwd, gpu, batch, tp, recompute, dtype_bytes, measured, unit)
    if unit is not None and unit.run is not None:
        # a profile times each layer's module alone; the loss runs outside the head's module
        # (runtime/step.py), so a measured head gets the modelled loss on top
        loss_fwd, loss_bwd = loss_time(arrays, unit.scaled(batch))
        fwd, bwd = np.where(measured, fwd + loss_fwd, fwd), np.where(measured, bwd + loss_bwd, bwd)
    return LayerTimes(fwd, bwd, rerun, comm_measured)


def _apply_profile(arrays: LayerArrays, profile: ProfileDB, gpu: GPUSpec, batch: float, tp: int,
                   fwd: np.ndarray, bwd: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Replace the roofline by measured times for every layer the profile has.
    Where the profile timed a layer with its TP collectives inside (``hetplan
    profile`` at tp > 1), the layer keeps them (fourth array: True there) and
    the kernel adds no TP communication of its own: the collectives as they
    ran in the layer, not an alpha-beta estimate of them. Where the profile
    also timed the layers chained in one micro-batch, the measured times are
    scaled by how much longer they took that way (``ProfileDB.chain_factor``):
    a step runs them chained."""
    fwd, bwd = fwd.copy(), bwd.copy()
    measured = np.zeros(arrays.num_layers, dtype=bool)
    with_comm = np.zeros(arrays.num_layers, dtype=bool)
    found: dict[str, tuple[tuple[float, float] | None, bool]] = {}
    chain_factor = getattr(profile, "chain_factor", None)
    chained = chain_factor(gpu.name, tp, batch) if chain_factor is not None else 1.0
    for index, key in enumerate(arrays.profile_keys):
        if key not in found:
            inside = profile.includes_tp_comm(key, gpu.name, tp)
            found[key] = (profile.lookup(key, gpu.name, tp, batch, with_tp_comm=inside), inside)
        value, inside = found[key]
        if value is not None:
            fwd[index], bwd[index] = value[0] * chained, value[1] * chained
            measured[index], with_comm[index] = True, inside
    return fwd, bwd, measured, with_comm
