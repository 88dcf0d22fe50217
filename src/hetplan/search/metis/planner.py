"""The ``metis`` planner: Metis's hetero-aware search (Um et al., ATC'24, Algorithm 1).

For every number of micro-batches B, every number of stages S and every
stage-to-device-group mapping that survives Metis's two prunings
(``metis/groups.py``: group sizes above N/S·(1 − var), permutations of at most
``max_permute_len`` units):

1. every stage starts all-DP — (dp, tp) = (|group|, 1), or the least TP that
   leaves each replica a sample — and a heterogeneous group splits its
   micro-batch over its GPUs in proportion to their speed (data load
   balancing, ``metis/stage_costs.data_balance``);
2. layers go to stages in proportion to each stage's capacity (its throughput
   running the whole model alone), then boundary layers move between
   neighbours while that shortens the slowest stage (capacity-aware layer
   balancing); heterogeneous stages then re-balance their data on their own
   layers, and the layers are balanced once more;
3. a DP-first depth-first search walks the stages in order (those before the
   current one are settled); a stage that runs out of memory branches:
   (a) a heterogeneous stage moves samples to GPUs with spare memory (data
   balancing bounded by memory), (b) raise its TP degree (halve dp, double
   tp, re-balance data, and layers over it and the remaining stages) and look
   at it again, (c) keep its (dp, tp) and shed layers to the remaining
   stages, in proportion to their capacity, until it fits;
4. every complete plan is costed with Metis eq. 1,
   ``Σ t_i + (B − 1)·max t_j + DP_all``, in the form the shared cost model
   computes it (:func:`metis_cost`: the kernel's stage numbers combined by
   ``cost.pipeline.iteration_time`` — pipeline transfers outside the
   bottleneck term, the gradient all-reduce overlapping the last backward
   pass, the optimizer step), so Metis's cost of a plan is its estimate;
5. the best candidates get the exact layer placement for their own stages,
   (dp, tp) and splits (``search.common.stage_partition``; ``exact_layers``)
   and are ranked by the shared CostModel.

The search is Metis's; ``metis/bounds.py`` only skips mappings (and DFS states)
that provably cannot come within ``prune_slack`` of the best cost found so
far, so it returns the same best plan much sooner.

Fixes to what the authors' code gets wrong (their repository, run as is):
results do not depend on PYTHONHASHSEED (GPU types are sorted, no set
iteration decides anything); links between nodes use the inter-node bandwidth
(their ``get_inter_bandwidth`` returned the intra-node one); a missing profile
entry falls back to the analytic estimate with a note (or a clear error up
front with ``strict_profile``) instead of a KeyError mid-search; ``var`` is a
float; and a *work* budget (stage mappings searched, never seconds, so the
result never depends on machine load) stops the search and returns the best
plans so far, saying so in their notes.
"""

from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import dataclass, field
from typing import Iterator, Sequence

from hetplan.cost.stage import StageOption
from hetplan.cost.model import CostModel
from hetplan.plan.workload import Workload
from hetplan.errors import HetplanError
from hetplan.plan.spec import LayerStrategy, Plan, RankedPlan, Stage
from hetplan.profile.metis import missing_entries
from hetplan.search.base import cost_model_for, no_fit_error, rank_key
from hetplan.search.common.budget import WorkBudget
from hetplan.search.common.degrees import divisors
from hetplan.search.common.replica_tp import widen
from hetplan.search.common.stage_partition import PipelinePartitioner
from hetplan.search.metis.bounds import Bounds, StageBound
from hetplan.search.metis.evaluation import Evaluation, metis_cost
from hetplan.search.metis.groups import (
    DeviceGroup,
    MappingEnumerator,
    StageMapping,
    distinct_permutations,
    make_group,
    merge_smallest,
    min_group_size,
    size_multisets,
)
from hetplan.search.metis.stage_costs import Intra, MetisCosts, StageHandle, data_balance, even_split


