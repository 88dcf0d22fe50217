"""Context parallelism (CP) and expert parallelism (EP) in the model, the cost
kernel and the planners: volumes against their sources' formulas, memory per
GPU against the formulas, and the planners' choices on long sequences and MoE."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import numpy as np
import pytest

from hetplan.cli import main
from hetplan.cluster.presets import get_cluster
from hetplan.cluster.spec import ClusterSpec, NodeSpec
from hetplan.cost.model import CostModel
from hetplan.plan.workload import Workload
from hetplan.cost.comm import alltoall_time
from hetplan.cost.compute import gemm_efficiency
from hetplan.cost.constants import COLLECTIVE_BANDWIDTH_EFFICIENCY, CP_KV_PASSES, EP_ALLTOALL_PASSES, GEMM_HALF_DIM
from hetplan.cost.cp_ep import causal_cp_work_fraction, cp_activation_bytes, cp_gather_bytes, ring_kv_bytes
from hetplan.cost.memory import in_flight_micro_batches
from hetplan.cost.stage import StageOption
from hetplan.errors import HetplanError
from hetplan.model.families import llama_decoder
from hetplan.model.presets import get_model
from hetplan.model.spec import LayerSpec, ModelSpec
from setting_roundtrip import estimate_keeps_setting
from hetplan.plan.spec import Plan
from hetplan.search.auto import AutoPlanner
from hetplan.search.baselines.uniform import UniformPlanner, uniform_plan
from hetplan.search.common.stage_partition import PipelinePartitioner
from hetplan.units import gbps_to_bytes_per_s
from hetplan.plan.validate import validate_plan


def _tiny_llama(seq: int = 256) -> ModelSpec:
    return llama_decoder("tl", 4, 256, 8, 2, 512, 1000, seq)


def _node_cluster(gpus_per_node: int = 8, nodes: int = 1) -> ClusterSpec:
    return ClusterSpec("c", tuple(NodeSpec("H100", gpus_per_node, 3600.0, 400.0, name=f"n{i}")
                                  for i in range(nodes)), 400.0)


# --------------------------------------------------------------------------- model


def test_mixtral_and_deepseek_layers_know_their_experts_and_attention() -> None:
    mixtral = get_model("mixtral-8x7b")
    block = mixtral.layers[1]
    s, h, p = 4096, 4096, 2
    assert (block.attention, block.num_experts, block.top_k, block.expert_ffn) == ("causal", 8, 2, 14336)
    assert block.expert_params == 8 * 3 * h * 14336  # SwiGLU experts, no bias
    assert block.expert_flops == pytest.approx(2.0 * 2 * s * 3 * h * 14336)  # top-2 copies through 3 matrices
    assert block.dispatch_bytes == p * 2 * s * h  # every token's 2 routed copies of its hidden state
    assert block.kv_bytes == 2 * p * s * 8 * 128  # K and V of 8 KV heads of 128
    assert mixtral.layers[0].num_experts == 0 and mixtral.layers[0].attention == ""
    deepseek = get_model("deepseek-v2-lite")
    dense, moe = deepseek.layers[1], deepseek.layers[2]
    assert dense.num_experts == 0 and moe.num_experts == 64 and moe.top_k == 6 and moe.shared_expert_ffn == 2 * 1408
    assert moe.kv_bytes == p * 4096 * 16 * (192 + 128)  # MLA: per-head K (nope + rope) and V after up-projection
    gpt = get_model("gpt3-1.3b")
    assert gpt.layers[1].attention == "causal"
    assert get_model("bert-huge-32").layers[1].attention == "full"
    swin = get_model("swin-huge-32").layers[1]
    assert (swin.attention, swin.attention_window) == ("sliding", 49)


def test_layer_fields_round_trip_and_are_checked() -> None:
    model = get_model("mixtral-8x7b")
    again = ModelSpec.from_dict(json.loads(json.dumps(model.to_dict())))
    assert again.layers == model.layers
    base = model.layers[1]
    data = {k: v for k, v in model.to_dict()["layers"][1].items()}
    with pytest.raises(HetplanError, match="attention must be one of"):
        LayerSpec(**{**data, "attention": "diagonal"})
    with pytest.raises(HetplanError, match="top_k must be between 1 and num_experts"):
        LayerSpec(**{**data, "top_k": 9})
    with pytest.raises(HetplanError, match="need num_experts"):
        LayerSpec(**{**data, "num_experts": 0})
    with pytest.raises(HetplanError, match="expert_params exceed"):
        LayerSpec(**{**data, "expert_params": base.params})


# --------------------------------------------------------------------------- formulas


def test_causal_load_balance_matches_a_brute_force_count() -> None:
    """Count the causal score entries each rank computes, zigzag and contiguous."""
    s = 64
    mask = np.tril(np.ones((s, s), dtype=bool))
    for cp in (2, 4, 8):
        chunk = s // (2 * cp)
        zigzag = [mask[np.r_[i * chunk:(i + 1) * chunk, (2 * cp - 1 - i) * chunk:(2 * cp - i) * chunk]].sum()
                  for i in range(cp)]
        contiguous = [mask[i * s // cp:(i + 1) * s // cp].sum() for i in range(cp)]
        # entries per rank over the whole triangle (the kernel counts s²/2; the diagonal adds s/2)
        assert max(zigzag) == min(zigzag)
        assert max(zigzag) / mask.sum() == pytest.approx(causal_cp_work_fraction(cp, True))
        assert max(contiguous) / mask.sum() == pytest.approx(causal_cp_work_fraction(cp, False), rel=2 * cp / s)


def test_cp_exchange_equals_the_llama3_all_gather_and_the_ring_volume() -> None:
    """Per layer and micro-batch: passes x ((cp-1)/cp of the samples' K/V per TP rank over the
    NVLink ring at NCCL's bus efficiency + one collective latency), hand-computed."""
    model = _tiny_llama(256)
    cluster = _node_cluster()
    cost = CostModel(Workload(model, cluster, 8))
    kernel = cost.kernel
    cp, tp, share = 4, 2, 2
    grid = np.arange(8).reshape(cp, tp)
    (rate, latency), _ = kernel.cp_ep_links(grid, cp, 1)
    bandwidth = gbps_to_bytes_per_s(3600.0) * COLLECTIVE_BANDWIDTH_EFFICIENCY
    assert rate == pytest.approx((cp - 1) / cp / bandwidth)
    comm = kernel.cp_ep_comm_time("none", share, tp, (cp, 1, (rate, latency), (0.0, 0.0)), np.zeros(6))
    block = model.layers[1]
    received = (cp - 1) / cp * block.kv_bytes * share / tp
    assert comm[1] == pytest.approx(CP_KV_PASSES["none"] * (received / bandwidth + latency))
    assert comm[0] == comm[-1] == 0.0  # embedding and head exchange nothing
    assert ring_kv_bytes(block.kv_bytes, cp) == pytest.approx((cp - 1) / cp * block.kv_bytes)
    # a sliding window of w tokens needs only w tokens' K/V from the ranks before
    window = np.array([32.0])
    assert cp_gather_bytes(np.array([1.0]), cp, window, 256)[0] * (cp - 1) / cp == pytest.approx(32 / 256)


def test_alltoall_volume_in_a_node_and_across_nodes() -> None:
    """(ep-1)/ep of each rank's send buffer leaves it: on NVLink inside a node,
    and through the NICs for the part bound for other nodes."""
    one = _node_cluster(8, 1)
    m = 1e9
    intra = gbps_to_bytes_per_s(3600.0) * COLLECTIVE_BANDWIDTH_EFFICIENCY
    assert alltoall_time(one, range(8), m) == pytest.approx(7 / 8 * m / intra)
    two = _node_cluster(4, 2)
    nic = 400.0 * 1e9 / 8 * COLLECTIVE_BANDWIDTH_EFFICIENCY
    # each node sends its 4 GPUs' buffers' halves to the other node through its NIC
    assert alltoall_time(two, range(8), m) == pytest.approx(4 * m * 4 / 8 / nic)
    assert alltoall_time(two, range(8), m, concurrent_groups=2) == pytest.approx(2 * 4 * m * 4 / 8 / nic)


def test_ep_alltoall_charge_is_the_formula() -> None:
    """Four all-to-alls per MoE layer and micro-batch, each of tokens x top_k x hidden x dtype,
    scaled by the busiest rank's imbalance."""
    model = get_model("moe-1.3b")
    cost = CostModel(Workload(model, _node_cluster(), 8, expert_imbalance=1.5))
    kernel = cost.kernel
    grid = np.arange(8).reshape(8, 1)
    _, (rate, latency) = kernel.cp_ep_links(grid, 1, 4)
    comm = kernel.cp_ep_comm_time("none", 2, 1, (1, 4, (0.0, 0.0), (rate, latency)), np.zeros(model.num_layers))
    moe = [i for i, layer in enumerate(model.layers) if layer.is_moe]
    layer = model.layers[moe[0]]
    assert layer.dispatch_bytes == 2 * 2 * 1024 * 768  # bf16, top-2, seq 1024, hidden 768
    expected = EP_ALLTOALL_PASSES["none"] * (layer.dispatch_bytes * 2 * 1.5 * rate + latency)
    assert comm[moe[0]] == pytest.approx(expected)
    assert all(comm[i] == 0 for i in range(model.num_layers) if i not in moe)


# --------------------------------------------------------------------------- memory


def test_activations_per_gpu_fall_with_cp_as_the_formula_says() -> None:
    model = _tiny_llama(1024)
    workload = Workload(model, _node_cluster(), 8)
    cost = CostModel(workload)
    act = cost.kernel.activation_bytes(1, "none", False)
    kv = np.array([layer.kv_bytes for layer in model.layers])
    previous = math.inf
    for cp in (1, 2, 4, 8):
        plan = uniform_plan(workload, 8 // cp, 1, 1, 1, cp=cp)
        validate_plan(plan, model, workload.cluster)
        parts = cost.memory_breakdown(plan)[0]
        in_flight = in_flight_micro_batches(plan.schedule, 0, 1, plan.num_micro_batches)
        expected = float(np.sum((act - kv) / cp + kv)) * 1 * in_flight  # one sample per replica
        assert parts["activations"] == pytest.approx(expected, rel=1e-6)
        assert float(np.sum(cp_activation_bytes(act, kv, cp))) * in_flight == pytest.approx(expected)
        assert parts["activations"] < previous
        previous = parts["activations"]
        assert sum(parts.values()) == pytest.approx(cost.estimate(plan).peak_memory_bytes[0], abs=8)


def test_expert_states_per_gpu_fall_with_ep_as_the_formula_says() -> None:
    model = get_model("moe-1.3b")
    workload = Workload(model, _node_cluster(), 8)
    cost = CostModel(workload)
    experts = sum(layer.expert_params for layer in model.layers)
    weight, grad, opt = workload.state_bytes
    base = cost.memory_breakdown(uniform_plan(workload, 8, 1, 1, 1))[0]
    for ep in (2, 4, 8):
        plan = uniform_plan(workload, 8, 1, 1, 1, ep=ep)
        parts = cost.memory_breakdown(plan)[0]
        saved = experts * (1 - 1 / ep)
        assert base["params"] - parts["params"] == pytest.approx(saved * weight, rel=1e-9)
        assert base["optimizer"] - parts["optimizer"] == pytest.approx(saved * opt, rel=1e-9)
        # ZeRO-1 shards the experts' optimizer states over the dp/ep ranks holding the same experts
        z1 = cost.memory_breakdown(uniform_plan(workload, 8, 1, 1, 1, zero=1, ep=ep))[0]
        dense = sum(layer.params - layer.tied_params for layer in model.layers) - experts
        assert z1["optimizer"] == pytest.approx((dense / 8 + experts / ep / (8 // ep)) * opt, rel=1e-6)
        assert sum(parts.values()) == pytest.approx(cost.estimate(plan).peak_memory_bytes[0], abs=8)


def test_expert_gradients_sync_only_over_the_ranks_holding_the_same_experts() -> None:
    """ep = dp x cp leaves each expert on one rank: its gradients need no sync at all."""
    model = get_model("moe-1.3b")
    workload = Workload(model, _node_cluster(), 8, overlap_grad_sync=False)
    cost = CostModel(workload)
    full = cost.stage_timing(uniform_plan(workload, 8, 1, 1, 1, ep=8).stages[0], 8)
    none = cost.stage_timing(uniform_plan(workload, 8, 1, 1, 1).stages[0], 8)
    experts = sum(layer.expert_params for layer in model.layers)
    total = sum(layer.params - layer.tied_params for layer in model.layers)
    assert full.grad_sync_s == pytest.approx(none.grad_sync_s * (total - experts) / total, rel=1e-6)


# --------------------------------------------------------------------------- planners and kernel


def test_partition_tables_of_cp_ep_stages_are_the_estimate() -> None:
    """The exact solver's own value of a cp/ep plan is its estimate (the one kernel)."""
    model = get_model("moe-1.3b")
    workload = Workload(model, _node_cluster(8, 2), 16)
    cost = CostModel(workload)
    stages = ((tuple(range(8)), 2, 1, (2, 2), 4, 4), (tuple(range(8, 16)), 2, 2, (2, 2), 2, 2))
    options = [[StageOption(d, dp, tp, split, zero, rc, tp > 1, cp=cp, ep=ep)
                for zero in (0, 2, 3) for rc in ("none", "selective", "full")]
               for d, dp, tp, split, cp, ep in stages]
    solution = PipelinePartitioner(cost.kernel, 4, 4).solve(options)
    assert solution is not None
    plan = Plan(model.name, workload.cluster.name, 16, 4, 4, "1f1b", solution.stages)
    validate_plan(plan, model, workload.cluster)
    assert (plan.stages[0].cp, plan.stages[0].ep, plan.stages[1].cp, plan.stages[1].ep) == (4, 4, 2, 2)
    assert cost.estimate(plan).iteration_time_s == pytest.approx(solution.iteration_s, rel=1e-9)
    assert cost.quick(plan)[0] == pytest.approx(solution.iteration_s, rel=1e-9)


def test_cp_ep_plan_json_round_trips() -> None:
    model = get_model("moe-1.3b")
    workload = Workload(model, _node_cluster(8, 2), 16)
    plan = uniform_plan(workload, 4, 2, 1, 2, zero=2, cp=2, ep=4)
    again = Plan.from_dict(json.loads(json.dumps(plan.to_dict())))
    assert again == plan and again.stages[0].cp == 2 and again.stages[0].ep == 4
    cost = CostModel(workload)
    assert cost.estimate(again) == cost.estimate(plan)


def _long_llama() -> ModelSpec:
    return llama_decoder("llama3-8b-64k", 32, 4096, 32, 8, 14336, 128256, 65536)


def test_llama3_8b_at_64k_tokens_gets_context_parallelism() -> None:
    """64 H100, 64k-token samples: one sample's activations are ~305 GiB, so
    without CP every plan recomputes in full or offloads to host memory (the
    best, dp32 tp2 z2 offload, keeps ~152 GiB per GPU on the host: it fits a
    DGX H100's 2 TB); CP shards the activations and is faster than all of them."""
    workload = Workload(_long_llama(), get_cluster("64xH100"), 64)
    cost = CostModel(workload)
    no_cp = [p for p in UniformPlanner().candidates(workload) if p.stages[0].cp == 1]
    best_without = min(t for t, fits in (cost.quick(p) for p in no_cp) if fits)
    for planner in (UniformPlanner(), AutoPlanner()):
        best = planner.plan(workload, 1, cost)[0]
        assert best.plan.stages[0].cp > 1, planner.name
        assert best.estimate.fits
        assert best.estimate.iteration_time_s < best_without, planner.name


def test_mixtral_gets_expert_parallelism_when_routing_is_balanced_enough() -> None:
    """Mixtral-8x7B on 64 H100, 256 x 4k tokens. MFU counts the active (top-2)
    FLOPs; 30-50% is what Megatron-Core reaches on H100 for MoE models (Liu
    et al. 2025, "MoE Parallel Folding", arXiv:2504.14960: 49.3% Mixtral
    8x22B, 39.0% Qwen2-57B-A14B). Without EP each expert's matmuls see only
    2/8 of a rank's tokens (``compute.expert_token_efficiency``), with EP ep
    times more, but the busiest EP rank carries the imbalance: auto takes EP
    at a busiest-rank load of 1.1 and not at the default 1.25 (a capacity
    buffer, EXPERT_LOAD_IMBALANCE), where the best EP plan stays within 10%."""
    model = get_model("mixtral-8x7b")
    balanced = Workload(model, get_cluster("64xH100"), 256, expert_imbalance=1.1)
    best = AutoPlanner().plan(balanced, 1)[0]
    assert best.plan.stages[0].ep > 1
    assert 0.3 <= best.estimate.mfu <= 0.5
    default = Workload(model, get_cluster("64xH100"), 256)
    chosen = AutoPlanner().plan(default, 1)[0]
    assert chosen.plan.stages[0].ep == 1 and 0.3 <= chosen.estimate.mfu <= 0.5
    cost = CostModel(default)
    with_ep = min(t for t, fits in (cost.quick(p) for p in UniformPlanner().candidates(default)
                                    if p.stages[0].ep > 1) if fits)
    assert chosen.estimate.iteration_time_s < with_ep < 1.1 * chosen.estimate.iteration_time_s


def test_expert_matmuls_run_at_the_efficiency_of_their_token_side() -> None:
    """Per MoE layer and micro-batch of u samples: expert FLOPs / (rate x m/(m + GEMM_HALF_DIM)) with
    m = u x seq x top_k / experts tokens per expert, x ep x imbalance under EP; dense work unchanged."""
    model = get_model("mixtral-8x7b")
    cost = CostModel(Workload(model, _node_cluster(), 8, expert_imbalance=1.25))
    kernel, gpu = cost.kernel, _node_cluster().devices[0].gpu
    block = model.layers[1]
    rate = gpu.peak_flops_for(2) * float(gemm_efficiency(gpu, kernel.arrays.gemm_dim, 1)[1])
    for u, ep, load in ((1, 1, 1.0), (2, 1, 1.0), (1, 8, 1.25), (2, 4, 1.25)):
        work = kernel.unit_work(gpu, 1, False, load, 1, load * ep if ep > 1 else 1.0).scaled(u)
        m = u * 4096 * 2 / 8 * (ep * load if ep > 1 else 1.0)
        expected = load * u * block.expert_flops / rate / (m / (m + GEMM_HALF_DIM))
        assert work.expert_time()[1] == pytest.approx(expected, rel=1e-9)
        dense = (block.fwd_flops - block.attention_flops - block.expert_flops) * u / rate
        assert work.gemm_s[1] == pytest.approx(dense, rel=1e-9)
    assert kernel.time_class(gpu, 1, 1, "none", False, (0.0, 0.0)).total[-1] > 0
    llama = CostModel(Workload(_tiny_llama(), _node_cluster(), 8)).kernel
    unit = llama.unit_work(gpu, 1, False)
    assert not np.any(unit.expert_time()) and np.all(unit.forward() == unit.gemm_s + unit.attention_s
                                                     + unit.memory_s + unit.launch_s)


def _mixed_cluster() -> ClusterSpec:
    return ClusterSpec("a100+h100", (NodeSpec("A100-80GB", 4, 2400.0, 200.0, name="a"),
                                     NodeSpec("H100", 4, 3600.0, 400.0, name="h")), 200.0)


def test_expert_split_follows_gpu_speed_on_a_mixed_cluster() -> None:
    """4 A100 + 4 H100, 16 experts over ep8 (one EP group across both): the
    uniform planner's best single-stage EP plan gives the H100 ranks more
    experts, and that beats the same plan with an even split."""
    workload = Workload(get_model("moe-1.3b"), _mixed_cluster(), 16)
    cost = CostModel(workload)
    single = [p for p in UniformPlanner().candidates(workload, cost) if p.pp == 1 and p.stages[0].ep == 8]
    best = min(single, key=lambda p: (not cost.quick(p)[1], cost.quick(p)[0], p.describe()))
    split = best.stages[0].ep_split
    assert split is not None and sum(split) == 16 and min(split) >= 1
    assert min(split[4:]) > max(split[:4])  # EP ranks 4-7 are the H100s
    validate_plan(best, workload.model, workload.cluster)
    even = best.with_changes(stages=tuple(replace(s, ep_split=None) for s in best.stages))
    assert cost.quick(best)[0] < cost.quick(even)[0]
    # memory: an H100 holds split[4] / 2 times an even share of the experts
    experts = sum(layer.expert_params for layer in workload.model.layers)
    parts, even_parts = cost.memory_breakdown(best), cost.memory_breakdown(even)
    weight = workload.state_bytes[0]
    assert parts[4]["params"] - even_parts[4]["params"] == pytest.approx(experts * (split[4] - 2) / 16 * weight,
                                                                         rel=1e-6)
    assert sum(parts[4].values()) == pytest.approx(cost.estimate(best).peak_memory_bytes[4], abs=8)
    again = Plan.from_dict(json.loads(json.dumps(best.to_dict())))
    assert again == best and "ep_split" not in json.dumps(even.to_dict())


def test_uneven_expert_split_is_checked_and_refused_where_unsupported() -> None:
    workload = Workload(get_model("moe-1.3b"), _mixed_cluster(), 16)
    plan = uniform_plan(workload, 8, 1, 1, 1, ep=8, expert_split=True)
    stage = plan.stages[0]
    for bad, message in (((2,) * 7 + (1,), "sums to 15"), ((0,) + (2,) * 7 + (2,), "has 9 entries"),
                         ((0, 4, 2, 2, 2, 2, 2, 2), "at least one expert")):
        broken = plan.with_changes(stages=(replace(stage, ep_split=bad),))
        with pytest.raises(HetplanError, match=message):
            validate_plan(broken, workload.model, workload.cluster)
    dense = Workload(_tiny_llama(), _mixed_cluster(), 8)
    dense_plan = uniform_plan(dense, 8, 1, 1, 1)
    with pytest.raises(HetplanError, match="ep_split needs ep > 1"):
        validate_plan(dense_plan.with_changes(stages=(replace(dense_plan.stages[0], ep_split=(1, 1)),)),
                      dense.model, dense.cluster)
    from hetplan.export.tools import to_megatron_args
    with pytest.raises(HetplanError, match="same number of experts"):
        to_megatron_args(plan, workload.model)
    from hetplan.plan.layout import PlanLayout
    with pytest.raises(HetplanError, match="splits experts unevenly"):
        PlanLayout.from_plan(plan, [layer.name for layer in workload.model.layers])


def test_estimate_takes_cp_and_ep(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["estimate", "--model", "moe-1.3b", "--cluster", "8xH100", "--global-batch", "16", "--tp", "1",
            "--pp", "1", "--dp", "8", "--micro-batch", "1"]
    assert main([*args[:-3], "4", "--micro-batch", "1", "--ep", "4", "--cp", "2"]) == 0  # dp4 x cp2
    out = capsys.readouterr().out
    assert "cp2" in out and "ep4" in out
    for extra, message in ((["--ep", "3"], "ep=3 must divide the 16 experts"),
                           (["--dp", "2", "--cp", "3"], "must divide the sequence length 1024")):
        assert main(args + extra) == 2
        assert message in capsys.readouterr().err
    assert main(["estimate", "--model", "gpt3-1.3b", "--cluster", "8xH100", "--global-batch", "8", "--tp", "1",
                 "--pp", "1", "--dp", "8", "--micro-batch", "1", "--ep", "2"]) == 2
    assert "has no mixture-of-experts layer" in capsys.readouterr().err


def test_expert_imbalance_is_an_option_kept_in_the_plan_file(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    """--expert-imbalance reaches the cost model, is written to the plan file and
    read back by estimate (the same step time); out of range is one error line."""
    args = ["estimate", "--model", "moe-1.3b", "--cluster", "8xH100", "--global-batch", "16", "--tp", "1",
            "--pp", "1", "--dp", "8", "--micro-batch", "1", "--ep", "8"]
    times = {}
    for load in ("1.0", "2.0"):
        kept, times[load], _ = estimate_keeps_setting(args, "--expert-imbalance", load, "expert_imbalance",
                                                      tmp_path, capsys)
        assert kept == float(load)
    assert times["2.0"] > times["1.0"]  # the busiest rank's experts carry twice the average
    for bad in ("0.5", "65", "nan"):
        try:
            code = main([*args, "--expert-imbalance", bad])
        except SystemExit as exc:  # argparse's own check (not a finite number) exits
            code = exc.code
        assert code == 2
        err = capsys.readouterr().err
        assert err.startswith("hetplan: error:") and err.count("\n") == 1, err
