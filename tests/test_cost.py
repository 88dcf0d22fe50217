"""The shared cost model against hand-computed values."""

from __future__ import annotations

import pytest

from hetplan.cluster.spec import ClusterSpec, NodeSpec
from hetplan.cluster.io import load_cluster
from hetplan.cost.model import CostModel
from hetplan.plan.workload import Workload
from hetplan.cost import comm
from hetplan.cost.constants import ALLREDUCE_BUCKET_BYTES, COLLECTIVE_BANDWIDTH_EFFICIENCY, ZERO3_GATHERED_LAYERS
from hetplan.cost.memory import framework_overhead_bytes, in_flight_micro_batches, model_state_bytes
from hetplan.cost.pipeline import pipeline_time
from hetplan.model.presets import get_model, gpt_decoder
from hetplan.plan.spec import LayerStrategy, Plan, Stage
from hetplan.search.baselines.uniform import uniform_plan


def _cluster(nodes: int, per_node: int, intra_gbps: float, inter_gbps: float, gpu: str = "A100-80GB") -> ClusterSpec:
    return ClusterSpec("test", tuple(NodeSpec(gpu, per_node, intra_gbps, name=f"n{i}") for i in range(nodes)),
                       inter_gbps)


def test_mixed_precision_adam_is_16_bytes_per_param() -> None:
    w = Workload(get_model("gpt2-amp"), load_cluster("amp-homogeneous"), 32)
    assert w.optimizer == "adam-mixed"
    assert sum(w.state_bytes) == 16
    assert model_state_bytes(1000, 0, 8, w.state_bytes) == 16000


def test_zero_stages_shard_states() -> None:
    state = (2, 2, 12)
    assert model_state_bytes(800, 1, 8, state) == pytest.approx(800 * (2 + 2 + 12 / 8))
    assert model_state_bytes(800, 2, 8, state) == pytest.approx(800 * (2 + (2 + 12) / 8))
    # ZeRO-3 on 8 GPUs: 16/8 = 2 bytes per parameter of model state per GPU
    assert model_state_bytes(800, 3, 8, state) == pytest.approx(800 * 2)


def test_zero3_memory_adds_gathered_working_set() -> None:
    model = gpt_decoder("m", 4, 512, 8, 128, vocab=1000)
    workload = Workload(model, load_cluster("8xA100-80GB"), 8)
    plan = uniform_plan(workload, 8, 1, 1, 1, zero=3)
    memory = CostModel(workload).estimate(plan).peak_memory_bytes[0]
    state = workload.state_bytes  # (2, 2, 12): 16 bytes per parameter, 2 per GPU under ZeRO-3 on 8
    params = model.total_params  # tied embedding/head counted once on the stage
    largest = max(layer.params for layer in model.layers)
    activations = sum(layer.act_bytes for layer in model.layers)  # one sample, one micro-batch in flight
    expected = sum(state) / 8 * params + ZERO3_GATHERED_LAYERS * 2 * largest + activations \
        + framework_overhead_bytes(False)
    assert memory == pytest.approx(expected, rel=1e-9)


def test_tied_weight_is_synced_and_updated_once_per_stage() -> None:
    """A stage holding both the embedding and the LM head that shares its
    weight holds, all-reduces and updates that weight once."""
    model = gpt_decoder("m", 2, 512, 8, 128, vocab=1000)
    assert model.layers[-1].tied_params > 0
    workload = Workload(model, load_cluster("8xA100-80GB"), 8)
    cost = CostModel(workload)
    timing = cost.stage_timing(uniform_plan(workload, 8, 1, 1, 1).stages[0], 8)
    group = tuple(range(8))
    grad = workload.state_bytes[1]
    sync_bytes = model.total_params * grad
    latency = comm.collective_latency(workload.cluster, group, "allreduce") * sync_bytes / ALLREDUCE_BUCKET_BYTES
    expected_sync = comm.allreduce_time(workload.cluster, group, sync_bytes, 1) + latency
    assert timing.grad_sync_s == pytest.approx(expected_sync, rel=1e-9)
    assert timing.optimizer_s == pytest.approx(cost.kernel.optimizer_rate(group) * model.total_params, rel=1e-9)


