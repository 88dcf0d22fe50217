"""Peak memory per GPU by category (params, grads, optimizer, activations,
buffers): the categories add up to the peak every planner ranks by, and each
moves the way its physical cause says."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from hetplan.cli import main
from hetplan.cluster.io import load_cluster
from hetplan.cost.model import CostModel
from hetplan.plan.workload import Workload
from hetplan.cost.memory import MEMORY_CATEGORIES
from hetplan.cost.mixed import stage_memory_parts
from hetplan.model.presets import get_model
from hetplan.search import get_planner
from hetplan.search.baselines.uniform import uniform_plan

CASES = [("gpt3-1.3b", "metis-t4-v100-16", 64, "metis"), ("gpt3-1.3b", "metis-t4-v100-16", 64, "auto"),
         ("gpt2-amp", "amp-heterogeneous", 32, "amp"), ("bert-huge-32", "galvatron-8x-titan", 32, "galvatron-bmw")]


@pytest.mark.parametrize("model, cluster, gbs, planner", CASES, ids=[c[3] for c in CASES])
def test_categories_add_up_to_the_ranked_peak(model, cluster, gbs, planner):
    workload = Workload(get_model(model), load_cluster(cluster), gbs)
    cost = CostModel(workload)
    for ranked in get_planner(planner).plan(workload, 3):
        parts = cost.memory_breakdown(ranked.plan)
        assert set(parts) == set(ranked.estimate.peak_memory_bytes)
        for device, peak in ranked.estimate.peak_memory_bytes.items():
            assert tuple(parts[device]) == MEMORY_CATEGORIES
            assert all(v >= 0 for v in parts[device].values())
            assert sum(parts[device].values()) == pytest.approx(peak, abs=8)


def _parts(zero=0, recompute="none", micro=1):
    workload = Workload(get_model("gpt3-1.3b"), load_cluster("8xA100-80GB"), 64)
    plan = uniform_plan(workload, 8, 1, 1, micro, zero, recompute)
    return CostModel(workload).memory_breakdown(plan)[0]


def test_each_category_moves_with_its_cause():
    base, z3 = _parts(), _parts(zero=3)
    for key in ("grads", "optimizer"):
        assert z3[key] == pytest.approx(base[key] / 8, rel=1e-6)  # sharded over dp=8
    assert z3["params"] < base["params"] / 2  # sharded, plus two gathered layers
    assert _parts(recompute="full")["activations"] < base["activations"] / 3
    doubled = _parts(micro=2)
    assert doubled["activations"] == pytest.approx(2 * base["activations"], rel=1e-6)
    assert {k: doubled[k] for k in ("params", "grads", "optimizer", "buffers")} == \
        {k: base[k] for k in ("params", "grads", "optimizer", "buffers")}


def test_plan_json_carries_the_breakdown(tmp_path, capsys):
    path = tmp_path / "p.json"
    assert main(["plan", "--model", "gpt3-1.3b", "--cluster", "metis-t4-v100-16", "--global-batch", "64",
                 "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert all(k in out for k in MEMORY_CATEGORIES)  # the table's columns
    for entry in json.loads(path.read_text())["plans"]:
        est = entry["estimate"]
        parts = est["memory_breakdown_bytes"]
        for device, peak in est["peak_memory_bytes"].items():
            assert sum(parts[device].values()) == pytest.approx(peak, abs=8)


@pytest.mark.parametrize("pp", [1, 2])
def test_recompute_peak_is_the_backward_walk(pp):
    """Full recomputation: replaying backward layer by layer (layer i rebuilds
    its activations while the layers after it have freed theirs; the other
    micro-batches in flight keep all of theirs) gives the activations the
    model reports on every stage; the head after the last block, whose
    stored tensors are gone before that block recomputes, adds nothing."""
    workload = Workload(get_model("gpt3-1.3b"), load_cluster("8xA100-80GB"), 64)
    micro = 2
    plan = uniform_plan(workload, 8 // pp, 1, pp, micro, 0, "full")
    cost = CostModel(workload)
    stored_all = cost.kernel.activation_bytes(1, "full", False) * micro
    working_all = cost.kernel.backward_working_bytes(1, "full", False) * micro
    m = plan.num_micro_batches
    for j, stage in enumerate(plan.stages):
        stored, working = stored_all[list(stage.layers)], working_all[list(stage.layers)]
        walk = max(stored[:i + 1].sum() + working[i] for i in range(len(stored)))
        in_flight = min(pp - j, m)
        expected = (in_flight - 1) * stored.sum() + walk
        parts = cost.memory_breakdown(plan)[stage.devices[0]]
        assert parts["activations"] == pytest.approx(expected, rel=1e-9)
        # everything stored plus the largest working set counts the head's input too, on the last stage
        old_count = in_flight * stored.sum() + working.max()
        if j == pp - 1:
            assert parts["activations"] == pytest.approx(old_count - stored[-1], rel=1e-9)
        else:
            assert parts["activations"] == pytest.approx(old_count, rel=1e-9)


RUNTIME_PLANS = [  # (model, dp, tp, pp, micro-batch, zero, recompute, schedule, sequence parallel, offload)
    ("gpt3-1.3b", 8, 1, 1, 2, 0, "none", "1f1b", False, False),
    ("gpt3-1.3b", 8, 1, 1, 1, 1, "none", "1f1b", False, False),
    ("gpt3-1.3b", 8, 1, 1, 2, 2, "selective", "1f1b", False, False),
    ("gpt3-1.3b", 8, 1, 1, 8, 3, "full", "1f1b", False, False),
    ("gpt3-1.3b", 4, 2, 1, 2, 0, "none", "1f1b", True, False),
    ("gpt3-1.3b", 2, 2, 2, 4, 1, "full", "gpipe", False, False),
    ("gpt3-1.3b", 2, 1, 4, 1, 0, "none", "1f1b", False, False),
    ("llama2-7b", 4, 2, 1, 1, 3, "none", "1f1b", False, True),
    ("tiny-moe", 4, 1, 2, 2, 2, "none", "1f1b", False, False),
]


@pytest.mark.parametrize("case", RUNTIME_PLANS, ids=[f"{c[0]}-z{c[5]}-{c[6]}-{c[7]}-pp{c[3]}" for c in RUNTIME_PLANS])
def test_runtime_categories_add_up(case):
    """For hetplan's runtime the categories add up to the peak every plan kind
    is ranked by: the per-layer sum (``mixed.stage_peak_terms``) and the
    stage tables (``StageCosts``) agree at every moment of the peak (a first
    backward without gradients, the optimizer step, a later backward); a
    stage whose layers run differently adds up too."""
    name, dp, tp, pp, micro, zero, recompute, schedule, sp, offload = case
    workload = Workload(get_model(name), load_cluster("8xA100-80GB"), 64, target="hetplan")
    plan = uniform_plan(workload, dp, tp, pp, micro, zero, recompute, schedule, sp, offload=offload)
    cost = CostModel(workload)
    estimate, parts = cost.estimate(plan), cost.memory_breakdown(plan)
    for device, peak in estimate.peak_memory_bytes.items():
        assert tuple(parts[device]) == MEMORY_CATEGORIES
        assert sum(parts[device].values()) == pytest.approx(peak, abs=8)
    stage = plan.stages[0]
    half = stage.num_layers // 2
    mixed = replace(stage, strategies=tuple(replace(s, recompute="full" if i < half else s.recompute)
                                            for i, s in enumerate(stage.strategies)))
    memory = cost.device_memory(mixed, plan.micro_batch_size, 1.0)
    summed = stage_memory_parts(cost.kernel, mixed, plan.micro_batch_size, 1.0)
    assert [int(sum(p.values())) for p in summed] == pytest.approx(memory, abs=8)


def test_runtime_first_backward_holds_no_gradients():
    """One micro-batch: its backward starts before any gradient exists, so the
    peak is the states without gradients plus the activations; with two, the
    second backward holds the gradients and one micro-batch."""
    workload = Workload(get_model("gpt3-1.3b"), load_cluster("1xH100"), 16, target="hetplan")
    cost = CostModel(workload)
    one = cost.memory_breakdown(uniform_plan(workload, 1, 1, 1, 16, recompute="full"))[0]
    two = cost.memory_breakdown(uniform_plan(workload, 1, 1, 1, 8, recompute="full"))[0]
    assert one["grads"] == 0 and two["grads"] > 0
    assert one["optimizer"] == two["optimizer"] and one["loss"] == pytest.approx(2 * two["loss"], rel=1e-9)
