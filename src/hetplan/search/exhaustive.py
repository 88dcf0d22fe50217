"""The ``exhaustive`` planner: every plan of AMP's space on a small instance — the oracle.

The space is AMP's (§3.3): parallel degrees ``(pp, dp, tp)`` using all GPUs
with TP groups inside nodes, every micro-batch size, every device placement up
to symmetry (:func:`hetplan.search.placement.canonical_placements`: GPUs of a
node and identical nodes are interchangeable, so one placement per class is
enough and loses nothing), and every contiguous layer split. Each plan runs
1F1B without ZeRO or recomputation, like AMP's.

``objective="shared"`` (the default, the planner registered as
``exhaustive``) ranks by the shared cost model, fitting plans first: the
optimum other planners are tested against. ``objective="amp"`` ranks by AMP's
own cost (eq. 3–5), to check that AMP's search is exact within its space.

The number of plans grows as placements × C(L−1, pp−1); above ``max_plans``
the planner refuses with an error rather than run for hours.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from math import comb
from typing import Iterator

from hetplan.cost.stage import StageOption
from hetplan.cost.model import CostModel
from hetplan.plan.workload import Workload
from hetplan.errors import HetplanError
from hetplan.plan.spec import Plan, RankedPlan, uniform_stage
from hetplan.search.amp import AmpCostModel
from hetplan.search.base import cost_model_for, no_fit_error
from hetplan.search.common.degrees import enumerate_degrees, micro_batch_sizes
from hetplan.search.common.stage_partition import PartitionTables, PipelinePartitioner
from hetplan.search.common.placement import (
    Placement,
    canonical_placements,
    count_canonical_placements,
    describe_placement,
)

DEFAULT_MAX_PLANS = 200_000
OBJECTIVES = ("shared", "amp")


@dataclass(frozen=True)
class Strategy:
    """Degrees, micro-batch size (per replica) and placement; the layer split varies."""

    pp: int
    dp: int
    tp: int
    micro_batch: int
    placement: Placement

    def plan(self, workload: Workload, boundaries: tuple[int, ...], planner: str = "exhaustive") -> Plan:
        micro = self.dp * self.micro_batch
        stages = tuple(uniform_stage(range(a, b), devices, self.dp, self.tp, micro)
                       for a, b, devices in zip(boundaries, boundaries[1:], self.placement))
        return Plan(model=workload.model.name, cluster=workload.cluster.name,
                    global_batch_size=workload.global_batch_size, micro_batch_size=micro,
                    num_micro_batches=workload.global_batch_size // micro, schedule="1f1b",
                    stages=stages, planner=planner)


def all_splits(num_layers: int, num_stages: int) -> Iterator[tuple[int, ...]]:
    """Every contiguous split as boundaries ``(0, …, num_layers)``, lexicographic."""
    from itertools import combinations

    for cuts in combinations(range(1, num_layers), num_stages - 1):
        yield (0, *cuts, num_layers)


class ExhaustivePlanner:
    """Enumerate AMP's whole space (up to symmetry) and rank it."""

    name = "exhaustive"

    def __init__(self, objective: str = "shared", max_plans: int = DEFAULT_MAX_PLANS) -> None:
        if objective not in OBJECTIVES:
            raise HetplanError(f"unknown objective {objective!r}; use one of {', '.join(OBJECTIVES)}")
        self.objective = objective
        self.max_plans = max_plans

    def strategies(self, workload: Workload) -> Iterator[Strategy]:
        """Every (degrees, micro-batch, placement), in a fixed order (lazily)."""
        for pp, dp, tp in enumerate_degrees(workload):
            placements = list(canonical_placements(workload.cluster, pp, dp, tp))
            for micro_batch in micro_batch_sizes(workload.global_batch_size, dp):
                for placement in placements:
                    yield Strategy(pp, dp, tp, micro_batch, placement)

    def count(self, workload: Workload) -> int:
        """How many plans the enumeration visits (computed, not enumerated)."""
        total = 0
        splits = workload.model.num_layers - 1
        for pp, dp, tp in enumerate_degrees(workload):
            placements = count_canonical_placements(workload.cluster, pp, dp, tp)
            total += placements * len(micro_batch_sizes(workload.global_batch_size, dp)) * comb(splits, pp - 1)
        return total

    def plans(self, workload: Workload) -> Iterator[tuple[Strategy, tuple[int, ...]]]:
        """Every (strategy, layer split) of the space."""
        total = self.count(workload)
        if total > self.max_plans:
            raise HetplanError(
                f"the exhaustive space has {total:,} plans (limit {self.max_plans:,}); use a smaller model or "
                "cluster, or a search planner such as amp"
            )
        if not total:
            raise HetplanError(
                f"no parallel degrees of the {workload.cluster.num_devices} GPUs divide global batch "
                f"{workload.global_batch_size}; choose a multiple of a divisor of {workload.cluster.num_devices}"
            )
        for strategy in self.strategies(workload):
            for boundaries in all_splits(workload.model.num_layers, strategy.pp):
                yield strategy, boundaries

    def ranked(self, workload: Workload, top_k: int | None = None,
               cost: CostModel | None = None) -> list[RankedPlan]:
        """The whole space (or its best ``top_k``), best first by the chosen objective.

        With ``objective="amp"`` ``planner_cost_s`` is AMP's cost; with the
        shared objective plans are ranked by ``CostModel.quick`` (the estimate's
        time and fit). Only the returned plans get a full estimate."""
        cost_model = cost_model_for(workload, cost)
        scored: list[tuple[tuple[float, ...], Strategy, tuple[int, ...]]] = []
        if self.objective == "amp":
            amp = AmpCostModel(cost_model)
            terms, previous = None, None
            for index, (strategy, boundaries) in enumerate(self.plans(workload)):
                if strategy is not previous:
                    terms = amp.terms(strategy.placement, strategy.dp, strategy.tp, strategy.micro_batch)
                    previous = strategy
                gas = workload.global_batch_size // (strategy.dp * strategy.micro_batch)
                assert terms is not None
                scored.append(((amp.cost(terms, gas, boundaries).total_s, index), strategy, boundaries))
        else:
            tables = None
            for index, (strategy, boundaries) in enumerate(self.plans(workload)):
                if tables is None or tables[0] is not strategy:
                    tables = (strategy, *self._tables(cost_model, strategy))
                _, partitioner, table = tables
                cells = [(0, b - j, e - j - 1) for j, (b, e) in enumerate(zip(boundaries, boundaries[1:]))]
                fits = all(table.fits[j, o, x, y] for j, (o, x, y) in enumerate(cells))
                time_s = partitioner.iteration_s(table, boundaries, (0,) * strategy.pp)
                scored.append(((0 if fits else 1, time_s, index), strategy, boundaries))
        scored.sort(key=lambda item: item[0])  # ties: enumeration order
        kept = scored[:top_k] if top_k is not None else scored
        amp_cost = self.objective == "amp"
        out = []
        for key, strategy, boundaries in kept:
            plan = strategy.plan(workload, boundaries, self.name)
            out.append(RankedPlan(plan, cost_model.estimate(plan), key[0] if amp_cost else None))
        return out

    @staticmethod
    def _tables(cost_model: CostModel, strategy: Strategy) -> tuple[PipelinePartitioner, PartitionTables]:
        """The kernel's segment tables of a strategy's stages: every split is a lookup."""
        micro = strategy.dp * strategy.micro_batch
        gas = cost_model.workload.global_batch_size // micro
        split = (strategy.micro_batch,) * strategy.dp
        options = [[StageOption(devices, strategy.dp, strategy.tp, split)] for devices in strategy.placement]
        partitioner = PipelinePartitioner(cost_model.kernel, micro, gas)
        return partitioner, partitioner.tables(options)

    def plan(self, workload: Workload, top_k: int = 5, cost: CostModel | None = None) -> list[RankedPlan]:
        ranked = self.ranked(workload, top_k, cost)
        if self.objective == "shared" and not ranked[0].estimate.fits:
            raise no_fit_error(workload, ranked)
        return [replace(r, plan=r.plan.with_changes(notes=(describe_placement(workload, r.plan),)))
                for r in ranked[:top_k]]
