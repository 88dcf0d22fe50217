"""The ``megatron`` baseline: Megatron-LM's 3D-parallel heuristics as AMP §4.1 summarises them.

For every micro-batch size (per data-parallel replica, as AMP enumerates them):

1. TP degree at most the smallest number of GPUs in a node (and TP groups
   inside nodes, ``tp`` dividing the head count);
2. the parallel degrees with the smallest ``tp × pp`` whose plan fits in GPU
   memory (the shared cost model says whether it fits) — data parallelism
   takes everything else; among equal products, the larger ``tp`` (Megatron:
   tensor parallelism inside a node first, then pipeline parallelism);
3. device placement: TP workers in one node, then DP workers, then stages, in
   device-id order (the same heuristic AMP uses);
4. layers split evenly by count — the repeated blocks evenly, the embedding
   with the first stage and the head with the last (Megatron-LM; AMP's code
   does the same for GPT-2) — or by parameters (the contiguous split with the
   smallest heaviest stage, DeepSpeed's ``partition_method='parameters'``);
   both are kept as candidates.

The candidates — one per micro-batch size and layer-split rule — are what a
Megatron user would try. They are ranked first by ``tp × pp`` (the heuristic's
own preference: with a model that fits one GPU, Megatron's plan is pure data
parallelism, as AMP §4.5 reports), then by the shared cost model (standing in
for AMP's real trials of the micro-batch sizes and splits). No ZeRO, no
recomputation, 1F1B, as in AMP's experiments.
"""

from __future__ import annotations

from functools import lru_cache

from hetplan.cost.model import CostModel
from hetplan.plan.workload import Workload
from hetplan.errors import HetplanError
from hetplan.plan.spec import Plan, RankedPlan
from hetplan.search.base import cost_model_for, rank_key, rank_plans
from hetplan.search.baselines.uniform import uniform_plan
from hetplan.search.common.degrees import divisors, tp_degrees
from hetplan.search.common.layer_splits import block_split
from hetplan.search.common.partition import balanced_partition

SPLIT_RULES = ("layers", "parameters")


def layer_split(workload: Workload, pp: int, rule: str) -> list[range]:
    """Contiguous layer ranges: the blocks evenly by count (embedding on the
    first stage, head on the last: Megatron's split), or balanced by parameters."""
    if rule == "layers":
        return block_split(workload.model, pp)
    if rule == "parameters":
        return _parameter_split(tuple(float(layer.params) for layer in workload.model.layers), pp)
    raise HetplanError(f"unknown layer split rule {rule!r}; use one of {', '.join(SPLIT_RULES)}")


@lru_cache(maxsize=64)
def _parameter_split(params: tuple[float, ...], pp: int) -> list[range]:
    bounds = balanced_partition(params, pp)
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


def megatron_degrees(workload: Workload) -> list[tuple[int, int]]:
    """``(tp, pp)`` pairs Megatron may use, by ``tp × pp`` ascending, then ``tp`` descending."""
    n = workload.cluster.num_devices
    pairs = []
    for tp in tp_degrees(workload):
        for pp in divisors(n // tp):
            if pp <= workload.model.num_layers:
                pairs.append((tp, pp))
    return sorted(pairs, key=lambda p: (p[0] * p[1], -p[0]))


class MegatronPlanner:
    """Megatron-LM's heuristics (AMP §4.1): smallest tp x pp that fits, for each micro-batch size."""

    name = "megatron"

    def __init__(self, split_rules: tuple[str, ...] = SPLIT_RULES) -> None:
        for rule in split_rules:
            if rule not in SPLIT_RULES:
                raise HetplanError(f"unknown layer split rule {rule!r}; use one of {', '.join(SPLIT_RULES)}")
        self.split_rules = split_rules

    def candidates(self, workload: Workload, cost_model: CostModel) -> list[Plan]:
        """Megatron's proposals: per micro-batch size, the first (tp, pp) in
        :func:`megatron_degrees` order whose plan fits, with each split rule."""
        n, gbs = workload.cluster.num_devices, workload.global_batch_size
        pairs = megatron_degrees(workload)
        plans: list[Plan] = []
        seen: set[str] = set()
        for micro_batch in divisors(gbs):
            for tp, pp in pairs:
                dp = n // (tp * pp)
                if gbs % (dp * micro_batch):
                    continue
                fitting = []
                for rule in self.split_rules:
                    plan = uniform_plan(workload, dp, tp, pp, micro_batch, planner=self.name,
                                        layer_split=layer_split(workload, pp, rule))
                    if cost_model.quick(plan)[1]:
                        fitting.append(plan.with_changes(notes=(f"Megatron heuristic: smallest tp x pp that fits "
                                                                f"(tp={tp}, pp={pp}), layers split by {rule}",)))
                if fitting:
                    for plan in fitting:
                        key = plan.describe()
                        if key not in seen:
                            seen.add(key)
                            plans.append(plan)
                    break
        return plans

    def plan(self, workload: Workload, top_k: int = 5, cost: CostModel | None = None) -> list[RankedPlan]:
        cost_model = cost_model_for(workload, cost)
        plans = self.candidates(workload, cost_model)
        if not plans:
            # nothing fits: say why with the closest miss
            everything = []
            for micro_batch in divisors(workload.global_batch_size):
                for tp, pp in megatron_degrees(workload):
                    dp = workload.cluster.num_devices // (tp * pp)
                    if workload.global_batch_size % (dp * micro_batch) == 0:
                        everything.append(uniform_plan(workload, dp, tp, pp, micro_batch, planner=self.name))
            return rank_plans(cost_model, everything, top_k, require_fit=True)
        ranked = rank_plans(cost_model, plans, len(plans))
        # Megatron's choice is the smallest tp x pp; micro-batch size and split are tuned by trials
        ranked.sort(key=lambda r: (r.plan.stages[0].tp * r.plan.pp,) + rank_key(r))
        return ranked[:top_k]

