"""A pipelined plan's replay check with fewer micro-batches, extrapolated
exactly (issue 28: "seconds per plan for a 70B-class model on 2 cores").

A replay's cost is the torch ops it dispatches, about blocks x micro-batches
(``runtime/replay.py``); a pipeline's stage replays one step of all ``m``
micro-batches after its stages are initialized. :func:`fast_replay` replays
the plan with ``m1`` and ``m1 + 1`` micro-batches of the same size
(:func:`micro_batch_samples`) and takes each rank's peaks at ``m`` on the line
through the two.

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

The line's slope from a copy with fewer blocks (:func:`slope_copy`). Under
1F1B what grows per micro-batch -- the batch's rows, torch pipelining's
receive buffers (forward and gradient) and losses per micro-batch -- does not
depend on a stage's blocks: the activations a stage holds are bounded by
``pp - j`` micro-batches whatever ``m`` is. So the plan itself is replayed
at ``m1`` only, and the growth per micro-batch taken from its copy with
:data:`COPY_BLOCKS` blocks a stage, replayed at ``m1`` and ``m1 + 1``; the
copy's stages hand the plan's the shapes torch pipelining inferred for them
(the embedding and head are the plan's, so the stages' inputs and outputs are
the same), which spares the plan's replay the inference's micro-batch
(``replay.StageMetadata``). Tests hold the result equal to the full two-step
replay to the byte (bf16 dp2 ZeRO-3 with full recompute, three stages with
selective recompute); at Llama-3-70B it equals the two samples from the plan
itself to the byte (``benchmarks/bench_replay.py``). GPipe holds all ``m``
micro-batches' activations (a growth per block) and an interleaved schedule
cuts its chunks from the blocks: both take both samples from the plan.

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
from hetplan.plan.spec import Plan, Stage
from hetplan.plan.support import builtin_refusal
from hetplan.runtime.replay import LiveBytes, PlanReplay, StageReplay, chains_checked_once, replay_counted, \
    replay_plan

# The schedules whose phase peaks tests/test_replay_micro.py holds affine in the micro-batch count from
# micro_batch_samples' first on (to the byte against full replays).
EXTRAPOLATED_SCHEDULES = frozenset({"1f1b", "gpipe", "interleaved-1f1b"})
# The phases whose peaks lie each on its own line (module doc).
PHASES = ("forward", "backward", "optimizer")
# Decoder blocks per stage in the copy that gives a 1F1B stage's growth per micro-batch (slope_copy): three,
# as every block count from three on holds the same FSDP2 prefetch window (two blocks reach the embedding
# and head; measured on tiny-gpt dp2 ZeRO-3 with full recompute, branch replayfast).
COPY_BLOCKS = 3


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
    """``replay_plan(plan, spec)``'s peaks, from replays of fewer micro-batches where
    :func:`extrapolates`, else by ``replay_plan`` itself. Each rank's phase peaks are taken at
    the first sample from the plan itself and grow per micro-batch as between the samples of
    :func:`slope_copy` where it gives one, else of the plan (module doc)."""
    if not extrapolates(plan):
        return replay_plan(plan, spec)
    start = time.perf_counter()
    copy = slope_copy(plan, spec)
    stages = extrapolated(plan, spec, copy if copy is not None and copy_cheaper(plan, copy[0]) else None)
    return PlanReplay(stages, time.perf_counter() - start)


def extrapolated(plan: Plan, spec: Any, copy: tuple[Plan, Any] | None) -> tuple[StageReplay, ...]:
    """Each replayed rank of ``plan`` at its micro-batch count, its peaks at the first sample
    from ``plan`` and their growth per micro-batch from ``copy`` (a plan and its model), or
    from ``plan`` where ``copy`` is None."""
    first, second = micro_batch_samples(plan)
    slope_plan, slope_spec = copy if copy is not None else (plan, spec)
    # the copy's stages record their inferred shapes and hand them to the plan's (replay.StageMetadata)
    shapes: dict[tuple[int, int], Any] | None = {} if copy is not None else None
    with chains_checked_once():
        low = None if copy is None else phase_replay(with_micro_batches(slope_plan, first), slope_spec, shapes)
        high = phase_replay(with_micro_batches(slope_plan, second), slope_spec, shapes)
        base = phase_replay(with_micro_batches(plan, first), spec, shapes)
        low = low if low is not None else base
    steps, rest = divmod(plan.num_micro_batches - first, second - first)  # rest 0: m a multiple of pp if interleaved
    assert rest == 0, (plan.num_micro_batches, first, second)
    assert [s.rank for s, _ in base] == [s.rank for s, _ in high], "the copy replays other ranks"
    stages = []
    for (stage, at_base), (_, at_low), (_, at_high) in zip(base, low, high):
        device, host = zip(*(_line(at_base.get(p, (0, 0)), at_low.get(p, (0, 0)), at_high.get(p, (0, 0)), steps)
                             for p in PHASES))
        stages.append(replace(stage, peak_bytes=max(device), host_peak_bytes=max(host)))
    return tuple(stages)


def slope_copy(plan: Plan, spec: Any) -> tuple[Plan, Any] | None:
    """``plan`` and its model with each stage's decoder blocks cut to its first
    :data:`COPY_BLOCKS`, where what a stage holds per micro-batch does not depend on its
    blocks (module doc): 1F1B, hetplan's built-in decoder (a HF or ``pkg.mod:build`` model
    cannot be built with fewer blocks), identical blocks, one strategy per stage's blocks.
    None where it does not apply or no stage has more blocks than the copy."""
    if plan.schedule != "1f1b" or spec.source is not None or builtin_refusal(spec):
        return None
    blocks = spec.layers[1:-1]
    if any(replace(b, name=blocks[0].name) != blocks[0] for b in blocks):
        return None
    positions = [_block_positions(stage, len(spec.layers)) for stage in plan.stages]
    if any(len({stage.strategies[p] for p in kept}) > 1 for stage, kept in zip(plan.stages, positions)) or \
            all(len(kept) <= COPY_BLOCKS for kept in positions):
        return None
    layers, stages = [spec.layers[0]], []
    for stage, kept in zip(plan.stages, positions):
        dropped, blocks_here = set(kept[COPY_BLOCKS:]), set(kept)
        indices, strategies = [], []
        for p, index in enumerate(stage.layers):
            if p in dropped:
                continue
            if p in blocks_here:
                indices.append(len(layers))
                layers.append(replace(spec.layers[index], name=f"layers.{len(layers) - 1}"))
            else:
                indices.append(-1 if index else 0)  # the head: numbered once every block is
            strategies.append(stage.strategies[p])
        stages.append((stage, indices, strategies))
    layers.append(spec.layers[-1])
    head = len(layers) - 1
    cut = tuple(replace(stage, layers=tuple(head if i == -1 else i for i in indices), strategies=tuple(strategies))
                for stage, indices, strategies in stages)
    return replace(plan, stages=cut), replace(spec, layers=tuple(layers))


def copy_cheaper(plan: Plan, copy: Plan) -> bool:
    """Whether the copy's two samples dispatch fewer ops than the plan's second: a replay's
    work is about its blocks x micro-batches (module doc), counting one more micro-batch per
    sample for the stages' initialization (an upper bound for the samples that take the
    copy's shapes)."""
    first, second = micro_batch_samples(plan)
    blocks = sum(len(stage.layers) for stage in plan.stages)
    return sum(len(stage.layers) for stage in copy.stages) * (first + second + 2) < blocks * (second + 1)


