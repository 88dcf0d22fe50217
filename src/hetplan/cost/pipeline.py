"""How stage times combine: overlap, one micro-batch through a stage, the
pipeline (AMP eq. 4-5, Metis eq. 1) and the whole iteration.

With ``m`` micro-batches, per-micro-batch stage times ``t_j`` (forward +
backward) and one-way p2p times ``c_j`` between stage j and j+1::

    T_pipe = (m − 1) · max_j t_j + Σ_j t_j + 2 · Σ_j c_j

The first micro-batch crosses every stage and link forward and the last one
crosses them backward (the ``Σ`` terms); in between the slowest stage sets the
pace, or the slowest link if it is slower still: each link carries one
micro-batch's activations forward and its gradients back per micro-batch (one
transfer at a time each way, so ``max_j t_j`` becomes ``max(max_j t_j, max_j c_j)``;
on a fast network it is the stage). Under plain 1F1B a stage holds at most
``pp − j`` micro-batches, and each must go down the pipeline and back before
the stage takes another: the pace is the largest mean of ``t + 2c`` over every
run of consecutive stages (:func:`one_f_one_b_period`), which is at least both.
Interleaved 1F1B with ``v`` model chunks per device shrinks the fill and drain
by ``v`` (Narayanan et al. 2021 §2.2.2) but crosses each link ``v`` times:
``T = m·max t + (Σ t − max t)/v + 2v·Σ c`` (its pace the slowest stage or ``v``
link crossings; its round trips are not modelled). GPipe runs every forward
before any backward, so its pace stays the slowest stage or link.

The iteration then waits for every stage's gradient synchronisation: stage
``j`` finishes its last backward pass earlier than stage 0 by the backward
passes and links in front of it (Galvatron-BMW eq. 8), and its sync overlaps
that last backward pass. Gradient clipping needs every stage's gradients
(Megatron-LM's global norm), so the optimizer steps start together after the
last sync; each stage then runs its step and, under ZeRO-1/2, all-gathers its
updated parameters (ZeRO §5) — the slowest stage's step ends the iteration::

    T = max(T_pipe, max_j (T_pipe − A_j + exposed_j)) + max_j (step_j + gather_j)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np

from hetplan.cost.constants import CPU_OVERLAP_SLOWDOWN, OVERLAP_SLOWDOWN, P2P_PASSES


def overlapped_exposure(comm_s: np.ndarray | float, compute_s: np.ndarray | float,
                        slowdown: float = OVERLAP_SLOWDOWN) -> np.ndarray | float:
    """Extra time when ``comm_s`` runs under ``compute_s`` (elementwise on arrays).

    Galvatron-BMW §V (and its code's ``bct_dp_overlap``): the overlapped part
    runs ``slowdown`` times slower (OVERLAP_SLOWDOWN on GPUs), so the pair takes
    ``max(c, p) + (slowdown − 1)·min(c, p)`` instead of ``p``; a slowdown of 2
    is no overlap at all (``c + p``).
    """
    scalar = isinstance(comm_s, (float, int)) and isinstance(compute_s, (float, int))  # np.float64 is a float
    if not scalar and not np.any(comm_s):  # no communication (e.g. no ZeRO-3 gathers): nothing exposed
        return np.zeros(np.broadcast(comm_s, compute_s).shape)
    larger, smaller = (max, min) if scalar else (np.maximum, np.minimum)
    exposed = larger(comm_s, compute_s) + (slowdown - 1.0) * smaller(comm_s, compute_s) - compute_s
    if scalar:
        return float(exposed) if comm_s > 0 else 0.0
    return np.where(np.asarray(comm_s) > 0, exposed, 0.0)


def stage_micro_batch_time(fwd_s: np.ndarray | float, back_s: np.ndarray | float, tp_comm_s: np.ndarray | float,
                           gather_s: np.ndarray | float, scatter_s: np.ndarray | float,
                           slowdown: float = OVERLAP_SLOWDOWN) -> np.ndarray | float:
    """One micro-batch through a stage: forward, backward (+ recompute), TP
    communication, and ZeRO-3's parameter all-gathers overlapped with the
    forward and the gathers + gradient reduce-scatters with the backward."""
    return (fwd_s + back_s + tp_comm_s + overlapped_exposure(gather_s, fwd_s, slowdown)
            + overlapped_exposure(gather_s + scatter_s, back_s, slowdown))


def exposed_grad_sync(sync_s: np.ndarray | float, back_s: np.ndarray | float,
                      overlap: bool, slowdown: float = OVERLAP_SLOWDOWN) -> np.ndarray | float:
    """The part of a stage's end-of-step gradient sync not hidden behind its
    last backward pass (all of it without overlap)."""
    return overlapped_exposure(sync_s, back_s, slowdown) if overlap else sync_s


def overlap_slowdown(gpu_names: Iterable[str]) -> float:
    """How much overlapped communication and computation slow each other on
    these devices: OVERLAP_SLOWDOWN on GPUs (copy engines and NICs move data
    while the SMs compute), CPU_OVERLAP_SLOWDOWN on CPU processes."""
    return CPU_OVERLAP_SLOWDOWN if all(name == "CPU" for name in gpu_names) else OVERLAP_SLOWDOWN


def pipeline_time(stage_times: Sequence[float], p2p_times: Sequence[float], num_micro_batches: int,
                  virtual_stages: int = 1, schedule: str = "1f1b") -> float:
    """Time for ``num_micro_batches`` to pass forward and backward through the
    pipeline (module docstring); under plain 1F1B the pace is
    :func:`one_f_one_b_period`, which holds the round trips over slow links."""
    if not len(stage_times):
        return 0.0
    v = max(1, virtual_stages)
    # a link busier per micro-batch than every stage sets the pace (each chunk boundary on it is crossed once per
    # micro-batch each way: v crossings of a physical link under interleaving); simulate/events.py replays it
    slowest = one_f_one_b_period(stage_times, p2p_times) if schedule == "1f1b" and v == 1 else \
        max(max(stage_times), v * max(p2p_times, default=0.0))  # 1F1B's pace holds both
    return num_micro_batches * slowest + (sum(stage_times) - slowest) / v + P2P_PASSES * v * sum(p2p_times)


def one_f_one_b_period(stage_times: Sequence[float], p2p_times: Sequence[float]) -> float:
    """The steady pace of a 1F1B pipeline: the largest mean, over every run of
    consecutive stages ``j..l``, of ``Σ t + 2 Σ c`` (its stages and the links
    between them). Stage ``j`` runs ``pp − j`` forwards, then alternates one
    backward and one forward (torch 2.13 ``Schedule1F1B``: ``warmup_chunks =
    min(n_microbatches, num_stages − stage_index)``; Megatron-LM's 1F1B alike),
    so its backward of micro-batch ``i`` is followed by its forward of
    ``i + pp − j``, which crosses to stage ``l`` and comes back as the backward
    of ``i + l − j + 1``: a cycle of ``l − j + 1`` micro-batches through those
    stages and links each way. The pace is at least every such cycle's mean
    (the cycle means of the schedule's event graph); a run of one stage gives
    the stage's own time, as the closed form, and a run of two holds each
    link's one way (``(t_j + t_{j+1} + 2c_j)/2 >= c_j``). It binds where a link
    is comparable to the stages, as between nodes on Ethernet or between
    zones (``hetplan choose``): on 2,000 random pipelines with links from a
    tenth of a stage to nine stages the pipeline time so paced is at most 6%
    under the event simulator's (``simulate/events.py``;
    ``tests/test_simulate.py``), against 68% under with the slowest stage or
    link as the pace; at few micro-batches it can be up to 24% over."""
    times = [float(t) for t in stage_times]
    links = [float(c) for c in p2p_times] + [0.0]
    best = 0.0
    for j in range(len(times)):  # O(pp²) in plain Python: pipelines are short, and this runs per candidate
        legs = 0.0  # Σ t + 2 Σ c over the run j..l, less the last link's
        for length, (t, c) in enumerate(zip(times[j:], links[j:]), start=1):
            best = max(best, (legs + t) / length)
            legs += t + P2P_PASSES * c
    return best


@dataclass(frozen=True)
class StageTail:
    """What a stage adds after its last backward pass."""

    back_s: float  # its backward (+ recompute) of one micro-batch: what the sync overlaps
    sync_s: float  # end-of-step gradient reduction, before overlap
    post_step_s: float  # ZeRO-1/2 parameter all-gather after the optimizer step
    optimizer_s: float


@dataclass(frozen=True)
class IterationTime:
    pipeline_s: float
    finish_s: float  # pipeline plus the exposed gradient sync tail
    optimizer_s: float  # the optimizer step of the stage whose step (+ gather) ends last
    post_step_s: float  # that stage's ZeRO-1/2 parameter all-gather

    @property
    def total_s(self) -> float:
        return self.finish_s + self.optimizer_s + self.post_step_s

    @property
    def sync_tail_s(self) -> float:
        return self.finish_s - self.pipeline_s


def iteration_time(stage_times: Sequence[float], p2p_times: Sequence[float], tails: Sequence[StageTail],
                   num_micro_batches: int, overlap_grad_sync: bool, virtual_stages: int = 1,
                   slowdown: float = OVERLAP_SLOWDOWN, pipeline_s: float | None = None,
                   schedule: str = "1f1b") -> IterationTime:
    """The whole step (module docstring): pipeline, sync tail, optimizer.
    ``pipeline_s``: the pipeline's time where the closed form does not hold
    (processes sharing cores, ``cost/shared_cores.py``)."""
    t_pipe = pipeline_time(stage_times, p2p_times, num_micro_batches, virtual_stages, schedule) \
        if pipeline_s is None else pipeline_s
    finish = t_pipe
    ahead = 0.0
    for j, tail in enumerate(tails):
        if j > 0:
            ahead += tails[j - 1].back_s + p2p_times[j - 1]
        exposed = float(exposed_grad_sync(tail.sync_s, tail.back_s, overlap_grad_sync, slowdown))
        finish = max(finish, t_pipe - ahead + exposed)
    last = max(tails, key=step_after_sync)
    return IterationTime(t_pipe, finish, last.optimizer_s, last.post_step_s)


def step_after_sync(tail: StageTail) -> float:
    """What a stage does after the global gradient sync: its optimizer step and
    (ZeRO-1/2) the all-gather of its updated parameters."""
    return tail.optimizer_s + tail.post_step_s
