"""hetplan's own planner is at least as good as every planner it draws on."""

from __future__ import annotations

import pytest

from hetplan.cluster import load_cluster
from hetplan.cost import CostModel, Workload
from hetplan.model import get_model
from hetplan.search import get_planner, planner_names
from hetplan.search.auto import SOURCE_PLANNERS, AutoPlanner


@pytest.mark.parametrize("model, cluster, batch", [
    ("gpt2-amp", "amp-heterogeneous", 32),
    ("gpt2-amp", "amp-homogeneous", 32),
    ("gpt3-1.3b", "metis-t4-v100-8", 32),
])
def test_auto_beats_every_source(model: str, cluster: str, batch: int) -> None:
    workload = Workload(get_model(model), load_cluster(cluster), batch)
    best = AutoPlanner().plan(workload, top_k=1)[0]
    assert best.estimate.fits
    cost = CostModel(workload)
    for name in SOURCE_PLANNERS:
        if name not in planner_names():
            continue
        fitting = [r for r in get_planner(name).plan(workload, 5) if r.estimate.fits]
        if fitting:
            other = min(cost.estimate(r.plan).iteration_time_s for r in fitting)
            assert best.estimate.iteration_time_s <= other * (1 + 1e-9), name


def test_refinement_improves_a_uniform_plan() -> None:
    from hetplan.search.auto import refine
    from hetplan.search.uniform import uniform_plan

    workload = Workload(get_model("gpt2-amp"), load_cluster("amp-heterogeneous"), 32)
    cost = CostModel(workload)
    plan = uniform_plan(workload, 4, 1, 4, 1)
    refined = refine(cost, plan)
    assert refined and min(cost.estimate(p).iteration_time_s for p in refined) < cost.estimate(plan).iteration_time_s
