"""Memory formulas: per layer (vectorised over a model's layers) and the peak
of one GPU.

peak = model states (weights, gradients, optimizer states; divided by TP, and
       by dp according to the ZeRO stage)
     + ZeRO-3 working set (gathered parameters of the running and next layer)
     + activations of one micro-batch × micro-batches in flight
     + recompute working set (a checkpointed layer's rebuilt activations, less
       what the layers after it have freed: ``working_beyond_stored``)
     + framework overhead.

Micro-batches in flight (Narayanan et al. 2021 §2.2; Galvatron-BMW §IV-B):
GPipe keeps all ``m``; 1F1B keeps ``min(pp − j, m)`` on stage ``j`` (0-based),
so earlier stages hold more; interleaved 1F1B with ``v`` chunks multiplies that
by ``1 + (pp − 1)/(pp·v)`` (Narayanan et al. 2021 §2.2.2).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np

from hetplan.cost.constants import (
    CPU_FRAMEWORK_OVERHEAD_BYTES, DEFAULT_HOST_MEMORY_PER_GPU_MEMORY, FRAMEWORK_OVERHEAD_BYTES,
    GPUS_PER_REFERENCE_SERVER, HOST_MEMORY_GIB_PER_SERVER, HOST_MEMORY_RESERVE_FRACTION, ZERO3_GATHERED_LAYERS,
)
from hetplan.cost.layers import LayerArrays
from hetplan.units import GIB

if TYPE_CHECKING:
    from hetplan.cluster.spec import NodeSpec


def model_state_bytes(params: np.ndarray | float, zero: int, dp: int, state_bytes: tuple[int, int, int],
                      implementation: str = "deepspeed") -> np.ndarray | float:
    """Bytes of weights + gradients + optimizer states for ``params`` parameters
    under ZeRO stage ``zero`` across ``dp`` replicas (ZeRO §5.1: stage 1 shards
    optimizer states, 2 also gradients, 3 also weights), at the step's peak."""
    return params * state_bytes_per_param(zero, dp, state_bytes, implementation)


def state_bytes_per_param(zero: int, dp: int, state_bytes: tuple[int, int, int],
                          implementation: str = "deepspeed") -> float:
    """Model-state bytes one device keeps per parameter it holds (see ``model_state_bytes``)."""
    return sum(state_bytes_split(zero, dp, state_bytes, implementation))


def state_bytes_split(zero: int, dp: int, state_bytes: tuple[int, int, int],
                      implementation: str = "deepspeed") -> tuple[float, float, float]:
    """(weight, gradient, optimizer-state) bytes one device holds per parameter
    at the step's peak: what it keeps between steps (``resident_bytes_split``)
    plus, for ZeRO-2 under FSDP2, the whole weights gathered from forward to
    backward (``fully_shard(reshard_after_forward=False)`` keeps its shard and
    the unsharded copy). ZeRO-3's gathered layers are counted apart (``memory_parts``)."""
    weight, grad, opt = resident_bytes_split(zero, dp, state_bytes, implementation)
    if zero == 2 and implementation == "fsdp" and dp > 1:
        weight += float(state_bytes[0])
    return weight, grad, opt


def resident_bytes_split(zero: int, dp: int, state_bytes: tuple[int, int, int],
                         implementation: str = "deepspeed") -> tuple[float, float, float]:
    """(weight, gradient, optimizer-state) bytes one device keeps per parameter
    between steps (after the optimizer step; gradients after backward). ZeRO-1
    shards the optimizer states, ZeRO-2 also the gradients, ZeRO-3 also the
    weights (Rajbhandari et al. 2020 §5.1); FSDP2 (hetplan's runtime) keeps
    ZeRO-2's weights sharded too, DeepSpeed keeps them whole."""
    weight, grad, opt = (float(x) for x in state_bytes)
    if zero >= 1:
        opt = opt / dp
    if zero >= 2:
        grad = grad / dp
    if zero >= 3 or (zero == 2 and implementation == "fsdp"):
        weight = weight / dp
    return weight, grad, opt


def activation_bytes(arrays: LayerArrays, tp: int, recompute: str, sequence_parallel: bool,
                     linear_input_scale: float = 1.0) -> np.ndarray:
    """Activation bytes one TP rank keeps for backward, per sample and layer
    (Korthikanti et al. 2022, Table 2). ``linear_input_scale``: the size a
    linear layer's saved input keeps (``fp8_linear_input_scale``)."""
    if recompute == "full":
        return arrays.input_bytes / tp if sequence_parallel else arrays.input_bytes.copy()
    saved = 1.0 - linear_input_scale
    linear, linear_replicated = arrays.column("act_linear_input_bytes"), \
        arrays.column("act_linear_input_replicated_bytes")
    replicated = arrays.act_tp_replicated_bytes - saved * linear_replicated
    sharded = arrays.act_bytes - arrays.act_tp_replicated_bytes - saved * (linear - linear_replicated)
    if recompute == "selective":  # the core is TP-split, but whole in a layer that runs whole (tp_replicated)
        whole = arrays.tp_replicated if arrays.tp_replicated is not None else np.zeros(arrays.num_layers, bool)
        replicated = replicated - np.where(whole, arrays.act_attention_core_bytes, 0.0)
        sharded = sharded - np.where(whole, 0.0, arrays.act_attention_core_bytes)
    if sequence_parallel:
        return (replicated + sharded) / tp
    return replicated + sharded / tp


