"""The exact layer partition of a pipeline under the shared cost model.

Given the stages' device groups and, per stage, a few ways to run its layers
(``StageOption``: (dp, tp, data split) with a ZeRO stage and a recomputation
choice), find the contiguous layer split and the option of every stage that
minimise :meth:`hetplan.cost.CostModel.estimate`'s iteration time::

    F = P + max(0, max_j (x_j − A_j)) + max_j o_j

``P`` is the pipeline time ``(m − 1)·max t_j + Σ t_j + Σ e_j`` (stage time
per micro-batch ``t_j``, the two transfers of each boundary ``e_j``); ``x_j``
is stage j's exposed gradient sync, ``A_j`` the backward passes and links in
front of it; ``o_j`` its optimizer step plus (ZeRO-1/2) the all-gather of its
updated parameters (``cost/pipeline.py``). Every number comes from the
kernel's segment tables (``StageCosts.tables``), the same ones ``estimate`` reads.

The method. ``A_0 = 0``, so ``F >= F' = P + x_0 + max_j o_j``, and ``x_0``
depends on stage 0's segment alone: it is an extra cost of stage 0 in the
min-sum DP of ``fast_partition``. The step term is handled by a second
staircase: for a bound ``Ō`` only segments with ``o < Ō`` are allowed; the
best split under it has some ``O₁ < Ō``, and nothing with ``O`` in
``[O₁, Ō)`` can beat it, so the next bound is ``O₁`` — until the constrained
pipeline optimum plus the smallest achievable ``max o`` cannot beat the best
``F'`` found. That gives the exact ``min F'``. When the best split's true ``F``
equals its ``F'`` (stage 0's tail is the longest, as it almost always is: the
other stages finish their backward pass earlier) it is the exact optimum of
``F`` — *certified*; otherwise its ``F`` is within ``F − min F'`` of the
optimum, and small instances are settled by enumerating every split. Larger
ones are re-solved with every stage's tail, estimated from the previous
answer, as an extra cost (a repair: only a faster ``F`` is kept; the reported
bound stays ``min F'``).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, replace
from math import comb
from typing import Sequence

import numpy as np

from hetplan.cost.constants import P2P_PASSES
from hetplan.cost.kernel import CostKernel
from hetplan.cost.stage import SegmentTables, StageOption
from hetplan.cost.memory import in_flight_micro_batches
from hetplan.cost.pipeline import StageTail, exposed_grad_sync, iteration_time
from hetplan.plan import Stage
from hetplan.search.common.partition import PartitionProblem, fast_partition

INF = math.inf
# Splits × option choices enumerated when the staircase cannot certify its answer.
BRUTE_FORCE_LIMIT = 20_000
# Re-solves with later stages' sync tails as costs when the answer is not certified.
TAIL_REPAIRS = 1


@dataclass(frozen=True)
class PipelineSolution:
    """The best partition of one pipeline layout.

    Attributes:
        stages: the plan's stages (layers, devices, degrees, strategies).
        iteration_s: its iteration time under the shared model (= ``estimate``).
        lower_bound_s: no split or option choice of this layout is faster.
        certified: ``iteration_s`` is the exact optimum of the layout.
    """

    stages: tuple[Stage, ...]
    iteration_s: float
    lower_bound_s: float
    certified: bool


@dataclass(frozen=True)
class _Tables:
    """Every stage's options as (k, q, span, span) windows (``PartitionProblem``'s
    layout: ``[j, o, x, y]`` is layers ``[j + x, j + 1 + y)``), and the links.
    ``families`` (merged tables only): the member options of each family
    option; ``picks[j][o]``: which member each cell of it runs (None: its only member)."""

    options: tuple[tuple[StageOption, ...], ...]
    per_mb: np.ndarray
    back: np.ndarray
    sync: np.ndarray
    post: np.ndarray
    optimizer: np.ndarray
    fits: np.ndarray
    p2p: np.ndarray  # (k-1, L+1): one-way transfer when the cut is at position c
    extra: np.ndarray  # stage 0's tail x_0, zero elsewhere
    families: tuple[tuple[tuple[int, ...], ...], ...] = ()
    picks: tuple[tuple[np.ndarray | None, ...], ...] = ()


class PipelinePartitioner:
    """Solves layouts of one workload and schedule (module docstring)."""

    def __init__(self, kernel: CostKernel, micro_batch_size: int, num_micro_batches: int,
                 schedule: str = "1f1b") -> None:
        if schedule not in ("1f1b", "gpipe"):
            raise ValueError("the exact partition handles 1f1b and gpipe schedules")
        self.kernel = kernel
        self.micro_batch_size = micro_batch_size
        self.num_micro_batches = num_micro_batches
        self.schedule = schedule
        self.overlap = kernel.workload.overlap_grad_sync

    # --- tables --------------------------------------------------------------------------
    def tables(self, options: Sequence[Sequence[StageOption]]) -> _Tables:
        """Every option of every stage, as one set of windows."""
        return self._assemble(options, [[self._segment(j, len(options), o) for o in stage]
                                        for j, stage in enumerate(options)])

    def _segment(self, j: int, k: int, option: StageOption) -> SegmentTables:
        """Stage ``j``'s window (of ``k`` stages) of one option's kernel tables."""
        in_flight = in_flight_micro_batches(self.schedule, j, k, self.num_micro_batches)
        return self.kernel.stage(option).tables(in_flight, (j, self.kernel.num_layers - k + 1))

    def _assemble(self, options: Sequence[Sequence[StageOption]], segments: Sequence[Sequence[SegmentTables]],
                  families: tuple[tuple[tuple[int, ...], ...], ...] = (),
                  picks: Sequence[Sequence[np.ndarray | None]] = ()) -> _Tables:
        """Per-stage lists of windows stacked into (k, q, span, span) arrays
        (stages with fewer options padded with never-fitting ones)."""
        k, n = len(segments), self.kernel.num_layers
        q = max(len(s) for s in segments)
        span = n - k + 1
        shape = (k, q, span, span)
        per_mb, fits = np.full(shape, INF), np.zeros(shape, dtype=bool)
        back, sync, post, opt = (np.zeros(shape) for _ in range(4))
        for j, stage_segments in enumerate(segments):
            for o, t in enumerate(stage_segments):
                per_mb[j, o], back[j, o], sync[j, o] = t.per_micro_batch_s, t.back_s, t.grad_sync_s
                post[j, o], opt[j, o], fits[j, o] = t.post_step_s, t.optimizer_s, t.fits
        p2p = np.zeros((max(k - 1, 0), n + 1))
        output = self.kernel.arrays.output_bytes
        for j in range(k - 1):
            rate = self.kernel.p2p_rate(options[j][0].devices, options[j + 1][0].devices)
            p2p[j, 1:n] = rate * output[:n - 1] * self.micro_batch_size
        return _Tables(tuple(tuple(o) for o in options), per_mb, back, sync, post, opt, fits, p2p,
                       self._stage0_tail(sync, back, post), families, tuple(tuple(p) for p in picks))

    def _stage0_tail(self, sync: np.ndarray, back: np.ndarray, post: np.ndarray) -> np.ndarray:
        """The sum-only extra: stage 0's exposed gradient sync."""
        extra = np.zeros(sync.shape)
        extra[0] = exposed_grad_sync(sync[0], back[0], self.overlap)
        return extra

    def merged(self, options: Sequence[Sequence[StageOption]]) -> _Tables:
        """Options that differ only in recomputation merged into one *family* per
        stage, running at each layer range the fastest member that fits: members
        of a family share their ZeRO traffic and optimizer step, and a member
        that recomputes more is slower (stage 0's exposed sync shrinks by at
        most 0.7 of the added backward time), so the family is at least as good
        as each member at every range for the objective the staircase minimises."""
        k = len(options)
        families = tuple(_families(stage) for stage in options)
        segments, picks = [], []
        for j, (stage, stage_families) in enumerate(zip(options, families)):
            merged = [_merge_family([self._segment(j, k, stage[i]) for i in family], family)
                      for family in stage_families]
            segments.append([m[0] for m in merged])
            picks.append([m[1] for m in merged])
        return self._assemble(options, segments, families, picks)

    # --- the true objective ---------------------------------------------------------------------
    def iteration_s(self, tables: _Tables, bounds: Sequence[int], choice: Sequence[int]) -> float:
        """``F`` of one split and option choice, from the tables (what ``estimate`` returns)."""
        k = len(choice)
        cells = [(j, choice[j], bounds[j] - j, bounds[j + 1] - j - 1) for j in range(k)]
        times = [float(tables.per_mb[c]) for c in cells]
        tails = [StageTail(float(tables.back[c]), float(tables.sync[c]), float(tables.post[c]),
                           float(tables.optimizer[c])) for c in cells]
        p2p = [float(tables.p2p[j, bounds[j + 1]]) for j in range(k - 1)]
        return iteration_time(times, p2p, tails, self.num_micro_batches, self.overlap).total_s

    # --- solving --------------------------------------------------------------------------------
    def solve(self, options: Sequence[Sequence[StageOption]], incumbent: float = INF) -> PipelineSolution | None:
        """The best split and options of one layout (None: nothing fits, or
        nothing of the layout can be faster than ``incumbent``)."""
        if len(options) > self.kernel.num_layers:
            return None
        tables = self.merged(options)
        found = self._staircase(tables, incumbent)
        if found is None:
            return None
        (bounds, choice), true_f, lower = found
        if true_f <= lower * (1 + 1e-12):
            return PipelineSolution(self._stages(tables, bounds, choice), true_f, lower, True)
        if self._enumerable(options):
            members = self.tables(options)
            bounds, choice, true_f = self._brute_force(members)
            return PipelineSolution(self._stages(members, bounds, choice), true_f, true_f, True)
        for _ in range(TAIL_REPAIRS if lower < incumbent else 0):
            repaired = self._staircase(self._with_tails(tables, bounds, choice), incumbent)
            if repaired is None:
                break
            (b, c), _, _ = repaired
            f = self.iteration_s(tables, b, c)
            if f >= true_f * (1 - 1e-12):
                break
            bounds, choice, true_f = b, c, f
        return PipelineSolution(self._stages(tables, bounds, choice), true_f, lower, False)

    def _with_tails(self, tables: _Tables, bounds: Sequence[int], choice: Sequence[int]) -> _Tables:
        """The tables with every later stage's sync tail as an extra cost, taking
        the backward passes in front of it from a previous solution (a heuristic
        repair when stage 0's tail is not the longest; ``F`` decides)."""
        extra = tables.extra.copy()
        ahead = 0.0
        for j in range(1, len(choice)):
            cell = (j - 1, choice[j - 1], bounds[j - 1] - (j - 1), bounds[j] - j)
            ahead += float(tables.back[cell]) + float(tables.p2p[j - 1, bounds[j]])
            exposed = exposed_grad_sync(tables.sync[j], tables.back[j], self.overlap)
            extra[j] = np.maximum(exposed - ahead, 0.0)
        return replace(tables, extra=extra)

    def _staircase(self, tables: _Tables, incumbent: float = INF) \
            -> tuple[tuple[tuple[int, ...], tuple[int, ...]], float, float] | None:
        """Exact ``min F'`` (module docstring), with the true ``F`` of the best
        split visited; returns ((bounds, options), F, min F'). Stops early (and
        may return None) once nothing left can beat ``incumbent``."""
        m = self.num_micro_batches
        cuts = P2P_PASSES * tables.p2p[:, 1:-1] if len(tables.p2p) else None
        step = tables.optimizer + tables.post  # what each stage does after the global sync
        floor = PartitionProblem.from_windows(step, 1, None, tables.fits).min_bottleneck()
        if not math.isfinite(floor):
            return None
        best_f_prime, best_true, best = INF, INF, None
        bound = INF
        base = PartitionProblem.from_windows(tables.per_mb, m, cuts, tables.fits, tables.extra)
        while True:
            problem = base.restricted(tables.fits & (step < bound)) if math.isfinite(bound) else base
            part = fast_partition(problem)
            if part is None or part.cost_s + floor >= best_f_prime:
                break
            if part.cost_s + floor >= incumbent:  # what is left cannot beat the incumbent
                best_f_prime = min(best_f_prime, incumbent)
                break
            cells = [(j, o, a - j, b - j - 1) for j, (o, a, b) in enumerate(zip(part.options, part.boundaries,
                                                                               part.boundaries[1:]))]
            largest_step = max(float(step[c]) for c in cells)
            best_f_prime = min(best_f_prime, part.cost_s + largest_step)
            true_f = self.iteration_s(tables, part.boundaries, part.options)
            if true_f < best_true:
                best_true, best = true_f, (part.boundaries, part.options)
            bound = largest_step
        if best is None:
            return None
        return best, best_true, best_f_prime

    def _enumerable(self, options: Sequence[Sequence[StageOption]]) -> bool:
        k, q = len(options), max(len(o) for o in options)
        return comb(self.kernel.num_layers - 1, k - 1) * q ** k <= BRUTE_FORCE_LIMIT

    def _brute_force(self, tables: _Tables) -> tuple[tuple[int, ...], tuple[int, ...], float]:
        """Every split and option choice (small instances)."""
        k, q = tables.per_mb.shape[:2]
        n = self.kernel.num_layers
        best: tuple[tuple[int, ...], tuple[int, ...], float] | None = None
        for cuts in itertools.combinations(range(1, n), k - 1):
            bounds = (0, *cuts, n)
            for choice in itertools.product(range(q), repeat=k):
                if not all(tables.fits[j, o, bounds[j] - j, bounds[j + 1] - j - 1] for j, o in enumerate(choice)):
                    continue
                f = self.iteration_s(tables, bounds, choice)
                if best is None or f < best[2]:
                    best = (bounds, choice, f)
        assert best is not None  # the staircase found a fitting split
        return best

    @staticmethod
    def _stages(tables: _Tables, bounds: Sequence[int], choice: Sequence[int]) -> tuple[Stage, ...]:
        """The plan's stages; for merged tables, each stage runs its family's picked member."""
        stages = []
        for j, o in enumerate(choice):
            a, b = bounds[j], bounds[j + 1]
            member = o
            if tables.families:
                pick = tables.picks[j][o]
                member = tables.families[j][o][0] if pick is None else int(pick[a - j, b - j - 1])
            stages.append(tables.options[j][member].stage(range(a, b)))
        return tuple(stages)


def _families(options: Sequence[StageOption]) -> tuple[tuple[int, ...], ...]:
    """Indices of the options that differ only in recomputation, grouped, in order."""
    groups: dict[StageOption, list[int]] = {}
    for index, option in enumerate(options):
        groups.setdefault(replace(option, recompute="none"), []).append(index)
    return tuple(tuple(g) for g in groups.values())


def _merge_family(members: Sequence[SegmentTables],
                  indices: Sequence[int]) -> tuple[SegmentTables, np.ndarray | None]:
    """One family's windows: at every range the fastest member that fits (the
    first member where none fits), and which option index that is (None for a
    single member)."""
    if len(members) == 1:
        return members[0], None
    fits = np.stack([m.fits for m in members])
    best = np.where(fits, np.stack([m.per_micro_batch_s for m in members]), INF).argmin(axis=0)
    first = members[0]  # ZeRO traffic and optimizer step are the family's, whatever it recomputes
    merged = replace(first, per_micro_batch_s=np.choose(best, [m.per_micro_batch_s for m in members]),
                     back_s=np.choose(best, [m.back_s for m in members]), fits=fits.any(axis=0))
    return merged, np.asarray(indices)[best]
