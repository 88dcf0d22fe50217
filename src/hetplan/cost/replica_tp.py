"""Stages whose replicas run their own TP degree (``Stage.replica_tp``): Sailor's
mixed replicas, e.g. an A100 replica at tp 2 beside two V100 replicas at tp 4.

Each replica runs the stage's layers alone on its own TP group, at its own
degree and share of the micro-batch, so the kernel costs it as a stage of
that one degree (``replica_view``): its compute and TP communication at its
degree and share (the slowest replica sets the stage's pace), and its GPUs'
memory with the layers' states sharded over the ``dp`` devices that hold the
same weights. The weights are cut into ``tp`` shard chunks; the gradient of
chunk ``c`` is reduced over its holders, one device per replica
(``Stage.shard_holders``), all ``tp`` chunk groups at once; a device of the
replica with the smallest degree holds the most chunks and sets the sync's pace.
"""

from __future__ import annotations

from typing import Callable

from hetplan.cost.kernel import CostKernel
from hetplan.cost.memory import PeakTerms
from hetplan.cost.mixed import (
    held_params, segment_compute, stage_host_bytes, stage_peak_terms, stage_resident_parts,
)
from hetplan.cost.pipeline import stage_micro_batch_time
from hetplan.cost.stage import SegmentTiming, zero12_gradient_collective
from hetplan.plan.spec import Stage


def replica_view(stage: Stage, replica: int, share: int | None = None) -> Stage:
    """Replica ``replica`` as a stage of one TP degree: ``dp`` copies of its TP
    group, each with its share (or ``share``), so that everything the kernel
    derives from dp (states sharded over dp devices, the reduce buffer,
    ZeRO's step slices) and from the degree and share comes out as this
    replica's GPUs have it. The view keeps ``replica_tp`` (one degree for
    every copy, so its groups are the uniform ones): it marks a replica the
    runtime trains without a data-parallel wrapper (``mixed.stage_uses_ddp``)."""
    degree = stage.replica_degree(replica)
    share = stage.dp_split[replica] if share is None else share
    return Stage(stage.layers, stage.replica_devices(replica) * stage.dp, stage.dp, degree,
                 (share,) * stage.dp, stage.strategies, replica_tp=(degree,) * stage.dp)


def replica_time(kernel: CostKernel, stage: Stage, replica: int, share: int, micro_batch_size: int) -> float:
    """One micro-batch's compute and TP communication on replica ``replica``
    given ``share`` samples (what its place in the stage's time grows with)."""
    times = segment_compute(kernel, replica_view(stage, replica, share), list(range(stage.num_layers)),
                            micro_batch_size)
    return sum(times[:4])


def replica_fits(kernel: CostKernel, stage: Stage, replica: int, share: int, micro_batch_size: int,
                 in_flight: float, first_backward: bool, capacity: Callable[[int], int]) -> bool:
    """Every GPU of replica ``replica`` holds its layers with ``share`` samples
    per micro-batch (``capacity``: a device's bytes)."""
    terms = stage_peak_terms(kernel, replica_view(stage, replica, share), micro_batch_size, in_flight,
                             first_backward)
    return all(t.peak <= capacity(d) for d, t in zip(stage.replica_devices(replica), terms))


def _busiest_replica(stage: Stage) -> int:
    """The replica of the smallest TP degree: its devices hold the most shard chunks."""
    degrees = [stage.replica_degree(r) for r in range(stage.dp)]
    return degrees.index(min(degrees))


def replica_tp_timing(kernel: CostKernel, stage: Stage, micro_batch_size: int) -> SegmentTiming:
    """What a stage of mixed replica degrees charges (see the module docstring):
    compute and TP comm of its slowest replica, the data-parallel collectives
    of the busiest chunk holder over the shard-holder groups, the optimizer
    step of the slowest replica."""
    positions = list(range(stage.num_layers))
    worst: tuple[float, ...] = ()
    optimizer = 0.0
    for r in range(stage.dp):
        view = replica_view(stage, r)
        times = segment_compute(kernel, view, positions, micro_batch_size)
        if not worst or sum(times[:4]) > sum(worst[:4]):  # as replica_time
            worst = times
        step_rate = kernel.optimizer_rate(stage.replica_devices(r))
        optimizer = max(optimizer, sum(held_params(kernel, view, pos) * step_rate / (stage.dp if st.zero >= 1 else 1)
                                       for pos, st in enumerate(stage.strategies)))
    fwd, bwd, rec, tpc, offload = worst
    gather = scatter = sync = post = 0.0
    busiest = replica_view(stage, _busiest_replica(stage))
    groups = stage.dp_groups()

    def rate(kind: str) -> float:
        return kernel.holder_groups_rate(kind, groups, stage.tp)

    for pos, strategy in enumerate(stage.strategies):
        params = held_params(kernel, busiest, pos)
        if strategy.zero >= 3:
            gather += params * kernel.weight_bytes * rate("allgather")
            scatter += params * kernel.grad_bytes * rate("reduce_scatter")
        elif strategy.zero in (1, 2):
            sync += params * kernel.grad_bytes * rate(zero12_gradient_collective(strategy.zero))
            post += params * kernel.weight_bytes * rate("allgather")
        else:
            sync += params * kernel.grad_bytes * rate("allreduce")
    zero3 = float(stage_micro_batch_time(fwd, bwd + rec, 0.0, gather, scatter, kernel.overlap_slowdown)) - fwd - bwd - rec
    return SegmentTiming(fwd, bwd, rec, tpc, zero3, sync, post, optimizer, offload)


def replica_tp_peak_terms(kernel: CostKernel, stage: Stage, micro_batch_size: int, in_flight: float,
                          first_backward: bool = False) -> list[PeakTerms]:
    """Each device's memory terms (``memory.PeakTerms``), replica after replica,
    each replica's GPUs at its own degree and share."""
    out: list[PeakTerms] = []
    for r in range(stage.dp):
        terms = stage_peak_terms(kernel, replica_view(stage, r), micro_batch_size, in_flight, first_backward)
        out.extend(terms[:stage.replica_degree(r)])
    return out


def replica_tp_host_bytes(kernel: CostKernel, stage: Stage, micro_batch_size: int, in_flight: float) -> list[float]:
    """Each device's offloaded activations in host memory (``mixed.stage_host_bytes``), replica after replica."""
    out: list[float] = []
    for r in range(stage.dp):
        out.extend(stage_host_bytes(kernel, replica_view(stage, r), micro_batch_size, in_flight)
                   [:stage.replica_degree(r)])
    return out


def replica_tp_resident_parts(kernel: CostKernel, stage: Stage) -> list[dict[str, float]]:
    """Each device's parameters, gradients and optimizer states kept between
    steps (``mixed.stage_resident_parts``), replica after replica."""
    out: list[dict[str, float]] = []
    for r in range(stage.dp):
        parts = stage_resident_parts(kernel, replica_view(stage, r))
        out.extend(dict(parts) for _ in range(stage.replica_degree(r)))
    return out