def fp8_linear_input_scale(fp8: bool, dtype_bytes: int) -> float:
    """The size a linear layer's saved input keeps, over its ``dtype_bytes``
    one: FP8 training keeps it in FP8, one byte an element (Transformer
    Engine's ``Linear`` saves its quantized input and drops the row-wise copy
    backward does not need: transformer_engine/pytorch/module/linear.py)."""
    return 1.0 / dtype_bytes if fp8 else 1.0


def recompute_working_bytes(arrays: LayerArrays, tp: int, recompute: str, sequence_parallel: bool,
                            linear_input_scale: float = 1.0) -> np.ndarray:
    """Per sample: a checkpointed layer rebuilds its full activations during its
    backward pass; the stage pays the largest such layer once. The layer's
    input is not rebuilt: the recomputed forward reads (and its first op saves)
    the checkpoint tensor itself, already counted among the micro-batches in
    flight (torch.utils.checkpoint keeps the input; Korthikanti et al. 2022
    Table 2 counts it inside the layer's 34·sbh), so only the rest is extra."""
    if recompute != "full":
        return np.zeros(arrays.num_layers)
    full = activation_bytes(arrays, tp, "none", sequence_parallel, linear_input_scale)
    return np.maximum(full - activation_bytes(arrays, tp, "full", sequence_parallel), 0.0)


def working_beyond_stored(stored: np.ndarray, working: np.ndarray, axis: int = -1) -> np.ndarray:
    """What a stage's recompute working sets add, at their peak, to one
    micro-batch's stored activations (``stored`` and ``working`` per layer, in
    forward order along ``axis``). Backward runs the layers in reverse and a
    layer frees what it stored once its own backward is done, so while layer
    ``i`` rebuilds its activations the layers after it hold nothing for this
    micro-batch: the peak is ``max_i (working_i − stored after i)``. It is at
    least the last layer's working set, so never below 0; the freed layers
    matter where a big one follows the recomputed ones, such as a language
    head whose logits are gone before the last block recomputes."""
    stored = np.asarray(stored, dtype=np.float64)
    after = np.flip(np.cumsum(np.flip(stored, axis), axis), axis) - stored
    return np.asarray(working - after).max(axis=axis)


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


def node_host_memory_bytes(node: NodeSpec) -> int:
    """A node's host memory: as given (``NodeSpec.host_memory_bytes``), else
    its GPU type's reference server scaled to the node's GPUs, else as much as
    its GPUs' own memory (``DEFAULT_HOST_MEMORY_PER_GPU_MEMORY``)."""
    if node.host_memory_bytes:
        return node.host_memory_bytes
    gpu = node.gpu
    server_gib = HOST_MEMORY_GIB_PER_SERVER.get(gpu.catalog_name or gpu.name)
    if server_gib is not None:
        return int(server_gib * GIB * node.num_gpus // GPUS_PER_REFERENCE_SERVER)
    per_gpu = node.memory_bytes or gpu.memory_bytes
    return int(DEFAULT_HOST_MEMORY_PER_GPU_MEMORY * per_gpu * node.num_gpus)


def host_offload_capacity_bytes(node: NodeSpec) -> float:
    """Bytes of offloaded activations one GPU of ``node`` may keep in host
    memory: its share of the node's, less ``HOST_MEMORY_RESERVE_FRACTION``,
    in whole bytes. Unlimited for a CPU "device", which offloads within its own memory."""
    if node.gpu.name == "CPU":
        return math.inf
    return float(math.floor(node_host_memory_bytes(node) / node.num_gpus * (1.0 - HOST_MEMORY_RESERVE_FRACTION)))


MEMORY_CATEGORIES = ("params", "grads", "optimizer", "activations", "buffers")


def memory_parts(weights: Any, grads: Any, optimizer: Any, activations_per_micro_batch: Any, in_flight: float,
                 recompute_working: Any, largest_gathered: Any, overhead: Any) -> dict[str, Any]:
    """The peak of one GPU by category (``MEMORY_CATEGORIES``), the formula of
    the module docstring: parameters (its shard plus ZeRO-3's gathered
    layers), gradients, optimizer states, activations (micro-batches in flight
    plus the recompute working set) and buffers (framework overhead)."""
    return {
        "params": weights + ZERO3_GATHERED_LAYERS * largest_gathered,
        "grads": grads,
        "optimizer": optimizer,
        "activations": activations_per_micro_batch * in_flight + recompute_working,
        "buffers": overhead,
    }


def peak_memory_bytes(states: np.ndarray | float, activations_per_micro_batch: np.ndarray | float,
                      in_flight: float, recompute_working: np.ndarray | float, largest_gathered: np.ndarray | float,
                      overhead: float) -> np.ndarray | float:
    """Peak bytes on one GPU from its stage's sums and maxima: the sum of
    ``memory_parts`` with the model states in one sum, written out because the
    searches call it in their inner loops (tests/test_memory_breakdown.py checks
    the two agree on every device of every ranked plan)."""
    return (states + ZERO3_GATHERED_LAYERS * largest_gathered + activations_per_micro_batch * in_flight
            + recompute_working + overhead)