def test_zero1_all_reduces_and_zero2_reduce_scatters_gradients() -> None:
    workload = Workload(get_model("gpt2-amp"), load_cluster("8xA100-80GB"), 8)
    cost = CostModel(workload)
    one, two = (cost.stage_timing(uniform_plan(workload, 8, 1, 1, 1, zero=z).stages[0], 8) for z in (1, 2))
    assert one.post_step_s == pytest.approx(two.post_step_s) and one.post_step_s > 0  # both gather the weights
    group = tuple(range(8))
    kernel = cost.kernel

    def per_byte(kind: str) -> float:  # bandwidth plus one latency per message (a bucket or a layer)
        latency = comm.collective_latency(workload.cluster, group, kind) / kernel.message_bytes(kind, 1)
        return {"allreduce": comm.allreduce_time, "reduce_scatter": comm.reduce_scatter_time}[kind](
            workload.cluster, group, 1.0) + latency

    assert one.grad_sync_s == pytest.approx(two.grad_sync_s * per_byte("allreduce") / per_byte("reduce_scatter"))


def test_lower_bound_is_below_every_plan(gpt2_hetero: Workload, gpt2_cost: CostModel) -> None:
    bound = gpt2_cost.lower_bound_s()
    assert bound > 0
    for dp, tp, pp, u, zero, rc in [(16, 1, 1, 2, 0, "none"), (2, 2, 4, 1, 2, "full"), (1, 1, 16, 1, 0, "none"),
                                    (4, 4, 1, 8, 3, "selective")]:
        estimate = gpt2_cost.estimate(uniform_plan(gpt2_hetero, dp, tp, pp, u, zero, rc))
        assert estimate.lower_bound_s == bound <= estimate.iteration_time_s


def test_flat_ring_allreduce_is_amp_eq3() -> None:
    cluster = _cluster(1, 4, 100.0, 100.0)
    # 2(n-1)M / (n B): 2*3/4 * 1e9 B / 12.5e9 B/s = 0.12 s
    assert comm.flat_ring_allreduce_time(cluster, [0, 1, 2, 3], 1e9) == pytest.approx(0.12)
    assert comm.allreduce_time(cluster, [0, 1, 2, 3], 1e9) == pytest.approx(0.12 / COLLECTIVE_BANDWIDTH_EFFICIENCY)


def test_hierarchical_allreduce_across_nodes() -> None:
    cluster = _cluster(2, 4, 800.0, 80.0)
    eff = COLLECTIVE_BANDWIDTH_EFFICIENCY
    intra = 0.75 * 1e9 / (100e9 * eff)  # reduce-scatter (and all-gather) inside a node
    inter = 2 * 0.5 * 1e9 / (10e9 * eff)  # all-reduce between the 2 nodes' NICs
    assert comm.allreduce_time(cluster, list(range(8)), 1e9) == pytest.approx(2 * intra + inter)
    # a flat ring over the slowest link (AMP) is much slower here
    assert comm.flat_ring_allreduce_time(cluster, list(range(8)), 1e9) > inter


def test_p2p_is_bytes_over_bandwidth() -> None:
    cluster = _cluster(2, 1, 100.0, 8.0)
    assert comm.p2p_time(cluster, [0], [1], 1e9) == pytest.approx(1.0)  # 1 GB over 1 GB/s


def test_pipeline_time_formula() -> None:
    # (m-1) * max + sum + 2 * sum(p2p) = 3*3 + 6 + 0.6
    assert pipeline_time([1.0, 2.0, 3.0], [0.1, 0.2], 4) == pytest.approx(15.6)
    assert pipeline_time([2.0], [], 5) == pytest.approx(10.0)


def test_in_flight_micro_batches() -> None:
    assert [in_flight_micro_batches("1f1b", j, 4, 8) for j in range(4)] == [4, 3, 2, 1]
    assert in_flight_micro_batches("1f1b", 0, 4, 2) == 2
    assert in_flight_micro_batches("gpipe", 3, 4, 8) == 8


def test_estimate_parts_add_up(gpt2_hetero: Workload, gpt2_cost: CostModel) -> None:
    for dp, tp, pp, u, zero, rc in [(16, 1, 1, 2, 0, "none"), (2, 2, 4, 1, 1, "full"), (4, 1, 4, 2, 3, "selective")]:
        e = gpt2_cost.estimate(uniform_plan(gpt2_hetero, dp, tp, pp, u, zero, rc))
        parts = e.compute_s + e.bubble_s + e.p2p_s + e.dp_sync_s + e.tp_comm_s + e.recompute_s + e.optimizer_s
        assert parts == pytest.approx(e.iteration_time_s)
        assert e.samples_per_s == pytest.approx(32 / e.iteration_time_s)
        assert 0 < e.mfu < 1


