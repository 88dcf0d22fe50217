"""The `auto` planner: hetplan's own. Best of every paper's planner, then better.

1. Run the fast planners (uniform 3D, Megatron, AMP, Metis, Galvatron-BMW —
   whichever are installed) on the workload and pool their plans, all costed by
   the one shared cost model.
2. Refine the best pooled plans where the papers leave time on the table: for
   each plan's own stage device groups, try every ZeRO stage (0-2) and
   recomputation choice, and re-place the layers with the exact partition
   (``search.partition.fast_partition``) under the *shared* cost model and its
   per-stage memory limits — AMP's DP optimises AMP's cost, which ignores
   memory, NIC sharing and the backward p2p; Metis balances layers
   proportionally, not optimally.
3. Rank everything: fitting plans first, then by predicted iteration time.

By construction its best plan is at least as good, under the shared cost
model, as the best plan of every planner it runs.
"""

from __future__ import annotations

from hetplan.cost.model import CostModel
from hetplan.cost.workload import Workload
from hetplan.errors import HetplanError
from hetplan.plan import LayerStrategy, Plan, RankedPlan, Stage
from hetplan.progress import Progress
from hetplan.search.base import get_planner, no_fit_error, planner_names, rank_key, register_planner

SOURCE_PLANNERS = ("uniform", "megatron", "amp", "metis", "galvatron-bmw")
REFINE_TOP = 4
REFINE_ZERO = (0, 1, 2)
REFINE_RECOMPUTE = ("none", "selective", "full")


def _plan_key(plan: Plan) -> tuple:
    return (plan.micro_batch_size, plan.num_micro_batches, plan.schedule,
            tuple((s.layers[0], s.layers[-1], s.devices, s.dp_split, s.strategies, s.sequence_parallel)
                  for s in plan.stages))


def _refinable(plan: Plan) -> bool:
    """Plans with one (dp, tp) everywhere, even splits and no per-layer degrees."""
    first = plan.stages[0]
    return all((s.dp, s.tp) == (first.dp, first.tp) and len(set(s.dp_split)) == 1 and not s.has_layer_degrees
               for s in plan.stages)


def refine(cost_model: CostModel, plan: Plan) -> list[Plan]:
    """Exact layer placement under the shared model for each ZeRO/recompute choice."""
    from hetplan.search.partition import fast_partition, problem_from_cost_model

    if not _refinable(plan):
        return []
    dp, tp = plan.stages[0].dp, plan.stages[0].tp
    devices = [s.devices for s in plan.stages]
    out = []
    for zero in REFINE_ZERO:
        if zero and dp == 1:
            continue
        for recompute in REFINE_RECOMPUTE:
            problem = problem_from_cost_model(cost_model, devices, dp, tp, plan.micro_batch_size,
                                              plan.num_micro_batches, plan.schedule, zero, recompute)
            partition = fast_partition(problem)
            if partition is None:
                continue
            stages = tuple(
                Stage(tuple(r), s.devices, dp, tp, s.dp_split, (LayerStrategy(zero, recompute),) * len(r))
                for r, s in zip(partition.ranges(), plan.stages)
            )
            out.append(plan.with_changes(stages=stages, planner="auto",
                                         notes=(f"auto: refined a {plan.planner} plan — exact layer placement "
                                                f"under the shared cost model, zero {zero}, recompute {recompute}",)))
    return out


class AutoPlanner:
    """Best of the papers' planners, refined with exact placement under the shared model."""

    name = "auto"

    def __init__(self, sources: tuple[str, ...] = SOURCE_PLANNERS, refine_top: int = REFINE_TOP) -> None:
        self.sources = sources
        self.refine_top = refine_top

    def plan(self, workload: Workload, top_k: int = 5) -> list[RankedPlan]:
        cost_model = CostModel(workload)
        pool: dict[tuple, RankedPlan] = {}
        errors = []
        available = [name for name in self.sources if name in planner_names()]
        with Progress("auto planner", total=len(available) + self.refine_top) as progress:
            for name in available:
                progress.advance(note=name)
                try:
                    ranked = get_planner(name).plan(workload, max(top_k, self.refine_top))
                except HetplanError as exc:
                    errors.append(f"{name}: {exc}")
                    continue
                for r in ranked:
                    key = _plan_key(r.plan)
                    if key not in pool:
                        # re-cost with this workload's model so every entry is comparable
                        pool[key] = RankedPlan(r.plan, cost_model.estimate(r.plan))
            if not pool:
                raise HetplanError("no planner found a plan: " + "; ".join(errors))
            best = sorted(pool.values(), key=rank_key)[: self.refine_top]
            for r in best:
                progress.advance(note="refining")
                for plan in refine(cost_model, r.plan):
                    key = _plan_key(plan)
                    if key not in pool:
                        pool[key] = RankedPlan(plan, cost_model.estimate(plan))
        ranked = sorted(pool.values(), key=rank_key)
        if not ranked[0].estimate.fits:
            raise no_fit_error(workload, ranked)
        return ranked[:top_k]


def register() -> None:
    register_planner("auto", "hetplan's own: best of uniform/megatron/amp/metis/galvatron-bmw, refined by exact "
                     "layer placement and ZeRO/recompute choice under the shared cost model", AutoPlanner)