def _block_positions(stage: Stage, layer_count: int) -> list[int]:
    """Positions in ``stage.layers`` of its decoder blocks (not the embedding or the head)."""
    return [p for p, index in enumerate(stage.layers) if 0 < index < layer_count - 1]


def _line(base: tuple[int, int], low: tuple[int, int], high: tuple[int, int], steps: int) -> tuple[int, int]:
    """The (device, host) peaks ``steps`` sample intervals past ``base``, growing as from ``low`` to ``high``."""
    return base[0] + steps * (high[0] - low[0]), base[1] + steps * (high[1] - low[1])


def with_micro_batches(plan: Plan, count: int) -> Plan:
    """``plan`` with ``count`` micro-batches of the same size per step."""
    return replace(plan, num_micro_batches=count, global_batch_size=plan.micro_batch_size * count)


def phase_replay(plan: Plan, spec: Any, stage_shapes: dict[tuple[int, int], Any] | None = None,
                 ) -> list[tuple[StageReplay, dict[str, tuple[int, int]]]]:
    """Each replayed rank of ``plan`` (one step after the states are made and the stages
    initialized: ``replay.replay_rank``) with its phases' peaks; ``stage_shapes``: the stages'
    shapes recorded or handed over (``replay.StageMetadata``)."""
    made: list[PhasePeaks] = []
    flag = OptimizerFlag()

    def counter() -> LiveBytes:
        made.append(PhasePeaks(flag))
        return made[-1]

    with flag.hooked():
        stages = replay_counted(plan, spec, counter, stage_shapes=stage_shapes)
    return [(stage, live.phase_peaks) for (stage, _), live in zip(stages, made)]