def test_recompute_trades_time_for_memory(gpt2_hetero: Workload, gpt2_cost: CostModel) -> None:
    results = {rc: gpt2_cost.estimate(uniform_plan(gpt2_hetero, 4, 1, 4, 2, 0, rc))
               for rc in ("none", "selective", "full")}
    assert results["none"].iteration_time_s < results["selective"].iteration_time_s < results["full"].iteration_time_s
    assert results["none"].max_memory_bytes > results["selective"].max_memory_bytes > results["full"].max_memory_bytes


def test_1f1b_earlier_stages_hold_more_activations(gpt2_hetero: Workload, gpt2_cost: CostModel) -> None:
    plan = uniform_plan(gpt2_hetero, 1, 1, 8, 2)
    mems = [gpt2_cost.stage_memory(plan, j)[0] for j in range(1, 7)]  # middle stages hold equal layers
    assert mems == sorted(mems, reverse=True) and mems[0] > mems[-1]
    gpipe = plan.with_changes(schedule="gpipe")
    assert gpt2_cost.stage_memory(gpipe, 6)[0] > gpt2_cost.stage_memory(plan, 6)[0]


def test_explicit_layer_tp_equal_to_stage_tp_changes_nothing(gpt2_hetero: Workload, gpt2_cost: CostModel) -> None:
    plan = uniform_plan(gpt2_hetero, 2, 2, 4, 2)
    explicit = plan.with_changes(stages=tuple(
        Stage(s.layers, s.devices, s.dp, s.tp, s.dp_split, tuple(LayerStrategy(0, "none", 2) for _ in s.layers))
        for s in plan.stages))
    assert gpt2_cost.estimate(explicit).iteration_time_s == pytest.approx(gpt2_cost.estimate(plan).iteration_time_s)


def test_layer_with_own_tp_pays_transformation(gpt2_hetero: Workload, gpt2_cost: CostModel) -> None:
    plan = uniform_plan(gpt2_hetero, 4, 1, 4, 1)
    stage = plan.stages[1]
    mixed = tuple(LayerStrategy(0, "none", 4 if i % 2 else 1) for i in range(stage.num_layers))
    changed = plan.with_changes(stages=(plan.stages[0], Stage(stage.layers, stage.devices, 4, 1, stage.dp_split, mixed),
                                        *plan.stages[2:]))
    base, other = gpt2_cost.estimate(plan), gpt2_cost.estimate(changed)
    assert other.stages[1].tp_comm_s > base.stages[1].tp_comm_s == 0  # TP all-reduces + resharding
    assert other.stages[1].memory_bytes[0] < base.stages[1].memory_bytes[0]  # TP-4 layers hold 1/4 of their weights


def test_uneven_split_helps_mixed_replicas() -> None:
    cluster = ClusterSpec("mix", (NodeSpec("V100-16GB", 1, 100), NodeSpec("T4", 1, 100)), 100)
    model = gpt_decoder("m", 4, 1024, 16, 512)
    w = Workload(model, cluster, 8)
    cost = CostModel(w)
    layers = tuple(range(model.num_layers))

    def plan(split: tuple[int, int]) -> Plan:
        stage = Stage(layers, (0, 1), 2, 1, split, (LayerStrategy(),) * len(layers))
        return Plan("m", "mix", 8, 8, 1, "1f1b", (stage,))

    even = cost.estimate(plan((4, 4))).iteration_time_s
    skewed = cost.estimate(plan((6, 2))).iteration_time_s  # V100 is ~2x a T4 here
    assert skewed < even


def test_profile_overrides_flops() -> None:
    from hetplan.profile import ProfileDB, ProfileEntry

    model = gpt_decoder("m", 2, 256, 4, 64, vocab=500)
    cluster = load_cluster("8xT4")
    block = model.layers[1]
    db = ProfileDB([ProfileEntry(block.profile_key, "T4", 1, 1, 0.010, 0.020),
                    ProfileEntry(block.profile_key, "T4", 1, 4, 0.030, 0.060)])
    kernel = CostModel(Workload(model, cluster, 8, profile=db)).kernel
    gpu = cluster.devices[0].gpu
    assert kernel.layer_time(1, gpu, 4)[0] == pytest.approx(0.030)
    assert kernel.layer_time(1, gpu, 2)[1] == pytest.approx(0.020 + (0.060 - 0.020) / 3)  # interpolated
    assert kernel.layer_time(1, gpu, 7)[0] == pytest.approx(0.030 + 3 * 0.010)  # 7 = 4 + 1 + 1 + 1
