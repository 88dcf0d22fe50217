"""The ``amp`` planner: AMP (Li et al., NeurIPS 2022), Algorithm 1 with AMP's own cost model.

Algorithm 1 (§3.6), faithfully:

1. enumerate the parallel degrees ``(pp, dp, tp)`` with ``pp·dp·tp`` = number
   of GPUs, TP groups inside one node (and ``tp`` dividing every layer's head
   count), ``pp`` at most the number of layers;
2. for each, every micro-batch size ``mbs`` (per data-parallel replica) with
   ``dp·mbs`` dividing the global batch; ``gas = gbs / (dp·mbs)`` micro-batches;
3. device placement by the paper's heuristic (Megatron's, [19]): model-parallel
   (TP) workers in the same node first, then data-parallel, then pipeline
   workers, in device-id order — :func:`hetplan.search.common.placement.heuristic_placement`;
4. the optimal pipeline layer assignment for that placement (§3.5) — computed
   with :func:`hetplan.search.common.partition.fast_partition`, which returns the
   same optimum as the paper's DP (``partition="reference"`` runs the paper's
   DP itself);
5. AMP's cost (eq. 3–5), which ranks the strategies.

AMP's cost of a strategy is its own (eq. 3-5, ``amp/objective.py``), not the shared model.

Like the paper, this objective ignores memory, so a top-ranked strategy may
not fit (AMP §4.5: the 7th and 9th of its top 10 TransGAN strategies ran out of
memory). The planner keeps AMP's order — by AMP's own cost — and every
RankedPlan also carries the shared cost model's estimate, whose ``fits`` shows
the OOM ones (``hetplan plan --planner amp`` prints both columns).

Where this differs from the authors' code (not from the paper): per-stage GPU
types instead of a fixed 0.75/0.25 V100/T4 blend of profiles, the minimum
bandwidth over the whole DP group (their loop keeps only the last pair), and
the layer assignment by the DP also when ``gas = 1`` (their code falls back to
a uniform split there).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

from hetplan.cost.model import CostModel
from hetplan.plan.workload import Workload
from hetplan.errors import HetplanError
from hetplan.plan.spec import Plan, RankedPlan, uniform_stage
from hetplan.search.amp.objective import AmpCost, AmpCostModel
from hetplan.search.base import cost_model_for
from hetplan.search.common.degrees import enumerate_degrees, micro_batch_sizes
from hetplan.search.common.partition import Partition, fast_partition, reference_partition
from hetplan.search.common.placement import heuristic_placement
from hetplan.units import format_bytes

PARTITION_SOLVERS = {"fast": fast_partition, "reference": reference_partition}


@dataclass(frozen=True)
class AmpCandidate:
    """One strategy of Algorithm 1 with AMP's cost."""

    pp: int
    dp: int
    tp: int
    micro_batch: int  # per data-parallel replica (AMP's mbs)
    num_micro_batches: int  # gas
    stage_devices: tuple[tuple[int, ...], ...]
    partition: Partition  # the optimal layer assignment (its cost_s is eq. 5 for the slowest stages)
    cost: AmpCost

    @property
    def boundaries(self) -> tuple[int, ...]:
        return self.partition.boundaries

    def to_plan(self, workload: Workload, planner: str = "amp") -> Plan:
        micro = self.dp * self.micro_batch
        stages = tuple(uniform_stage(layers, devices, self.dp, self.tp, micro)
                       for layers, devices in zip(self.partition.ranges(), self.stage_devices))
        return Plan(model=workload.model.name, cluster=workload.cluster.name,
                    global_batch_size=workload.global_batch_size, micro_batch_size=micro,
                    num_micro_batches=self.num_micro_batches, schedule="1f1b", stages=stages, planner=planner)


class AMPPlanner:
    """AMP's Algorithm 1; ranks by AMP's own cost (eq. 3–5), memory ignored."""

    name = "amp"

    def __init__(self, partition: str = "fast") -> None:
        if partition not in PARTITION_SOLVERS:
            raise HetplanError(f"unknown partition solver {partition!r}; use one of {sorted(PARTITION_SOLVERS)}")
        self.partition = partition

    def strategies(self, workload: Workload) -> Iterator[tuple[int, int, int, int]]:
        """``(pp, dp, tp, mbs)`` in Algorithm 1's order."""
        for pp, dp, tp in enumerate_degrees(workload):
            for micro_batch in micro_batch_sizes(workload.global_batch_size, dp):
                yield pp, dp, tp, micro_batch

    def search(self, workload: Workload, amp_cost: AmpCostModel | None = None) -> list[AmpCandidate]:
        """Every strategy of Algorithm 1, ranked by AMP's cost (ties by plan text)."""
        amp_cost = amp_cost or AmpCostModel(CostModel(workload))
        solve = PARTITION_SOLVERS[self.partition]
        n = workload.cluster.num_devices
        candidates = []
        for pp, dp, tp, micro_batch in self.strategies(workload):
            gas = workload.global_batch_size // (dp * micro_batch)
            terms = amp_cost.terms(heuristic_placement(n, pp, dp, tp), dp, tp, micro_batch)
            best = solve(amp_cost.partition_problem(terms, gas))
            assert best is not None  # no memory limit: a split always exists
            cost = amp_cost.cost(terms, gas, best.boundaries)
            candidates.append(AmpCandidate(pp, dp, tp, micro_batch, gas, terms.stage_devices, best, cost))
        if not candidates:
            raise HetplanError(
                f"no parallel degrees of the {n} GPUs divide global batch {workload.global_batch_size}; "
                f"choose a multiple of a divisor of {n}"
            )
        candidates.sort(key=lambda c: (c.cost.total_s, c.to_plan(workload).describe()))
        return candidates

    def plan(self, workload: Workload, top_k: int = 5, cost: CostModel | None = None) -> list[RankedPlan]:
        cost_model = cost_model_for(workload, cost)
        candidates = self.search(workload, AmpCostModel(cost_model))
        ranked = []
        for rank, candidate in enumerate(candidates[:top_k], 1):
            plan = candidate.to_plan(workload, self.name)
            estimate = cost_model.estimate(plan)
            c = candidate.cost
            notes = [f"AMP rank {rank} of {len(candidates)}: AMP cost {c.total_s:.3f} s = pipeline "
                     f"{c.pipeline_s:.3f} s + DP sync {c.dp_sync_s:.3f} s (AMP eq. 3-5; memory not modelled)"]
            if not estimate.fits:
                worst = max(estimate.peak_memory_bytes,
                            key=lambda d: estimate.peak_memory_bytes[d] - estimate.memory_capacity_bytes[d])
                notes.append(f"out of memory: GPU {worst} needs {format_bytes(estimate.peak_memory_bytes[worst])} "
                             f"of {format_bytes(estimate.memory_capacity_bytes[worst])} — AMP's objective ignores "
                             "memory (AMP §4.5), so it ranks this plan anyway")
            ranked.append(RankedPlan(plan.with_changes(notes=tuple(notes)), estimate, c.total_s))
        return ranked

