"""The ``random`` baseline: AMP's RS — uniformly random valid strategies (AMP §4.5).

Each sample draws, uniformly and independently: parallel degrees ``(pp, dp,
tp)`` from AMP's space (TP inside a node), a micro-batch size for that ``dp``,
a device placement (TP groups inside nodes, otherwise any assignment of GPUs
to stages and replicas), and a contiguous layer split (any ``pp − 1`` cut
positions). No heuristic and no cost model guides the draw. AMP ran 50 such
strategies for real; hetplan draws ``num_samples`` (default 50) with a fixed
seed, so the result is reproducible, and ranks them by the shared cost model
(the stand-in for running them).
"""

from __future__ import annotations

import random
from dataclasses import replace

from hetplan.cost.model import CostModel
from hetplan.plan.workload import Workload
from hetplan.errors import HetplanError
from hetplan.plan.spec import Plan, RankedPlan, uniform_stage
from hetplan.search.base import cost_model_for, rank_plans
from hetplan.search.common.degrees import enumerate_degrees, micro_batch_sizes
from hetplan.search.common.placement import describe_placement, random_placement

DEFAULT_SAMPLES = 50  # AMP §4.5: "We run RS for 50 iterations"
DEFAULT_SEED = 0


class RandomPlanner:
    """Uniformly random valid strategies, best by the shared cost model."""

    name = "random"

    def __init__(self, num_samples: int = DEFAULT_SAMPLES, seed: int = DEFAULT_SEED) -> None:
        if num_samples < 1:
            raise HetplanError(f"random search needs at least one sample, got {num_samples}")
        self.num_samples = num_samples
        self.seed = seed

    def sample(self, workload: Workload) -> list[Plan]:
        """``num_samples`` random plans (repeats possible, as in sampling with replacement)."""
        degrees = enumerate_degrees(workload)
        if not degrees:
            raise HetplanError(
                f"no parallel degrees of the {workload.cluster.num_devices} GPUs divide global batch "
                f"{workload.global_batch_size}; choose a multiple of a divisor of {workload.cluster.num_devices}"
            )
        rng = random.Random(self.seed)
        n_layers = workload.model.num_layers
        plans = []
        for _ in range(self.num_samples):
            pp, dp, tp = rng.choice(degrees)
            micro_batch = rng.choice(micro_batch_sizes(workload.global_batch_size, dp))
            devices = random_placement(workload.cluster, pp, dp, tp, rng)
            cuts = sorted(rng.sample(range(1, n_layers), pp - 1))
            bounds = [0, *cuts, n_layers]
            micro = dp * micro_batch
            stages = tuple(uniform_stage(range(a, b), d, dp, tp, micro)
                           for a, b, d in zip(bounds, bounds[1:], devices))
            plans.append(Plan(model=workload.model.name, cluster=workload.cluster.name,
                              global_batch_size=workload.global_batch_size, micro_batch_size=micro,
                              num_micro_batches=workload.global_batch_size // micro, schedule="1f1b",
                              stages=stages, planner=self.name,
                              notes=(f"random strategy (seed {self.seed}, {self.num_samples} samples)",)))
        return plans

    def plan(self, workload: Workload, top_k: int = 5, cost: CostModel | None = None) -> list[RankedPlan]:
        ranked = rank_plans(cost_model_for(workload, cost), self.sample(workload), top_k)
        return [replace(r, plan=r.plan.with_changes(notes=r.plan.notes + (describe_placement(workload, r.plan),)))
                for r in ranked]

