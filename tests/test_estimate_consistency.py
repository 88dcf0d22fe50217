"""Every estimate any planner returns makes sense: finite, non-negative, and its
parts add up to the step time (hetplan.plan.spec.Estimate.checked), on every preset
scenario. JSON never carries a negative or NaN number."""

from __future__ import annotations

import json
import math

import pytest

from hetplan.errors import HetplanError
from hetplan.plan.spec import Estimate
from hetplan.search import get_planner, planner_names
from test_auto import PRESET_SCENARIOS, _workload

SLOW = {"exhaustive"}  # brute force: only on the smallest scenarios (tests/test_auto.py)


SIGNED = {"min_headroom_bytes"}  # free memory: negative says by how much a plan does not fit


def _numbers(data: object) -> list[float]:
    if isinstance(data, dict):
        return [x for k, v in data.items() if k not in SIGNED for x in _numbers(v)]
    if isinstance(data, list):
        return [x for v in data for x in _numbers(v)]
    return [float(data)] if isinstance(data, (int, float)) and not isinstance(data, bool) else []


@pytest.mark.parametrize("model, cluster, batch, limit_gib", PRESET_SCENARIOS)
def test_every_planners_estimates_add_up(model: str, cluster: str, batch: int, limit_gib: int) -> None:
    workload = _workload(model, cluster, batch, limit_gib)
    checked = 0
    for name in planner_names():
        if name in SLOW and workload.cluster.num_devices > 4:
            continue
        try:
            ranked = get_planner(name).plan(workload, top_k=3)
        except HetplanError:
            continue  # a planner that finds no plan says so; what it returns is what is checked
        for r in ranked:
            e = r.estimate
            parts = sum(getattr(e, k) for k in Estimate.TIME_PARTS)
            assert parts == pytest.approx(e.iteration_time_s, rel=1e-6), (name, r.plan.describe())
            assert e.checked() == e  # already clamped: checking again changes nothing
            numbers = _numbers(r.to_dict())
            assert all(math.isfinite(x) and x >= 0 for x in numbers), (name, r.plan.describe())
            json.dumps(r.to_dict(), allow_nan=False)
            checked += 1
    assert checked > 0


def test_checked_clamps_noise_and_refuses_real_negatives() -> None:
    workload = _workload("tiny-gpt", "local-cpu-4", 8, 0)
    e = get_planner("uniform").plan(workload, top_k=1)[0].estimate
    from dataclasses import replace

    noisy = replace(e, bubble_s=-2e-19, compute_s=e.compute_s + 2e-19 + e.bubble_s)
    assert noisy.checked().bubble_s == 0.0
    with pytest.raises(RuntimeError, match="impossible"):
        replace(e, bubble_s=-0.1 * e.iteration_time_s).checked()
    with pytest.raises(RuntimeError, match="impossible"):
        replace(e, mfu=float("nan")).checked()
    with pytest.raises(RuntimeError, match="add up"):
        replace(e, compute_s=e.compute_s + 1.0).checked()
