"""Peak memory of one GPU in a pipeline stage.

peak = model states (weights, gradients, optimizer states; divided by TP, and
       by dp according to the ZeRO stage)
     + ZeRO-3 working set (gathered parameters of the running and next layer)
     + activations of one micro-batch × micro-batches in flight
     + recompute working set (one layer's full activations under checkpointing)
     + framework overhead.

Micro-batches in flight (Narayanan et al. 2021 §2.2; Galvatron-BMW §IV-B):
GPipe keeps all ``m``; 1F1B keeps ``min(pp − j, m)`` on stage ``j`` (0-based),
so earlier stages hold more; interleaved 1F1B with ``v`` chunks multiplies that
by ``1 + (pp − 1)/(pp·v)`` (Narayanan et al. 2021 §2.2.2).
"""

from __future__ import annotations

from hetplan.cost.constants import (
    CPU_FRAMEWORK_OVERHEAD_BYTES,
    FRAMEWORK_OVERHEAD_BYTES,
    ZERO3_GATHERED_LAYERS,
)
from hetplan.model.spec import LayerSpec, ModelSpec
from hetplan.plan import LayerStrategy


def layer_params_per_device(layer: LayerSpec, tp: int) -> float:
    """Parameters of ``layer`` held by one rank of a TP group of size ``tp``."""
    return layer.params_tp_sharded / tp + layer.params_tp_replicated


def model_state_bytes(params: float, zero: int, dp: int, state_bytes: tuple[int, int, int]) -> float:
    """Bytes of weights + gradients + optimizer states for ``params`` parameters
    under ZeRO stage ``zero`` across ``dp`` replicas (ZeRO §5.1: stage 1 shards
    optimizer states, 2 also gradients, 3 also weights)."""
    weight, grad, opt = state_bytes
    if zero >= 1:
        opt = opt / dp
    if zero >= 2:
        grad = grad / dp
    if zero >= 3:
        weight = weight / dp
    return params * (weight + grad + opt)


def layer_activation_bytes(layer: LayerSpec, tp: int, recompute: str, sequence_parallel: bool) -> float:
    """Activation bytes one TP rank keeps for backward, per sample
    (Korthikanti et al. 2022, Table 2)."""
    if recompute == "full":
        return layer.input_bytes / tp if sequence_parallel else layer.input_bytes
    replicated = layer.act_tp_replicated_bytes
    sharded = layer.act_bytes - replicated
    if recompute == "selective":
        sharded -= layer.act_attention_core_bytes
    if sequence_parallel:
        return (replicated + sharded) / tp
    return replicated + sharded / tp


def in_flight_micro_batches(schedule: str, stage_index: int, pp: int, num_micro_batches: int,
                            virtual_stages: int = 1) -> float:
    """Micro-batches whose activations stage ``stage_index`` holds at its peak."""
    if schedule == "gpipe":
        return float(num_micro_batches)
    in_flight = float(min(pp - stage_index, num_micro_batches))
    if schedule == "interleaved-1f1b" and virtual_stages > 1:
        in_flight = min(in_flight * (1.0 + (pp - 1) / (pp * virtual_stages)), float(num_micro_batches))
    return in_flight


def framework_overhead_bytes(is_cpu: bool) -> int:
    return CPU_FRAMEWORK_OVERHEAD_BYTES if is_cpu else FRAMEWORK_OVERHEAD_BYTES


def device_memory(
    model: ModelSpec,
    layers: list[tuple[int, LayerStrategy, int, int, float]],
    in_flight: float,
    state_bytes: tuple[int, int, int],
    sequence_parallel: bool = False,
    is_cpu: bool = False,
) -> float:
    """Peak bytes on one GPU.

    ``layers`` lists, for every layer the GPU runs, ``(layer index, strategy,
    tp, dp, samples per micro-batch on this GPU's replica)``.
    """
    states = 0.0
    gathered = 0.0
    act_per_micro_batch = 0.0
    recompute_working = 0.0
    seen_tied: set[str] = set()
    for index, strategy, tp, dp, batch in layers:
        layer = model.layers[index]
        params = layer_params_per_device(layer, tp)
        if layer.tied_group:
            if layer.tied_group in seen_tied:
                params -= layer.tied_params / tp  # the shared weight is already held by this stage
            seen_tied.add(layer.tied_group)
        states += model_state_bytes(params, strategy.zero, dp, state_bytes)
        if strategy.zero >= 3:
            gathered = max(gathered, params * state_bytes[0])
        act_per_micro_batch += layer_activation_bytes(layer, tp, strategy.recompute, sequence_parallel) * batch
        if strategy.recompute == "full":
            recompute_working = max(
                recompute_working, layer_activation_bytes(layer, tp, "none", sequence_parallel) * batch
            )
    return (
        states
        + ZERO3_GATHERED_LAYERS * gathered
        + act_per_micro_batch * in_flight
        + recompute_working
        + framework_overhead_bytes(is_cpu)
    )