@dataclass(frozen=True)
class MetisOptions:
    """Knobs of the Metis search.

    Attributes:
        var: group-size variance for the lower bound N/S·(1 − var) (float in
            [0, 1]; 1 disables the bound). Metis Table 4 uses 0.5.
        max_permute_len: maximum permutation length of device groups (the
            smallest groups are merged in pairs until at most this many remain).
            The authors' default is 4; Table 4 uses 10.
        max_tp: largest TP degree (Metis profiles tp 1, 2, 4, 8).
        max_stages: most pipeline stages (0: min(GPUs, layers), as Metis).
        max_batch_per_replica: largest per-replica micro-batch share (0: no
            limit beyond memory; the authors' code caps it at the largest
            profiled mbs).
        max_evaluations: stop the search after this many (stage mapping,
            micro-batch count) pairs and return the best plans found so far
            (0: no budget). Work, not seconds: the same input always gives
            the same plan.
        rerank: how many of the best plans by Metis's cost are polished and
            re-costed by the shared cost model.
        max_leaves: most complete plans the DFS may produce per mapping and B.
        max_dfs_states: most DFS states visited per mapping and B (the DFS
            branches twice at every stage that runs out of memory).
        data_balance, layer_balance: the two load balancers (off: even data
            split / equal layer counts; for the Fig. 6 ablation).
        strict_profile: refuse (a ValueError naming the gaps) instead of
            falling back to the analytic estimate when the workload's profile
            lacks an entry.
        prune: skip mappings that provably cannot come within ``prune_slack``
            of the best cost found so far (``metis.bounds``); this does not
            change the best plan by Metis's cost.
        prune_slack: relative margin kept for the shared cost model's re-ranking.
        exact_layers: polish the layer boundaries of the returned plans with
            the exact pipeline partition (``common.stage_partition``) for their own
            stages and intra-stage plans (off: the paper's proportional
            balancing only).
        replica_tp: let the replicas of the plans' stages that hold several GPU
            types take their own TP degree, and try one stage over every GPU
            (``search.common.replica_tp``; Sailor's mixed replicas), where that
            is faster. Off by default: Metis gives a stage one (dp, tp), and
            hetplan's runtime does not train ``replica_tp`` stages yet.
    """

    var: float = 0.4
    max_permute_len: int = 4
    max_tp: int = 8
    max_stages: int = 0
    max_batch_per_replica: int = 0
    max_evaluations: int = 300
    rerank: int = 4
    max_leaves: int = 8
    max_dfs_states: int = 64
    data_balance: bool = True
    layer_balance: bool = True
    strict_profile: bool = False
    prune: bool = True
    prune_slack: float = 0.1
    exact_layers: bool = True
    replica_tp: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.var, (int, float)) or not 0.0 <= float(self.var) <= 1.0:
            raise HetplanError(f"metis: var must be a float in [0, 1], got {self.var!r}")
        object.__setattr__(self, "var", float(self.var))
        if self.max_permute_len < 1:
            raise HetplanError("metis: max_permute_len must be at least 1")
        if self.max_tp < 1:
            raise HetplanError("metis: max_tp must be at least 1")
        if self.max_evaluations < 0:
            raise HetplanError("metis: max_evaluations must be >= 0 (0 = no budget)")


@dataclass
class SearchStats:
    """What the last search did (for benchmarks and notes)."""

    size_orders: int = 0  # ordered group-size lists cut from the node lines
    mappings: int = 0  # distinct stage mappings cut from the node lines
    evaluations: int = 0  # (mapping, B) pairs searched
    pruned: int = 0  # (size multiset or mapping, B) pairs skipped by a lower bound
    complete_plans: int = 0  # plans the DFS produced and eq. 1 costed
    stage_counts: dict[int, int] = field(default_factory=dict)
    budget_hit: bool = False
    notes: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class _Candidate:
    cost_s: float
    groups: tuple[DeviceGroup, ...]
    intras: tuple[Intra, ...]
    bounds: tuple[int, ...]
    num_micro_batches: int


class _BudgetExceeded(Exception):
    """The work budget is spent: unwind to the outer loop."""


