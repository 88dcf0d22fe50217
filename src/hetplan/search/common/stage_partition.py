"""The exact layer partition of a pipeline under the shared cost model.

Given the stages' device groups and, per stage, a few ways to run its layers
(``StageOption``: (dp, tp, data split) with a ZeRO stage and a recomputation
choice), find the contiguous layer split and the option of every stage that
minimise :meth:`hetplan.cost.CostModel.estimate`'s iteration time::

    F = P + max(0, max_j (x_j − A_j)) + max_j o_j

``P`` is the pipeline time ``(m − 1)·pace + Σ t_j + Σ e_j`` (stage time per
micro-batch ``t_j``, the two transfers of each boundary ``e_j = 2·c_j``); under
1F1B the pace is the largest mean of ``t + 2c`` over every run of consecutive
stages (``cost.pipeline.one_f_one_b_period``: the round trips a stage waits
for), under GPipe ``max_j max(t_j, c_j)`` (a link slower than every stage
paces it); ``x_j``
is stage j's exposed gradient sync, ``A_j`` the backward passes and links in
front of it; ``o_j`` its optimizer step plus (ZeRO-1/2) the all-gather of its
updated parameters (``cost/pipeline.py``). Every number comes from the
kernel's segment tables (``StageCosts.tables``), the same ones ``estimate`` reads.

The method. Since ``x_j − A_j`` is the end of stage ``j``'s sync, for any
weights ``λ ≥ 0`` summing to one, ``F >= L_λ = P + Σ_j λ_j (x_j − A_j) + max_j o_j``
(a Lagrangian relaxation of the max). ``L_λ`` splits into per-stage and
per-boundary costs: stage ``i`` adds ``λ_i x_i − Λ_i back_i`` to the sum and
its boundary carries ``2 − Λ_i`` transfers, ``Λ_i = Σ_{j>i} λ_j``. So it is the
min-sum DP of ``fast_partition`` (under 1F1B its label DP, which carries
the pace of every run of stages) with a sum-only extra per stage, and the
step term is handled by a second staircase: for a bound ``Ō`` only segments
with ``o < Ō`` are allowed; the best split under it has some ``O₁ < Ō``, and
nothing with ``O`` in ``[O₁, Ō)`` can beat it, so the next bound is ``O₁`` —
until the constrained pipeline optimum plus the smallest achievable
``max o`` cannot beat the best found. That gives the exact ``min L_λ``: a lower
bound on the layout's optimum, and splits whose true ``F`` is evaluated.

``λ`` starts on stage 0 (``A_0 = 0``: ``L`` is ``F`` whenever stage 0's sync
ends last, as it usually does — the other stages finish their backward pass
earlier). When the answer's ``F`` does not reach the bound, another stage's
sync ended last; ``λ`` moves toward that stage (a subgradient step on the
dual; at most ``LAGRANGE_STEPS`` times, and only while the answer is more than
``DUAL_GAP`` above the bound — callers that want a close answer, like auto's
second solve of a layout left uncertified, ask for more). The layout's bound is the largest
``min L_λ``, its answer the best ``F`` seen, *certified* when they meet. Small
instances that stay uncertified are settled by enumerating every split.
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
from hetplan.plan.spec import Stage
from hetplan.search.common.partition import PartitionProblem, fast_partition

INF = math.inf
# Splits × option choices enumerated when the staircase cannot certify its answer.
BRUTE_FORCE_LIMIT = 20_000
# Dual steps (module docstring) per layout when the answer is not certified.
LAGRANGE_STEPS = 3
# Dual steps are taken while the answer is this far above the bound (small gaps are
# left: the steps cost a staircase each and rarely change a plan that close).
DUAL_GAP = 1.0
# Pipeline solves per dual step's staircase before it settles for a bound (the first step is exact).
STAIRS_PER_STEP = 3


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
class PartitionTables:
    """Every stage's options as (k, q, span, span) windows (``PartitionProblem``'s
    layout: ``[j, o, x, y]`` is layers ``[j + x, j + 1 + y)``), and the links.
    ``members[j][o]``: the windows of the options option ``o`` of stage ``j``
    stands for (itself, or a recomputation family's members);
    ``families``/``picks`` (merged tables only): the member option indices of
    each family option and which member each cell runs (None: its only member)."""

    options: tuple[tuple[StageOption, ...], ...]
    per_mb: np.ndarray
    back: np.ndarray
    sync: np.ndarray
    post: np.ndarray
    optimizer: np.ndarray
    fits: np.ndarray
    p2p: np.ndarray  # (k-1, L+1): one-way transfer when the cut is at position c
    members: tuple[tuple[tuple[SegmentTables, ...], ...], ...]
    families: tuple[tuple[tuple[int, ...], ...], ...] = ()
    picks: tuple[tuple[np.ndarray | None, ...], ...] = ()


@dataclass(frozen=True)
class _Relaxation:
    """``L_λ`` (module docstring) as a partition objective: the sum-only extra
    of every cell and the transfers each boundary carries."""

    weights: np.ndarray  # λ per stage
    extra: np.ndarray  # (k, q, span, span)
    link_passes: np.ndarray  # (k-1,)


@dataclass(frozen=True)
class _Staircase:
    """One staircase's answer: the best split by true ``F`` among those
    visited, its ``F``, ``min L_λ``, and the split that attains it."""

    best: tuple[tuple[int, ...], tuple[int, ...]]
    true_f: float
    lower_s: float
    relaxed: tuple[tuple[int, ...], tuple[int, ...]]


class PipelinePartitioner:
    """Solves plan shapes (``search.auto.PlanShape``) of one workload and schedule (module docstring)."""

    def __init__(self, kernel: CostKernel, micro_batch_size: int, num_micro_batches: int,
                 schedule: str = "1f1b") -> None:
        if schedule not in ("1f1b", "gpipe"):
            raise ValueError("the exact partition handles 1f1b and gpipe schedules")
        self.kernel = kernel
        self.micro_batch_size = micro_batch_size
        self.num_micro_batches = num_micro_batches
        self.schedule = schedule
        self.overlap = kernel.workload.overlap_grad_sync
        self.slowdown = kernel.overlap_slowdown
        self._merged: dict[tuple[tuple[StageOption, ...], ...], PartitionTables] = {}  # a shape solved again

    # --- tables --------------------------------------------------------------------------
    def tables(self, options: Sequence[Sequence[StageOption]]) -> PartitionTables:
        """Every option of every stage, as one set of windows."""
        segments = [[self._segment(j, len(options), o) for o in stage] for j, stage in enumerate(options)]
        return self._assemble(options, segments, [[(t,) for t in stage] for stage in segments])

    def _segment(self, j: int, k: int, option: StageOption) -> SegmentTables:
        """Stage ``j``'s window (of ``k`` stages) of one option's kernel tables."""
        in_flight = in_flight_micro_batches(self.schedule, j, k, self.num_micro_batches)
        return self.kernel.stage(option).tables(in_flight, (j, self.kernel.num_layers - k + 1), self.num_micro_batches)

    def _assemble(self, options: Sequence[Sequence[StageOption]], segments: Sequence[Sequence[SegmentTables]],
                  members: Sequence[Sequence[tuple[SegmentTables, ...]]],
                  families: tuple[tuple[tuple[int, ...], ...], ...] = (),
                  picks: Sequence[Sequence[np.ndarray | None]] = ()) -> PartitionTables:
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
        return PartitionTables(tuple(tuple(o) for o in options), per_mb, back, sync, post, opt, fits, p2p,
                       tuple(tuple(m) for m in members), families, tuple(tuple(p) for p in picks))

    def merged(self, options: Sequence[Sequence[StageOption]]) -> PartitionTables:
        """Options that differ only in recomputation merged into one *family* per
        stage, running at each layer range the fastest member that fits: members
        of a family share their ZeRO traffic and optimizer step and a member that
        recomputes more is slower, so the family's time is the least of its
        members' (the relaxation charges each cell its members' least cost)."""
        key = tuple(tuple(stage) for stage in options)
        if key not in self._merged:
            self._merged[key] = self._merge(options)
        return self._merged[key]

    def _merge(self, options: Sequence[Sequence[StageOption]]) -> PartitionTables:
        """:meth:`merged`, built."""
        k = len(options)
        families = tuple(_families(stage) for stage in options)
        segments, members, picks = [], [], []
        for j, (stage, stage_families) in enumerate(zip(options, families)):
            stage_members = [tuple(self._segment(j, k, stage[i]) for i in family) for family in stage_families]
            merged = [_merge_family(m, family) for m, family in zip(stage_members, stage_families)]
            segments.append([m[0] for m in merged])
            picks.append([m[1] for m in merged])
            members.append(stage_members)
        return self._assemble(options, segments, members, families, picks)

    # --- the relaxation ---------------------------------------------------------------------
    def relaxation(self, tables: PartitionTables, weights: np.ndarray) -> _Relaxation:
        """``L_λ`` for these weights: per cell the least over the members that
        fit of ``t + λ_i x_i − Λ_i back_i``, as an extra over the cell's time
        (the bottleneck term takes the least ``t``; both under-estimate, so the
        minimum stays a lower bound)."""
        k = len(weights)
        after = np.concatenate([np.cumsum(weights[::-1])[::-1][1:], [0.0]])  # Λ_i = Σ_{j>i} λ_j
        extra = np.zeros(tables.per_mb.shape)
        for i in range(k):
            if weights[i] == 0.0 and after[i] == 0.0:
                continue
            for o, family in enumerate(tables.members[i]):
                value = np.full(tables.per_mb.shape[2:], INF)
                for m in family:
                    exposed = exposed_grad_sync(m.grad_sync_s, m.back_s, self.overlap, self.slowdown)
                    cost = m.per_micro_batch_s + weights[i] * exposed - after[i] * m.back_s
                    value = np.minimum(value, np.where(m.fits, cost, INF))
                time = tables.per_mb[i, o]
                extra[i, o] = np.where(np.isfinite(time) & np.isfinite(value), value - np.where(
                    np.isfinite(time), time, 0.0), 0.0)
        return _Relaxation(weights, extra, P2P_PASSES - after[:k - 1])

    def _last_tail(self, tables: PartitionTables, bounds: Sequence[int], choice: Sequence[int]) -> int:
        """The stage whose gradient sync ends last in this split (``iteration_time``'s ``finish``)."""
        cells = [(j, o, bounds[j] - j, bounds[j + 1] - j - 1) for j, o in enumerate(choice)]
        ahead, last, latest = 0.0, 0, -INF
        for j, cell in enumerate(cells):
            if j > 0:
                ahead += float(tables.back[cells[j - 1]]) + float(tables.p2p[j - 1, bounds[j]])
            end = float(exposed_grad_sync(float(tables.sync[cell]), float(tables.back[cell]), self.overlap,
                                          self.slowdown)) - ahead
            if end > latest:
                last, latest = j, end
        return last

    # --- the true objective ---------------------------------------------------------------------
    def iteration_s(self, tables: PartitionTables, bounds: Sequence[int], choice: Sequence[int]) -> float:
        """``F`` of one split and option choice, from the tables (what ``estimate`` returns)."""
        k = len(choice)
        cells = [(j, choice[j], bounds[j] - j, bounds[j + 1] - j - 1) for j in range(k)]
        times = [float(tables.per_mb[c]) for c in cells]
        tails = [StageTail(float(tables.back[c]), float(tables.sync[c]), float(tables.post[c]),
                           float(tables.optimizer[c])) for c in cells]
        p2p = [float(tables.p2p[j, bounds[j + 1]]) for j in range(k - 1)]
        return iteration_time(times, p2p, tails, self.num_micro_batches, self.overlap,
                              slowdown=self.slowdown, schedule=self.schedule).total_s

    # --- solving --------------------------------------------------------------------------------
    def solve(self, options: Sequence[Sequence[StageOption]], incumbent: float = INF,
              dual_steps: int = LAGRANGE_STEPS, stairs: int | None = STAIRS_PER_STEP,
              dual_gap: float = DUAL_GAP) -> PipelineSolution | None:
        """The best split and options of one layout (None: nothing fits, or
        nothing of the layout can be faster than ``incumbent``). ``dual_steps``
        and ``stairs`` (None: exact) set the work spent when the first answer is
        not certified, and only while it is more than ``dual_gap`` above the
        bound (module docstring)."""
        k = len(options)
        if k > self.kernel.num_layers:
            return None
        tables = self.merged(options)
        weights = np.zeros(k)
        weights[0] = 1.0
        best: tuple[tuple[int, ...], tuple[int, ...]] | None = None
        true_f, lower = INF, -INF
        for step in range(dual_steps + 1):
            # only what beats both the incumbent and this layout's best so far matters
            found = self._staircase(tables, self.relaxation(tables, weights), min(incumbent, true_f),
                                    stairs if step else None)
            if found is None:  # nothing fits, or no split's L comes under the incumbent
                if best is None:
                    return None
                lower = max(lower, min(incumbent, true_f))
                break
            lower = max(lower, found.lower_s)
            if found.true_f < true_f:
                best, true_f = found.best, found.true_f
            if true_f <= lower * (1 + max(dual_gap, 1e-12)) or lower >= incumbent:
                break
            last = self._last_tail(tables, *found.relaxed)  # a subgradient: move λ toward it
            weights = weights * (1 - 1 / (step + 2))
            weights[last] += 1 / (step + 2)
        assert best is not None
        if true_f <= lower * (1 + 1e-12):
            return PipelineSolution(self._stages(tables, *best), true_f, lower, True)
        if self._enumerable(options):
            members = self.tables(options)
            bounds, choice, true_f = self._brute_force(members)
            return PipelineSolution(self._stages(members, bounds, choice), true_f, true_f, True)
        return PipelineSolution(self._stages(tables, *best), true_f, lower, False)

    def _staircase(self, tables: PartitionTables, relaxation: _Relaxation, incumbent: float = INF,
                   max_stairs: int | None = None) -> _Staircase | None:
        """Exact ``min L_λ`` (module docstring), with the true ``F`` of the best
        split visited. Stops early (and may return None) once nothing left can
        beat ``incumbent``; after ``max_stairs`` pipeline solves it returns a
        lower bound on ``min L_λ`` instead (every split not yet excluded costs
        at least the last constrained optimum plus the least step)."""
        m = self.num_micro_batches
        cuts = relaxation.link_passes[:, None] * tables.p2p[:, 1:-1] if len(tables.p2p) else None
        step = tables.optimizer + tables.post  # what each stage does after the global sync
        floor = PartitionProblem.from_windows(step, 1, None, tables.fits).min_bottleneck()
        if not math.isfinite(floor):
            return None
        best_l, best_true, best, relaxed = INF, INF, None, None
        bound = INF
        base = PartitionProblem.from_windows(tables.per_mb, m, cuts, tables.fits, relaxation.extra,
                                             link_pace=tables.p2p, one_f_one_b=self.schedule == "1f1b")
        for stair in itertools.count():
            problem = base.restricted(tables.fits & (step < bound)) if math.isfinite(bound) else base
            part = fast_partition(problem)
            if part is None or part.cost_s + floor >= best_l:
                break
            if max_stairs is not None and stair >= max_stairs:  # give up exactness, keep a valid bound
                best_l = part.cost_s + floor
                break
            if part.cost_s + floor >= incumbent:  # what is left cannot beat the incumbent
                best_l = min(best_l, incumbent)
                break
            cells = [(j, o, a - j, b - j - 1) for j, (o, a, b) in enumerate(zip(part.options, part.boundaries,
                                                                               part.boundaries[1:]))]
            largest_step = max(float(step[c]) for c in cells)
            if part.cost_s + largest_step < best_l:
                best_l, relaxed = part.cost_s + largest_step, (part.boundaries, part.options)
            true_f = self.iteration_s(tables, part.boundaries, part.options)
            if true_f < best_true:
                best_true, best = true_f, (part.boundaries, part.options)
            bound = largest_step
        if best is None or relaxed is None:
            return None
        return _Staircase(best, best_true, best_l, relaxed)

    def _enumerable(self, options: Sequence[Sequence[StageOption]]) -> bool:
        k, q = len(options), max(len(o) for o in options)
        return comb(self.kernel.num_layers - 1, k - 1) * q ** k <= BRUTE_FORCE_LIMIT

    def _brute_force(self, tables: PartitionTables) -> tuple[tuple[int, ...], tuple[int, ...], float]:
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
    def _stages(tables: PartitionTables, bounds: Sequence[int], choice: Sequence[int]) -> tuple[Stage, ...]:
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
    """Indices of the options that differ only in recomputation and activation
    offloading (both trade time for activation memory; neither changes ZeRO
    traffic or the optimizer step), grouped, in order."""
    groups: dict[StageOption, list[int]] = {}
    for index, option in enumerate(options):
        groups.setdefault(replace(option, recompute="none", offload=False), []).append(index)
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
                     back_s=np.choose(best, [m.back_s for m in members]), fits=np.asarray(fits.any(axis=0)))
    return merged, np.asarray(indices)[best]
