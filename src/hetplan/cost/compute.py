"""Compute time of every layer on one GPU: a measured profile where there is
one, else a roofline over FLOPs and memory traffic with a per-kernel overhead.

time = matmul FLOPs / (peak · GEMM_EFFICIENCY)
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
    ATTENTION_CORE_KERNELS,
    ATTENTION_CORE_PASSES,
    BACKWARD_FLOPS_RATIO,
    ELEMENTWISE_KERNELS_PER_GEMM,
    GEMM_EFFICIENCY,
    KERNEL_LAUNCH_S,
    MEMORY_BANDWIDTH_EFFICIENCY,
)
from hetplan.cost.layers import LayerArrays
from hetplan.profile.db import ProfileDB


@dataclass(frozen=True)
class LayerTimes:
    """Seconds per layer (arrays over the model's layers) for one pass over a
    replica's share of a micro-batch; communication not included."""

    fwd_s: np.ndarray
    bwd_s: np.ndarray
    recompute_s: np.ndarray  # extra forward work done during backward

    @property
    def back_s(self) -> np.ndarray:
        """Backward plus recomputation: what runs in the backward pass."""
        return self.bwd_s + self.recompute_s


def pass_time(flops: np.ndarray | float, mem_bytes: np.ndarray | float, kernels: np.ndarray | float,
              gpu: GPUSpec, dtype_bytes: int) -> np.ndarray:
    """The roofline: tensor-core work, memory-bound traffic and kernel launches."""
    peak = gpu.peak_flops_for(dtype_bytes) * GEMM_EFFICIENCY
    bandwidth = gpu.memory_bandwidth_bytes_per_s * MEMORY_BANDWIDTH_EFFICIENCY
    return np.asarray(flops) / peak + np.asarray(mem_bytes) / bandwidth + np.asarray(kernels) * KERNEL_LAUNCH_S


def tp_activation_fraction(arrays: LayerArrays, tp: int, sequence_parallel: bool) -> np.ndarray:
    """Share of each layer's elementwise traffic one TP rank handles: TP splits
    all but the replicated activations; sequence parallelism splits those too."""
    if tp == 1 or sequence_parallel:
        return np.full(arrays.num_layers, 1.0 / tp)
    total = arrays.act_bytes
    replicated = np.divide(arrays.act_tp_replicated_bytes, total, out=np.zeros_like(total), where=total > 0)
    return np.where(total > 0, replicated + (1.0 - replicated) / tp, 1.0 / tp)


def roofline_passes(arrays: LayerArrays, gpu: GPUSpec, batch: float, tp: int, dtype_bytes: int,
                    sequence_parallel: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Forward and backward roofline time of every layer for ``batch`` samples
    on one GPU of a TP group of ``tp`` (backward: twice the work, Kaplan 2020)."""
    flops = arrays.fwd_flops * batch / tp
    mem = arrays.fwd_mem_bytes * batch * tp_activation_fraction(arrays, tp, sequence_parallel)
    kernels = arrays.gemm_count * (1.0 + ELEMENTWISE_KERNELS_PER_GEMM)
    fwd = pass_time(flops, mem, kernels, gpu, dtype_bytes)
    bwd = pass_time(flops * BACKWARD_FLOPS_RATIO, mem * BACKWARD_FLOPS_RATIO, kernels * BACKWARD_FLOPS_RATIO,
                    gpu, dtype_bytes)
    return fwd, bwd


def recompute_time(arrays: LayerArrays, fwd: np.ndarray, gpu: GPUSpec, batch: float, tp: int, recompute: str,
                   dtype_bytes: int, measured: np.ndarray | None) -> np.ndarray:
    """Forward work redone in the backward pass: the whole forward under full
    recomputation; under selective recomputation the attention core (Korthikanti
    et al. 2022 §5): its matmuls plus the softmax/dropout traffic over the
    stored scores — or, for measured layers, the core's share of the forward."""
    if recompute == "full":
        return fwd.copy()
    if recompute != "selective":
        return np.zeros_like(fwd)
    core_flops = arrays.attention_flops * batch / tp
    core_mem = ATTENTION_CORE_PASSES * arrays.act_attention_core_bytes * batch / tp
    analytic = pass_time(core_flops, core_mem, ATTENTION_CORE_KERNELS, gpu, dtype_bytes)
    extra = np.where(arrays.attention_flops > 0, analytic, 0.0)
    if measured is not None:
        share = np.divide(arrays.attention_flops, arrays.fwd_flops, out=np.zeros_like(fwd),
                          where=arrays.fwd_flops > 0)
        extra = np.where(measured & (arrays.attention_flops > 0), fwd * share, extra)
    return extra


def layer_times(arrays: LayerArrays, gpu: GPUSpec, batch: float, tp: int, recompute: str, dtype_bytes: int,
                sequence_parallel: bool = False, profile: ProfileDB | None = None) -> LayerTimes:
    """Forward, backward and recompute time of every layer for ``batch``
    samples on one GPU of a TP group of size ``tp``: measured where the
    profile has the layer, the roofline elsewhere."""
    if batch <= 0:
        zero = np.zeros(arrays.num_layers)
        return LayerTimes(zero, zero, zero)
    fwd, bwd = roofline_passes(arrays, gpu, batch, tp, dtype_bytes, sequence_parallel)
    measured = None
    if profile is not None:
        fwd, bwd, measured = _apply_profile(arrays, profile, gpu, batch, tp, fwd, bwd)
    return LayerTimes(fwd, bwd, recompute_time(arrays, fwd, gpu, batch, tp, recompute, dtype_bytes, measured))


def _apply_profile(arrays: LayerArrays, profile: ProfileDB, gpu: GPUSpec, batch: float, tp: int,
                   fwd: np.ndarray, bwd: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Replace the roofline by measured times for every layer the profile has."""
    fwd, bwd = fwd.copy(), bwd.copy()
    measured = np.zeros(arrays.num_layers, dtype=bool)
    found: dict[str, tuple[float, float] | None] = {}
    for index, key in enumerate(arrays.profile_keys):
        if key not in found:
            found[key] = profile.lookup(key, gpu.name, tp, batch)
        value = found[key]
        if value is not None:
            fwd[index], bwd[index] = value
            measured[index] = True
    return fwd, bwd, measured
