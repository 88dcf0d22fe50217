"""Stages whose layers run differently: Galvatron-BMW's per-layer (dp, tp),
ZeRO stage and checkpointing inside one pipeline stage.

The kernel's ``StageCosts`` costs a stage that runs every layer one way; this
module costs the general stage from the same tables and the same combining
formulas. Consecutive layers with the same TP degree form a *segment*: its
replicas (TP groups) run independently, so the slowest replica of a segment
sets its pace; between segments of different TP degrees the layer input is
re-laid out (Galvatron-BMW's transformation R: an all-gather over the larger
TP group, forward and backward). Gradient traffic is grouped by the layers'
(TP degree, ZeRO stage), each group on its own data-parallel groups.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hetplan.cluster.catalog import GPUSpec
from hetplan.cost.constants import OFFLOAD_RESIDENT_LAYERS, TRANSFORM_PASSES, ZERO3_GATHERED_LAYERS
from hetplan.cost.groups import first_appearance
from hetplan.cost.kernel import CostKernel
from hetplan.cost.stage import SegmentTiming, zero12_gradient_collective
from hetplan.cost.memory import (
    PeakTerms, accumulated_grad_bytes, resident_bytes_split, runtime_uses_ddp, state_bytes_split, step_temporary_bytes,
    working_beyond_stored, zero1_gather_bytes,
)
from hetplan.cost.pipeline import stage_micro_batch_time
from hetplan.cost.zero3 import Zero3Layers, runs_zero3_moments, zero3_layers, zero3_moment
from hetplan.errors import HetplanError
from hetplan.plan.spec import Stage


def layer_replicas(stage: Stage, position: int, micro_batch_size: int) -> list[tuple[tuple[int, ...], float]]:
    """(TP group devices, samples) of each replica running the ``position``-th
    layer of ``stage``: the stage's own replicas and dp_split, or — for a
    layer with its own tp — runs of ``tp`` devices sharing the micro-batch evenly."""
    dp, tp = stage.layer_degrees(position)
    if tp == stage.tp:
        return [(stage.replica_devices(r), float(stage.dp_split[r])) for r in range(stage.dp)]
    return [(stage.devices[r * tp:(r + 1) * tp], micro_batch_size / dp) for r in range(dp)]


def tp_segments(stage: Stage) -> list[list[int]]:
    """Runs of consecutive layer positions that share a TP degree."""
    segments: list[list[int]] = []
    previous = None
    for pos in range(stage.num_layers):
        tp = stage.layer_degrees(pos)[1]
        if tp != previous:
            segments.append([])
            previous = tp
        segments[-1].append(pos)
    return segments


def held_params(kernel: CostKernel, stage: Stage, position: int) -> float:
    """Parameters one device holds for a layer of the stage (a tied weight
    that an earlier layer of the stage already holds is not held again; 1/ep
    of the routed experts)."""
    tp = stage.layer_degrees(position)[1]
    index = stage.layers[position]
    params = float(kernel.params_per_device(tp, stage.ep)[index])
    if kernel.arrays.tied_previous[index] >= stage.layers[0]:
        params -= float(kernel.tied_share(tp)[index])
    return params


def expert_share(kernel: CostKernel, stage: Stage, position: int) -> float:
    """Routed-expert parameters one device holds for a layer (part of ``held_params``; 0 without EP)."""
    if stage.ep == 1:
        return 0.0
    return float(kernel.expert_params_per_device(stage.layer_degrees(position)[1], stage.ep)[stage.layers[position]])


def stage_uses_ddp(kernel: CostKernel, stage: Stage) -> bool:
    """hetplan's runtime trains ``stage`` on DDP (``memory.runtime_uses_ddp``),
    or, as DDP does, keeps its weights once and its gradients whole with no
    reduce buffer: a replica of a stage of mixed TP degrees, which has no
    data-parallel wrapper (``runtime/mixed.py`` averages its ``.grad`` after
    the step; ``cost/replica_tp.replica_view`` marks it by ``replica_tp``)."""
    if not kernel.runtime or stage.has_layer_degrees or any(s.zero for s in stage.strategies):
        return False
    if stage.replica_tp is not None:
        return True
    whole = stage.layers[0] == 0 and stage.layers[-1] == kernel.num_layers - 1
    return runtime_uses_ddp(0, stage.dp, stage.tp, stage.cp, stage.ep, whole)


def accumulated_grads(kernel: CostKernel, stage: Stage, position: int, zero: int) -> float:
    """Gradient bytes one device holds for a layer beyond ``state_split``'s while
    the runtime accumulates micro-batches (``memory.accumulated_grad_bytes``);
    none on a mixed-degree replica, whose gradients stay in ``.grad`` alone
    (``stage_uses_ddp``)."""
    if stage.replica_tp is not None:
        return 0.0
    dp = stage.layer_degrees(position)[0] * stage.cp
    held, experts = held_params(kernel, stage, position), expert_share(kernel, stage, position)
    state, implementation, ddp = kernel.workload.state_bytes, kernel.state_implementation, stage_uses_ddp(kernel, stage)
    dense = accumulated_grad_bytes(zero, dp, state, implementation, ddp)
    if not experts:
        return held * dense
    return (held - experts) * dense + experts * accumulated_grad_bytes(zero, dp // stage.ep, state, implementation, ddp)


def state_split(kernel: CostKernel, stage: Stage, position: int, zero: int, resident: bool = False
                ) -> tuple[float, float, float]:
    """(weight, gradient, optimizer-state) bytes one device holds for a layer:
    dense parameters sharded over the dp·cp devices with the same shard,
    routed experts over the dp·cp/ep with the same experts (``cp_ep``)."""
    dp = stage.layer_degrees(position)[0] * stage.cp
    held, experts = held_params(kernel, stage, position), expert_share(kernel, stage, position)
    state, implementation = kernel.workload.state_bytes, kernel.state_implementation
    if resident:
        dense = resident_bytes_split(zero, dp, state, implementation)
    else:
        dense = state_bytes_split(zero, dp, state, implementation, stage_uses_ddp(kernel, stage))
    weights, grads, states = dense
    if not experts:
        return held * weights, held * grads, held * states
    e_weights, e_grads, e_states = (resident_bytes_split if resident else state_bytes_split)(
        zero, dp // stage.ep, state, implementation)
    dense_held = held - experts
    return (dense_held * weights + experts * e_weights, dense_held * grads + experts * e_grads,
            dense_held * states + experts * e_states)


def expert_states(kernel: CostKernel, stage: Stage, position: int, zero: int) -> tuple[float, float, float]:
    """The routed experts' part of ``state_split`` (0 without EP)."""
    experts = expert_share(kernel, stage, position)
    if not experts:
        return 0.0, 0.0, 0.0
    dp = stage.layer_degrees(position)[0] * stage.cp
    split = state_bytes_split(zero, dp // stage.ep, kernel.workload.state_bytes, kernel.state_implementation)
    return experts * split[0], experts * split[1], experts * split[2]


def expert_scales(stage: Stage) -> np.ndarray:
    """Per device of the stage (in its order): the routed experts it holds
    over an even 1/ep share (``Stage.ep_split``: EP rank ``row % ep``)."""
    rows = len(stage.devices) // stage.tp
    if stage.ep_split is None or stage.ep == 1:
        return np.ones(len(stage.devices))
    share = np.asarray(stage.ep_split, dtype=float) * stage.ep / sum(stage.ep_split)
    return np.repeat(np.tile(share, rows // stage.ep), stage.tp)


def check_uniform_cp_ep(stage: Stage) -> None:
    """Layers of one stage with context or expert parallelism run one way:
    the per-layer path below has no CP/EP form."""
    if stage.cp > 1 or stage.ep > 1:
        raise HetplanError(f"a stage with cp={stage.cp} and ep={stage.ep} needs one ZeRO stage, recomputation, "
                           "offload and tp for all its layers; give its layers one strategy")


def replica_classes(kernel: CostKernel, stage: Stage, position: int,
                    micro_batch_size: int) -> list[tuple[GPUSpec, float, tuple[float, float]]]:
    """(slowest GPU, samples, TP link) of the replicas running the
    ``position``-th layer (as ``layer_replicas``), once per distinct kind in
    order of first appearance: alike replicas cost alike, and on a large
    cluster most replicas are alike (``CostKernel.replica_classes``)."""
    dp, tp = stage.layer_degrees(position)
    grid = kernel.device_array(stage.devices).reshape(dp, tp)
    gpu, link, representatives = kernel.replica_classes(grid)
    batches = np.asarray(stage.dp_split, dtype=np.float64) if tp == stage.tp else \
        np.full(dp, micro_batch_size / dp)
    values, batch = np.unique(batches, return_inverse=True)
    firsts, _ = first_appearance((gpu * len(representatives) + link) * len(values) + batch.reshape(-1))
    links = [kernel.tp_link(tuple(grid[r].tolist())) if tp > 1 else (0.0, 0.0) for r in representatives]
    gpus = kernel.cluster_arrays.gpus
    return [(gpus[gpu[r]], float(batches[r]), links[link[r]]) for r in firsts.tolist()]


def segment_compute(kernel: CostKernel, stage: Stage, segment: list[int],
                     micro_batch_size: int) -> tuple[float, float, float, float, float]:
    """(fwd, bwd, recompute, TP comm, offload) of the slowest replica over the
    segment; the exposed host transfers of offloading are part of recompute
    and apart (the breakdown's own row)."""
    worst: tuple[float, float, float, float, float, float] | None = None
    tp = stage.layer_degrees(segment[0])[1]
    by_recompute: dict[tuple[str, bool], list[int]] = {}
    for pos in segment:
        strategy = stage.strategies[pos]
        by_recompute.setdefault((strategy.recompute, strategy.offload), []).append(stage.layers[pos])
    for gpu, batch, tp_link in replica_classes(kernel, stage, segment[0], micro_batch_size):
        f = b = rc = c = off = 0.0
        for (recompute, offload), indices in by_recompute.items():
            t = kernel.layer_times(gpu, batch, tp, recompute, stage.sequence_parallel)
            f += float(t.fwd_s[indices].sum())
            b += float(t.bwd_s[indices].sum())
            rc += float(t.recompute_s[indices].sum())
            if offload:  # exposed host transfers count with recomputation (CostKernel.time_class)
                off += float(kernel.offload_exposed_time(gpu, batch, tp, recompute,
                                                         stage.sequence_parallel)[indices].sum())
            c += float(kernel.tp_comm_time(recompute, batch, tp_link, t)[indices].sum())
        rc += off
        total = f + b + rc + c
        if worst is None or total > worst[0]:
            worst = (total, f, b, rc, c, off)
    assert worst is not None
    return worst[1:]


def transform_rate(kernel: CostKernel, devices: tuple[int, ...], tp_before: int, tp_after: int) -> float:
    """Seconds per byte of input of Galvatron-BMW's transformation R between
    adjacent layers with different TP degrees, forward and backward: the layer
    input gathered over the larger TP group (slicing to a smaller group is
    local), on the slowest such group; the bytes are the input of one
    micro-batch divided by the smaller dp."""
    if tp_before == tp_after:
        return 0.0
    slowest = kernel.slowest_run_rate("allgather", devices, max(tp_before, tp_after))
    return TRANSFORM_PASSES * slowest / min(len(devices) // tp_before, len(devices) // tp_after)


def transform_time(kernel: CostKernel, stage: Stage, before: int, after: int, micro_batch_size: int) -> float:
    """R (forward and backward) entering the ``after``-th layer of the stage."""
    rate = transform_rate(kernel, stage.devices, stage.layer_degrees(before)[1], stage.layer_degrees(after)[1])
    return rate * float(kernel.arrays.input_bytes[stage.layers[after]]) * micro_batch_size


def mixed_stage_timing(kernel: CostKernel, stage: Stage, micro_batch_size: int) -> SegmentTiming:
    """What a stage with per-layer strategies charges (see the module docstring)."""
    check_uniform_cp_ep(stage)
    fwd = bwd = rec = tpc = offload = 0.0
    segments = tp_segments(stage)
    for s_index, segment in enumerate(segments):
        f, b, rc, c, off = segment_compute(kernel, stage, segment, micro_batch_size)
        fwd, bwd, rec, tpc, offload = fwd + f, bwd + b, rec + rc, tpc + c, offload + off
        if s_index > 0:
            tpc += transform_time(kernel, stage, segments[s_index - 1][-1], segment[0], micro_batch_size)
    gather = scatter = sync = post = optimizer = 0.0
    optimizer_rate = kernel.optimizer_rate(stage.devices)
    for pos, strategy in enumerate(stage.strategies):
        dp, tp = stage.layer_degrees(pos)
        params = held_params(kernel, stage, pos)
        optimizer += params * optimizer_rate / (dp if strategy.zero >= 1 else 1)
        if dp < 2:
            continue
        rate = kernel.dp_collective_rate
        if strategy.zero >= 3:
            gather += params * kernel.weight_bytes * rate("allgather", stage.devices, tp)
            scatter += params * kernel.grad_bytes * rate("reduce_scatter", stage.devices, tp)
        elif strategy.zero in (1, 2):
            sync += params * kernel.grad_bytes * rate(zero12_gradient_collective(strategy.zero), stage.devices, tp)
            post += params * kernel.weight_bytes * rate("allgather", stage.devices, tp)
        else:
            sync += params * kernel.grad_bytes * rate("allreduce", stage.devices, tp)
    zero3 = float(stage_micro_batch_time(fwd, bwd + rec, 0.0, gather, scatter, kernel.overlap_slowdown)) - fwd - bwd - rec
    return SegmentTiming(fwd, bwd, rec, tpc, zero3, sync, post, optimizer, offload)


def mixed_stage_memory(kernel: CostKernel, stage: Stage, micro_batch_size: int, in_flight: float,
                       first_backward: bool = False) -> list[int]:
    """Peak bytes of each device of a stage with per-layer strategies."""
    return [int(terms.peak) for terms in stage_peak_terms(kernel, stage, micro_batch_size, in_flight, first_backward)]


def stage_memory_parts(kernel: CostKernel, stage: Stage, micro_batch_size: int, in_flight: float,
                       first_backward: bool = False) -> list[dict[str, float]]:
    """Each device's peak by category (``memory.PeakTerms.parts``), for any stage."""
    return [terms.parts() for terms in stage_peak_terms(kernel, stage, micro_batch_size, in_flight, first_backward)]


@dataclass
class _LayerMemory:
    """One layer's part of its stage's memory (``stage_peak_terms``), per sample or per micro-batch."""

    tp: int
    act: float  # stored per sample
    work: float  # backward working set per sample
    loss: float  # the loss's part of ``act``
    transient: float  # the loss's part of ``work``


def _layer_memory(kernel: CostKernel, stage: Stage, pos: int) -> tuple[_LayerMemory, float, float]:
    """A layer's activations (``_LayerMemory``) and what it keeps per
    micro-batch whatever its size (``CostKernel.micro_batch_bytes``): (kept
    for every micro-batch in flight, rebuilt while it runs backward)."""
    tp = stage.layer_degrees(pos)[1]
    index, strategy = stage.layers[pos], stage.strategies[pos]
    # one CP rank's activations per sample of its replica (cp_ep.cp_activation_bytes)
    act = float(kernel.rank_activation_bytes(tp, strategy.recompute, stage.sequence_parallel, stage.cp)[index])
    work = float(kernel.backward_working_bytes(tp, strategy.recompute, stage.sequence_parallel, stage.cp)[index])
    if strategy.offload:  # kept on the host: only a working set stays (CostKernel.offload_working_bytes)
        act, work = 0.0, float(kernel.offload_working_bytes(tp, strategy.recompute, stage.sequence_parallel)[index])
    loss, transient = (float(x[index]) for x in kernel.loss_bytes(stage.cp))
    per_mb = float(kernel.micro_batch_bytes(tp, stage.ep)[index])
    if strategy.offload:
        return _LayerMemory(tp, act, work, 0.0, transient), 0.0, OFFLOAD_RESIDENT_LAYERS * per_mb
    if strategy.recompute == "full":
        return _LayerMemory(tp, act, work, loss, transient), 0.0, per_mb
    return _LayerMemory(tp, act, work, loss, transient), per_mb, 0.0


def stage_peak_terms(kernel: CostKernel, stage: Stage, micro_batch_size: int, in_flight: float,
                     first_backward: bool = False) -> list[PeakTerms]:
    """Each device's memory terms (``memory.PeakTerms``; ``first_backward`` as
    there, for the code that trains), for any stage: per-layer strategies
    summed layer by layer."""
    if stage.has_layer_degrees:
        check_uniform_cp_ep(stage)
    per_layer = []
    weights = grads = optimizer = gathered = kept_per_mb = rebuilt_per_mb = reduce = largest = zero1 = 0.0
    accumulated = layer_grads = 0.0
    experts = np.zeros(3)  # the routed experts' part of weights, grads, optimizer
    ddp = stage_uses_ddp(kernel, stage)
    for pos, strategy in enumerate(stage.strategies):
        dp, tp = stage.layer_degrees(pos)
        index = stage.layers[pos]
        w, g, o = state_split(kernel, stage, pos, strategy.zero)
        weights, grads, optimizer = weights + w, grads + g, optimizer + o
        layer_grads = max(layer_grads, g)
        accumulated += accumulated_grads(kernel, stage, pos, strategy.zero)
        experts += expert_states(kernel, stage, pos, strategy.zero)
        layer, kept, rebuilt = _layer_memory(kernel, stage, pos)
        per_layer.append(layer)
        kept_per_mb, rebuilt_per_mb = kept_per_mb + kept, max(rebuilt_per_mb, rebuilt)
        group = dp * stage.cp
        if strategy.zero >= 3 and group > 1:
            gathered = max(gathered, float(kernel.params_per_device(tp, stage.ep)[index]) * kernel.weight_bytes)
        if group > 1 and not ddp:  # DDP reduces its buckets in place: no buffer
            buffer = kernel.reduce_peak_bytes(tp, stage.ep, strategy.zero, strategy.recompute, stage.sequence_parallel,
                                              stage.cp)
            reduce = max(reduce, float(buffer[index]))
        tensor = float(kernel.largest_tensor(tp, stage.ep)[index])
        largest = max(largest, tensor / group if strategy.zero >= 1 else tensor)
        if strategy.zero == 1 and group > 1 and kernel.runtime:  # memory.zero1_gather_bytes, layer by layer
            zero1 += float(zero1_gather_bytes(held_params(kernel, stage, pos), group))
    step = float(step_temporary_bytes(kernel.workload.runtime_optimizer, largest)) + zero1
    accumulating = not first_backward or in_flight > 1  # several micro-batches (first_backward: all in flight)
    positions = {layer.tp: pos for pos, layer in enumerate(per_layer)}  # one layer of each TP degree
    shares = {tp: [batch for _, batch in layer_replicas(stage, pos, micro_batch_size)]
              for tp, pos in positions.items()}  # a replica's share of a micro-batch, per TP degree
    # devices with the same shares and overhead have the same parts: one dict per class of them
    per_device = {tp: np.repeat(np.asarray(replicas, dtype=np.float64), len(stage.devices) // len(replicas))
                  for tp, replicas in shares.items()}
    overhead = kernel.cluster_arrays.overhead[kernel.device_array(stage.devices)]
    scales = expert_scales(stage)
    keys = np.stack([per_device[tp] for tp in sorted(per_device)] + [overhead.astype(np.float64), scales], axis=1)
    firsts, classes = first_appearance(keys)
    # DDP's buckets hold the gradients before the first backward; a mixed-degree replica, costed
    # like DDP (stage_uses_ddp), has no wrapper: autograd makes its gradients in backward after
    # ``zero_grad(set_to_none=True)`` freed them (runtime/context.py ``_part_settings``: dp 1 with
    # ``replica_tp``; runtime/mixed.py averages ``.grad`` after the backward), so its first backward
    # holds, at its peak, those of the layer in backward (AccumulateGrad keeps each new gradient as
    # ``.grad``): the largest layer's, as the replay of a tp1/2 pipeline's first stage shows
    # (docs/cost-model.md, "The replay check")
    grads_held = ddp and stage.replica_tp is None
    first_grads = layer_grads if stage.replica_tp is not None and kernel.runtime else 0.0
    zero3 = _zero3_layers(kernel, stage, ddp)
    terms = []
    for i in firsts.tolist():
        batch = {tp: float(column[i]) for tp, column in per_device.items()}
        w, g, o = np.array([weights, grads, optimizer]) + (scales[i] - 1.0) * experts
        if zero3 is not None:
            terms.append(_zero3_terms(zero3, float(w), float(g), float(o), batch[stage.tp], in_flight,
                                      float(overhead[i]), step, first_backward and kernel.runtime))
            continue
        stored = np.array([layer.act * batch[layer.tp] for layer in per_layer])
        work = float(working_beyond_stored(stored, np.array([layer.work * batch[layer.tp] for layer in per_layer])))
        loss_stored = sum(layer.loss * batch[layer.tp] for layer in per_layer) * in_flight
        loss_work = min(work, float(working_beyond_stored(
            stored, np.array([layer.transient * batch[layer.tp] for layer in per_layer]))))
        one = float(stored.sum()) + kept_per_mb  # what one micro-batch in flight keeps
        activations = one * in_flight + work + rebuilt_per_mb
        terms.append(PeakTerms(float(w) + ZERO3_GATHERED_LAYERS * gathered, float(g), float(o),
                               activations - loss_stored - loss_work, loss_stored + loss_work, reduce,
                               float(overhead[i]), step, first_backward and kernel.runtime, one,
                               accumulated if accumulating else 0.0, grads_held, first_grads))
    return [terms[c] for c in classes.tolist()]


def _zero3_layers(kernel: CostKernel, stage: Stage, ddp: bool) -> Zero3Layers | None:
    """The stage's layers for ZeRO-3's per-layer moments (``cost/zero3.py``), or
    None where its peak is not theirs (one TP degree for the stage's layers)."""
    if ddp or stage.has_layer_degrees or not runs_zero3_moments(
            kernel, [s.zero for s in stage.strategies], stage.dp * stage.cp, any(s.offload for s in stage.strategies),
            stage.dp_split):
        return None
    return zero3_layers(kernel, stage.layers[0], stage.layers[-1] + 1, stage.tp, stage.ep,
                        [s.recompute for s in stage.strategies], stage.sequence_parallel, stage.cp)


def _zero3_terms(layers: Zero3Layers, weights: float, grads: float, optimizer: float, batch: float,
                 in_flight: float, overhead: float, step: float, first_backward: bool) -> PeakTerms:
    """``PeakTerms`` of a ZeRO-3 stage: the micro-batches in flight besides the one
    in backward keep what they stored, that one is at its peak moment
    (``zero3.zero3_moment``), and the root's layers stay gathered throughout."""
    moment = zero3_moment(layers, batch)
    one = layers.one_per_sample * batch + layers.one_fixed
    one_loss = float(layers.loss.sum()) * batch
    others = in_flight - 1.0
    return PeakTerms(weights + layers.root_weights + moment.gathered, grads, optimizer,
                     others * (one - one_loss) + moment.activations - moment.loss, others * one_loss + moment.loss,
                     moment.grads, overhead, step, first_backward, one, 0.0, False)


def stage_host_bytes(kernel: CostKernel, stage: Stage, micro_batch_size: int, in_flight: float) -> list[float]:
    """Each device's offloaded activations in host memory, for any stage: the
    activations ``stage_memory_parts`` leaves off the device for its
    offloaded layers, for every micro-batch in flight (``StageCosts.host_bytes``)."""
    offloaded = [pos for pos, strategy in enumerate(stage.strategies) if strategy.offload]
    total = np.zeros(len(stage.devices))
    for pos in offloaded:
        dp, tp = stage.layer_degrees(pos)
        strategy = stage.strategies[pos]
        act = float(kernel.rank_activation_bytes(tp, strategy.recompute, stage.sequence_parallel,
                                                 stage.cp)[stage.layers[pos]])
        replicas = np.asarray([batch for _, batch in layer_replicas(stage, pos, micro_batch_size)], dtype=np.float64)
        total += np.repeat(replicas, len(stage.devices) // len(replicas)) * act
    return (total * in_flight).tolist()


def stage_resident_parts(kernel: CostKernel, stage: Stage) -> dict[str, float]:
    """Bytes of parameters, gradients and optimizer states one device of the
    stage keeps between steps (``memory.resident_bytes_split``; the same on
    every device of a stage, whose layers shard alike on every replica): what
    the runtime's local tensors hold after a step, without the gathered
    working sets ``stage_memory_parts`` adds for the peak."""
    parts = {"params": 0.0, "grads": 0.0, "optimizer": 0.0}
    for pos, strategy in enumerate(stage.strategies):
        for key, value in zip(parts, state_split(kernel, stage, pos, strategy.zero, resident=True)):
            parts[key] += value
    return parts