class MetisPlanner:
    """Metis's Algorithm 1 over the shared cost model (see the module docstring)."""

    name = "metis"

    def __init__(self, options: MetisOptions | None = None) -> None:
        self.options = options or MetisOptions()
        self.stats = SearchStats()

    # --- public -----------------------------------------------------------------
    def plan(self, workload: Workload, top_k: int = 5, cost: CostModel | None = None) -> list[RankedPlan]:
        """The best ``top_k`` plans, ranked by the shared cost model."""
        self.stats = SearchStats()
        ctx = _Search(workload, self.options, self.stats, cost)
        notes = ctx.check_profile()
        best = ctx.run()
        if not best:
            if self.stats.budget_hit:
                raise HetplanError(
                    f"metis found no plan within its work budget of {self.options.max_evaluations:,} stage "
                    "mappings; raise max_evaluations"
                )
            raise HetplanError(
                f"metis found no plan that fits: every stage mapping of {workload.cluster.num_devices} GPUs "
                f"runs out of memory at every TP degree up to {self.options.max_tp} for global batch "
                f"{workload.global_batch_size}; use a smaller global batch or more GPUs"
            )
        if self.stats.budget_hit:
            notes.append(ctx.budget.note("metis"))
        self.stats.notes = notes
        return ctx.finish(best, top_k, notes)

    def plan_mapping(self, workload: Workload, groups: Sequence[Sequence[int]], num_micro_batches: int,
                     top_k: int = 1) -> list[RankedPlan]:
        """Metis's intra-stage search and load balancing for one fixed
        stage-to-device-group mapping (device ids per stage, in order) and one
        number of micro-batches — the setting of Metis Fig. 6."""
        self.stats = SearchStats()
        ctx = _Search(workload, self.options, self.stats)
        mapping_groups = tuple(make_group(workload.cluster, g) for g in groups)
        used = [d for g in groups for d in g]
        if len(set(used)) != len(used):
            raise HetplanError("plan_mapping: a GPU appears in two stages")
        if workload.global_batch_size % num_micro_batches:
            raise HetplanError(f"global batch {workload.global_batch_size} is not a multiple of "
                               f"{num_micro_batches} micro-batches")
        ctx.search_mapping(StageMapping(mapping_groups, ()), num_micro_batches)
        best = ctx.candidates()
        if not best:
            raise HetplanError("metis: no plan fits this mapping at any TP degree")
        return ctx.finish(best, top_k, [])


