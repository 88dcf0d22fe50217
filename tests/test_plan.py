"""Plan/Estimate JSON round trips and the validator's messages."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from hetplan.cost.model import CostModel
from hetplan.plan.workload import Workload
from hetplan.plan.file import load_plan, save_plan
from hetplan.plan.spec import Estimate, LayerStrategy, Plan, Stage
from hetplan.search.baselines.uniform import uniform_plan
from hetplan.plan.validate import InvalidPlanError, validate_plan


@pytest.fixture
def plan(gpt2_hetero: Workload) -> Plan:
    return uniform_plan(gpt2_hetero, 2, 2, 4, 2, zero=1, recompute="selective")


def test_plan_json_round_trip(plan: Plan, tmp_path) -> None:
    again = Plan.from_dict(json.loads(json.dumps(plan.to_dict())))
    assert again == plan
    path = tmp_path / "p.json"
    save_plan(path, plan)
    assert load_plan(path) == plan


def test_uneven_plan_round_trip() -> None:
    stage = Stage((0, 1), (3, 0, 5), 3, 1, (5, 2, 1), (LayerStrategy(3, "full", 1), LayerStrategy(0, "none")))
    plan = Plan("m", "c", 16, 8, 2, "gpipe", (stage,), planner="x", notes=("why",))
    assert Plan.from_dict(json.loads(json.dumps(plan.to_dict()))) == plan


def test_estimate_json_round_trip(plan: Plan, gpt2_cost: CostModel) -> None:
    est = gpt2_cost.estimate(plan)
    again = Estimate.from_dict(json.loads(json.dumps(est.to_dict())))
    assert again == est
    data = est.to_dict()
    for key in ("iteration_time_s", "samples_per_s", "tokens_per_s", "mfu", "peak_memory_bytes", "fits"):
        assert key in data


def _restage(plan: Plan, index: int, **changes) -> Plan:
    stages = list(plan.stages)
    stages[index] = replace(stages[index], **changes)
    return plan.with_changes(stages=tuple(stages))


def test_valid_plan_passes(plan: Plan, gpt2_hetero: Workload) -> None:
    validate_plan(plan, gpt2_hetero.model, gpt2_hetero.cluster, check_names=True)


@pytest.mark.parametrize("breaker, message", [
    (lambda p: p.with_changes(global_batch_size=33), "not the global batch"),
    (lambda p: _restage(p, 1, layers=p.stages[1].layers[1:]), "expected layer"),
    (lambda p: p.with_changes(stages=p.stages[:-1]), "but the model has 26 layers"),
    (lambda p: _restage(p, 0, devices=p.stages[0].devices[:3]), "dp x cp x tp"),
    (lambda p: _restage(p, 0, ep=3), "ep=3 must divide"),
    (lambda p: _restage(p, 1, devices=p.stages[0].devices), "already uses"),
    (lambda p: _restage(p, 0, devices=(0, 1, 2, 99)), "has 16"),
    (lambda p: _restage(p, 0, dp_split=(3, 2)), "sums to 5"),
    (lambda p: _restage(p, 0, dp_split=(4,)), "dp_split has 1 entries"),
    (lambda p: _restage(p, 0, strategies=p.stages[0].strategies[:-1]), "layer strategies"),
    (lambda p: _restage(p, 0, strategies=(LayerStrategy(zero=5),) * len(p.stages[0].layers)), "ZeRO stage 5"),
    (lambda p: _restage(p, 0, strategies=(LayerStrategy(recompute="most"),) * len(p.stages[0].layers)), "recompute"),
    (lambda p: p.with_changes(schedule="zigzag"), "unknown schedule"),
    (lambda p: p.with_changes(model="other"), "made for model"),
])
def test_validator_rejects_broken_plans(plan: Plan, gpt2_hetero: Workload, breaker, message: str) -> None:
    broken = breaker(plan)
    with pytest.raises(InvalidPlanError, match=message):
        validate_plan(broken, gpt2_hetero.model, gpt2_hetero.cluster, check_names=True)


def test_validator_rejects_tp_not_dividing_heads(gpt2_hetero: Workload) -> None:
    plan = uniform_plan(gpt2_hetero, 4, 4, 1, 1)
    stage = plan.stages[0]
    odd = stage.__class__(stage.layers, stage.devices[:3], 1, 3, (4,), stage.strategies)
    with pytest.raises(InvalidPlanError, match="does not divide the 16 attention heads"):
        validate_plan(plan.with_changes(stages=(odd,)), gpt2_hetero.model, gpt2_hetero.cluster)


def test_module_name_lists(plan: Plan, gpt2_hetero: Workload) -> None:
    from hetplan.export.tools import stage_module_names

    names = stage_module_names(plan, gpt2_hetero.model)
    assert names[0][0] == "embed" and names[-1][-1] == "head"
    assert sum(len(n) for n in names) == gpt2_hetero.model.num_layers


def test_micro_batch_size_means_per_replica_in_json_and_tables():
    """'mbs' as every other tool means it: samples per data-parallel replica per
    micro-batch; the total over the replicas is micro_batch_total. Plans
    written before (no micro_batch_total) stored the total and still load."""
    from hetplan.export.tools import export_plan
    from hetplan.model.presets import get_model
    from hetplan.plan.spec import Plan, uniform_stage

    stage = uniform_stage(range(6), list(range(8)), 8, 1, 8)  # 8 replicas, 1 sample each
    plan = Plan("tiny-gpt", "local-cpu-8", 64, 8, 8, "1f1b", (stage,))
    assert plan.micro_batch_per_replica == 1
    assert "mbs 1 x 8 (per replica)" in plan.describe()
    data = plan.to_dict()
    assert data["micro_batch_size"] == 1 and data["micro_batch_total"] == 8
    assert Plan.from_dict(data) == plan
    megatron = export_plan(plan, get_model("tiny-gpt"), "megatron")
    assert megatron[megatron.index("--micro-batch-size") + 1] == str(data["micro_batch_size"])
    old = {k: v for k, v in data.items() if k != "micro_batch_total"}
    old["micro_batch_size"] = 8  # the total, as format-2 files wrote it
    assert Plan.from_dict(old) == plan


def test_uneven_shares_have_no_single_per_replica_size():
    from dataclasses import replace

    from hetplan.plan.spec import Plan, uniform_stage

    stage = replace(uniform_stage(range(6), [0, 1], 2, 1, 2), dp_split=(3, 1))
    plan = Plan("tiny-gpt", "local-cpu-2", 8, 4, 2, "1f1b", (stage,))
    assert plan.micro_batch_per_replica is None
    assert "mb 4 x 2 (split per stage)" in plan.describe() and "split 3:1" in plan.describe()
    assert plan.to_dict()["micro_batch_size"] is None and Plan.from_dict(plan.to_dict()) == plan
