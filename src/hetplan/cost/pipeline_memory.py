"""What a pipelined step of hetplan's runtime holds beyond its stage's layers.

``memory.PeakTerms`` counts a stage's states, the activations of its
micro-batches in flight and its backward's working sets. A pipelined stage of
hetplan's runtime (torch.distributed.pipelining, ``runtime/spine.py``) also
holds, found in the replay's live tensors at the peak (``runtime/replay.py``)
and read from torch 2.13's code:

* **receive buffers**: every micro-batch of the step has its own buffer for each
  tensor the stage receives, made when the schedule first runs and kept for the
  whole run (``distributed/pipelining/stage.py``
  ``PipelineStage._prepare_forward_infra`` / ``_setup_forward_recv_info``: one
  ``_RecvInfo`` buffer per micro-batch for each input of a stage after the
  first; ``_prepare_backward_infra`` / ``_create_grad_recv_info``: one per
  micro-batch for each output gradient of a stage before the last). Each is the
  boundary tensor of one micro-batch: the fp32 residual stream the runtime sends
  between stages (``model/runtime_memory.py`` ``LayerMemory.boundary``), whole
  on every TP rank (a stage's input is a plain tensor), the rank's 1/cp of the
  tokens under CP. Interleaved 1F1B keeps them per model chunk.
* **the new gradient beside** ``.grad``: a weight's backward after the first
  micro-batch makes its gradient as a new tensor that autograd then adds into
  the ``.grad`` it accumulates (``torch/csrc/autograd/functions/accumulate_grad.h``
  ``AccumulateGrad::accumulateGrad``: ``variable_grad += new_grad``), so for a
  moment both are held: at most the largest weight's fp32 gradient at once.
  FSDP2 (ZeRO-2/3 on dp > 1) reduces each layer's new gradients through its
  reduce buffer instead (``FSDP_REDUCE_BUFFER_LAYERS``, already counted). It
  stands beside the loss's buffers (the last stage's first backward is the
  head's), which the ZeRO-0/1 reduce buffer never does: that buffer is made in
  a layer's post-backward hook of the last micro-batch, after the head's
  backward has freed the loss's gradients (``memory.PeakTerms``: ``loss``), so
  only what it exceeds them by adds to the new gradient (replayed: tiny-gpt
  pp2 x dp2 ZeRO-0, the last stage peaks inside the head's backward holding the
  head weight's new gradient and no reduce buffer; counting both was +4.3%).

* **interleaved 1F1B's micro-batches in flight** per model chunk: torch's
  ``ScheduleInterleaved1F1B`` (``distributed/pipelining/schedules.py``,
  ``_calculate_single_rank_operations``, ``_get_warmup_ops``, ``_get_1f1b_rank_ops``)
  runs ``(v - 1)·r + 2·(pp - 1 - rank)`` warm-up forwards (``r`` micro-batches per
  round), then one forward and one backward at a time, taking forwards chunk by
  chunk in rounds and backwards from the last chunk back; a chunk's micro-batches
  pile up while the backwards serve another (the last stage of a 2 x 2 pipeline
  holds 3 micro-batches of its first chunk, where Narayanan et al.'s average,
  ``memory.in_flight_micro_batches``, gives 1.25). :func:`interleaved_in_flight`
  walks that order.

One-stage plans hold none of these (no pipeline; their gradient accumulation is
costed with the non-pipelined plans).
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np

from hetplan.cost.memory import PeakTerms, in_flight_micro_batches
from hetplan.plan.layout import interleaved_chunks, runs_heterogeneous
from hetplan.plan.spec import Plan, Stage

if TYPE_CHECKING:  # the kernel's range tables use this module (cost/stage.py); here only its type
    from hetplan.cost.kernel import CostKernel


def _stage_chunks(plan: Plan) -> tuple[tuple[int, ...], ...]:
    """Layer indices per model chunk, as the runtime cuts them (``PlanLayout``)."""
    virtual = plan.virtual_stages if plan.schedule == "interleaved-1f1b" else 1
    if any(len(s.layers) < virtual for s in plan.stages):  # a plan the runtime refuses (PlanLayout): chunks = stages
        virtual = 1
    return interleaved_chunks(plan, virtual)


def interleaved_order(pp: int, rank: int, num_micro_batches: int, virtual: int) -> list[tuple[bool, int]]:
    """(forward?, local chunk) of each computation ``rank`` runs in torch's
    interleaved 1F1B (module doc; the functions named there, torch 2.13)."""
    m = num_micro_batches
    per_round = m // max(1, m // pp)
    warmup = min((virtual - 1) * per_round + 2 * (pp - 1 - rank), m * virtual)
    total = m * virtual

    def forward(op: int) -> tuple[bool, int]:
        return True, (op // per_round) % virtual

    def backward(op: int) -> tuple[bool, int]:
        return False, virtual - 1 - ((op - warmup) // per_round) % virtual

    order = [forward(op) for op in range(warmup)]
    for op in range(warmup, total):
        order += [forward(op), backward(op)]
    return order + [backward(op) for op in range(total, total + warmup)]


def interleaved_in_flight(pp: int, rank: int, num_micro_batches: int, chunk_bytes: list[float]) -> float:
    """Micro-batches of the whole stage whose activations rank ``rank`` holds at
    its peak in interleaved 1F1B, weighted by what one micro-batch of each of its
    chunks keeps (``chunk_bytes``, in local order): the largest sum over its
    backwards of each chunk's micro-batches in flight (the one in backward
    included), over one micro-batch of every chunk."""
    held = [0] * len(chunk_bytes)
    peak = 0.0
    for is_forward, chunk in interleaved_order(pp, rank, num_micro_batches, len(chunk_bytes)):
        if is_forward:
            held[chunk] += 1
            continue
        peak = max(peak, sum(n * b for n, b in zip(held, chunk_bytes)))
        held[chunk] -= 1
    whole = sum(chunk_bytes)
    return peak / whole if whole > 0 else 0.0


def receive_buffer_bytes(kernel: CostKernel, plan: Plan, stage_index: int) -> np.ndarray:
    """Per device of stage ``stage_index``: the receive buffers torch pipelining
    keeps for the step (module doc), every micro-batch's, of every chunk it runs."""
    stage = plan.stages[stage_index]
    chunks = _stage_chunks(plan)
    boundary = kernel.memory_arrays.input_bytes  # per sample: the tensor entering each layer
    per_sample = sum(float(received_per_sample(boundary, chunk[0], chunk[-1] + 1))
                     for chunk in chunks[stage_index::plan.pp])
    # each replica's share on each of its devices (Stage.replica_devices: cp x its own TP degree with replica_tp)
    replica_samples = np.asarray([stage.dp_split[r] for r in range(stage.dp) for _ in stage.replica_devices(r)],
                                 dtype=np.float64)
    return per_sample / stage.cp * replica_samples * plan.num_micro_batches


