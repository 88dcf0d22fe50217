"""The exact layer partition of a pipeline under the shared cost model.

Given the stages' device groups and, per stage, a few ways to run its layers
(``StageOption``: (dp, tp, data split) with a ZeRO stage and a recomputation
choice), find the contiguous layer split and the option of every stage that
minimise :meth:`hetplan.cost.CostModel.estimate`'s iteration time::

    F = P + max(0, max_j (x_j − A_j)) + max_j o_j

``P`` is the pipeline time ``(m − 1)·max t_j + Σ t_j + Σ e_j`` (stage time
per micro-batch ``t_j``, the two transfers of each boundary ``e_j``); ``x_j``
is stage j's exposed gradient sync plus its post-step all-gather, ``A_j`` the
backward passes and links in front of it; ``o_j`` its optimizer step
(``cost/pipeline.py``). Every number comes from the kernel's segment tables
(``StageCosts.tables``), the same ones ``estimate`` reads.

The method. ``A_0 = 0``, so ``F >= F' = P + x_0 + max_j o_j``, and ``x_0``
depends on stage 0's segment alone: it is an extra cost of stage 0 in the
min-sum DP of ``fast_partition``. The optimizer term is handled by a second
staircase: for a bound ``Ō`` only segments with ``o < Ō`` are allowed; the
best split under it has some ``O₁ < Ō``, and nothing with ``O`` in
``[O₁, Ō)`` can beat it, so the next bound is ``O₁`` — until the constrained
pipeline optimum plus the smallest achievable ``max o`` cannot beat the best
``F'`` found. That gives the exact ``min F'``. When the best split's true ``F``
equals its ``F'`` (stage 0's tail is the longest, as it almost always is: the
other stages finish their backward pass earlier) it is the exact optimum of
``F`` — *certified*; otherwise its ``F`` is within ``F − min F'`` of the
optimum, and small instances are settled by enumerating every split.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from math import comb
from typing import Sequence

import numpy as np

from hetplan.cost.constants import P2P_PASSES
from hetplan.cost.kernel import CostKernel, SegmentTables, StageOption
from hetplan.cost.memory import in_flight_micro_batches
from hetplan.cost.pipeline import StageTail, exposed_grad_sync, iteration_time
from hetplan.plan import Stage
from hetplan.search.common.partition import PartitionProblem, fast_partition

INF = math.inf
# Splits × option choices enumerated when the staircase cannot certify its answer.
BRUTE_FORCE_LIMIT = 20_000


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
    layout: ``[j, o, x, y]`` is layers ``[j + x, j + 1 + y)``), and the links."""

    options: tuple[tuple[StageOption, ...], ...]
    per_mb: np.ndarray
    back: np.ndarray
    sync: np.ndarray
    post: np.ndarray
    optimizer: np.ndarray
    fits: np.ndarray
    p2p: np.ndarray  # (k-1, L+1): one-way transfer when the cut is at position c
    extra: np.ndarray  # stage 0's tail x_0, zero elsewhere


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
        k, n = len(options), self.kernel.num_layers
        q = max(len(o) for o in options)
        span = n - k + 1
        shape = (k, q, span, span)
        per_mb, fits = np.full(shape, INF), np.zeros(shape, dtype=bool)
        back, sync, post, opt = (np.zeros(shape) for _ in range(4))
        for j, stage_options in enumerate(options):
            in_flight = in_flight_micro_batches(self.schedule, j, k, self.num_micro_batches)
            for o, option in enumerate(stage_options):
                t: SegmentTables = self.kernel.stage(option).tables(in_flight, (j, span))
                per_mb[j, o], back[j, o], sync[j, o] = t.per_micro_batch_s, t.back_s, t.grad_sync_s
                post[j, o], opt[j, o], fits[j, o] = t.post_step_s, t.optimizer_s, t.fits
        extra = np.zeros(shape)
        extra[0] = exposed_grad_sync(sync[0], back[0], self.overlap) + post[0]
        p2p = np.zeros((max(k - 1, 0), n + 1))
        output = self.kernel.arrays.output_bytes
        for j in range(k - 1):
            rate = self.kernel.p2p_rate(options[j][0].devices, options[j + 1][0].devices)
            p2p[j, 1:n] = rate * output[:n - 1] * self.micro_batch_size
        return _Tables(tuple(tuple(o) for o in options), per_mb, back, sync, post, opt, fits, p2p, extra)

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
    def solve(self, options: Sequence[Sequence[StageOption]]) -> PipelineSolution | None:
        """The best split and options of one layout (None: nothing fits)."""
        if len(options) > self.kernel.num_layers:
            return None
        tables = self.tables(options)
        found = self._staircase(tables)
        if found is None:
            return None
        (bounds, choice), true_f, lower = found
        certified = true_f <= lower * (1 + 1e-12)
        if not certified and self._enumerable(tables):
            bounds, choice, true_f = self._brute_force(tables)
            lower, certified = true_f, True
        return PipelineSolution(self._stages(tables, bounds, choice), true_f, lower, certified)

    def _staircase(self, tables: _Tables) -> tuple[tuple[tuple[int, ...], tuple[int, ...]], float, float] | None:
        """Exact ``min F'`` (module docstring), with the true ``F`` of the best
        split visited; returns ((bounds, options), F, min F')."""
        m = self.num_micro_batches
        cuts = P2P_PASSES * tables.p2p[:, 1:-1] if len(tables.p2p) else None
        floor = PartitionProblem.from_windows(tables.optimizer, 1, None, tables.fits).min_bottleneck()
        if not math.isfinite(floor):
            return None
        best_f_prime, best_true, best = INF, INF, None
        bound = INF
        while True:
            allowed = tables.fits & (tables.optimizer < bound) if math.isfinite(bound) else tables.fits
            problem = PartitionProblem.from_windows(tables.per_mb, m, cuts, allowed, tables.extra)
            part = fast_partition(problem)
            if part is None or part.cost_s + floor >= best_f_prime:
                break
            cells = [(j, o, a - j, b - j - 1) for j, (o, a, b) in enumerate(zip(part.options, part.boundaries,
                                                                               part.boundaries[1:]))]
            largest_step = max(float(tables.optimizer[c]) for c in cells)
            best_f_prime = min(best_f_prime, part.cost_s + largest_step)
            true_f = self.iteration_s(tables, part.boundaries, part.options)
            if true_f < best_true:
                best_true, best = true_f, (part.boundaries, part.options)
            bound = largest_step
        if best is None:
            return None
        return best, best_true, best_f_prime

    def _enumerable(self, tables: _Tables) -> bool:
        k, q = tables.per_mb.shape[:2]
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
        return tuple(tables.options[j][o].stage(range(bounds[j], bounds[j + 1])) for j, o in enumerate(choice))
