"""Compute time of one layer on one GPU: a measured profile if there is one,
else a roofline over FLOPs and memory traffic with a per-kernel overhead.

time = matmul FLOPs / (peak · GEMM_EFFICIENCY)
     + elementwise bytes / (memory bandwidth · MEMORY_BANDWIDTH_EFFICIENCY)
     + kernels · KERNEL_LAUNCH_S

The launch term is what makes small micro-batches and narrow layers (AMP's
TransGAN layers of width 16) cost more than their FLOPs say (AMP §3.4).
"""

from __future__ import annotations

from dataclasses import dataclass

from hetplan.cluster.catalog import GPUSpec
from hetplan.cost.constants import (
    BACKWARD_FLOPS_RATIO,
    ELEMENTWISE_KERNELS_PER_GEMM,
    GEMM_EFFICIENCY,
    KERNEL_LAUNCH_S,
    MEMORY_BANDWIDTH_EFFICIENCY,
)
from hetplan.model.spec import LayerSpec
from hetplan.profile.db import ProfileDB


@dataclass(frozen=True)
class LayerTime:
    """Seconds for one pass of one layer over a replica's share of a micro-batch."""

    fwd_s: float
    bwd_s: float
    recompute_s: float  # extra forward work done during backward


def _pass_time(flops: float, mem_bytes: float, kernels: float, gpu: GPUSpec, dtype_bytes: int) -> float:
    peak = gpu.peak_flops_for(dtype_bytes) * GEMM_EFFICIENCY
    bandwidth = gpu.memory_bandwidth_bytes_per_s * MEMORY_BANDWIDTH_EFFICIENCY
    return flops / peak + mem_bytes / bandwidth + kernels * KERNEL_LAUNCH_S


def _tp_activation_fraction(layer: LayerSpec, tp: int, sequence_parallel: bool) -> float:
    """Share of the layer's elementwise traffic one TP rank handles."""
    if tp == 1 or layer.act_bytes <= 0:
        return 1.0 / tp
    if sequence_parallel:
        return 1.0 / tp
    replicated = layer.act_tp_replicated_bytes / layer.act_bytes
    return replicated + (1.0 - replicated) / tp


def layer_time(
    layer: LayerSpec,
    gpu: GPUSpec,
    batch: float,
    tp: int,
    recompute: str,
    dtype_bytes: int,
    sequence_parallel: bool = False,
    profile: ProfileDB | None = None,
) -> LayerTime:
    """Forward, backward and recompute time of ``layer`` for ``batch`` samples
    on one GPU of a TP group of size ``tp`` (communication not included)."""
    if batch <= 0:
        return LayerTime(0.0, 0.0, 0.0)
    measured = profile.lookup(layer.profile_key, gpu.name, tp, batch) if profile is not None else None
    if measured is not None:
        fwd, bwd = measured
        attention_share = layer.attention_flops / layer.fwd_flops if layer.fwd_flops else 0.0
    else:
        flops = layer.fwd_flops * batch / tp
        mem = layer.fwd_mem_bytes * batch * _tp_activation_fraction(layer, tp, sequence_parallel)
        kernels = layer.gemm_count * (1.0 + ELEMENTWISE_KERNELS_PER_GEMM)
        fwd = _pass_time(flops, mem, kernels, gpu, dtype_bytes)
        bwd = _pass_time(flops * BACKWARD_FLOPS_RATIO, mem * BACKWARD_FLOPS_RATIO,
                         kernels * BACKWARD_FLOPS_RATIO, gpu, dtype_bytes)
        attention_share = 0.0
        if layer.fwd_flops > 0:
            attention_share = layer.attention_flops / layer.fwd_flops
    if recompute == "full":
        extra = fwd
    elif recompute == "selective" and layer.attention_flops > 0:
        if measured is not None:
            extra = fwd * attention_share
        else:
            # attention core: QK^T and scores·V matmuls plus the softmax/dropout
            # traffic over the stored scores (read + write each)
            core_flops = layer.attention_flops * batch / tp
            core_mem = 2.0 * layer.act_attention_core_bytes * batch / tp
            extra = _pass_time(core_flops, core_mem, 4, gpu, dtype_bytes)
    else:
        extra = 0.0
    return LayerTime(fwd, bwd, extra)
