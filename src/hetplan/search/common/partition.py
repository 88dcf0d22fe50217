"""Pipeline layer assignment: split L layers into k contiguous stages.

The objective is AMP's pipeline time (AMP eq. 5; Metis eq. 1; the shared cost
model's ``pipeline_time`` with ``e = 2·c``)::

    cost = (m − 1) · max_j t_j  +  Σ_j t_j  +  Σ_j e_j

where stage ``j`` (0-based) runs layers ``[b_j, b_{j+1})``, ``t_j`` is its time
per micro-batch on *its own devices* (stages may run on different GPU types),
``e_j`` is the time to cross the boundary between stage ``j`` and ``j + 1``
when the cut falls after layer ``b_{j+1} − 1`` (it may depend on both the cut
and the link), and ``m`` is the number of micro-batches. Optionally every
stage has a memory limit: the layers it holds must fit, where a layer may cost
a different number of bytes on different stages (stage ``j`` of a 1F1B
pipeline keeps ``pp − j`` micro-batches of activations).

Three exact solvers share one problem description, :class:`PartitionProblem`:

* :func:`fast_partition` — the one planners use. It walks the Pareto
  staircase of (bottleneck, sum). A min-sum dynamic program (Σ t + Σ e, every
  stage strictly faster than a bound ``U``; O(k·L²), vectorised with numpy)
  gives the cheapest split below each bound. Start with the unbounded min-sum
  split and the cheapest split among those with the smallest achievable
  bottleneck (a min-max DP) as incumbents; then repeatedly lower ``U`` to the
  bottleneck of the last answer — or further, to where ``(m − 1)·U`` plus the
  last answer's sum reaches the incumbent — and solve again, until the min-sum
  below ``U`` plus ``(m − 1)`` times the smallest bottleneck cannot beat the
  incumbent. Invariant: no split with bottleneck ≥ ``U`` beats the incumbent,
  so the result is exact. Each step costs O(k·L²); the number of steps is the
  number of Pareto points visited (about 15 at L = 96, k = 16 with random
  layer costs; ~1,000× faster than the paper's DP there).
  Supports heterogeneous stages and per-stage memory limits.
* :func:`reference_partition` — AMP §3.5 (eq. 6–8) as written: the table
  ``dp[i][j][m]`` over the auxiliary "tolerance" ``m`` (every possible stage
  time, plus 0), O(k·L⁴) work, vectorised over ``m``. It accepts stages with
  different speeds (the tolerance set is then the union of every stage's
  segment times, and the paper's lemma still holds) but, like the paper, has
  no memory limit.
* :func:`brute_force_partition` — every one of the C(L−1, k−1) splits.

Two generalisations serve the exact planners (``search/common/stage_partition.py``):
a stage may have several *options* (ways to run its layers: ZeRO stage,
recomputation) with their own time and memory per segment — the solvers then
choose a split and an option per stage together — and a segment may carry an
*extra* cost that counts in the sum but not in the bottleneck (stage 0's share
of the gradient-sync tail). The staircase argument is unchanged: for a bound
``U`` the min-sum DP picks, per segment, the cheapest option whose time is
below ``U``.

Under 1F1B the shared model's pace is not the slowest stage but the largest
mean of ``t + 2c`` over every run of consecutive stages (the round trips a
stage waits for, ``cost.pipeline.one_f_one_b_period``; ``one_f_one_b=True``).
No per-stage value carries it, so the min-sum below a pace ``U`` is a label DP:
a split's prefix is kept as (its sum, the largest excess over ``U`` of a run
ending at its last stage), only the Pareto front of those per end layer, each
stage extending every label to every end and option at once
(:meth:`PartitionProblem._min_sum_paced`). The staircase is unchanged; it
starts from the optimum of the same problem paced by its slowest stage or link
(a pace never above 1F1B's: the vectorised DP, cheap), whose split is close;
each of its steps needs only a sum under the incumbent less ``(m − 1)`` times
the least pace, so the DP drops a prefix whose sum plus the least sum of any
rest reaches that (``PartitionProblem._least_rest``). At 96 layers × 16
stages it takes ~20 ms; equal to brute force on random instances with
options, extras, memory limits and links (``tests/test_partition.py``).

Boundaries are returned as ``(b_0 = 0, b_1, …, b_k = L)``; stage ``j`` runs
``range(b_j, b_{j+1})`` (:meth:`Partition.ranges`). Ties between splits of equal
cost are broken deterministically but differently by each solver; compare
costs, not splits.

Also here: :func:`balanced_partition` (contiguous split minimising the largest
stage weight — Megatron/DeepSpeed's "balance by parameters").
"""

from __future__ import annotations

import copy

import itertools
import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from hetplan.cost.constants import P2P_PASSES
from hetplan.cost.pipeline import one_f_one_b_period
from hetplan.errors import HetplanError

INF = float("inf")
# Under 1F1B's pace the label DP keeps splits paced below the bound less this
# relative margin: the DP's and ``one_f_one_b_period``'s sums round differently,
# and a split paced at the bound itself must not come back (the staircase would
# repeat it). A split within it of the bound is skipped: at most this fraction of
# the pipeline term.
PACE_MARGIN = 1e-12
# A prefix is dropped from that DP once its sum plus the least rest reaches the
# cap plus this relative margin: the DP's sums and ``evaluate``'s round
# differently, and a split at the cap within rounding must still come back.
CAP_MARGIN = 1e-9