def received_per_sample(boundary: np.ndarray, starts: np.ndarray | int, ends: np.ndarray | int) -> np.ndarray:
    """Bytes per sample of one micro-batch's receive buffers for a chunk of layers
    ``[start, end)`` (module doc; ``boundary``: per layer, the tensor entering it):
    its input, received from the chunk before, unless it starts the model, and the
    gradient of its output, received from the chunk after, unless it ends it.
    Broadcasts over arrays of starts and ends (the searches' range tables)."""
    layers = len(boundary)
    starts, ends = np.asarray(starts), np.asarray(ends)
    received = np.where(starts > 0, boundary[np.minimum(starts, layers - 1)], 0.0)
    return received + np.where(ends < layers, boundary[np.minimum(ends, layers - 1)], 0.0)


def holds_new_gradient(num_micro_batches: int, group: int, zero: int) -> bool:
    """A weight's new gradient stands beside the ``.grad`` it is added into (module
    doc): with several micro-batches, unless FSDP2 reduces it (ZeRO-2/3 on a
    ``group`` of dp·cp > 1; ``zero``: the stage's lowest stage)."""
    return num_micro_batches > 1 and not (group > 1 and zero >= 2)


def stage_in_flight(kernel: CostKernel, plan: Plan, stage_index: int) -> float | None:
    """Micro-batches stage ``stage_index`` of an interleaved plan holds at its peak
    (:func:`interleaved_in_flight`, its chunks weighted by the activations and
    weight copies one micro-batch keeps); None for other schedules."""
    chunks = _stage_chunks(plan)
    if len(chunks) == plan.pp:
        return None
    stage = plan.stages[stage_index]
    recompute = stage.strategies[0].recompute  # the runtime deals chunks by count: one strategy for the stage
    act = kernel.rank_activation_bytes(stage.tp, recompute, stage.sequence_parallel, stage.cp)
    per_mb = kernel.micro_batch_bytes(stage.tp, stage.ep)
    batch = plan.micro_batch_size / stage.dp
    sizes = [float(sum(act[layer] * batch + per_mb[layer] for layer in chunk)) for chunk in chunks[stage_index::plan.pp]]
    return interleaved_in_flight(plan.pp, stage_index, plan.num_micro_batches, sizes)


