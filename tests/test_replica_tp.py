"""Stages whose replicas run their own TP degree (``Stage.replica_tp``, issue 35 item 3):
the plan file form, validation, the kernel's per-replica costs against hand
computations, the search's split and degrees against brute force, the runtime's refusal."""

from __future__ import annotations

import itertools
import json
from dataclasses import replace
from pathlib import Path

import pytest

from hetplan.app.choose import allocations, cross_zone_bytes, plan_allocation
from hetplan.app.planning import replica_tp_best, runnable_best
from hetplan.app.workload import WorkloadOptions, load_workload
from hetplan.cluster.pool import pool_from_dict
from hetplan.cluster.spec import ClusterSpec, NodeSpec
from hetplan.cost.memory import in_flight_micro_batches
from hetplan.cost.model import CostModel
from hetplan.cost.stage import zero12_gradient_collective
from hetplan.errors import HetplanError
from hetplan.export.target import refusal
from hetplan.model.presets import get_model
from hetplan.plan.file import load_plan, save_plan
from hetplan.plan.spec import LayerStrategy, Plan, Stage, uniform_stage
from hetplan.plan.support import runtime_refusal
from hetplan.plan.validate import validate_plan
from hetplan.plan.workload import Workload
from hetplan.report.text import memory_table
from hetplan.search.metis import MetisOptions, MetisPlanner
from hetplan.search.common import replica_tp as replica_tp_search
from hetplan.search.common.replica_tp import best_split, stage_variants, with_replica_tp

# Two 4-GPU nodes: A100s with memory to spare, V100-16GBs that hold GPT-3 1.3B only at tp 4.
CLUSTER = ClusterSpec("a100-v100", (NodeSpec("A100-80GB", 4, 600), NodeSpec("V100-16GB", 4, 300)), 400)


def mixed(zero: int = 0, split: tuple[int, ...] = (5, 3), degrees: tuple[int, ...] = (2, 4),
          devices: tuple[int, ...] = (0, 1, 4, 5, 6, 7), layers: int = 26) -> Stage:
    """An A100 replica at tp 2 (GPUs 0-1) and a V100 replica at tp 4 (GPUs 4-7)."""
    return Stage(tuple(range(layers)), devices, len(degrees), max(degrees), split,
                 (LayerStrategy(zero=zero),) * layers, replica_tp=degrees)


def one_stage(stage: Stage, model: str = "gpt2-amp", micro_batches: int = 4) -> Plan:
    mb = sum(stage.dp_split)
    return Plan(model, CLUSTER.name, mb * micro_batches, mb, micro_batches, "1f1b", (stage,))


def test_layout_of_a_mixed_stage() -> None:
    stage = mixed()
    assert stage.replica_devices(0) == (0, 1) and stage.replica_devices(1) == (4, 5, 6, 7)
    assert stage.tp_groups() == [(0, 1), (4, 5, 6, 7)]
    # chunk c of 4 is held, in the tp-2 replica, by its TP rank c // 2
    assert [stage.shard_holders(c) for c in range(4)] == [(0, 4), (0, 5), (1, 6), (1, 7)]
    assert stage.dp_groups() == [(0, 4), (0, 5), (1, 6), (1, 7)]
    assert "dp2 tp2/4" in one_stage(stage).describe()


def test_plan_file_round_trip(tmp_path: Path) -> None:
    plan = one_stage(mixed())
    path = tmp_path / "plan.json"
    save_plan(path, plan)
    assert json.loads(path.read_text())["plan"]["stages"][0]["replica_tp"] == [2, 4]
    assert load_plan(path) == plan
    even = one_stage(uniform_stage(range(26), range(8), 2, 4, 8))
    assert "replica_tp" not in even.to_dict()["stages"][0]  # omitted when None: older readers read it
    assert Plan.from_dict(even.to_dict()) == even