class _Search:
    """One search: caches shared across mappings, the candidate heap and
    Algorithm 1's outer loops."""

    def __init__(self, workload: Workload, options: MetisOptions, stats: SearchStats,
                 cost: CostModel | None = None) -> None:
        self.workload = workload
        self.options = options
        self.stats = stats
        self.budget = WorkBudget(options.max_evaluations, "(stage mapping, micro-batch count) evaluations")
        self.cm = cost_model_for(workload, cost)
        self.costs = MetisCosts(self.cm)
        self.model = workload.model
        self.cluster = workload.cluster
        self.num_layers = self.model.num_layers
        self.heap: list[tuple[float, int, _Candidate]] = []  # max-heap on cost (negated)
        self.counter = itertools.count()
        self.weights = self._reference_weights()
        self._init: dict[tuple[int, int], Intra | None] = {}  # by group class (MetisCosts.group_class)
        self._options: dict[tuple[int, int, int], list[Intra]] = {}
        self._opt_cache: dict[tuple[object, ...], list[StageBound] | None] = {}
        self._type_cache: dict[tuple[tuple[int, ...], int], float] = {}
        self._tp_ok_cache: dict[tuple[int, int], bool] = {}
        self.best = math.inf
        self._searched: set[tuple[tuple[object, ...], int]] = set()
        self.bounds = Bounds(self.costs, self._options_for, options.max_tp)

    # --- set-up -----------------------------------------------------------------
    def check_profile(self) -> list[str]:
        """Notes on profile gaps (or a clear error with ``strict_profile``)."""
        profile = self.workload.profile
        if profile is None:
            return []
        tps = [t for t in (1, 2, 4, 8) if t <= self.options.max_tp]
        missing = missing_entries(profile, self.model, self.cluster.gpu_types, tps)
        if not missing:
            return []
        shown = ", ".join(f"{name} on {gpu} tp{tp}" for name, gpu, tp in missing[:4])
        more = f" and {len(missing) - 4} more" if len(missing) > 4 else ""
        if self.options.strict_profile:
            raise HetplanError(f"the profile has no time for {shown}{more}; profile them or drop strict_profile")
        return [f"profile has no time for {shown}{more}: the analytic estimate is used for those"]

    def _reference_weights(self) -> list[float]:
        """Per-layer load for proportional layer balancing: the mean over the
        cluster's GPUs of each layer's time at tp 1, micro-batch 1, as a prefix
        sum (the authors used one GPU type's profile)."""
        counts: dict[str, int] = {}
        gpus = {}
        for d in self.cluster.devices:
            counts[d.gpu.name] = counts.get(d.gpu.name, 0) + 1
            gpus[d.gpu.name] = d.gpu
        total = sum(counts.values())
        prefix = [0.0] * (self.num_layers + 1)
        for name in sorted(counts):
            p = self.costs.time_prefix(gpus[name], 1, 1)
            for i in range(self.num_layers + 1):
                prefix[i] += p[i] * counts[name] / total
        return prefix

    # --- Algorithm 1 outer loops ------------------------------------------------------
    def run(self) -> list[_Candidate]:
        """Every B and pruned stage mapping; the best candidates by eq. 1."""
        opts = self.options
        n = self.cluster.num_devices
        max_stages = min(n, self.num_layers)
        if opts.max_stages:
            max_stages = min(max_stages, opts.max_stages)
        batches = sorted(divisors(self.workload.global_batch_size), reverse=True)
        enumerator = MappingEnumerator(self.cluster, opts.var, opts.max_permute_len)
        try:
            if opts.prune:
                self._seed(enumerator, max_stages, batches)
            # every stage count in turn, one size order at a time: a work budget
            # then spreads over all depths instead of spending itself on the first
            walks = [self._walk(num_stages, enumerator, batches) for num_stages in range(1, max_stages + 1)]
            while walks:
                walks = [walk for walk in walks if next(walk, None) is not None]
        except _BudgetExceeded:
            self.stats.budget_hit = True
        return self.candidates()

    def _walk(self, num_stages: int, enumerator: MappingEnumerator, batches: list[int]) -> Iterator[bool]:
        """Search the mappings of ``num_stages`` stages, pausing after each size order."""
        n = self.cluster.num_devices
        seen: set[tuple[object, ...]] = set()
        for multiset in size_multisets(n, num_stages, enumerator.sizes,
                                       min_group_size(n, num_stages, self.options.var)):
            self._check_budget()
            alive = [b for b in batches if not self._prune_sizes(multiset, b)]
            if not alive:
                continue
            for order in self._orders(multiset):
                self.stats.size_orders += 1
                self._search_order(order, alive, enumerator, seen, num_stages)
                yield True

    def _orders(self, multiset: tuple[int, ...]) -> Iterator[tuple[int, ...]]:
        """Orderings of a multiset of group sizes after merging the smallest
        groups (the permutation-length pruning)."""
        units = merge_smallest(multiset, self.options.max_permute_len)
        for order in distinct_permutations(units):
            yield tuple(s for unit in order for s in unit)

    def _search_order(self, order: tuple[int, ...], live: list[int], enumerator: MappingEnumerator,
                      seen: set[tuple[object, ...]], num_stages: int) -> None:
        """Cut the order from every node line; search each new mapping."""
        for line in enumerator.lines:
            mapping = line.cut(order)
            if mapping.key in seen:
                continue
            seen.add(mapping.key)
            self.stats.mappings += 1
            self.stats.stage_counts[num_stages] = self.stats.stage_counts.get(num_stages, 0) + 1
            for b in live:
                if (mapping.key, b) not in self._searched and not self._prune_mapping(mapping.groups, b):
                    self.search_mapping(mapping, b)

    def candidates(self) -> list[_Candidate]:
        """The kept candidates, best eq. 1 first."""
        return [c for _, _, c in sorted(self.heap, key=lambda item: (-item[0], -item[1]))]

    def _seed(self, enumerator: MappingEnumerator, max_stages: int, batches: list[int]) -> None:
        """Search one mapping per number of stages first (equal groups, first
        node line), so that the pruning threshold is tight early. The full
        loop skips what was searched here: the result is the same."""
        n = self.cluster.num_devices
        for num_stages in range(1, max_stages + 1):
            if n % num_stages or (n // num_stages) not in enumerator.sizes:
                continue
            mapping = enumerator.lines[0].cut((n // num_stages,) * num_stages)
            for b in batches:
                self._check_budget()
                if not self._prune_mapping(mapping.groups, b):
                    self.search_mapping(mapping, b)

    def _check_budget(self) -> None:
        if self.budget.exhausted:
            raise _BudgetExceeded()

    # --- pruning by lower bounds (same answer, less work) -------------------------------
    def threshold(self) -> float:
        """Plans whose eq. 1 cannot come below this are not searched: the
        best so far, widened by ``prune_slack`` so that near-best plans still
        reach the shared cost model's re-ranking."""
        if not self.options.prune or not math.isfinite(self.best):
            return math.inf
        return self.best * (1.0 + self.options.prune_slack)

    def _prune_sizes(self, multiset: tuple[int, ...], num_micro_batches: int) -> bool:
        """Bound every mapping whose groups have these sizes (in any order)."""
        if not self.options.prune:
            return False
        micro_batch = self.workload.global_batch_size // num_micro_batches
        key = (multiset, num_micro_batches)
        if key not in self._opt_cache:
            self._opt_cache[key] = self.bounds.multiset_options(multiset, micro_batch, num_micro_batches)
        options = self._opt_cache[key]
        if options is None:
            self.stats.pruned += 1
            return True
        threshold = self.threshold()
        if math.isfinite(threshold):
            tkey = (multiset, micro_batch)
            bottleneck = self._type_cache.get(tkey)
            if bottleneck is None:
                bottleneck = self._type_cache[tkey] = self.bounds.type_bottleneck(multiset, micro_batch)
            if self.bounds.beaten(options, num_micro_batches, threshold, bottleneck):
                self.stats.pruned += 1
                return True
        return False

    def _prune_mapping(self, groups: tuple[DeviceGroup, ...], num_micro_batches: int) -> bool:
        """No plan of this mapping can come within the threshold, or its
        memory rules it out."""
        if not self.options.prune:
            return False
        micro_batch = self.workload.global_batch_size // num_micro_batches
        options = self.bounds.mapping_options(groups, micro_batch, num_micro_batches)
        if options is None:
            self.stats.pruned += 1
            return True
        threshold = self.threshold()
        if math.isfinite(threshold) and self.bounds.beaten(
                options, num_micro_batches, threshold, transfers=lambda: self.bounds.transfers(groups, micro_batch)):
            self.stats.pruned += 1
            return True
        return False

    # --- intra-stage plans -------------------------------------------------------------------
    def initial_intra(self, group: DeviceGroup, micro_batch: int) -> Intra | None:
        """All-DP; a group with more GPUs than the micro-batch has samples
        starts at the smallest TP that leaves each replica a sample (the
        authors' generator raises TP on such invalid strategies too)."""
        key = (self.costs.group_class(group), micro_batch)
        if key in self._init:
            return self._init[key]
        tp = 1
        intra = None
        while tp and group.size // tp > micro_batch:
            tp = self.next_tp(group, tp)
        if tp:
            dp = group.size // tp
            split = self.split(group, dp, tp, micro_batch)
            if split is not None:
                intra = Intra(dp, tp, split)
        self._init[key] = intra
        return intra

    def _options_for(self, group: DeviceGroup, micro_batch: int, from_tp: int) -> list[Intra]:
        """The intra-stage plans the DFS may reach from ``from_tp``: the start,
        then every TP raise."""
        key = (self.costs.group_class(group), micro_batch, from_tp)
        found = self._options.get(key)
        if found is None:
            found = []
            start = self.initial_intra(group, micro_batch)
            tp = start.tp if start is not None else 0
            while tp:
                if tp >= from_tp:
                    if start is not None and tp == start.tp:
                        found.append(start)
                    else:
                        split = self.split(group, group.size // tp, tp, micro_batch)
                        if split is not None:
                            found.append(Intra(group.size // tp, tp, split))
                tp = self.next_tp(group, tp)
            self._options[key] = found
        return found

    def split(self, group: DeviceGroup, dp: int, tp: int, micro_batch: int,
              layers: tuple[int, int] | None = None, in_flight: float = 1.0,
              memory_bound: bool = False) -> tuple[int, ...] | None:
        """Per-replica shares of the micro-batch (data load balancing)."""
        if micro_batch < dp:
            return None
        if not self.options.data_balance or (not memory_bound and not group.is_hetero):
            return even_split(micro_batch, dp)
        return data_balance(self.costs, group, dp, tp, micro_batch, layers, in_flight, memory_bound)

    def next_tp(self, group: DeviceGroup, tp: int) -> int:
        """The next TP degree (doubling) whose groups stay inside nodes and
        divide every layer's heads; 0 when there is none."""
        cand = tp * 2
        while cand <= min(self.options.max_tp, group.size):
            if group.size % cand == 0 and self._tp_ok(group, cand):
                return cand
            cand *= 2
        return 0

    def _tp_ok(self, group: DeviceGroup, tp: int) -> bool:
        """TP groups stay inside nodes and every layer supports ``tp``."""
        key = (self.costs.group_class(group), tp)
        ok = self._tp_ok_cache.get(key)
        if ok is None:
            grid = self.cm.kernel.device_array(group.devices).reshape(-1, tp)
            ok = self.cm.kernel.cluster_arrays.rows_in_one_node(grid) and self.cm.kernel.all_support_tp(tp)
            self._tp_ok_cache[key] = ok
        return ok

    # --- one mapping, one B -----------------------------------------------------------------
    def search_mapping(self, mapping: StageMapping, num_micro_batches: int) -> None:
        """Algorithm 1 lines 5-22 for one mapping and one B (one unit of the work budget)."""
        if not self.budget.spend():
            raise _BudgetExceeded()
        self._searched.add((mapping.key, num_micro_batches))
        self.stats.evaluations += 1
        Evaluation(self, mapping.groups, num_micro_batches).run()

    def record(self, handles: Sequence[StageHandle], bounds: tuple[int, ...], micro_batch: int,
               num_micro_batches: int) -> None:
        self.stats.complete_plans += 1
        cost = metis_cost(handles, bounds, micro_batch, num_micro_batches, self.costs,
                          self.workload.overlap_grad_sync)
        self.best = min(self.best, cost)
        cand = _Candidate(cost, tuple(h.group for h in handles), tuple(h.intra for h in handles), bounds,
                          num_micro_batches)
        item = (-cost, -next(self.counter), cand)
        if len(self.heap) < self.options.rerank:
            heapq.heappush(self.heap, item)
        elif item > self.heap[0]:
            heapq.heapreplace(self.heap, item)

    # --- plans -------------------------------------------------------------------------------
    def to_plan(self, cand: _Candidate) -> Plan:
        micro_batch = self.workload.global_batch_size // cand.num_micro_batches
        stages = []
        for j, (g, it) in enumerate(zip(cand.groups, cand.intras)):
            layers = tuple(range(cand.bounds[j], cand.bounds[j + 1]))
            stages.append(Stage(layers=layers, devices=g.devices, dp=it.dp, tp=it.tp, dp_split=it.split,
                                strategies=(LayerStrategy(),) * len(layers)))
        return Plan(model=self.model.name, cluster=self.cluster.name,
                    global_batch_size=self.workload.global_batch_size, micro_batch_size=micro_batch,
                    num_micro_batches=cand.num_micro_batches, schedule="1f1b", stages=tuple(stages),
                    planner="metis")

    def stage_notes(self, plan: Plan) -> list[str]:
        """One line per stage: device group, GPU types, (dp, tp), layers and
        the per-GPU micro-batch split."""
        lines = []
        for j, s in enumerate(plan.stages):
            group = make_group(self.cluster, s.devices)
            nodes = sorted({self.cluster.devices[d].node for d in s.devices})
            node_names = ",".join(self.cluster.nodes[n].name or str(n) for n in nodes)
            split = "+".join(str(x) for x in s.dp_split)
            per_gpu = (f"micro-batch split {split} (of {plan.micro_batch_size})" if s.dp > 1
                       else f"micro-batch {plan.micro_batch_size}")
            types = group.describe().split(": ", 1)[1]
            lines.append(f"stage {j}: GPUs {_ranges(s.devices)} = {types} (node {node_names}); "
                         f"dp{s.dp} x tp{'/'.join(map(str, s.replica_tp)) if s.replica_tp else s.tp}; layers {s.layers[0]}-{s.layers[-1]} ({s.num_layers}); {per_gpu}")
        return lines

    def polish(self, cand: _Candidate) -> _Candidate:
        """The exact layer placement (``common.stage_partition``) for the
        candidate's own stages, intra-stage plans and data splits, under the
        shared model's full objective; kept when it is faster. Metis's
        proportional balancing decides the search; this only moves boundaries
        of the plans it returns."""
        if not self.options.exact_layers or len(cand.groups) == 1:
            return cand
        micro_batch = self.workload.global_batch_size // cand.num_micro_batches
        options = [[StageOption(g.devices, it.dp, it.tp, it.split)] for g, it in zip(cand.groups, cand.intras)]
        solution = PipelinePartitioner(self.cm.kernel, micro_batch, cand.num_micro_batches).solve(options)
        if solution is None or solution.iteration_s >= cand.cost_s - 1e-12:
            return cand
        bounds = (0,) + tuple(s.layers[-1] + 1 for s in solution.stages)
        return _Candidate(solution.iteration_s, cand.groups, cand.intras, bounds, cand.num_micro_batches)

    def finish(self, best: list[_Candidate], top_k: int, notes: list[str]) -> list[RankedPlan]:
        """Polish the best candidates' layer placement, re-cost them with the
        shared cost model and rank them."""
        ranked = []
        seen: set[tuple[object, ...]] = set()
        for cand in best:
            cand = self.polish(cand)
            plan = self.to_plan(cand)
            key = (plan.stages, plan.num_micro_batches)
            if key in seen:
                continue
            seen.add(key)
            ranked.append(RankedPlan(plan, self.cm.estimate(plan), planner_cost_s=cand.cost_s))
        ranked.sort(key=rank_key)
        if self.options.replica_tp:
            ranked = widen(self.cm, ranked, len(ranked))
        if not ranked[0].estimate.fits:
            raise no_fit_error(self.workload, ranked)
        out = []
        for r in ranked[:top_k]:
            plan = r.plan.with_changes(notes=(*self.stage_notes(r.plan), *r.plan.notes, *notes))
            out.append(RankedPlan(plan, r.estimate, r.planner_cost_s))
        return out


def _ranges(devices: Sequence[int]) -> str:
    """'0-3,8,10-11' for a list of GPU ids."""
    parts = []
    ids = list(devices)
    start = prev = ids[0]
    ends: list[int | None] = [*ids[1:], None]
    for d in ends:
        if d is not None and d == prev + 1:
            prev = d
            continue
        parts.append(f"{start}-{prev}" if prev != start else f"{start}")
        if d is not None:
            start = prev = d
    return ",".join(parts)