__all__ = [
    "Partition",
    "PartitionProblem",
    "balanced_partition",
    "brute_force_partition",
    "fast_partition",
    "reference_partition",
]


@dataclass(frozen=True)
class Partition:
    """A split of the layers into contiguous pipeline stages and its cost.

    Attributes:
        boundaries: ``(0, b_1, …, L)``; stage ``j`` runs layers ``[b_j, b_{j+1})``.
        cost_s: the objective, ``(m − 1)·max t + Σ t + Σ e``.
        stage_times_s: ``t_j`` per stage (with ``link_pace`` and without
            ``one_f_one_b``: the larger of ``t_j`` and its outgoing link's
            one-way time, its bottleneck value).
        boundary_times_s: ``e_j`` per boundary (k − 1 of them).
        options: the option each stage runs (all 0 for a problem without options).
        pace_s: 1F1B's pace (``cost.pipeline.one_f_one_b_period``) for a
            problem built with ``one_f_one_b``; None where the slowest stage
            (or link) paces the pipeline.
    """

    boundaries: tuple[int, ...]
    cost_s: float
    stage_times_s: tuple[float, ...]
    boundary_times_s: tuple[float, ...]
    options: tuple[int, ...] = ()
    pace_s: float | None = None

    @property
    def bottleneck_s(self) -> float:
        """What sets the pipeline's pace: 1F1B's round trips (``pace_s``, for a
        problem built with ``one_f_one_b``), else the slowest stage."""
        return self.max_stage_s if self.pace_s is None else self.pace_s

    @property
    def num_stages(self) -> int:
        return len(self.boundaries) - 1

    @property
    def sizes(self) -> tuple[int, ...]:
        """Layers per stage."""
        return tuple(b - a for a, b in zip(self.boundaries, self.boundaries[1:]))

    @property
    def max_stage_s(self) -> float:
        return max(self.stage_times_s)

    def ranges(self) -> list[range]:
        """Layer indices of each stage."""
        return [range(a, b) for a, b in zip(self.boundaries, self.boundaries[1:])]


def _as_stage_matrix(values: object, k: int, length: int, what: str) -> np.ndarray:
    """(length,) → broadcast to every stage; (k, length) kept; else an error."""
    arr = np.asarray(values, dtype=float)
    if arr.ndim == 1:
        if arr.shape[0] != length:
            raise HetplanError(f"{what} has {arr.shape[0]} entries, expected {length}")
        arr = np.broadcast_to(arr, (k, length))
    elif arr.ndim != 2 or arr.shape != (k, length):
        raise HetplanError(f"{what} must have shape ({length},) or ({k}, {length}), got {arr.shape}")
    if not np.all(np.isfinite(arr)):
        raise HetplanError(f"{what} must be finite")
    return arr