@pytest.mark.parametrize("stage, message", [
    (replace(mixed(), replica_tp=(2, 4, 4)), "replica_tp has 3 entries for dp=2"),
    (replace(mixed(), replica_tp=(3, 4)), "replica_tp [3, 4] must divide tp=4, the largest of them"),
    (replace(mixed(), tp=8), "replica_tp [2, 4] must divide tp=8, the largest of them"),
    (replace(mixed(), devices=(0, 1, 4, 5, 6)), "has 5 devices but replica_tp [2, 4] x cp=1 needs 6"),
    (replace(mixed(), sequence_parallel=True), "replica_tp cannot be combined with sequence_parallel"),
    (replace(mixed(), strategies=(LayerStrategy(tp=2),) * 26), "replica_tp cannot be combined with per-layer tp"),
])
def test_validation_refuses_in_one_line(stage: Stage, message: str) -> None:
    plan = one_stage(stage)
    with pytest.raises(HetplanError) as info:
        validate_plan(plan, get_model("gpt2-amp"), CLUSTER)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_runtime_trains_mixed_degrees_at_zero_0_and_refuses_zero_1_in_one_line() -> None:
    assert runtime_refusal(one_stage(mixed()), get_model("gpt2-amp")) == ""
    why = runtime_refusal(one_stage(mixed(zero=1)), get_model("gpt2-amp"))
    assert "with ZeRO > 0" in why and "\n" not in why


@pytest.mark.parametrize("zero", [0, 1])
def test_kernel_costs_each_replica_at_its_own_degree_and_share(zero: int) -> None:
    """Time: the slowest replica's, each costed as a lone replica of its degree
    on its GPUs (the kernel's uniform path); memory: each GPU as in a uniform
    stage of its replica's degree, type and share with the same dp (states
    sharded over dp = 2); gradient sync: the tp-2 replica's parameters over
    the chunk holders."""
    model = get_model("gpt2-amp")
    n = model.num_layers
    cm = CostModel(Workload(model, CLUSTER, 32))
    stage = mixed(zero)
    timing = cm.stage_timing(stage, 8)
    alone = [cm.stage_timing(uniform_stage(range(n), devices, 1, tp, share, zero), share)
             for devices, tp, share in (((0, 1), 2, 5), ((4, 5, 6, 7), 4, 3))]
    assert timing.fwd_s + timing.back_s + timing.tp_comm_s == pytest.approx(
        max(a.fwd_s + a.back_s + a.tp_comm_s for a in alone), rel=1e-12)
    kernel = cm.kernel
    held = kernel.held_params(2, 0, n)
    sync_kind = zero12_gradient_collective(zero) if zero else "allreduce"
    assert timing.grad_sync_s == pytest.approx(
        held * kernel.grad_bytes * kernel.holder_groups_rate(sync_kind, stage.dp_groups(), 4), rel=1e-12)
    memory = cm.device_memory(stage, 8, 4)
    a100 = cm.device_memory(uniform_stage(range(n), (0, 1, 2, 3), 2, 2, 10, zero), 10, 4)[0]
    v100 = cm.device_memory(uniform_stage(range(n), (4, 5, 6, 7) + (0, 1, 2, 3), 2, 4, 6, zero), 6, 4)[0]
    assert memory == [a100] * 2 + [v100] * 4


def test_holder_rate_of_uniform_groups_is_the_stage_rate() -> None:
    """The shard-holder groups of a uniform stage are its dp groups: the same rate."""
    kernel = CostModel(Workload(get_model("gpt2-amp"), CLUSTER, 32)).kernel
    stage = uniform_stage(range(26), range(8), 4, 2, 8)
    assert kernel.holder_groups_rate("allreduce", stage.dp_groups(), 2) == \
        kernel.dp_collective_rate("allreduce", stage.devices, 2)


# One node of each with two GPUs: the brute force below stays small.
SMALL = ClusterSpec("a100-v100-small", (NodeSpec("A100-80GB", 2, 600), NodeSpec("V100-16GB", 2, 300)), 400)


def _brute_force(cm: CostModel, plan: Plan) -> float:
    """The fastest fitting one-stage plan over every degree per GPU type and every split."""
    best = float("inf")
    for degrees in itertools.product((1, 2), repeat=2):
        template = with_degrees(plan, degrees)
        for split in _compositions(plan.micro_batch_size, template.dp):
            time_s, fits = cm.quick(replace(plan, stages=(replace(template, dp_split=split),)))
            if fits:
                best = min(best, time_s)
    return best


