"""Offload's exposed host transfers are their own row of the step breakdown
(issue 33, item 4), not part of recomputation."""

from __future__ import annotations

import pytest

from hetplan.app.explain import explain
from hetplan.cluster.io import load_cluster
from hetplan.cost.model import CostModel
from hetplan.model.presets import get_model
from hetplan.plan.workload import Workload
from hetplan.report.text import breakdown
from hetplan.search.baselines.uniform import uniform_plan


def test_an_offloading_plan_that_recomputes_nothing_shows_offload_not_recompute() -> None:
    workload = Workload(get_model("llama3-8b"), load_cluster("8xH100"), 16)
    plan = uniform_plan(workload, 8, 1, 1, 2, zero=3, recompute="none", offload=True)
    same = uniform_plan(workload, 8, 1, 1, 2, zero=3, recompute="none")
    estimate, kept = CostModel(workload).estimate(plan), CostModel(workload).estimate(same)
    assert estimate.recompute_s == 0.0 and estimate.offload_s > 0.0
    # the transfers are what offloading adds to the same plan's step
    assert estimate.iteration_time_s - kept.iteration_time_s == pytest.approx(estimate.offload_s, rel=1e-6)
    text = breakdown(estimate)
    assert "activation offload (exposed)" in text and "recompute" not in text
    assert "recomputation" not in " ".join(explain(plan, estimate, workload))