class PartitionProblem:
    """One pipeline layer-assignment problem (see the module docstring).

    Build it from per-layer numbers with the constructor, from whole-segment
    numbers with :meth:`from_segments` when a stage's time is not a sum over
    its layers (e.g. the slowest of several unequal replicas), or from the
    windows the solvers read with :meth:`from_windows`.

    Stage ``j`` of ``k`` starts at a layer in ``[j, j + span)`` and ends in
    ``[j + 1, j + 1 + span)`` with ``span = L − k + 1``; only that *window* of
    its segment costs is stored: ``[j, o, x, y]`` is option ``o`` of stage
    ``j`` on layers ``[j + x, j + 1 + y)`` (valid for ``x <= y``).

    Args:
        stage_layer_times: seconds per micro-batch of layer ``l`` when it runs
            on stage ``j``: shape ``(k, L)``, or ``(L,)`` for stages of equal
            speed (then give ``num_stages``).
        num_micro_batches: ``m`` (AMP's ``gas``), at least 1.
        boundary_times: ``e`` for a cut after layer ``c`` on boundary ``j``
            (between stage ``j`` and ``j + 1``): shape ``(k − 1, L − 1)``, or
            ``(L − 1,)`` when every link is the same; ``None`` for no cost.
        stage_layer_memory: bytes layer ``l`` needs on stage ``j``: ``(k, L)``
            or ``(L,)``; ``None`` for no memory limit.
        stage_memory_capacity: bytes each stage may use (scalar or ``(k,)``).
        num_stages: k, needed when every per-stage input is one-dimensional.
        link_pace: ``(k − 1, L + 1)``, one way of boundary ``j``'s transfer
            when the cut is at position ``c``: the pipeline runs at the pace of
            its slowest stage *or link* (``cost.pipeline.pipeline_time``), so
            a stage's bottleneck value is ``max(t_j, pace_j)`` while the sum
            keeps ``t_j`` (``None``: stages alone set the pace, as in AMP eq. 5).
        one_f_one_b: with ``link_pace``, the pace is 1F1B's instead: the
            largest mean of ``t + 2c`` over every run of consecutive stages
            (``cost.pipeline.one_f_one_b_period``, which holds each link's one
            way too). No per-stage value carries it, so the min-sum under a
            pace bound is a label DP (:meth:`_min_sum_paced`).
    """

    def __init__(
        self,
        stage_layer_times: Sequence[float] | Sequence[Sequence[float]] | np.ndarray,
        num_micro_batches: int,
        boundary_times: Sequence[float] | Sequence[Sequence[float]] | np.ndarray | None = None,
        stage_layer_memory: Sequence[float] | Sequence[Sequence[float]] | np.ndarray | None = None,
        stage_memory_capacity: float | Sequence[float] | np.ndarray | None = None,
        num_stages: int | None = None,
        link_pace: np.ndarray | None = None,
        one_f_one_b: bool = False,
    ) -> None:
        times = np.asarray(stage_layer_times, dtype=float)
        if times.ndim == 2:
            k = times.shape[0]
            if num_stages is not None and num_stages != k:
                raise HetplanError(f"stage_layer_times has {k} rows but num_stages={num_stages}")
        elif num_stages is None:
            raise HetplanError("give num_stages when stage_layer_times is one-dimensional")
        else:
            k = num_stages
        num_layers = times.shape[-1]
        times = _as_stage_matrix(times, k, num_layers, "stage_layer_times")
        if np.any(times < 0):
            raise HetplanError("layer times must be >= 0")
        if k > num_layers:
            raise HetplanError(f"cannot split {num_layers} layers into {k} stages: every stage needs at least one layer")
        fits = None
        if stage_layer_memory is not None or stage_memory_capacity is not None:
            if stage_layer_memory is None or stage_memory_capacity is None:
                raise HetplanError("give both stage_layer_memory and stage_memory_capacity, or neither")
            mem = _as_stage_matrix(stage_layer_memory, k, num_layers, "stage_layer_memory")
            cap = np.broadcast_to(np.asarray(stage_memory_capacity, dtype=float), (k,))
            fits = (_window_sums(mem) <= cap[:, None, None] * (1.0 + 1e-12))[:, None]
        segments = np.maximum(_window_sums(times), 0.0)[:, None]  # rounding of prefix differences
        self._init(segments, fits, None, num_micro_batches, boundary_times, num_layers, link_pace, one_f_one_b)

    @classmethod
    def from_segments(
        cls,
        segment_times: np.ndarray,
        num_micro_batches: int,
        boundary_times: Sequence[float] | Sequence[Sequence[float]] | np.ndarray | None = None,
        segment_fits: np.ndarray | None = None,
        segment_extra: np.ndarray | None = None,
        link_pace: np.ndarray | None = None,
        one_f_one_b: bool = False,
    ) -> PartitionProblem:
        """A problem from whole-segment numbers.

        Args:
            segment_times: shape ``(k, L + 1, L + 1)``; entry ``[j, a, b]`` is
                stage ``j``'s time per micro-batch when it runs layers
                ``[a, b)`` (only ``a < b`` is read). Shape ``(k, q, L + 1, L + 1)``
                gives every stage ``q`` options to choose from.
            segment_fits: same shape, bool: stage ``j`` may hold ``[a, b)``.
            segment_extra: same shape, >= 0: added to the sum, not the bottleneck.
            link_pace, one_f_one_b: as in the constructor.
        """
        times = np.asarray(segment_times, dtype=float)
        if times.ndim == 3:
            times = times[:, None]
        if times.ndim != 4 or times.shape[2] != times.shape[3]:
            raise HetplanError(f"segment_times must have shape (k, L+1, L+1) or (k, q, L+1, L+1), got {times.shape}")

        def same_shape(values: np.ndarray | None, what: str, dtype: type) -> np.ndarray | None:
            if values is None:
                return None
            arr: np.ndarray = np.asarray(values, dtype=dtype)
            arr = arr[:, None] if arr.ndim == 3 else arr
            if arr.shape != times.shape:
                raise HetplanError(f"{what} must have the shape of segment_times {times.shape}, got {arr.shape}")
            return _windows(arr)

        fits = same_shape(segment_fits, "segment_fits", bool)
        extra = same_shape(segment_extra, "segment_extra", float)
        self = cls.__new__(cls)
        self._init(_windows(times), fits, extra, num_micro_batches, boundary_times, times.shape[2] - 1, link_pace,
                   one_f_one_b)
        return self

    @classmethod
    def from_windows(cls, times: np.ndarray, num_micro_batches: int, boundary_times: np.ndarray | None,
                     fits: np.ndarray | None = None, extra: np.ndarray | None = None,
                     link_pace: np.ndarray | None = None, one_f_one_b: bool = False) -> PartitionProblem:
        """A problem from the windows themselves, ``(k, q, span, span)`` each
        (see the class docstring; what ``StageCosts.tables`` returns)."""
        k, _, span, _ = times.shape
        self = cls.__new__(cls)
        self._init(times, fits, extra, num_micro_batches, boundary_times, span + k - 1, link_pace, one_f_one_b)
        return self

    def _init(self, times: np.ndarray, fits: np.ndarray | None, extra: np.ndarray | None,
              num_micro_batches: int, boundary_times: object, num_layers: int,
              link_pace: np.ndarray | None = None, one_f_one_b: bool = False) -> None:
        k, q, span = times.shape[0], times.shape[1], times.shape[2]
        #: ``[j, y]``: one way of stage j's outgoing link when it ends at cell y (1F1B's pace only).
        self._outgoing: np.ndarray | None = None
        if link_pace is not None and k > 1:
            if one_f_one_b:
                self._outgoing = _outgoing(link_pace, k, span)
            else:
                times, extra = _paced(times, extra, _outgoing(link_pace, k, span))
        n = num_layers
        if k < 1:
            raise HetplanError("a pipeline needs at least one stage")
        if n < k or span != n - k + 1:
            raise HetplanError(f"cannot split {n} layers into {k} stages: every stage needs at least one layer")
        if num_micro_batches < 1 or int(num_micro_batches) != num_micro_batches:
            raise HetplanError(f"the number of micro-batches must be a positive integer, got {num_micro_batches}")
        self.num_stages = k
        self.num_options = q
        self.num_layers = n
        self.num_micro_batches = int(num_micro_batches)
        self.has_options_or_extra = q > 1 or extra is not None
        upper = np.triu(np.ones((span, span), dtype=bool))[None, None]
        #: the time, also where memory forbids it (for reports).
        self._raw = np.where(upper, times, INF)
        if not (self._raw >= 0).all():  # negative or NaN
            raise HetplanError("stage times must be >= 0")
        self._extra = extra
        self._allow(fits)
        self.cut_times = _cuts(boundary_times, k, n)

    def _allow(self, fits: np.ndarray | None) -> None:
        """Which cells may be used (None: all)."""
        self._allowed = fits
        self.has_memory_limit = fits is not None
        #: ``[j, o, x, y]``: option o of stage j on layers [j + x, j + 1 + y); +inf where not allowed.
        self.option_times = np.where(fits, self._raw, INF) if fits is not None else self._raw
        #: the same, plus the sum-only extra: what the stage adds to Σ.
        self.option_sums = self.option_times if self._extra is None else self.option_times + self._extra
        #: ``[j, x, y]``: the fastest allowed option's time (the only one when q = 1).
        self.window_times = self.option_times[:, 0] if self.num_options == 1 else self.option_times.min(axis=1)
        self._by_end_cache: tuple[np.ndarray, np.ndarray] | None = None
        self._least_rest_cache: np.ndarray | None = None

    def _stage_paced(self) -> PartitionProblem:
        """This 1F1B problem paced by its slowest stage or link instead: a pace
        never above 1F1B's with the same sums, so its optimum (the vectorised
        staircase, cheap) bounds this one's from below, and its split is a
        close first answer here."""
        assert self._outgoing is not None
        other = copy.copy(self)
        other._outgoing = None
        other._raw, other._extra = _paced(self._raw, self._extra, self._outgoing)
        other._allow(self._allowed)
        return other

    def restricted(self, allowed: np.ndarray) -> PartitionProblem:
        """The same problem with only the ``allowed`` cells usable (same shape as the times)."""
        other = copy.copy(self)
        other._allow(allowed)
        return other

    @property
    def span(self) -> int:
        return self.num_layers - self.num_stages + 1

    def segment_times(self) -> np.ndarray:
        """``[j, a, b]``: stage j's (fastest allowed option's) time on [a, b); +inf
        outside its window or where it is not allowed."""
        k, n, span = self.num_stages, self.num_layers, self.span
        full = np.full((k, n + 1, n + 1), INF)
        for j in range(k):
            full[j, j:j + span, j + 1:j + 1 + span] = self.window_times[j]
        return full

    # --- evaluating a given split ------------------------------------------------
    def check_boundaries(self, boundaries: Sequence[int]) -> tuple[int, ...]:
        b = tuple(int(x) for x in boundaries)
        if len(b) != self.num_stages + 1 or b[0] != 0 or b[-1] != self.num_layers:
            raise HetplanError(f"boundaries must be {self.num_stages + 1} cut positions from 0 to {self.num_layers}")
        if any(x >= y for x, y in zip(b, b[1:])):
            raise HetplanError(f"every stage needs at least one layer; got boundaries {b}")
        return b

    def _cell(self, j: int, option: int, a: int, b: int) -> tuple[int, int, int, int]:
        return j, option, a - j, b - j - 1

    def fits(self, boundaries: Sequence[int], options: Sequence[int] | None = None) -> bool:
        """Every stage within its memory limit (always true without limits)."""
        return self._fits(self.check_boundaries(boundaries), self._options(options))

    def _fits(self, b: tuple[int, ...], opts: tuple[int, ...]) -> bool:
        return all(math.isfinite(self.option_times[self._cell(j, opts[j], b[j], b[j + 1])])
                   for j in range(self.num_stages))

    def _options(self, options: Sequence[int] | None) -> tuple[int, ...]:
        if options is None:
            if self.num_options > 1:
                raise HetplanError("this problem has options per stage: give the option of every stage")
            return (0,) * self.num_stages
        if len(options) != self.num_stages or not all(0 <= o < self.num_options for o in options):
            raise HetplanError(f"give one option in 0..{self.num_options - 1} per stage, got {tuple(options)}")
        return tuple(int(o) for o in options)

    def evaluate(self, boundaries: Sequence[int], options: Sequence[int] | None = None) -> Partition:
        """The split's stage times and cost (``cost_s`` is inf if it does not fit)."""
        return self._evaluate(self.check_boundaries(boundaries), self._options(options))

    def _evaluate(self, b: tuple[int, ...], opts: tuple[int, ...]) -> Partition:
        """``evaluate`` of a split and options already checked (the solver's own)."""
        k = self.num_stages
        cells = [self._cell(j, opts[j], b[j], b[j + 1]) for j in range(k)]
        stage = tuple(float(self._raw[c]) for c in cells)
        sums = tuple(float(self.option_sums[c]) for c in cells)
        links = tuple(float(self.cut_times[j, b[j + 1]]) for j in range(k - 1))
        pace = None if self._outgoing is None else \
            one_f_one_b_period(stage, [float(self._outgoing[j, b[j + 1] - j - 1]) for j in range(k - 1)])
        bottleneck = max(stage) if pace is None else pace
        cost = (self.num_micro_batches - 1) * bottleneck + math.fsum(sums) + math.fsum(links) \
            if self._fits(b, opts) else INF
        return Partition(b, cost, stage, links, opts, pace)

    def cost(self, boundaries: Sequence[int], options: Sequence[int] | None = None) -> float:
        return self.evaluate(boundaries, options).cost_s

    # --- building blocks of the fast solver ----------------------------------------
    def _min_sum(self, bound: float, cap: float = INF) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
        """Split (and options) minimising Σ sums + Σ e with every stage time
        (1F1B: the pace) < ``bound`` (None: no such split). Under 1F1B's pace,
        ``cap``: the caller needs only a Σ under it, and None may also mean
        that none is (``_min_sum_paced`` drops the prefixes that cannot)."""
        if self._outgoing is not None and bound != INF:
            return self._min_sum_paced(bound, cap)
        k, n = self.num_stages, self.num_layers
        span = self.span
        columns = np.arange(span)
        best = np.full(span, INF)  # best[x]: cost of stages < j covering layers [0, j + x)
        best[0] = 0.0
        args = np.empty((k, span), dtype=np.int64)
        segments = self._segment_sums(bound)
        for j in range(k):
            start = best if j == 0 else best + self.cut_times[j - 1, j:j + span]
            total = segments[j] + start  # [y, x]: stages < j end at x, stage j runs [j + x, j + 1 + y)
            arg = total.argmin(axis=1)
            args[j] = arg
            best = total[columns, arg]
        if not math.isfinite(best[span - 1]):
            return None
        bounds = [n]
        options = []
        x = span - 1
        for j in range(k - 1, -1, -1):
            end = x
            x = int(args[j, x])
            options.append(self._best_option(j, x, end, bound))
            bounds.append(j + x)
        return tuple(reversed(bounds)), tuple(reversed(options))

    def _min_sum_paced(self, bound: float, cap: float = INF) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
        """``_min_sum`` under 1F1B's pace: the least Σ over splits whose every
        run of stages ``j..l`` has a mean ``t + 2c`` below ``U`` (the bound,
        less ``PACE_MARGIN``). Going stage by stage, that holds iff each stage
        starts with ``t_l + e_{l−1} < U`` where ``e_l = max(0, e_{l−1} + t_l +
        2c_l − U)`` is the largest excess of a run ending at ``l`` (``e_{−1} =
        0``): so a prefix is summed up by its end, its sum and its ``e``, and
        only prefixes no other beats on both sum and ``e`` (a Pareto front per
        end: a smaller ``e`` never hurts what follows) are extended. Each stage
        extends every label to every end and option at once (numpy), then keeps
        each end's front. A prefix whose sum plus the least sum of any rest
        (``_least_rest``) reaches ``cap`` (plus ``CAP_MARGIN``) is dropped, and
        so is every prefix it beats: what is left is each front's part under
        the cap, and the answer is the same whenever it is under the cap."""
        k, q, span = self.num_stages, self.num_options, self.span
        assert self._outgoing is not None
        limit = bound * (1.0 - PACE_MARGIN)
        ends = np.zeros(1, dtype=np.int64)  # per label: the cell where the next stage starts
        sums, excess = np.zeros(1), np.zeros(1)
        trail: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []  # per stage: (ends, parent, option)
        rest = self._least_rest() if cap < INF else None
        for j in range(k):
            cols = slice(span - 1, span) if j == k - 1 else slice(0, span)
            times = self.option_times[j][:, ends, cols]  # (q, labels, ends)
            cut = self.cut_times[j, j + 1:j + 1 + span][cols] if j < k - 1 else 0.0
            trip = P2P_PASSES * self._outgoing[j, cols]
            total = np.where(times + excess[None, :, None] < limit,
                             sums[None, :, None] + self.option_sums[j][:, ends, cols] + cut, INF)
            if rest is not None:  # no split through this prefix has a sum under the cap
                total[total + rest[j + 1, cols][None, None, :] >= cap + CAP_MARGIN * abs(cap)] = INF
            after = np.maximum(0.0, excess[None, :, None] + times + trip - limit)
            rows = q * len(ends)
            total, after = total.reshape(rows, -1).T, after.reshape(rows, -1).T  # [end, row]
            order = np.lexsort((after, total))  # per end: by sum, then excess
            total, after = np.take_along_axis(total, order, 1), np.take_along_axis(after, order, 1)
            lowest = np.minimum.accumulate(after, axis=1)
            front = np.isfinite(total) & (after < np.concatenate([np.full((len(total), 1), INF), lowest[:, :-1]], 1))
            end, rank = np.nonzero(front)
            if not len(end):
                return None
            row = order[end, rank]
            trail.append((ends, row % len(ends), row // len(ends)))
            ends = end + cols.start
            sums, excess = total[front], after[front]
        label = 0  # the last stage's front, by sum: its first is the least
        bounds, options = [self.num_layers], []
        for j in range(k - 1, -1, -1):
            starts, parent, option = trail[j]
            options.append(int(option[label]))
            label = int(parent[label])
            bounds.append(j + int(starts[label]))
        return tuple(reversed(bounds)), tuple(reversed(options))

    def _least_rest(self) -> np.ndarray:
        """``[j, x]``: the least sum (times, extras and cuts, memory and pace
        ignored) of stages ``j..k−1`` when stage ``j`` starts at window cell
        ``x``; row ``k`` is 0. A lower bound on what any split adds after a
        prefix, computed once per problem."""
        if self._least_rest_cache is None:
            k, span = self.num_stages, self.span
            rest = np.zeros((k + 1, span))
            least = self.option_sums.min(axis=1)  # [j, x, y]
            rest[k - 1] = least[k - 1, :, span - 1]
            for j in range(k - 2, -1, -1):
                after = least[j] + self.cut_times[j, j + 1:j + 1 + span][None, :] + rest[j + 1][None, :]
                rest[j] = after.min(axis=1)
            self._least_rest_cache = rest
        return self._least_rest_cache

    def _by_end(self) -> tuple[np.ndarray, np.ndarray]:
        """Single-option problems: times and sums indexed ``[j, y, x]`` (end cell
        first), contiguous — the DPs reduce over the start cell ``x``, and numpy
        reduces fastest along the last axis. Built once per problem."""
        if self._by_end_cache is None:
            times = np.ascontiguousarray(self.option_times[:, 0].transpose(0, 2, 1))
            sums = times if self.option_sums is self.option_times else \
                np.ascontiguousarray(self.option_sums[:, 0].transpose(0, 2, 1))
            self._by_end_cache = (times, sums)
        return self._by_end_cache

    def _segment_sums(self, bound: float) -> np.ndarray:
        """``[j, y, x]``: stage j's least sum per window cell (end cell first)
        over the options whose time is below the bound."""
        if self.num_options == 1:
            times, sums = self._by_end()
            return sums if bound == INF else np.where(times < bound, sums, INF)
        sums = self.option_sums if bound == INF else np.where(self.option_times < bound, self.option_sums, INF)
        return np.ascontiguousarray(sums.min(axis=1).transpose(0, 2, 1))

    def _best_option(self, j: int, x: int, y: int, bound: float) -> int:
        """The option that achieves ``_segment_sums`` at one window cell (the first on ties)."""
        if self.num_options == 1:
            return 0
        sums = self.option_sums[j, :, x, y]
        if bound != INF:
            sums = np.where(self.option_times[j, :, x, y] < bound, sums, INF)
        return int(sums.argmin())

    def min_bottleneck(self) -> float:
        """The smallest achievable max_j t_j over all splits that fit (inf: none);
        under 1F1B's pace, of ``max(t_j, c_j)``: a lower bound on the pace."""
        span = self.span
        if self._outgoing is not None:
            paced = np.maximum(self.window_times, self._outgoing[:, None, :])
            window = np.ascontiguousarray(paced.transpose(0, 2, 1))
        else:
            window = self._by_end()[0] if self.num_options == 1 else \
                np.ascontiguousarray(self.window_times.transpose(0, 2, 1))  # [j, y, x]
        best = np.full(span, INF)
        best[0] = 0.0
        for j in range(self.num_stages):
            best = np.maximum(window[j], best).min(axis=1)
        return float(best[span - 1])


def _paced(times: np.ndarray, extra: np.ndarray | None,
           outgoing: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Windows whose bottleneck value is ``max(t, the outgoing link's one-way
    time)`` and a sum-only extra that gives the sum back its ``t``: the
    objective becomes ``(m − 1)·max_j max(t_j, c_j) + Σ t + Σ e``, the shared
    model's pipeline time when a link is slower than every stage (``outgoing``:
    :func:`_outgoing`)."""
    paced = np.maximum(times, outgoing[:, None, None, :])
    finite = np.isfinite(times)
    shift = np.zeros(times.shape)
    shift[finite] = times[finite] - paced[finite]
    return paced, shift if extra is None else extra + shift


def _outgoing(link_pace: np.ndarray, k: int, span: int) -> np.ndarray:
    """``[j, y]``: one way of stage j's outgoing link when the stage ends at
    layer ``j + 1 + y`` (where its link's cut is); 0 for the last stage."""
    outgoing = np.zeros((k, span))
    for j in range(k - 1):
        outgoing[j] = link_pace[j, j + 1:j + 1 + span]
    return outgoing


def _window_sums(per_layer: np.ndarray) -> np.ndarray:
    """(k, L) per-layer values → each stage's window of segment sums (k, span, span)."""
    k, n = per_layer.shape
    span = n - k + 1
    prefix = np.concatenate([np.zeros((k, 1)), np.cumsum(per_layer, axis=1)], axis=1)
    rows = np.arange(span)
    return np.stack([prefix[j, j + 1 + rows][None, :] - prefix[j, j + rows][:, None] for j in range(k)])


def _windows(full: np.ndarray) -> np.ndarray:
    """(k, q, L+1, L+1) → each stage's window (k, q, span, span)."""
    k, n = full.shape[0], full.shape[2] - 1
    span = n - k + 1
    return np.stack([full[j, :, j:j + span, j + 1:j + 1 + span] for j in range(k)])


def _cuts(boundary_times: object, k: int, n: int) -> np.ndarray:
    """Boundary cost indexed by cut position c (layers before the cut), 0 at c = 0 and c = L."""
    cuts = np.zeros((max(k - 1, 0), n + 1))
    if boundary_times is not None and k > 1:
        arr = np.asarray(boundary_times, dtype=float)
        if arr.ndim == 1:
            if arr.shape[0] != n - 1:
                raise HetplanError(f"boundary_times has {arr.shape[0]} entries, expected {n - 1}")
            arr = np.broadcast_to(arr, (k - 1, n - 1))
        elif arr.shape != (k - 1, n - 1):
            raise HetplanError(f"boundary_times must have shape ({n - 1},) or ({k - 1}, {n - 1}), got {arr.shape}")
        if not np.all(np.isfinite(arr)) or np.any(arr < 0):
            raise HetplanError("boundary times must be finite and >= 0")
        cuts[:, 1:n] = arr
    return cuts


# --- solvers ------------------------------------------------------------------------------
def fast_partition(problem: PartitionProblem) -> Partition | None:
    """Exact optimum of the pipeline objective; None if no split fits in memory.

    Pareto-staircase search (see the module docstring). Every solution with a
    bottleneck ≥ the current bound ``U`` is known not to beat the incumbent, so
    the search ends exactly when the remaining region cannot either.
    """
    w = problem.num_micro_batches - 1
    first = problem._min_sum(INF)
    if first is None:
        return None
    best = first_part = problem._evaluate(*first)
    if w == 0 or problem.num_stages == 1 and problem.num_options == 1:
        return best
    floor = problem.min_bottleneck()
    top_sum = best.cost_s - w * best.bottleneck_s  # the smallest Σ t + Σ e of any split
    if problem._outgoing is None:
        # the cheapest split among those with the smallest bottleneck: a good incumbent when m is large
        bottom = problem._min_sum(float(np.nextafter(floor, INF)))
    else:  # 1F1B: the stage-paced optimum, a lower bound and (its split) a close incumbent
        paced = fast_partition(problem._stage_paced())
        bottom = None if paced is None else (paced.boundaries, paced.options)
    if bottom is not None:
        candidate = problem._evaluate(*bottom)
        if candidate.cost_s < best.cost_s:
            best = candidate
    # invariant: no split with bottleneck >= bound beats ``best``
    bound = min(first_part.bottleneck_s, (best.cost_s - top_sum) / w)
    while bound > floor:
        split = problem._min_sum(bound, best.cost_s - w * floor)  # a Σ at or over that ends the loop below
        if split is None:
            break
        current = problem._evaluate(*split)
        sum_part = current.cost_s - w * current.bottleneck_s
        if sum_part + w * floor >= best.cost_s:
            break
        if current.cost_s < best.cost_s:
            best = current
        bound = min(current.bottleneck_s, (best.cost_s - sum_part) / w)
    return best


def reference_partition(problem: PartitionProblem) -> Partition | None:
    """AMP §3.5, eq. 6–8: the dynamic program over the tolerance ``m``.

    ``table[j][i][m]`` is the best value of eq. 6 for the first ``i`` layers in
    stages ``0..j`` with tolerance ``possible[m]``; the recursion (eq. 8) looks
    the prefix up at ``max(t, m)`` where ``t`` is the new last stage's time.
    The answer is ``table[k−1][L][m = 0]`` (``possible[0] = 0``). O(k·L⁴)
    work: O(k·L²) states times O(L²) tolerances, each O(L); the loop over
    tolerances is a numpy vector. Stages may differ in speed; memory limits
    are not supported (the paper has none).
    """
    if problem.has_memory_limit or problem.has_options_or_extra:
        raise HetplanError("the reference DP (AMP §3.5) has no memory limit, options or extra costs; "
                           "use fast_partition")
    k, n, w = problem.num_stages, problem.num_layers, problem.num_micro_batches - 1
    seg = problem.segment_times()
    finite = seg[np.isfinite(seg)]
    possible = np.unique(np.concatenate([[0.0], finite]))
    index = np.searchsorted(possible, np.where(np.isfinite(seg), seg, 0.0))
    positions = np.arange(len(possible))

    def penalty(t: float) -> np.ndarray:
        return w * np.maximum(0.0, t - possible)

    # base case: one stage holding layers [0, i)  (eq. 7)
    table = np.full((n + 1, len(possible)), INF)
    for i in range(1, n + 1):
        t = seg[0, 0, i]
        if math.isfinite(t):
            table[i] = penalty(t) + t
    choices: list[np.ndarray | None] = [None]
    for j in range(1, k):
        new = np.full((n + 1, len(possible)), INF)
        arg = np.full((n + 1, len(possible)), -1, dtype=np.int32)
        for i in range(j + 1, n + 1):
            best = new[i]
            best_arg = arg[i]
            for cut in range(j, i):  # the last stage runs [cut, i)  (eq. 8)
                t = seg[j, cut, i]
                if not math.isfinite(t):
                    continue  # outside stage j's window: no split of k stages uses it
                prev = table[cut]
                at = index[j, cut, i]
                looked = np.where(positions < at, prev[at], prev)  # prev[index of max(t, m)]
                value = looked + penalty(t) + t + problem.cut_times[j - 1, cut]
                better = value < best
                best = np.where(better, value, best)
                best_arg = np.where(better, cut, best_arg)
            new[i] = best
            arg[i] = best_arg
        table = new
        choices.append(arg)
    if not math.isfinite(table[n, 0]):
        return None
    # walk back: at stage j, layer count i, tolerance index m
    bounds = [n]
    m_index = 0
    i = n
    for j in range(k - 1, 0, -1):
        chosen = choices[j]
        assert chosen is not None  # set for every stage j >= 1 above
        cut = int(chosen[i, m_index])
        m_index = max(int(index[j, cut, i]), m_index)
        bounds.append(cut)
        i = cut
    bounds.append(0)
    return problem.evaluate(tuple(reversed(bounds)))


def brute_force_partition(problem: PartitionProblem) -> Partition | None:
    """Every split and option choice, in lexicographic order; the first of the cheapest wins."""
    n, k = problem.num_layers, problem.num_stages
    best: Partition | None = None
    choices = list(itertools.product(range(problem.num_options), repeat=k))
    for cuts in itertools.combinations(range(1, n), k - 1):
        for options in choices:
            candidate = problem.evaluate((0, *cuts, n), options)
            if math.isfinite(candidate.cost_s) and (best is None or candidate.cost_s < best.cost_s):
                best = candidate
    return best


def balanced_partition(weights: Sequence[float], num_stages: int) -> tuple[int, ...]:
    """Boundaries of the contiguous split that minimises the heaviest stage.

    What Megatron-LM/DeepSpeed do when told to balance stages by parameter
    count (DeepSpeed ``partition_method='parameters'``). Among the splits with
    that bottleneck, each stage in turn takes as many layers as still leaves a
    feasible remainder (earlier stages fill first), so the result is unique.
    O(k·L + L·log L) time and O(k·L) memory from prefix sums (no segment table:
    at 10,000 layers one would hold 10⁸ numbers).
    """
    values = np.asarray(weights, dtype=float)
    n, k = len(values), num_stages
    if k < 1 or k > n:
        raise HetplanError(f"cannot split {n} layers into {k} stages: every stage needs at least one layer")
    if not np.all(np.isfinite(values)) or np.any(values < 0):
        raise HetplanError("layer weights must be finite and >= 0")
    prefix = np.concatenate([[0.0], np.cumsum(values)])
    bottleneck = _min_bottleneck(prefix, k)
    tol = bottleneck * (1 + 1e-12) + 1e-300
    longest = _longest_stages(prefix, tol)  # stage from a may end at any b in (a, longest[a]]
    starts = np.arange(n)
    # reach[j][b]: layers [b, n) can be split into stages j..k-1 within the bound
    reach = np.zeros((k + 1, n + 1), dtype=bool)
    reach[k, n] = True
    for j in range(k - 1, -1, -1):
        count = np.concatenate([[0], np.cumsum(reach[j + 1])])  # count[b]: reachable ends < b
        reach[j, :n] = count[longest + 1] > count[starts + 1]
    bounds = [0]
    for j in range(k):
        a = bounds[-1]
        # the largest stage that still leaves a feasible remainder: fills early stages first
        ends = np.nonzero(reach[j + 1, a + 1:longest[a] + 1])[0]
        bounds.append(int(a + 1 + ends[-1]))
    return tuple(bounds)


def _longest_stages(prefix: np.ndarray, bound: float) -> np.ndarray:
    """For every start ``a``, the last end ``b`` with weight of ``[a, b)`` at most
    ``bound`` (``a`` itself when even one layer is heavier). Prefix differences
    grow with ``b``, so one binary search per start, corrected for rounding."""
    n = len(prefix) - 1
    ends = np.minimum(np.searchsorted(prefix, prefix[:n] + bound, side="right") - 1, n)
    starts = np.arange(n)
    ends = np.maximum(ends, starts)
    for _ in range(n):  # rounding: step back while the difference exceeds the bound
        over = (ends > starts) & (prefix[ends] - prefix[starts] > bound)
        if not over.any():
            break
        ends = np.where(over, ends - 1, ends)
    for _ in range(n):  # and forward while the next one still fits
        under = (ends < n) & (prefix[np.minimum(ends + 1, n)] - prefix[starts] <= bound)
        if not under.any():
            break
        ends = np.where(under, ends + 1, ends)
    return ends


def _greedy_stages(prefix: np.ndarray, bound: float, limit: int) -> bool:
    """Some split into at most ``limit`` stages keeps every stage's weight within ``bound``."""
    n = len(prefix) - 1
    a, stages = 0, 0
    while a < n:
        stages += 1
        b = min(int(np.searchsorted(prefix, prefix[a] + bound, side="right")) - 1, n)
        while b > a and prefix[b] - prefix[a] > bound:
            b -= 1
        while b < n and prefix[b + 1] - prefix[a] <= bound:
            b += 1
        if b == a or stages > limit:
            return False
        a = b
    return True


def _min_bottleneck(prefix: np.ndarray, k: int) -> float:
    """The least heaviest-stage weight over every split into ``k`` stages: the
    smallest float for which the greedy split needs at most ``k`` stages
    (feasibility grows with the bound; non-negative floats order as their bits)."""
    top = float(prefix[-1] - prefix[0])
    if _greedy_stages(prefix, 0.0, k):
        return 0.0
    lo, hi = 0, int(np.float64(top).view(np.int64))  # lo infeasible, hi feasible
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if _greedy_stages(prefix, float(np.int64(mid).view(np.float64)), k):
            hi = mid
        else:
            lo = mid
    return float(np.int64(hi).view(np.float64))