def accumulating_gradient_bytes(kernel: CostKernel, stage: Stage, num_micro_batches: int, tp: int | None = None
                                ) -> float:
    """The new fp32 gradient of the stage's largest weight beside the ``.grad`` it is
    added into (module doc), on a device of TP degree ``tp`` (default the stage's; a
    replica of a stage of mixed degrees holds its own degree's share): 0 with one
    micro-batch or where FSDP2 reduces it."""
    if not holds_new_gradient(num_micro_batches, stage.dp * stage.cp, min(s.zero for s in stage.strategies)):
        return 0.0
    largest = kernel.largest_tensor(stage.tp if tp is None else tp, stage.ep)[list(stage.layers)]
    return float(largest.max()) * kernel.grad_bytes if largest.size else 0.0


def pipelined_terms(kernel: CostKernel, plan: Plan, stage_index: int, terms: list[PeakTerms]) -> list[PeakTerms]:
    """Each device's ``terms`` (in device order) of a pipelined stage of hetplan's
    runtime with what the pipeline holds added (module doc): the receive buffers
    at every moment of the step (with the framework's buffers), the new
    gradient during backward (with the reduce buffer, which it stands beside)."""
    if not kernel.runtime or plan.pp <= 1:
        return terms
    stage = plan.stages[stage_index]
    buffers = receive_buffer_bytes(kernel, plan, stage_index)
    degrees = [stage.replica_degree(r) for r in range(stage.dp) for _ in stage.replica_devices(r)]
    new_grad = {t: accumulating_gradient_bytes(kernel, stage, plan.num_micro_batches, t) for t in set(degrees)}
    freed = freed_logits_bytes(kernel, plan, stage_index)
    return [replace(t, overhead=t.overhead + float(b), reduce_buffer=_beside_new_gradient(t, new_grad[degree]),
                    loss=max(t.loss - float(f), 0.0))
            for t, b, degree, f in zip(terms, buffers, degrees, freed)]


def freed_logits_bytes(kernel: CostKernel, plan: Plan, stage_index: int) -> np.ndarray:
    """Per device of the stage, the logits the loss's terms count that hetplan's
    own pipeline executor does not hold: its last stage computes each
    micro-batch's loss and keeps only the loss (``runtime/hetero.py``
    ``HeteroPipeline.run``: ``saved[k] = (x, loss)``), so the logits are freed
    once the loss has its log-softmax (replayed: a heterogeneous pipeline's tp1
    last stage was +6.6%, 131 KB of its 226 KB gap the logits), where torch
    pipelining's stage keeps each output until its backward. 0 elsewhere."""
    stage = plan.stages[stage_index]
    devices = [stage.dp_split[r] for r in range(stage.dp) for _ in stage.replica_devices(r)]
    if stage_index != plan.pp - 1 or not runs_heterogeneous(plan):
        return np.zeros(len(devices))
    held = float(kernel.memory_arrays.column("act_held_bytes")[list(stage.layers)].sum()) / stage.cp
    in_flight = in_flight_micro_batches(plan.schedule, stage_index, plan.pp, plan.num_micro_batches)
    return np.asarray(devices, dtype=np.float64) * held * in_flight


def _beside_new_gradient(terms: PeakTerms, new_grad: float) -> float:
    """The backward's buffers with the new gradient (module doc): the reduce buffer
    counts only beyond the loss's buffers, which are freed before it is made."""
    if new_grad <= 0:
        return terms.reduce_buffer
    return new_grad + max(terms.reduce_buffer - terms.loss, 0.0)
