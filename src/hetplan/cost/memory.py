"""Memory formulas: per layer (vectorised over a model's layers) and the peak
of one GPU.

peak = model states (weights, gradients, optimizer states; divided by TP, and
       by dp according to the ZeRO stage)
     + ZeRO-3 working set (gathered parameters of the running and next layer;
       on hetplan's runtime per layer instead: ``zero3_backward_moment``)
     + framework overhead
     + the larger of
       - the backward pass: activations of one micro-batch × micro-batches in
         flight, plus the backward's working set (a checkpointed layer's
         rebuilt activations, the loss's gradient buffers, less what the
         layers after it have freed: ``working_beyond_stored``), plus what
         the code that trains holds whatever the batch (hetplan's runtime:
         the 16-bit weight copies autocast keeps per micro-batch in flight,
         FSDP2's gradient reduction buffer, the whole gradients a backward
         holds while micro-batches accumulate: ``accumulated_grad_bytes``)
       - the optimizer step: its temporaries (``step_temporary_bytes``).

Under target "hetplan" the activations and copies are what hetplan's runtime
keeps (``hetplan.model.runtime_memory``), the states its fp32 ones
(``RUNTIME_STATE_BYTES``); ``PeakTerms`` holds the terms of one device.

Micro-batches in flight (Narayanan et al. 2021 §2.2; Galvatron-BMW §IV-B):
GPipe keeps all ``m``; 1F1B keeps ``min(pp − j, m)`` on stage ``j`` (0-based),
so earlier stages hold more; interleaved 1F1B with ``v`` chunks multiplies that
by ``1 + (pp − 1)/(pp·v)`` (Narayanan et al. 2021 §2.2.2).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from hetplan.cost.constants import (
    CPU_FRAMEWORK_OVERHEAD_BYTES, DEFAULT_HOST_MEMORY_PER_GPU_MEMORY, FRAMEWORK_OVERHEAD_BYTES,
    GPUS_PER_REFERENCE_SERVER, HOST_MEMORY_GIB_PER_SERVER, HOST_MEMORY_RESERVE_FRACTION, OPTIMIZER_STEP_TEMPORARIES,
    ZERO1_GATHER_BYTES, ZERO1_SLICE_COPY_BYTES, ZERO3_GATHERED_LAYERS,
)
from hetplan.cost.layers import LayerArrays
from hetplan.units import GIB

if TYPE_CHECKING:
    from hetplan.cluster.spec import NodeSpec

# Implementations that keep ZeRO-2's weights sharded between steps: FSDP2, and
# hetplan's runtime (FSDP2 plus its own ZeRO-1: ``resident_bytes_split``).
FSDP_LIKE = ("fsdp", "hetplan")
FP32_BYTES = 4  # the optimizer's update runs on fp32 tensors (master weights and states)


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
                      implementation: str = "deepspeed", ddp: bool = False) -> tuple[float, float, float]:
    """(weight, gradient, optimizer-state) bytes one device holds per parameter
    at the step's peak: what it keeps between steps (``resident_bytes_split``)
    plus, for ZeRO-2 under FSDP2, the whole weights gathered from forward to
    backward (``fully_shard(reshard_after_forward=False)`` keeps its shard and
    the unsharded copy), and for hetplan's runtime's ZeRO-0/1 on FSDP2
    ``replicate`` the same copy (``runtime_replicate_copy``; not on ``ddp``,
    plain data parallelism's DDP: ``runtime_uses_ddp``). ZeRO-3's gathered
    layers are counted apart (``PeakTerms.weights``)."""
    weight, grad, opt = resident_bytes_split(zero, dp, state_bytes, implementation)
    if zero == 2 and implementation in FSDP_LIKE and dp > 1:
        weight += float(state_bytes[0])
    elif runtime_replicate_copy(zero, dp, implementation, ddp):
        weight += float(state_bytes[0])
    return weight, grad, opt


def runtime_uses_ddp(zero: int, dp: int, tp: int, cp: int, ep: int, whole_model: bool) -> bool:
    """hetplan's runtime trains plain data parallelism (ZeRO-0, no TP, CP, EP,
    one stage holding ``whole_model``) on DDP, everything else data-parallel on
    FSDP2 (``runtime/context.py`` ``_plain_ddp``)."""
    return zero == 0 and dp > 1 and tp == 1 and cp == 1 and ep == 1 and whole_model


def runtime_replicate_copy(zero: int, dp: int, implementation: str, ddp: bool) -> bool:
    """hetplan's runtime runs ZeRO-0/1 layers under FSDP2 ``replicate``, a
    ``fully_shard`` whose shard is the whole weight: it all-gathers the weights
    into a second whole copy from forward until after backward (torch 2.13,
    ``fsdp/_fully_shard/_fsdp_param.py`` ``init_all_gather_outputs`` beside the
    ``padded_sharded_param`` of ``_init_sharded_param``; replayed: the weights
    held twice at the peak). DDP (``ddp``) keeps the weights once."""
    return implementation == "hetplan" and zero <= 1 and dp > 1 and not ddp


def accumulated_grad_bytes(zero: int, dp: int, state_bytes: tuple[int, int, int], implementation: str,
                           ddp: bool) -> float:
    """Gradient bytes per parameter a backward of hetplan's runtime holds beyond
    ``state_bytes_split``'s while it accumulates micro-batches (one stage's
    step of several): the runtime reduces ZeRO-0/1/2 gradients once, after the
    last micro-batch (``runtime/parallelize.py`` ``set_accumulating``; torch
    pipelining alike, ``stage.py`` ``backward_maybe_with_nosync``), so until
    then

    * FSDP2 accumulates each gradient whole, unsharded (``_fsdp_param.py``
      ``unsharded_accumulated_grad``): ZeRO-2 holds the whole fp32 gradients,
      not its 1/dp shard;
    * DDP's gradients accumulate in the tensors autograd made (``.grad``),
      which its reducer copies into its bucket only when it reduces
      (``torch/csrc/distributed/c10d/reducer.cpp``
      ``Reducer::mark_variable_ready_dense``: ``bucket_view.copy_(grad)``
      where the gradient is not a view of the bucket, as after
      ``zero_grad(set_to_none=True)``): a second whole copy beside the bucket.

    Replayed (``runtime/replay.py``): tiny-gpt dp2, 2 micro-batches, ZeRO-0
    on DDP and ZeRO-2 on FSDP2 hold exactly these whole gradients at their peak."""
    if implementation != "hetplan" or dp <= 1:
        return 0.0
    grad = float(state_bytes[1])
    if ddp:
        return grad
    if zero == 2:
        return grad - grad / dp
    return 0.0


def resident_bytes_split(zero: int, dp: int, state_bytes: tuple[int, int, int],
                         implementation: str = "deepspeed") -> tuple[float, float, float]:
    """(weight, gradient, optimizer-state) bytes one device keeps per parameter
    between steps (after the optimizer step; gradients after backward). ZeRO-1
    shards the optimizer states, ZeRO-2 also the gradients, ZeRO-3 also the
    weights (Rajbhandari et al. 2020 §5.1); FSDP2 (hetplan's runtime) keeps
    ZeRO-2's weights sharded too, DeepSpeed keeps them whole. hetplan's
    runtime's ZeRO-1 also keeps the fp32 slice of each parameter its
    optimizer steps (``ZERO1_SLICE_COPY_BYTES``), with the optimizer states."""
    weight, grad, opt = (float(x) for x in state_bytes)
    if zero >= 1:
        opt = opt / dp
    if zero == 1 and implementation == "hetplan" and dp > 1:
        opt += ZERO1_SLICE_COPY_BYTES / dp
    if zero >= 2:
        grad = grad / dp
    if zero >= 3 or (zero == 2 and implementation in FSDP_LIKE):
        weight = weight / dp
    return weight, grad, opt


def step_temporary_bytes(optimizer: str, largest_shard: np.ndarray | float) -> np.ndarray | float:
    """Bytes the optimizer step of hetplan's runtime adds on one device while
    it updates the largest parameter (shard) it holds, ``largest_shard``
    elements (activations are gone by then): ``OPTIMIZER_STEP_TEMPORARIES``
    fp32 tensors of its size."""
    return OPTIMIZER_STEP_TEMPORARIES[optimizer] * FP32_BYTES * largest_shard


def zero1_gather_bytes(params: np.ndarray | float, dp: int) -> np.ndarray | float:
    """Bytes hetplan's runtime's ZeRO-1 adds after its optimizer step to gather
    the updated slices of ``params`` parameters over ``dp`` ranks (``ZERO1_GATHER_BYTES``:
    every rank's slices, copied from there into the weights)."""
    if dp <= 1:
        return 0.0
    return ZERO1_GATHER_BYTES * params


def activation_bytes(arrays: LayerArrays, tp: int, recompute: str, sequence_parallel: bool,
                     linear_input_scale: float = 1.0) -> np.ndarray:
    """Activation bytes one TP rank keeps for backward, per sample and layer
    (Korthikanti et al. 2022, Table 2). ``linear_input_scale``: the size a
    linear layer's saved input keeps (``fp8_linear_input_scale``). What the
    training code keeps whole on every rank (``LayerArrays.act_undivided_bytes``:
    hetplan's gathered logits and loss) no parallelism divides, and what a
    layer's loss holds outside its forward (``act_outside_bytes``)
    recomputation does not drop."""
    outside = arrays.column("act_outside_bytes")
    if recompute == "full":
        return (arrays.input_bytes / tp if sequence_parallel else arrays.input_bytes) + outside
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
        undivided = arrays.column("act_undivided_bytes")
        return (replicated - undivided + sharded) / tp + undivided
    return replicated + sharded / tp


def fp8_linear_input_scale(fp8: bool, dtype_bytes: int) -> float:
    """The size a linear layer's saved input keeps, over its ``dtype_bytes``
    one: FP8 training keeps it in FP8, one byte an element (Transformer
    Engine's ``Linear`` saves its quantized input and drops the row-wise copy
    backward does not need: transformer_engine/pytorch/module/linear.py)."""
    return 1.0 / dtype_bytes if fp8 else 1.0


def backward_working_bytes(arrays: LayerArrays, tp: int, recompute: str, sequence_parallel: bool,
                           linear_input_scale: float = 1.0) -> np.ndarray:
    """Per sample: what a layer's backward holds beyond what it stored, paid
    once per stage at its peak (``working_beyond_stored``): the transient
    buffers of its backward (``LayerArrays.working_bytes``: the loss's
    gradients) and, for a checkpointed layer, the activations it rebuilds.
    The layer's input is not rebuilt: the recomputed forward reads (and its
    first op saves) the checkpoint tensor itself, already counted among the
    micro-batches in flight (torch.utils.checkpoint keeps the input;
    Korthikanti et al. 2022 Table 2 counts it inside the layer's 34·sbh), so
    only the rest is extra."""
    transient = arrays.column("working_bytes")
    if recompute != "full":
        return transient.copy()
    full = activation_bytes(arrays, tp, "none", sequence_parallel, linear_input_scale)
    return np.maximum(full - activation_bytes(arrays, tp, "full", sequence_parallel), 0.0) + transient


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
    if node.gpu.catalog_name == "CPU":
        return math.inf
    return float(math.floor(node_host_memory_bytes(node) / node.num_gpus * (1.0 - HOST_MEMORY_RESERVE_FRACTION)))


MEMORY_CATEGORIES = ("params", "grads", "optimizer", "activations", "loss", "buffers")


@dataclass(frozen=True)
class PeakTerms:
    """One device's memory, in the terms of its peaks: the backward pass of
    its micro-batches in flight (their activations, the loss's buffers,
    FSDP's reduce buffer) and the optimizer step (its temporaries). What the
    device keeps throughout (its states, ZeRO-3's gathered layers, the
    framework's overhead) is under both. See the module docstring.

    ``first_backward``: every micro-batch of the step is in flight before the
    stage's first backward (one micro-batch, GPipe, 1F1B with no more
    micro-batches than stages after it) and the code that trains makes its
    gradients in backward (hetplan's runtime: FSDP2 and autograd allocate them
    there; ``zero_grad(set_to_none=True)`` frees them after each step): the
    first backward holds no gradients yet, the second one micro-batch
    (``micro_batch``: what one keeps) less and all of them."""

    weights: float  # its parameter shards and ZeRO-3's gathered layers
    grads: float
    optimizer: float
    activations: float  # saved for backward, micro-batches in flight, working sets, weight copies; less the loss
    loss: float  # logits and log-softmax held, and the loss's gradients
    reduce_buffer: float  # FSDP2's gradient reduction buffer, during backward
    overhead: float  # CUDA context, workspaces, allocator (framework_overhead_bytes)
    step: float = 0.0  # the optimizer step's temporaries
    first_backward: bool = False
    micro_batch: float = 0.0  # what one micro-batch in flight keeps (activations, copies, loss)
    accumulated: float = 0.0  # gradients a backward after the first holds beyond ``grads`` (accumulated_grad_bytes)
    grads_held: bool = False  # the gradients are held before the first backward too (DDP's buckets)
    first_grads: float = 0.0  # gradients the first backward holds at its peak where none are held before it

    @property
    def backward(self) -> float:
        return self.activations + self.loss + self.reduce_buffer

    @property
    def moment(self) -> str:
        """When the peak is: "step", "first" (a backward with no gradients yet, or
        with DDP's buckets only) or "backward" (one with the gradients)."""
        later = self.accumulated + (self.backward - self.micro_batch if self.first_backward else self.backward)
        first = self.backward - (0.0 if self.grads_held else self.grads - self.first_grads)
        if self.step > later and (not self.first_backward or self.step > first):
            return "step"
        return "first" if self.first_backward and first > later else "backward"

    @property
    def peak(self) -> float:
        return sum(self.parts().values())

    def parts(self) -> dict[str, float]:
        """The peak by category (``MEMORY_CATEGORIES``) at its moment (``moment``):
        the step's temporaries count with the optimizer; a backward before any
        gradient has none; the next holds one micro-batch less."""
        moment = self.moment
        grads = {"first": self.grads if self.grads_held else self.first_grads, "step": self.grads}.get(
            moment, self.grads + self.accumulated)
        kept = {"params": self.weights, "grads": grads,
                "optimizer": self.optimizer + (self.step if moment == "step" else 0.0)}
        if moment == "step":
            return {**kept, "activations": 0.0, "loss": 0.0, "buffers": self.overhead}
        fewer = self.micro_batch if self.first_backward and moment == "backward" else 0.0
        share = fewer / (self.activations + self.loss) if self.activations + self.loss > 0 else 0.0
        return {**kept, "activations": self.activations * (1.0 - share), "loss": self.loss * (1.0 - share),
                "buffers": self.reduce_buffer + self.overhead}


def peak_memory_bytes(states: np.ndarray | float, activations_per_micro_batch: np.ndarray | float,
                      in_flight: float, recompute_working: np.ndarray | float, largest_gathered: np.ndarray | float,
                      overhead: float | np.ndarray, backward_fixed: np.ndarray | float = 0.0,
                      step: np.ndarray | float = 0.0) -> np.ndarray | float:
    """Peak bytes on one GPU from its stage's sums and maxima: ``PeakTerms.peak``
    with the model states in one sum (``backward_fixed``: what the backward
    peak holds whatever the batch, the weight copies and reduce buffer;
    ``step``: the optimizer step's temporaries), written out because the
    searches call it in their inner loops (tests/test_memory_breakdown.py
    checks the two agree on every device of every ranked plan)."""
    backward = activations_per_micro_batch * in_flight + recompute_working + backward_fixed
    return states + ZERO3_GATHERED_LAYERS * largest_gathered + overhead + np.maximum(backward, step)


@dataclass(frozen=True)
class Zero3Moment:
    """What one micro-batch's backward holds on a ZeRO-3 stage of hetplan's
    runtime at its peak moment (``zero3_backward_moment``), by category."""

    activations: float  # stored by the layers not yet run backward, held outputs, the running layer's working set
    loss: float  # the loss's part of ``activations``
    gathered: float  # the unsharded parameters of the running layer and the one prefetched
    grads: float  # unsharded gradients: the running layer's, the previous one's reduce-scatter input, the root's


def zero3_backward_moment(stored: np.ndarray, held: np.ndarray, work: np.ndarray, loss: np.ndarray,
                          loss_work: np.ndarray, grads: np.ndarray, gathered: np.ndarray,
                          root_grads: np.ndarray) -> Zero3Moment:
    """The peak of one micro-batch's backward on a ZeRO-3 stage of hetplan's
    runtime (FSDP2 ``fully_shard`` per layer, ``reshard_after_forward=True``;
    a tied weight's layers with the root, ``runtime/parallelize.py``
    ``apply_dp``; torch 2.13 ``distributed/fsdp/_fully_shard/_fsdp_param_group.py``):
    the largest, over the stage's layers ``i`` run backward from the last, of
    what is alive while layer ``i`` runs its backward. Throughout it:

    * what the layers after ``i`` still hold (``held``: the logits, until
      the micro-batch's backward ends);
    * layer ``i - 1``'s unsharded parameters, prefetched by layer ``i``'s
      ``pre_backward`` (``_backward_prefetch``: the previous module of
      ``post_forward_order``; the root prefetches the last layer);
    * the root's unsharded gradients its layers ``i`` and after made
      (``root_grads``: the root's parameters stay gathered for the step and
      it reduces their gradients after its last layer's backward);

    and the largest of three moments:

    * its start: its unsharded parameters (``gathered``: unsharded in its
      ``pre_backward``), what the layers up to ``i`` stored, its working set
      (``work``: a checkpointed layer's rebuilt activations, the loss's
      gradients, the activation gradients its MLP's backward holds) and layer
      ``i + 1``'s reduce-scatter input, which FSDP2 keeps until the next
      reduce-scatter (``post_backward``: ``reduce_scatter_states``, at most
      ``reduce_scatter_max_input_buffers`` = 1);
    * its end, its activations freed: its parameters, its whole unsharded
      fp32 gradients (``grads``: autograd makes them in its backward) and
      layer ``i + 1``'s reduce-scatter input;
    * its ``post_backward``: it reshards its parameters and drops layer
      ``i + 1``'s input, then copies its gradients into its own
      (``_fsdp_collectives.py`` ``foreach_reduce``: ``reduce_scatter_input``
      allocated and filled before ``unsharded_grads.clear()``): its
      gradients twice.

    Every array is per layer of the stage in forward order, in bytes of one
    micro-batch; a root layer has no ``grads`` or ``gathered`` of its own."""
    stored_through = np.cumsum(stored)
    held_after = np.cumsum(held[::-1])[::-1] - held
    loss_through = np.cumsum(loss)
    root_after = np.cumsum(root_grads[::-1])[::-1]
    following = np.append(grads[1:], 0.0)  # layer i + 1's reduce-scatter input (none after the stage's last)
    previous = np.insert(gathered[:-1], 0, 0.0)  # layer i - 1's prefetched parameters
    before = stored_through - stored  # stored by the layers before i
    start = stored_through + work + gathered + following
    end = before + np.maximum(gathered + grads + following, 2 * grads)
    total = np.maximum(start, end) + held_after + previous + root_after
    i = int(np.argmax(total))
    if start[i] >= end[i]:
        return Zero3Moment(activations=float(stored_through[i] + work[i] + held_after[i]),
                           loss=float(loss_through[i] + loss_work[i] + held_after[i]),
                           gathered=float(gathered[i] + previous[i]), grads=float(following[i] + root_after[i]))
    kept = gathered[i] + grads[i] + following[i] >= 2 * grads[i]  # its end, before post_backward
    return Zero3Moment(activations=float(before[i] + held_after[i]),
                       loss=float(loss_through[i] - loss[i] + held_after[i]),
                       gathered=float((gathered[i] if kept else 0.0) + previous[i]),
                       grads=float(grads[i] + (following[i] if kept else grads[i]) + root_after[i]))