def with_degrees(plan: Plan, degrees: tuple[int, int], per_node: int = 2) -> Stage:
    """The A100 node's GPUs at ``degrees[0]``, the V100 node's at ``degrees[1]``."""
    replica_tp = (degrees[0],) * (per_node // degrees[0]) + (degrees[1],) * (per_node // degrees[1])
    return replace(plan.stages[0], devices=tuple(range(2 * per_node)), dp=len(replica_tp), tp=max(replica_tp),
                   dp_split=(1,) * len(replica_tp), replica_tp=replica_tp if degrees[0] != degrees[1] else None)


def _compositions(total: int, parts: int) -> list[tuple[int, ...]]:
    """Every way to write ``total`` as ``parts`` positive whole numbers."""
    return [tuple(b - a for a, b in zip((0,) + cut, cut + (total,)))
            for cut in itertools.combinations(range(1, total), parts - 1)]


def test_mixed_degrees_win_where_they_are_best_and_equal_brute_force() -> None:
    """GPT-3 1.3B on 2 A100-80GB + 2 V100-16GB, one stage, micro-batch 16: the
    V100s hold it only at tp 2, where the A100s lose time to TP traffic; the
    search's best plan gives the A100 replicas their own lower degree, is
    faster than every plan of one degree, and equals the brute-force optimum
    over every degree per type and every split."""
    model = get_model("gpt3-1.3b")
    cm = CostModel(Workload(model, SMALL, 64))
    plan = one_stage(uniform_stage(range(model.num_layers), range(4), 2, 2, 16), "gpt3-1.3b")
    found = with_replica_tp(cm, plan)
    assert found.stages[0].replica_tp == (1, 1, 2)
    found_s, fits = cm.quick(found)
    assert fits and found_s == pytest.approx(_brute_force(cm, plan), rel=1e-12)
    uniform = [cm.quick(replace(plan, stages=(variant,)))
               for variant in stage_variants(cm, plan, 0) if variant.replica_tp is None]
    assert uniform and all(found_s < time_s for time_s, fits in uniform if fits)


def test_greedy_split_is_the_best_split() -> None:
    """``best_split`` against every split of one mixed stage (4 A100 replicas
    at tp 1, one V100 replica at tp 4; micro-batch 10)."""
    model = get_model("gpt3-1.3b")
    cm = CostModel(Workload(model, CLUSTER, 40))
    seed = one_stage(uniform_stage(range(model.num_layers), range(8), 2, 4, 10), "gpt3-1.3b")
    stage = with_degrees(seed, (1, 4), per_node=4)
    in_flight = in_flight_micro_batches(seed.schedule, 0, 1, seed.num_micro_batches, 1)
    split = best_split(cm, stage, 10, in_flight, in_flight >= seed.num_micro_batches)
    assert split is not None
    found_s = cm.quick(replace(seed, stages=(replace(stage, dp_split=split),)))[0]
    every = [cm.quick(replace(seed, stages=(replace(stage, dp_split=s),))) for s in _compositions(10, 5)]
    assert found_s == pytest.approx(min(t for t, fits in every if fits), rel=1e-12)


def test_choose_returns_mixed_replicas_with_mixed_tp() -> None:
    """``hetplan choose --mixed-tp``'s per-allocation planning on one node of 2
    A100-80GB and one of 2 V100-32GB (one zone), with Metis held to one stage:
    the point's plan gives the A100 replicas their own TP degree and is faster
    than the planner's own best plan of one degree per stage; its egress,
    across zones, runs over the shard-chunk holder groups."""
    offer = {"gpus_per_node": 2, "nodes": 1, "intra_node_bandwidth_gbps": 600, "inter_node_bandwidth_gbps": 400,
             "zone": "a"}
    pool = pool_from_dict({"name": "mixed", "zones": {"a": {"egress_usd_per_gb": 0.01}},
                           "inter_zone_bandwidth_gbps": 10,
                           "offers": [{**offer, "gpu": "A100-80GB", "price_per_gpu_hour": 1.8},
                                      {**offer, "gpu": "V100-32GB", "price_per_gpu_hour": 0.9}]}, "pool.yaml")
    base = load_workload(WorkloadOptions(model="gpt3-1.3b", global_batch=64))
    both = [a for a in allocations(pool, base) if a.counts == (1, 1)][0]
    planner = MetisPlanner(MetisOptions(max_stages=1))
    mixed_point = plan_allocation(pool, base, both, planner, 1.0, replica_tp_best)
    own_point = plan_allocation(pool, base, both, planner, 1.0, runnable_best)
    assert not isinstance(mixed_point, str) and not isinstance(own_point, str)
    assert mixed_point.best.plan.stages[0].replica_tp == (1, 1, 2)
    assert mixed_point.best.estimate.iteration_time_s < own_point.best.estimate.iteration_time_s
    stage = mixed_point.best.plan.stages[0]
    zones = ["a", "a", "b", "b"]  # the A100 node in zone a, the V100 node in zone b
    sent = cross_zone_bytes(mixed_point.best.plan, mixed_point.workload, zones)
    kernel = CostModel(mixed_point.workload).kernel
    held = sum(kernel.held_params(2, i, i + 1) for i in stage.layers)  # one shard chunk of each layer
    # chunk c's ring (0, 1, 2 + c): link 1 -> 2 + c leaves zone a, 2 + c -> 0 leaves zone b, each carrying
    # (n - 1) / n x 2 x the chunk's gradient bytes (ZeRO-0's all-reduce), for both chunks
    per_zone = 2 * (2 / 3) * 2 * kernel.grad_bytes * held
    assert sent == pytest.approx({"a": per_zone, "b": per_zone}, rel=1e-9)


@pytest.mark.parametrize("tool", ["torchtitan", "megatron", "deepspeed"])
def test_exports_refuse_mixed_degrees_even_with_an_even_split(tool: str) -> None:
    """An even split does not make a mixed stage exportable: one line says why."""
    plan = one_stage(mixed(split=(4, 4)))
    workload = Workload(get_model("gpt2-amp"), CLUSTER, plan.global_batch_size)
    why = refusal(plan, workload, tool)
    assert why.endswith("runs one tp on every replica; stage 0 gives its replicas tp 2/4 — make the plan with one "
                        "tp per stage") and "\n" not in why


def test_memory_table_names_each_replicas_degree() -> None:
    """The report's memory rows give each GPU type its replicas' own degree (the replay of
    each replica: tests/test_replay.py)."""
    model = get_model("gpt3-1.3b")
    workload = Workload(model, SMALL, 64)
    cm = CostModel(workload)
    plan = one_stage(replace(mixed(layers=model.num_layers), devices=(0, 1, 2, 3), dp=3, tp=2, dp_split=(8, 7, 1),
                             replica_tp=(1, 1, 2)), "gpt3-1.3b")
    estimate = cm.estimate(plan)
    rows = {line.split()[1]: line.split()[2] for line in memory_table(plan, estimate, workload).splitlines()[2:]}
    assert rows == {"A100-80GB": "3x1", "V100-16GB": "3x2"}


def test_a_cut_degree_search_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    """Past the work budget a stage keeps its degrees, and the plan's notes say so."""
    monkeypatch.setattr(replica_tp_search, "MAX_DEGREE_COMBINATIONS", 3)
    model = get_model("gpt3-1.3b")
    cm = CostModel(Workload(model, SMALL, 64))
    plan = one_stage(uniform_stage(range(model.num_layers), range(4), 2, 2, 16), "gpt3-1.3b")
    found = with_replica_tp(cm, plan)
    assert found is not None and found.stages == plan.stages
    assert found.notes[-1].startswith("stage 0: more than 3 combinations of per-type TP degrees")


def test_metis_option_gives_mixed_replicas_and_is_off_by_default() -> None:
    """``MetisOptions(replica_tp=True)`` held to one stage on the small cluster
    returns the mixed stage, noted and faster; without it Metis's one (dp, tp).
    (At a global batch of 64 Metis's own dp2 tp2 at micro-batch 4 stays 0.3% ahead.)"""
    workload = Workload(get_model("gpt3-1.3b"), SMALL, 128)
    mixed_best = MetisPlanner(MetisOptions(max_stages=1, replica_tp=True)).plan(workload, 1)[0]
    own_best = MetisPlanner(MetisOptions(max_stages=1)).plan(workload, 1)[0]
    assert mixed_best.plan.stages[0].replica_tp == (1, 1, 2) and own_best.plan.stages[0].replica_tp is None
    assert any("replicas of their own TP degree" in note for note in mixed_best.plan.notes)
    assert any("dp3 x tp1/1/2" in note for note in mixed_best.plan.notes)
    assert mixed_best.estimate.iteration_time_s < own_best.estimate.iteration_time_s
