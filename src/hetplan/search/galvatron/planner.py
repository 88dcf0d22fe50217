"""Galvatron-BMW (Wang et al., "Improving Automatic Parallel Training via
Balanced Memory Workload Optimization", TKDE 2024) as hetplan planners.

Three levels, as the paper compares them:

* ``galvatron`` — Galvatron-Base without activation checkpointing.
* ``galvatron-base`` (Alg. 1) — for every PP degree P, the even pipeline
  partition; per stage the decision-tree strategies (DP, SDP, TP, CKPT; see
  ``galvatron.space``) and the dynamic program under the memory budget (see
  ``galvatron.dp``); around it the batch-size loop: grow the global batch
  until no strategy fits, keep the best throughput.
* ``galvatron-bmw`` (Alg. 2) — the same, plus the bi-objective pipeline
  partition: start from the memory-balanced partition (1F1B keeps more
  micro-batches in flight on earlier stages), move boundary layers off the
  slowest stage while the three validation rules of §IV-B hold, keep the best.

And the restricted variants the paper's tables compare against:
``galvatron-dp-tp``, ``galvatron-dp-pp`` (automatic parallelism with two
dimensions), ``pure-dp`` (PyTorch DDP), ``pure-tp`` (Megatron), ``pure-pp``
(PyTorch GPipe), ``pure-sdp`` (FSDP / ZeRO-3), ``deepspeed-3d`` (2-way DP, TP
and PP). Every planner here searches the batch size with ``--global-batch
auto``; with a fixed batch it plans for that batch.

All candidates are costed with the shared CostModel's building blocks inside
the search and ranked with ``CostModel.estimate`` at the end. Deviations from
the paper (each says why) are listed in ``docs/planners/galvatron.md``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Sequence

import numpy as np

from hetplan.cost.memory import in_flight_micro_batches, peak_memory_bytes
from hetplan.cost.model import CostModel
from hetplan.cost.pipeline import StageTail, iteration_time
from hetplan.plan.workload import Workload
from hetplan.errors import HetplanError, OutOfMemoryError
from hetplan.plan.spec import Plan, RankedPlan
from hetplan.search.base import cost_model_for, rank_key
from hetplan.search.common.batch_grid import batch_grid
from hetplan.search.common.layer_splits import block_split
from hetplan.search.galvatron.dp import StageSolution, default_granularity, solve_stages
from hetplan.search.galvatron.partition import Partition, StageCostModel, adjust_candidates, min_max_partition, \
    partition_ranges, validate_adjustment
from hetplan.search.galvatron.space import DP, PARADIGMS, TP, effective_strategies, pp_degrees
from hetplan.search.galvatron.tables import GalvatronCosts, StageContext
from hetplan.units import format_bytes

PARTITION_MODES = ("even", "memory", "time", "bi-objective")


@dataclass(frozen=True)
class GalvatronConfig:
    """What a Galvatron variant searches.

    Attributes:
        name: planner name.
        paradigms: per-layer paradigms of the decision trees (DP, SDP, TP).
        ckpt: include activation checkpointing in the trees.
        pipeline: try PP degrees > 1.
        partition: "even" (Galvatron-Base), "memory" / "time" (the balanced
            partitions alone, Table IV's 1F1B+Mem / 1F1B+Time) or
            "bi-objective" (Galvatron-BMW, Alg. 2).
        micro_batch_multipliers: with PP degree P > 1, the numbers of
            micro-batches tried are ``P * k`` (1F1B needs ≥ P in flight to fill
            the pipeline; more shrink the bubble but also the micro-batch);
            P = 1 runs one micro-batch.
        pp_any_divisor: PP degrees are every divisor of N, not only powers of two.
        memory_bins: the DP's memory dimension has this many bins over the budget
            (``granularity_bytes`` overrides it).
        granularity_bytes: memory granularity of the DP (0: budget / memory_bins).
        batch_step: batch sizes are multiples of this (0: the number of GPUs).
        batch_linear_steps: the batch loop walks step·1 … step·k linearly for
            k ≤ this, then grows k by ``batch_growth`` per step.
        batch_growth: growth of the batch loop beyond the linear part.
        max_adjustments: cap on the partitions Alg. 2 visits per (batch, P, m).
        estimate_top: candidates per batch size ranked with the full CostModel.
        bmw_batch_window: Alg. 2's batch range starts at B0 − r with r this
            fraction of B0 (B0: Galvatron-Base's best batch) and grows until
            nothing fits.
        bmw_patience: Alg. 2's batch loop also stops after this many batch
            sizes above B0 without a better throughput.
        max_batch: the batch loop stops here at the latest.
    """

    name: str
    paradigms: tuple[str, ...] = PARADIGMS
    ckpt: bool = True
    pipeline: bool = True
    partition: str = "even"
    micro_batch_multipliers: tuple[int, ...] = (4, 16)
    pp_any_divisor: bool = True
    memory_bins: int = 128
    granularity_bytes: int = 0
    batch_step: int = 0
    batch_linear_steps: int = 8
    batch_growth: float = 1.125
    max_adjustments: int = 64
    estimate_top: int = 1
    bmw_batch_window: float = 0.5
    bmw_patience: int = 3
    max_batch: int = 1 << 20

    def __post_init__(self) -> None:
        if self.partition not in PARTITION_MODES:
            raise HetplanError(f"partition must be one of {', '.join(PARTITION_MODES)}, not {self.partition!r}")
        if not set(self.paradigms) <= set(PARADIGMS) or not self.paradigms:
            raise HetplanError(f"paradigms must be a subset of {PARADIGMS}")


@dataclass
class _Candidate:
    """One searched configuration: a partition with per-stage DP solutions."""

    planner_cost_s: float
    batch: int
    pp: int
    num_micro_batches: int
    partition: Partition
    solutions: tuple[StageSolution, ...]


@dataclass
class SearchStats:
    """What a search did (for benchmarks and the docs)."""

    batch_sizes: list[int] = field(default_factory=list)
    stage_dps: int = 0
    partitions: int = 0
    estimates: int = 0


def strategy_runs(labels: Sequence[str]) -> str:
    """Runs of identical strategies as 'label×N' (the paper's Fig. 7)."""
    out: list[str] = []
    prev, count = None, 0
    ends: list[str | None] = [*labels, None]
    for label in ends:
        if label == prev:
            count += 1
            continue
        if prev is not None:
            out.append(f"{prev}×{count}" if count > 1 else prev)
        prev, count = label, 1
    return ", ".join(out)


def stage_runs(stage_lines: Sequence[str], gpus_per_stage: int) -> str:
    """Per-stage strategy runs; consecutive stages with the same runs are merged
    ('stages 1-6 (GPUs 4-27): dp4×5 each')."""
    if len(stage_lines) == 1:
        return stage_lines[0]
    out = []
    j = 0
    while j < len(stage_lines):
        k = j
        while k + 1 < len(stage_lines) and stage_lines[k + 1] == stage_lines[j]:
            k += 1
        first, last = j * gpus_per_stage, (k + 1) * gpus_per_stage - 1
        gpus = f"GPU {first}" if first == last else f"GPUs {first}-{last}"
        if k == j:
            out.append(f"stage {j} ({gpus}): {stage_lines[j]}")
        else:
            out.append(f"stages {j}-{k} ({gpus}): {stage_lines[j]} each")
        j = k + 1
    return " | ".join(out)


class GalvatronPlanner:
    """A Galvatron variant (see the module docstring)."""

    searches_batch_size = True

    def __init__(self, config: GalvatronConfig) -> None:
        self.config = config
        self.name = config.name
        self.stats = SearchStats()

    # --- public API -------------------------------------------------------------------
    def plan(self, workload: Workload, top_k: int = 5, cost: CostModel | None = None) -> list[RankedPlan]:
        """Plans for the workload's own global batch."""
        self.stats = SearchStats()
        search = _Search(self.config, workload, self.stats, cost)
        ranked = search.ranked_at(workload.global_batch_size, top_k)
        if not ranked:
            raise search.no_fit_error(workload.global_batch_size)
        return ranked

    def plan_auto_batch(self, workload: Workload, top_k: int = 5) -> list[RankedPlan]:
        """Alg. 1's batch-size loop: grow the batch until no strategy fits, keep
        the best throughput; plans carry the chosen global batch."""
        self.stats = SearchStats()
        search = _Search(self.config, workload, self.stats)
        ranked = search.batch_loop(top_k)
        if not ranked:
            raise search.no_fit_error(search.first_batch)
        return ranked


class _Search:
    """One search over one workload (caches stage DPs across partitions)."""

    def __init__(self, config: GalvatronConfig, workload: Workload, stats: SearchStats,
                 cost: CostModel | None = None) -> None:
        self.config = config
        self.workload = workload
        self.model = workload.model
        self.cluster = workload.cluster
        self.n_gpus = workload.cluster.num_devices
        self.stats = stats
        self.cm = cost_model_for(workload, cost)
        self._costs: dict[int, GalvatronCosts] = {}
        self._stage_cache: dict[tuple, StageSolution | None] = {}
        self.capacity = min(workload.device_capacity_bytes(d) for d in range(self.n_gpus))
        self.first_batch = config.batch_step or self.n_gpus
        self._pruned: set[tuple[int, int]] = set()
        self._contexts: dict[tuple[int, int, int, int], StageContext] = {}

    # --- strategy sets ---------------------------------------------------------------
    def costs_for(self, n: int) -> GalvatronCosts:
        if n not in self._costs:
            ckpt = (False, True) if self.config.ckpt else (False,)
            strategies = effective_strategies(n, self.config.paradigms, ckpt)
            self._costs[n] = GalvatronCosts(self.cm, strategies)
        return self._costs[n]

    def pp_choices(self) -> list[int]:
        if not self.config.pipeline:
            return [1]
        return pp_degrees(self.n_gpus, self.model.num_layers, self.config.pp_any_divisor)

    def micro_batch_counts(self, batch: int, pp: int) -> list[int]:
        """Init_Microbatch_Num (Alg. 1 line 18): ``P * k`` for each multiplier
        that divides the batch; for a batch too small for any, the largest
        count that divides it (micro-batches of one sample at the least)."""
        if pp == 1:
            return [1]
        out = []
        for k in self.config.micro_batch_multipliers:
            m = pp * k
            if m <= batch and batch % m == 0 and m not in out:
                out.append(m)
        if not out:
            limit = pp * min(self.config.micro_batch_multipliers)
            out = [max(m for m in range(1, min(batch, limit) + 1) if batch % m == 0)]
        return out

    def granularity(self, capacity_bytes: float) -> float:
        """The DP's memory bin for stages whose GPUs hold ``capacity_bytes``:
        their budget in ``memory_bins`` steps (or the configured bin)."""
        if self.config.granularity_bytes:
            return float(self.config.granularity_bytes)
        return default_granularity(capacity_bytes, self.config.memory_bins)

    # --- stages ---------------------------------------------------------------------------
    def context(self, pp: int, j: int, batch: int, m: int) -> StageContext:
        """Stage j of a P-stage pipeline: its device block (Takeaway #1: PP splits
        the devices into equal consecutive groups, node by node), micro-batch and
        1F1B in-flight count."""
        key = (pp, j, batch, m)
        ctx = self._contexts.get(key)
        if ctx is None:
            n = self.n_gpus // pp
            devices = tuple(range(j * n, (j + 1) * n))
            ctx = StageContext(devices, batch // m, m, in_flight_micro_batches("1f1b", j, pp, m))
            self._contexts[key] = ctx
        return ctx

    def solve_many(self, pp: int, batch: int, items: Sequence[tuple[int, range, int]]) -> None:
        """Run the stage DPs of ``(stage index, layers, m)`` not yet cached, all at once."""
        todo = []
        keys = []
        for j, layers, m in items:
            ctx = self.context(pp, j, batch, m)
            key = (layers.start, layers.stop, ctx)
            if key not in self._stage_cache and key not in keys:
                keys.append(key)
                todo.append((layers, ctx))
        if not todo:
            return
        self.stats.stage_dps += len(todo)
        costs = self.costs_for(self.n_gpus // pp)
        by_capacity: dict[float, list[int]] = {}  # stages of equal memory share a bin size and run in lockstep
        for i, (_, ctx) in enumerate(todo):
            by_capacity.setdefault(costs.capacity_bytes(ctx.devices), []).append(i)
        for capacity, rows in sorted(by_capacity.items()):
            sols = solve_stages(costs, [todo[i] for i in rows], self.granularity(capacity))
            for i, sol in zip(rows, sols):
                self._stage_cache[keys[i]] = sol

    def solved(self, pp: int, j: int, layers: range, batch: int, m: int) -> StageSolution | None:
        ctx = self.context(pp, j, batch, m)
        key = (layers.start, layers.stop, ctx)
        if key not in self._stage_cache:
            self.solve_many(pp, batch, [(j, layers, m)])
        return self._stage_cache[key]

    def search_partition(self, pp: int, partition: Partition, batch: int, m: int) -> _Candidate | None:
        """Galvatron_Search (Alg. 1 lines 17-28) on one partition."""
        self.stats.partitions += 1
        ranges = partition_ranges(partition)
        self.solve_many(pp, batch, [(j, r, m) for j, r in enumerate(ranges)])
        sols = []
        for j, layers in enumerate(ranges):
            sol = self.solved(pp, j, layers, batch, m)
            if sol is None:
                return None
            sols.append(sol)
        return _Candidate(self.pipeline_cost(pp, partition, sols, batch, m), batch, pp, m, partition, tuple(sols))

    def pipeline_cost(self, pp: int, partition: Partition, sols: Sequence[StageSolution], batch: int,
                      m: int) -> float:
        """Iteration time of the plan, as ``CostModel.estimate`` computes it
        (the stage numbers are the kernel's)."""
        ranges = partition_ranges(partition)
        n = self.n_gpus // pp
        p2p = [self.cm.kernel.p2p_time(range(j * n, (j + 1) * n), range((j + 1) * n, (j + 2) * n), ranges[j][-1],
                                       batch // m) for j in range(pp - 1)]
        tails = [StageTail(s.timing.back_s, s.timing.grad_sync_s, s.timing.post_step_s, s.timing.optimizer_s)
                 for s in sols]
        return iteration_time([s.mb_time_s for s in sols], p2p, tails, m, self.workload.overlap_grad_sync,
                              slowdown=self.cm.kernel.overlap_slowdown).total_s

    # --- partitions (Galvatron-BMW) ---------------------------------------------------------
    def _layer_model(self, pp: int, batch: int, m: int, strategy_of: Sequence[int]) \
            -> tuple[StageCostModel, StageCostModel]:
        """Per-layer time and memory on every stage under fixed per-layer strategies
        (a layer's memory depends on its stage through the 1F1B in-flight count)."""
        costs = self.costs_for(self.n_gpus // pp)
        picks = np.asarray(strategy_of)
        rows = np.arange(len(picks))
        times, mems, peaks = [], [], []
        for j in range(pp):
            ctx = self.context(pp, j, batch, m)
            arr = costs.stacked(ctx)
            valid = arr["valid"][rows, picks]
            times.append(np.where(valid, arr["mb"][rows, picks], np.inf))
            mems.append(np.where(valid, arr["fwd"][rows, picks], np.inf))
            peaks.append(peak_memory_bytes(0.0, 0.0, 0.0, arr["bwd"][rows, picks], arr["gathered"][rows, picks], 0.0))
        overhead = costs.overhead_bytes(self.context(pp, 0, batch, m).devices)
        return StageCostModel(np.array(times)), StageCostModel(np.array(mems), np.array(peaks), overhead)

    def _fallback_strategies(self, pp: int, batch: int, m: int) -> list[int]:
        """Strategy_Init when the even partition fits nowhere: per layer the
        strategy with the least forward memory."""
        costs = self.costs_for(self.n_gpus // pp)
        arr = costs.stacked(self.context(pp, 0, batch, m))
        return [int(i) for i in np.where(arr["valid"], arr["fwd"], np.inf).argmin(axis=1)]

    def balanced_partitions(self, pp: int, batch: int, m: int, base: _Candidate | None) \
            -> tuple[Partition | None, Partition | None]:
        """PP_Partition_Init (Alg. 2 line 7): the memory- and time-balanced
        partitions under the strategies of the even partition's search."""
        if base is not None:
            strategy_of = [c for sol in base.solutions for c in sol.choices]
        else:
            strategy_of = self._fallback_strategies(pp, batch, m)
        time_model, mem_model = self._layer_model(pp, batch, m, strategy_of)
        num_layers = self.model.num_layers
        return min_max_partition(mem_model, num_layers, pp), min_max_partition(time_model, num_layers, pp)

    def bi_objective(self, pp: int, batch: int, m: int, p_mem: Partition, p_time: Partition) -> list[_Candidate]:
        """Alg. 2's loop for one (batch, P, m): from the memory-balanced
        partition, move a boundary layer off the slowest stage while the §IV-B
        rules hold; every visited partition that fits is a candidate."""
        out: list[_Candidate] = []
        queue = [p_mem]
        visited = {p_mem}
        steps = 0
        costs = self.costs_for(self.n_gpus // pp)
        caps = [costs.capacity_bytes(self.context(pp, j, batch, m).devices) for j in range(pp)]
        while queue and steps < self.config.max_adjustments:
            steps += 1
            partition = queue.pop(0)
            cand = self.search_partition(pp, partition, batch, m)
            if cand is None:
                continue
            out.append(cand)
            strategy_of = [c for sol in cand.solutions for c in sol.choices]
            time_model, mem_model = self._layer_model(pp, batch, m, strategy_of)
            times = [s.mb_time_s for s in cand.solutions]
            t_max_mem = max(mem_model.stage_costs(p_time))
            for new in adjust_candidates(partition, times):
                if new in visited:
                    continue
                if validate_adjustment(time_model.stage_costs(new), mem_model.stage_costs(new), max(times), caps,
                                       t_max_mem):
                    visited.add(new)
                    queue.append(new)
        return out

    # --- one batch size ---------------------------------------------------------------------
    def candidates_at(self, batch: int, adjust: bool = True) -> list[_Candidate]:
        """Every searched configuration at one batch size: for each PP degree and
        number of micro-batches, the even partition (Galvatron-Base) and, per the
        partition mode, the memory- and time-balanced partitions and (with
        ``adjust``) Alg. 2's adjustments between them."""
        mode = self.config.partition
        out: list[_Candidate] = []
        for pp in self.pp_choices():
            counts = [m for m in self.micro_batch_counts(batch, pp) if (pp, m // pp) not in self._pruned]
            if not counts:
                continue
            self.costs_for(self.n_gpus // pp).release()  # tables of other batch sizes are not needed again
            even = tuple(len(r) for r in block_split(self.model, pp))
            self.solve_many(pp, batch, [(j, r, m) for m in counts for j, r in enumerate(partition_ranges(even))])
            bases = {m: self.search_partition(pp, even, batch, m) for m in counts}
            own = pp > 1 and mode in ("memory", "time")
            found: dict[int, list[_Candidate]] = {m: [c] if not own and (c := bases[m]) is not None else []
                                                  for m in counts}
            if pp > 1 and mode != "even":
                balanced = {m: self.balanced_partitions(pp, batch, m, bases[m]) for m in counts}
                wanted = {"memory": (0,), "time": (1,), "bi-objective": (0, 1)}[mode]
                self.solve_many(pp, batch, [(j, r, m) for m in counts for w in wanted
                                            if (part := balanced[m][w]) is not None
                                            for j, r in enumerate(partition_ranges(part))])
                for m in counts:
                    seen = {c.partition for c in found[m]}
                    for w in wanted:
                        part = balanced[m][w]
                        if part is None or part in seen:
                            continue
                        seen.add(part)
                        cand = self.search_partition(pp, part, batch, m)
                        if cand is not None:
                            found[m].append(cand)
                    p_mem, p_time = balanced[m]
                    if mode == "bi-objective" and adjust and p_mem is not None and p_time is not None:
                        for cand in self.bi_objective(pp, batch, m, p_mem, p_time):
                            if cand.partition not in seen:
                                seen.add(cand.partition)
                                found[m].append(cand)
            for m in counts:
                if not found[m]:
                    self._pruned.add((pp, m // pp))  # a larger batch needs more memory still
                out.extend(found[m])
        return out

    def to_plan(self, cand: _Candidate) -> Plan:
        n = self.n_gpus // cand.pp
        costs = self.costs_for(n)
        mbs = cand.batch // cand.num_micro_batches
        lines = [strategy_runs([costs.strategies[c].label() for c in sol.choices]) for sol in cand.solutions]
        notes: tuple[str, ...] = ("per-layer strategies: " + stage_runs(lines, n),)
        if cand.pp > 1:
            notes += (f"pipeline partition [{strategy_runs([str(x) for x in cand.partition])}] layers "
                      f"({self.config.partition}), "
                      f"{cand.num_micro_batches} micro-batches of {mbs}, 1F1B",)
        return Plan(
            model=self.model.name, cluster=self.cluster.name, global_batch_size=cand.batch, micro_batch_size=mbs,
            num_micro_batches=cand.num_micro_batches, schedule="1f1b",
            stages=tuple(sol.stage for sol in cand.solutions), planner=self.config.name, notes=notes,
        )

    def rank(self, cands: list[_Candidate], top: int) -> list[RankedPlan]:
        """Rank the best ``top`` candidates by planner cost with the shared CostModel."""
        cands = sorted(cands, key=lambda c: (c.planner_cost_s / c.batch, c.pp, c.num_micro_batches, c.partition))
        ranked = []
        seen = set()
        for cand in cands:
            plan = self.to_plan(cand)
            key = (plan.describe(), round(cand.planner_cost_s, 9))  # drop equal-cost twins
            if key in seen:
                continue
            seen.add(key)
            cm = cost_model_for(replace(self.workload, global_batch_size=cand.batch), self.cm)
            estimate = cm.estimate(plan)
            self.stats.estimates += 1
            if estimate.fits:
                ranked.append(RankedPlan(plan, estimate, cand.planner_cost_s))
            if len(ranked) >= top:
                break
        return ranked

    def ranked_at(self, batch: int, top_k: int, adjust: bool = True) -> list[RankedPlan]:
        self.stats.batch_sizes.append(batch)
        ranked = self.rank(self.candidates_at(batch, adjust), max(top_k, self.config.estimate_top))
        ranked.sort(key=lambda r: (-r.estimate.samples_per_s,) + rank_key(r)[1:])
        return ranked[:top_k]

    def batch_loop(self, top_k: int) -> list[RankedPlan]:
        """Alg. 1's loop: grow the batch until nothing fits, keep the best
        throughput. For Galvatron-BMW that loop already tries the memory- and
        time-balanced partitions; then Alg. 2's loop runs the partition
        adjustments for batches from ``B0 − r`` (B0: the first loop's best)
        until nothing fits or ``bmw_patience`` batch sizes bring no gain."""
        config = self.config
        results: list[RankedPlan] = []
        grid = list(batch_grid(self.first_batch, config.batch_linear_steps, config.batch_growth, config.max_batch))
        two_phase = config.partition == "bi-objective" and self.pp_choices() != [1]
        for batch in grid:
            ranked = self.ranked_at(batch, max(1, config.estimate_top), adjust=not two_phase)
            if not ranked:
                break  # no strategy fits any more (Alg. 1 line 14)
            results.extend(ranked)
        if two_phase and results:
            best = max(r.estimate.samples_per_s for r in results)
            b0 = min(r.plan.global_batch_size for r in results if r.estimate.samples_per_s == best)
            lower = b0 - int(config.bmw_batch_window * b0)
            self._pruned.clear()
            stale = 0
            for batch in grid:
                if batch < lower:
                    continue
                ranked = self.ranked_at(batch, max(1, config.estimate_top), adjust=True)
                if not ranked:
                    break  # Alg. 2 line 24
                results.extend(ranked)
                top = max(r.estimate.samples_per_s for r in ranked)
                if top > best:
                    best, stale = top, 0
                elif batch > b0:
                    stale += 1
                    if stale >= config.bmw_patience:
                        break
        results.sort(key=lambda r: (-r.estimate.samples_per_s, r.plan.global_batch_size, r.plan.describe()))
        return results[:top_k]

    def no_fit_error(self, batch: int) -> OutOfMemoryError:
        hint = "a smaller global batch, a larger --memory-limit, or more GPUs"
        if batch % self.n_gpus:
            hint = f"a global batch that is a multiple of the {self.n_gpus} GPUs, " + hint
        return OutOfMemoryError(
            f"{self.config.name}: no strategy fits in {format_bytes(self.capacity)} per GPU at global batch "
            f"{batch}; use {hint}"
        )


# --- registry ---------------------------------------------------------------------------------------
VARIANTS: dict[str, tuple[GalvatronConfig, str]] = {
    "galvatron-bmw": (GalvatronConfig("galvatron-bmw", partition="bi-objective"),
                      "Galvatron-BMW (Alg. 2): per-layer DP/SDP/TP/CKPT under a memory budget, bi-objective "
                      "pipeline partition, batch-size search"),
    "galvatron-base": (GalvatronConfig("galvatron-base"),
                       "Galvatron-Base (Alg. 1): per-layer DP/SDP/TP/CKPT by dynamic programming, even pipeline "
                       "partition, batch-size search"),
    "galvatron": (GalvatronConfig("galvatron", ckpt=False),
                  "Galvatron-Base without activation checkpointing"),
    "galvatron-dp-tp": (GalvatronConfig("galvatron-dp-tp", paradigms=(DP, TP), ckpt=False, pipeline=False),
                        "Galvatron restricted to DP+TP per layer (no PP, SDP, CKPT)"),
    "galvatron-dp-pp": (GalvatronConfig("galvatron-dp-pp", paradigms=(DP,), ckpt=False),
                        "Galvatron restricted to DP+PP (no TP, SDP, CKPT)"),
}



def get_variant(variant: str, **changes: Any) -> GalvatronPlanner:
    """A Galvatron variant by name, optionally with changed settings (e.g.
    ``get_variant("galvatron-bmw", ckpt=False, name="galvatron-1f1b-bi-obj")``
    is Table II's Galvatron (1F1B+Bi-obj))."""
    config = VARIANTS[variant][0]
    return GalvatronPlanner(replace(config, **changes) if changes else config)
