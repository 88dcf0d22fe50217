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

Boundaries are returned as ``(b_0 = 0, b_1, …, b_k = L)``; stage ``j`` runs
``range(b_j, b_{j+1})`` (:meth:`Partition.ranges`). Ties between splits of equal
cost are broken deterministically but differently by each solver; compare
costs, not splits.

Also here: :func:`balanced_partition` (contiguous split minimising the largest
stage weight — Megatron/DeepSpeed's "balance by parameters") and
:func:`problem_from_cost_model`, which builds a :class:`PartitionProblem` whose
objective and memory limits are the shared cost model's for given stage device
groups, so any planner can place layers exactly under the shared model.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import numpy as np

from hetplan.errors import HetplanError

if TYPE_CHECKING:  # pragma: no cover
    from hetplan.cost.model import CostModel

INF = float("inf")

__all__ = [
    "Partition",
    "PartitionProblem",
    "balanced_partition",
    "brute_force_partition",
    "fast_partition",
    "problem_from_cost_model",
    "reference_partition",
]


@dataclass(frozen=True)
class Partition:
    """A split of the layers into contiguous pipeline stages and its cost.

    Attributes:
        boundaries: ``(0, b_1, …, L)``; stage ``j`` runs layers ``[b_j, b_{j+1})``.
        cost_s: the objective, ``(m − 1)·max t + Σ t + Σ e``.
        stage_times_s: ``t_j`` per stage.
        boundary_times_s: ``e_j`` per boundary (k − 1 of them).
    """

    boundaries: tuple[int, ...]
    cost_s: float
    stage_times_s: tuple[float, ...]
    boundary_times_s: tuple[float, ...]

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

    Build it from per-layer numbers with the constructor, or from whole-segment
    numbers with :meth:`from_segments` when a stage's time is not a sum over
    its layers (e.g. the slowest of several unequal replicas).

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
    """

    def __init__(
        self,
        stage_layer_times: Sequence[float] | Sequence[Sequence[float]] | np.ndarray,
        num_micro_batches: int,
        boundary_times: Sequence[float] | Sequence[Sequence[float]] | np.ndarray | None = None,
        stage_layer_memory: Sequence[float] | Sequence[Sequence[float]] | np.ndarray | None = None,
        stage_memory_capacity: float | Sequence[float] | np.ndarray | None = None,
        num_stages: int | None = None,
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
        fits = None
        if stage_layer_memory is not None or stage_memory_capacity is not None:
            if stage_layer_memory is None or stage_memory_capacity is None:
                raise HetplanError("give both stage_layer_memory and stage_memory_capacity, or neither")
            mem = _as_stage_matrix(stage_layer_memory, k, num_layers, "stage_layer_memory")
            cap = np.broadcast_to(np.asarray(stage_memory_capacity, dtype=float), (k,))
            mem_prefix = np.concatenate([np.zeros((k, 1)), np.cumsum(mem, axis=1)], axis=1)
            seg_mem = mem_prefix[:, None, :] - mem_prefix[:, :, None]  # [j, a, b] = bytes of [a, b)
            fits = seg_mem <= cap[:, None, None] * (1.0 + 1e-12)
        prefix = np.concatenate([np.zeros((k, 1)), np.cumsum(times, axis=1)], axis=1)
        segments = prefix[:, None, :] - prefix[:, :, None]
        segments = np.maximum(segments, 0.0)  # rounding of prefix differences
        self._init(segments, num_micro_batches, boundary_times, fits, has_memory=fits is not None)

    @classmethod
    def from_segments(
        cls,
        segment_times: np.ndarray,
        num_micro_batches: int,
        boundary_times: Sequence[float] | Sequence[Sequence[float]] | np.ndarray | None = None,
        segment_fits: np.ndarray | None = None,
    ) -> PartitionProblem:
        """A problem from whole-segment numbers.

        Args:
            segment_times: shape ``(k, L + 1, L + 1)``; entry ``[j, a, b]`` is
                stage ``j``'s time per micro-batch when it runs layers
                ``[a, b)`` (only ``a < b`` is read).
            segment_fits: same shape, bool: stage ``j`` may hold ``[a, b)``.
        """
        times = np.array(segment_times, dtype=float)
        if times.ndim != 3 or times.shape[1] != times.shape[2]:
            raise HetplanError(f"segment_times must have shape (k, L+1, L+1), got {times.shape}")
        fits = None
        if segment_fits is not None:
            fits = np.asarray(segment_fits, dtype=bool)
            if fits.shape != times.shape:
                raise HetplanError(f"segment_fits must have shape {times.shape}, got {fits.shape}")
        self = cls.__new__(cls)
        self._init(times, num_micro_batches, boundary_times, fits, has_memory=fits is not None)
        return self

    def _init(self, segments: np.ndarray, num_micro_batches: int, boundary_times: object,
              fits: np.ndarray | None, has_memory: bool) -> None:
        k, n = segments.shape[0], segments.shape[1] - 1
        if k < 1:
            raise HetplanError("a pipeline needs at least one stage")
        if n < k:
            raise HetplanError(f"cannot split {n} layers into {k} stages: every stage needs at least one layer")
        if num_micro_batches < 1 or int(num_micro_batches) != num_micro_batches:
            raise HetplanError(f"the number of micro-batches must be a positive integer, got {num_micro_batches}")
        self.num_stages = k
        self.num_layers = n
        self.num_micro_batches = int(num_micro_batches)
        self.has_memory_limit = has_memory
        valid = np.triu(np.ones((n + 1, n + 1), dtype=bool), 1)[None, :, :]
        if fits is not None:
            valid = valid & fits
        finite = np.where(valid, segments, np.nan)
        if np.any(finite[~np.isnan(finite)] < 0):
            raise HetplanError("stage times must be >= 0")
        #: ``[j, a, b]``: stage j's time on layers [a, b); +inf where not allowed.
        self.segment_times = np.where(valid, segments, INF)
        #: ``[j, a, b]``: the time, also where memory forbids it (for reports).
        self._raw_segments = np.where(np.triu(np.ones((n + 1, n + 1), dtype=bool), 1)[None], segments, INF)
        # boundary cost indexed by cut position c (layers before the cut), 0 at c = 0 and c = L
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
        #: ``[j, c]``: time across boundary j when the cut is after layer c − 1.
        self.cut_times = cuts

    # --- evaluating a given split ------------------------------------------------
    def check_boundaries(self, boundaries: Sequence[int]) -> tuple[int, ...]:
        b = tuple(int(x) for x in boundaries)
        if len(b) != self.num_stages + 1 or b[0] != 0 or b[-1] != self.num_layers:
            raise HetplanError(f"boundaries must be {self.num_stages + 1} cut positions from 0 to {self.num_layers}")
        if any(x >= y for x, y in zip(b, b[1:])):
            raise HetplanError(f"every stage needs at least one layer; got boundaries {b}")
        return b

    def fits(self, boundaries: Sequence[int]) -> bool:
        """Every stage within its memory limit (always true without limits)."""
        b = self.check_boundaries(boundaries)
        return all(math.isfinite(self.segment_times[j, b[j], b[j + 1]]) for j in range(self.num_stages))

    def evaluate(self, boundaries: Sequence[int]) -> Partition:
        """The split's stage times and cost (``cost_s`` is inf if it does not fit)."""
        b = self.check_boundaries(boundaries)
        k = self.num_stages
        stage = tuple(float(self._raw_segments[j, b[j], b[j + 1]]) for j in range(k))
        links = tuple(float(self.cut_times[j, b[j + 1]]) for j in range(k - 1))
        cost = self._cost(stage, links) if self.fits(b) else INF
        return Partition(b, cost, stage, links)

    def cost(self, boundaries: Sequence[int]) -> float:
        return self.evaluate(boundaries).cost_s

    def _cost(self, stage: Sequence[float], links: Sequence[float]) -> float:
        return (self.num_micro_batches - 1) * max(stage) + math.fsum(stage) + math.fsum(links)

    # --- building blocks of the fast solver ----------------------------------------
    def _min_sum(self, bound: float) -> tuple[int, ...] | None:
        """Split minimising Σ t + Σ e with every stage time < ``bound`` (None: none)."""
        k, n = self.num_stages, self.num_layers
        span = n - k + 1  # stage j starts in [j, j + span) and ends in [j + 1, j + 1 + span)
        columns = np.arange(span)
        best = np.full(span, INF)  # best[x]: cost of stages < j covering layers [0, j + x)
        best[0] = 0.0
        args = np.empty((k, span), dtype=np.int64)
        for j in range(k):
            seg = self.segment_times[j, j:j + span, j + 1:j + 1 + span]
            if bound != INF:
                seg = np.where(seg < bound, seg, INF)
            start = best if j == 0 else best + self.cut_times[j - 1, j:j + span]
            total = start[:, None] + seg
            arg = total.argmin(axis=0)
            args[j] = arg
            best = total[arg, columns]
        if not math.isfinite(best[span - 1]):
            return None
        bounds = [n]
        x = span - 1
        for j in range(k - 1, -1, -1):
            x = int(args[j, x])
            bounds.append(j + x)
        return tuple(reversed(bounds))

    def min_bottleneck(self) -> float:
        """The smallest achievable max_j t_j over all splits that fit (inf: none)."""
        k, n = self.num_stages, self.num_layers
        span = n - k + 1
        best = np.full(span, INF)
        best[0] = 0.0
        for j in range(k):
            seg = self.segment_times[j, j:j + span, j + 1:j + 1 + span]
            best = np.maximum(best[:, None], seg).min(axis=0)
        return float(best[span - 1])


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
    best = problem.evaluate(first)
    if w == 0 or problem.num_stages == 1:
        return best
    floor = problem.min_bottleneck()
    top_sum = best.cost_s - w * best.max_stage_s  # the smallest Σ t + Σ e of any split
    # the cheapest split among those with the smallest bottleneck: a good incumbent when m is large
    bottom = problem._min_sum(float(np.nextafter(floor, INF)))
    if bottom is not None:
        candidate = problem.evaluate(bottom)
        if candidate.cost_s < best.cost_s:
            best = candidate
    # invariant: no split with bottleneck >= bound beats ``best``
    bound = min(problem.evaluate(first).max_stage_s, (best.cost_s - top_sum) / w)
    while bound > floor:
        split = problem._min_sum(bound)
        if split is None:
            break
        current = problem.evaluate(split)
        sum_part = current.cost_s - w * current.max_stage_s
        if sum_part + w * floor >= best.cost_s:
            break
        if current.cost_s < best.cost_s:
            best = current
        bound = min(current.max_stage_s, (best.cost_s - sum_part) / w)
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
    if problem.has_memory_limit:
        raise HetplanError("the reference DP (AMP §3.5) has no memory limit; use fast_partition")
    k, n, w = problem.num_stages, problem.num_layers, problem.num_micro_batches - 1
    seg = problem.segment_times
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
        cut = int(choices[j][i, m_index])  # type: ignore[index]
        m_index = max(int(index[j, cut, i]), m_index)
        bounds.append(cut)
        i = cut
    bounds.append(0)
    return problem.evaluate(tuple(reversed(bounds)))


def brute_force_partition(problem: PartitionProblem) -> Partition | None:
    """Every split, in lexicographic order; the first of the cheapest wins."""
    n, k = problem.num_layers, problem.num_stages
    best: Partition | None = None
    for cuts in itertools.combinations(range(1, n), k - 1):
        candidate = problem.evaluate((0, *cuts, n))
        if math.isfinite(candidate.cost_s) and (best is None or candidate.cost_s < best.cost_s):
            best = candidate
    return best


def balanced_partition(weights: Sequence[float], num_stages: int) -> tuple[int, ...]:
    """Boundaries of the contiguous split that minimises the heaviest stage.

    What Megatron-LM/DeepSpeed do when told to balance stages by parameter
    count (DeepSpeed ``partition_method='parameters'``). Among the splits with
    that bottleneck, each stage in turn takes as many layers as still leaves a
    feasible remainder (earlier stages fill first), so the result is unique.
    """
    problem = PartitionProblem(np.asarray(weights, dtype=float), 1, num_stages=num_stages)
    bottleneck = problem.min_bottleneck()
    # earliest-cut greedy under the bound gives a deterministic split with that bottleneck
    seg = problem.segment_times[0]
    n, k = problem.num_layers, num_stages
    tol = bottleneck * (1 + 1e-12) + 1e-300
    # reachable[j][b]: layers [b, n) can be split into stages j..k-1 within the bound
    reach = np.zeros((k + 1, n + 1), dtype=bool)
    reach[k, n] = True
    for j in range(k - 1, -1, -1):
        for a in range(n):
            ends = np.nonzero(reach[j + 1, a + 1:] & (seg[a, a + 1:] <= tol))[0]
            reach[j, a] = ends.size > 0
    bounds = [0]
    for j in range(k):
        a = bounds[-1]
        # the largest stage that still leaves a feasible remainder: fills early stages first
        ends = np.nonzero(reach[j + 1, a + 1:] & (seg[a, a + 1:] <= tol))[0]
        bounds.append(int(a + 1 + ends[-1]))
    return tuple(bounds)


# --- the shared cost model as a partition problem ----------------------------------------
def problem_from_cost_model(
    cost_model: CostModel,
    stage_devices: Sequence[Sequence[int]],
    dp: int,
    tp: int,
    micro_batch_size: int,
    num_micro_batches: int,
    schedule: str = "1f1b",
    zero: int = 0,
    recompute: str = "none",
    memory_limit: bool = True,
) -> PartitionProblem:
    """The layer assignment for fixed stage device groups, under the shared cost model.

    Stage ``j`` runs on ``stage_devices[j]`` (``dp·tp`` ids, TP innermost, as in
    :class:`hetplan.plan.Stage`), every layer with the same ``zero`` and
    ``recompute``, the micro-batch split evenly over the ``dp`` replicas. The
    stage time is the slowest replica's forward + backward + recompute + TP
    communication, exactly as :meth:`CostModel.estimate` computes it for such a
    stage; boundary times are the p2p time of the cut layer's output, counted
    twice (forward activation and backward gradient), so the objective equals
    the shared model's ``pipeline_time``. Gradient sync and the optimizer step
    are not part of it (they do not depend on the micro-batch count). With
    ``memory_limit`` each stage must fit its GPUs' memory with the schedule's
    micro-batches in flight (1F1B: ``min(pp − j, m)`` on stage ``j``).
    ZeRO-3 is refused: its exposed parameter gathers make a stage's time
    depend on the whole stage, not a sum over layers.
    """
    from hetplan.cost import comm
    from hetplan.cost.memory import (
        framework_overhead_bytes,
        in_flight_micro_batches,
        layer_activation_bytes,
        layer_params_per_device,
        model_state_bytes,
    )
    from hetplan.cost.constants import ZERO3_GATHERED_LAYERS

    model, cluster, workload = cost_model.model, cost_model.cluster, cost_model.workload
    k, n = len(stage_devices), model.num_layers
    if zero >= 3:
        raise HetplanError("ZeRO-3's exposed parameter gathers make a stage's time non-additive over its "
                           "layers; use zero 0, 1 or 2 here")
    if micro_batch_size % dp:
        raise HetplanError(f"micro-batch {micro_batch_size} does not split evenly over dp={dp}")
    batch = micro_batch_size / dp
    segments = np.empty((k, n + 1, n + 1))
    for j, devices in enumerate(stage_devices):
        if len(devices) != dp * tp:
            raise HetplanError(f"stage {j} has {len(devices)} devices, expected dp x tp = {dp * tp}")
        per_replica = []
        for r in range(dp):
            group = tuple(devices[r * tp:(r + 1) * tp])
            gpu = cost_model.slowest_gpu(group)
            row = []
            for index in range(n):
                t = cost_model.layer_time(index, gpu, batch, tp, recompute)
                c = 0.0
                if tp > 1:
                    c = cost_model.tp_comm_time(index, batch, group) * (3.0 if recompute == "full" else 2.0)
                row.append(t.fwd_s + t.bwd_s + t.recompute_s + c)
            per_replica.append(row)
        prefix = np.concatenate([np.zeros((dp, 1)), np.cumsum(np.asarray(per_replica), axis=1)], axis=1)
        segments[j] = np.max(prefix[:, None, :] - prefix[:, :, None], axis=0)
    links = np.zeros((max(k - 1, 0), max(n - 1, 0)))
    for j in range(k - 1):
        for c in range(n - 1):
            num_bytes = model.layers[c].output_bytes * micro_batch_size
            links[j, c] = 2.0 * comm.p2p_time(cluster, stage_devices[j], stage_devices[j + 1], num_bytes)
    fits = None
    if memory_limit:
        weight_b = workload.state_bytes[0]
        fits = np.zeros((k, n + 1, n + 1), dtype=bool)
        params = np.array([layer_params_per_device(layer, tp) for layer in model.layers])
        state = np.array([model_state_bytes(p, zero, dp, workload.state_bytes) for p in params])
        act = np.array([layer_activation_bytes(layer, tp, recompute, False) * batch for layer in model.layers])
        work = np.array([layer_activation_bytes(layer, tp, "none", False) * batch if recompute == "full" else 0.0
                         for layer in model.layers])
        gathered = params * weight_b if zero >= 3 else np.zeros(n)
        tied = [layer.tied_group for layer in model.layers]
        for j, devices in enumerate(stage_devices):
            flight = in_flight_micro_batches(schedule, j, k, num_micro_batches)
            capacity = min(workload.device_capacity_bytes(d) for d in devices)
            is_cpu = any(cluster.devices[d].gpu.name == "CPU" for d in devices)
            per_layer = state + act * flight
            prefix = np.concatenate([[0.0], np.cumsum(per_layer)])
            for a in range(n):
                running_work = running_gather = 0.0
                seen: dict[str, int] = {}
                duplicate = 0.0
                for b in range(a + 1, n + 1):
                    layer = b - 1
                    running_work = max(running_work, work[layer])
                    running_gather = max(running_gather, gathered[layer])
                    if tied[layer]:
                        if tied[layer] in seen:
                            duplicate += state[layer]
                        seen[tied[layer]] = layer
                    total = (prefix[b] - prefix[a] - duplicate + running_work
                             + ZERO3_GATHERED_LAYERS * running_gather + framework_overhead_bytes(is_cpu))
                    fits[j, a, b] = total <= capacity
    return PartitionProblem.from_segments(segments, num_micro_batches, links, fits)
