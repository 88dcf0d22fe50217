"""A pipelined plan's replay check with fewer micro-batches, extrapolated
exactly (issue 28: "seconds per plan for a 70B-class model on 2 cores").

A replay's cost is the torch ops it dispatches, about blocks x micro-batches
(``runtime/replay.py``); a pipeline's stage replays two steps of all ``m``
micro-batches. :func:`fast_replay` replays the plan with ``m1`` and ``m1 + 1``
micro-batches of the same size (:func:`micro_batch_samples`) and takes each
rank's peaks at ``m`` on the line through the two.

Why a line. After a schedule's warm-up the live set of a stage repeats from
one micro-batch to the next (1F1B: stage ``j`` holds at most ``pp - j``
micro-batches' activations, and from ``m = pp + 1`` on every stage runs a
forward beside accumulated gradients); what still grows with ``m`` -- the
replica's whole batch of token ids, torch pipelining's receive buffers and
losses per micro-batch, GPipe's ``m`` micro-batches of activations -- grows
by the same bytes per micro-batch. The peak is the largest over the step's
moments, and a largest of lines is a line only while one moment kind holds
it (the optimizer's step, which holds no activations, can be the peak at
few micro-batches and not at many). So the peaks are kept per phase --
forward, backward (inside the autograd engine) and the optimizer's step --
each phase's on its own line, and the rank's peak is the largest of the
phases' at ``m`` (device and host bytes apart). That each phase's peak is
affine from ``m1`` on is what ``tests/test_replay_micro.py`` checks: the
extrapolated peaks equal full replays to the byte.

Only the schedules those tests hold (:data:`EXTRAPOLATED_SCHEDULES`) are
extrapolated, on torch pipelining's executor: a plan of another schedule, a
heterogeneous pipeline (``runtime/hetero.py``, not tested here), a plan of one
stage (replayed in one step already), or one with ``m`` no larger than the
samples' is replayed in full.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import replace
from typing import Any, Iterator

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from hetplan.plan.layout import runs_heterogeneous
from hetplan.plan.spec import Plan
from hetplan.runtime.replay import LiveBytes, PlanReplay, StageReplay, replay_counted, replay_plan

# The schedules whose phase peaks tests/test_replay_micro.py holds affine in the micro-batch count from
# micro_batch_samples' first on (to the byte against full replays).
EXTRAPOLATED_SCHEDULES = frozenset({"1f1b", "gpipe", "interleaved-1f1b"})
# The phases whose peaks lie each on its own line (module doc).
PHASES = ("forward", "backward", "optimizer")


class OptimizerFlag:
    """Whether an optimizer's step runs now (torch's global optimizer step hooks, while :meth:`hooked`)."""

    def __init__(self) -> None:
        self.stepping = False

    @contextlib.contextmanager
    def hooked(self) -> Iterator[None]:
        """Flag every optimizer's steps inside."""
        def enter(*_: Any) -> None:
            self.stepping = True

        def leave(*_: Any) -> None:
            self.stepping = False

        handles = (register_optimizer_step_pre_hook(enter), register_optimizer_step_post_hook(leave))
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()


class PhasePeaks(LiveBytes):
    """:class:`LiveBytes` that also keeps each phase's device and host peaks of the step (module doc)."""

    def __init__(self, optimizer: OptimizerFlag) -> None:
        super().__init__()
        self.optimizer = optimizer
        self.phase_peaks: dict[str, tuple[int, int]] = {}

    def reset_peak(self) -> None:
        super().reset_peak()
        self.phase_peaks = {self.phase(): (self.now, self.host_now)}

    def phase(self) -> str:
        """The phase running now: the optimizer's step, an autograd node (backward), or forward."""
        if self.optimizer.stepping:
            return "optimizer"
        return "backward" if torch._C._current_autograd_node() is not None else "forward"

    def grew(self) -> None:
        phase = self.phase()
        device, host = self.phase_peaks.get(phase, (0, 0))
        self.phase_peaks[phase] = (max(device, self.now), max(host, self.host_now))


def micro_batch_samples(plan: Plan) -> tuple[int, int]:
    """The two micro-batch counts replayed. 1F1B and GPipe: ``pp + 1`` (every stage past its
    warm-up: module doc) and one more. Interleaved 1F1B runs a multiple of ``pp`` micro-batches
    (``plan/validate.py``) in rounds of ``pp`` (torch 2.13 ``_PipelineScheduleRuntime``'s
    ``microbatches_per_round``): ``3 pp`` and ``4 pp``, a round apart (from ``2 pp`` the line
    missed tiny-gpt pp2 x 2 chunks' stage 0 by +8,448 B at 8 micro-batches)."""
    pp = len(plan.stages)
    if plan.schedule == "interleaved-1f1b":
        return 3 * pp, 4 * pp
    return pp + 1, pp + 2


def extrapolates(plan: Plan) -> bool:
    """Whether :func:`fast_replay` replays ``plan`` with fewer micro-batches (module doc)."""
    return len(plan.stages) > 1 and plan.schedule in EXTRAPOLATED_SCHEDULES and not runs_heterogeneous(plan) \
        and plan.num_micro_batches > micro_batch_samples(plan)[1]


def fast_replay(plan: Plan, spec: Any) -> PlanReplay:
    """``replay_plan(plan, spec)``'s peaks, from two replays of fewer micro-batches where
    :func:`extrapolates`, else by ``replay_plan`` itself."""
    if not extrapolates(plan):
        return replay_plan(plan, spec)
    start = time.perf_counter()
    first, second = micro_batch_samples(plan)
    low, high = (phase_replay(with_micro_batches(plan, m), spec) for m in (first, second))
    steps, rest = divmod(plan.num_micro_batches - first, second - first)  # rest 0: m a multiple of pp if interleaved
    assert rest == 0, (plan.num_micro_batches, first, second)
    stages = []
    for (stage, at_low), (_, at_high) in zip(low, high):
        device, host = zip(*(_line(at_low.get(p, (0, 0)), at_high.get(p, (0, 0)), steps) for p in PHASES))
        stages.append(replace(stage, peak_bytes=max(device), host_peak_bytes=max(host)))
    return PlanReplay(tuple(stages), time.perf_counter() - start)


def _line(low: tuple[int, int], high: tuple[int, int], steps: int) -> tuple[int, int]:
    """The (device, host) peaks ``steps`` sample intervals past ``low``, ``high`` one past it."""
    return low[0] + steps * (high[0] - low[0]), low[1] + steps * (high[1] - low[1])


def with_micro_batches(plan: Plan, count: int) -> Plan:
    """``plan`` with ``count`` micro-batches of the same size per step."""
    return replace(plan, num_micro_batches=count, global_batch_size=plan.micro_batch_size * count)


def phase_replay(plan: Plan, spec: Any) -> list[tuple[StageReplay, dict[str, tuple[int, int]]]]:
    """Each replayed rank of ``plan`` (two steps, the peaks the second's) with its phases' peaks."""
    made: list[PhasePeaks] = []
    flag = OptimizerFlag()

    def counter() -> LiveBytes:
        made.append(PhasePeaks(flag))
        return made[-1]

    with flag.hooked():
        stages = replay_counted(plan, spec, counter, states_first=False)
    return [(stage, live.phase_peaks) for (stage, _), live in zip(stages, made)]
