"""The physical effects of the compute and communication model: each against
a hand-computed value or a property that must hold."""

from __future__ import annotations

import numpy as np
import pytest

from hetplan.cluster.spec import ClusterSpec, NodeSpec
from hetplan.cluster.catalog import get_gpu
from hetplan.cost import comm
from hetplan.cost.compute import attention_efficiency, attention_time, gemm_efficiency, layer_times
from hetplan.cost.constants import (
    ATTENTION_BACKWARD_RATIO,
    ATTENTION_HALF_SEQ,
    COLLECTIVE_BANDWIDTH_EFFICIENCY,
    NCCL_BASE_LATENCY_S,
    NCCL_RING_HOP_LATENCY_S,
    NCCL_TREE_HOP_LATENCY_S,
    SUSTAINED_MATMUL_FRACTION,
)
from hetplan.cost.layers import layer_arrays
from hetplan.model.layers import BlockShape, transformer_block
from hetplan.model.presets import gpt_decoder
from hetplan.model.spec import ModelSpec


def _block_model(seq: int, fused: bool, kind: str = "decoder", hidden: int = 1024) -> ModelSpec:
    shape = BlockShape(hidden=hidden, heads=hidden // 64, ffn=4 * hidden, seq=seq, fused_attention=fused,
                       dropout=not fused)
    layer = transformer_block("b", kind, shape, 2)
    return ModelSpec(name="m", family="gpt", layers=(layer,), seq_len=seq, dtype_bytes=2, hidden_size=hidden,
                     num_heads=hidden // 64, vocab_size=1000)


def _cluster(nodes: int, per_node: int, intra_gbps: float = 2400.0) -> ClusterSpec:
    return ClusterSpec("t", tuple(NodeSpec("A100-80GB", per_node, intra_gbps, name=f"n{i}") for i in range(nodes)),
                       1600.0)


def test_fused_causal_attention_runs_half_the_scores() -> None:
    gpu = get_gpu("A100-80GB")
    causal = layer_arrays(_block_model(4096, fused=True, kind="decoder"))
    full = layer_arrays(_block_model(4096, fused=True, kind="encoder"))
    assert causal.attention_fused[0] and full.attention_fused[0]
    assert attention_time(causal, gpu, 1, 1, 2)[0] == pytest.approx(0.5 * attention_time(full, gpu, 1, 1, 2)[0])


def test_eager_attention_is_not_taken_for_fused() -> None:
    """An eager kernel keeps the score matrix; it runs the whole matrix at matmul speed."""
    eager = layer_arrays(_block_model(2048, fused=False))
    assert not eager.attention_fused[0]


def test_attention_efficiency_rises_with_sequence_length() -> None:
    gpu = get_gpu("H100")
    rates = [attention_efficiency(gpu, s) for s in (256, 1024, 4096, 32768)]
    assert rates == sorted(rates) and rates[-1] < 1.0


def test_attention_kernels_run_at_their_benchmarked_rates() -> None:
    """H100, head dim 128, 8-16k tokens (Shah et al. 2024, Fig. 5-6): forward
    and backward TFLOP/s of FlashAttention-2 and cuDNN, combined over the
    1 + 2.5 FLOPs of a step; a long-sequence kernel reaches them up to the
    s / (s + half) ramp. MosaicML's Triton kernel is the fitted one."""
    gpu, seq = get_gpu("H100"), 1 << 20
    ramp = seq / (seq + ATTENTION_HALF_SEQ)
    for kernel, fwd, bwd in (("flash2", 370, 320), ("cudnn", 600, 517)):
        combined = 3.5 / (1 / fwd + 2.5 / bwd)
        assert attention_efficiency(gpu, seq, kernel) * 989 == pytest.approx(combined * ramp, rel=1e-9)
    assert attention_efficiency(gpu, seq, "triton") == pytest.approx(0.2 * ramp)
    a100 = get_gpu("A100-80GB")
    assert attention_efficiency(a100, seq, "cudnn") == attention_efficiency(a100, seq, "flash2")


def test_attention_kernel_sets_the_attention_time_of_an_estimate() -> None:
    """The same plan with cuDNN's kernel instead of FlashAttention-2's: only
    the attention core gets faster, by the ratio of their rates."""
    from hetplan.cost.model import CostModel
    from hetplan.plan.workload import Workload
    from hetplan.cluster.presets import homogeneous_cluster

    model = _block_model(8192, fused=True)
    cluster = homogeneous_cluster(8, "H100", 8)
    units = {k: CostModel(Workload(model, cluster, 8, attention_kernel=k)).kernel.unit_work(cluster.devices[0].gpu,
                                                                                           1, False)
             for k in ("flash2", "cudnn")}
    ratio = attention_efficiency(get_gpu("H100"), 8192, "cudnn") / attention_efficiency(get_gpu("H100"), 8192)
    assert units["flash2"].attention_s[0] == pytest.approx(ratio * units["cudnn"].attention_s[0], rel=1e-9)
    assert units["flash2"].gemm_s[0] == units["cudnn"].gemm_s[0]


def test_unknown_attention_kernel_is_an_error() -> None:
    from hetplan.cluster.presets import homogeneous_cluster
    from hetplan.plan.workload import Workload
    from hetplan.errors import HetplanError

    with pytest.raises(HetplanError, match="unknown attention kernel 'flash9'"):
        Workload(_block_model(128, fused=True), homogeneous_cluster(8, "H100", 8), 8, attention_kernel="flash9")


def test_flash_attention_backward_is_2_5_forwards() -> None:
    """Long sequence: attention dominates the block, so backward/forward tends to 2.5."""
    arrays = layer_arrays(_block_model(65536, fused=True, hidden=256))
    times = layer_times(arrays, get_gpu("A100-80GB"), 1, 1, "none", 2)
    ratio = float(times.bwd_s[0] / times.fwd_s[0])
    assert 2.0 < ratio <= ATTENTION_BACKWARD_RATIO


def test_smaller_matmuls_run_below_the_best_rate() -> None:
    gpu = get_gpu("A100-80GB")
    dims = np.array([256.0, 1024.0, 8192.0])
    big = gemm_efficiency(gpu, dims, 1)
    assert list(big) == sorted(big) and big[-1] < gpu.matmul_efficiency
    assert np.all(gemm_efficiency(gpu, dims, 8) < big)  # the weight side split over 8 TP ranks


def test_measured_matmul_rate_sets_the_best_efficiency() -> None:
    """A100-80GB's catalog entry carries its measured matmul rate: large GEMMs
    run at the part of it a GPU sustains in training."""
    gpu = get_gpu("A100-80GB")
    sustained = gpu.matmul_efficiency * SUSTAINED_MATMUL_FRACTION[gpu.name]
    assert gemm_efficiency(gpu, np.array([1e9]), 1)[0] == pytest.approx(sustained, rel=1e-6)


def test_ring_latency_follows_nccl_model() -> None:
    """Two nodes of 4 GPUs: an all-gather ring has 7 steps, 1 of them across nodes."""
    cluster = _cluster(2, 4)
    group = list(range(8))
    hops = NCCL_RING_HOP_LATENCY_S
    expected = NCCL_BASE_LATENCY_S + 6 * hops["nvlink"] + 1 * hops["net"]
    assert comm.collective_latency(cluster, group, "allgather") == pytest.approx(expected)
    # all-reduce: twice the steps, or a tree when that is faster
    ring = NCCL_BASE_LATENCY_S + 12 * hops["nvlink"] + 2 * hops["net"]
    tree = 2 * (3 * NCCL_TREE_HOP_LATENCY_S["nvlink"] + 1 * NCCL_TREE_HOP_LATENCY_S["net"])
    assert comm.collective_latency(cluster, group, "allreduce") == pytest.approx(min(ring, tree))


def test_collective_latency_grows_with_gpus_and_nodes() -> None:
    small = comm.collective_latency(_cluster(4, 8), list(range(32)), "allgather")
    large = comm.collective_latency(_cluster(64, 8), list(range(512)), "allgather")
    assert large > 10 * small
    assert comm.collective_latency(_cluster(1, 8), [0], "allgather") == 0.0


def test_data_parallel_rate_includes_latency_per_message() -> None:
    """A sharded-data-parallel gather costs more per byte at 512 GPUs than
    at 16, even though the per-node bandwidth is the same."""
    from hetplan.plan.workload import Workload
    from hetplan.cost.kernel import CostKernel

    model = gpt_decoder("m", 8, 1024, 16, 1024, vocab=1000)
    rates = []
    for nodes in (2, 64):
        kernel = CostKernel(Workload(model, _cluster(nodes, 8), 8 * nodes))
        devices = tuple(range(8 * nodes))
        bandwidth_only = kernel.collective_rate("allgather", devices)
        rates.append(kernel.dp_collective_rate("allgather", devices, 1) - bandwidth_only)
    assert rates[1] > rates[0] > 0


def test_deepspeed_shards_cross_each_gpus_own_nic() -> None:
    """``zero_implementation="deepspeed"``: across nodes, every GPU's share of a
    ZeRO-3 gather crosses its own NIC, so the network part is 8x a
    topology-aware ring's on 8-GPU nodes; inside one node, and for gradient
    all-reduce, the two implementations cost the same."""
    from hetplan.plan.workload import Workload
    from hetplan.cost.kernel import CostKernel

    model = gpt_decoder("m", 8, 1024, 16, 1024, vocab=1000)
    kernels = {impl: CostKernel(Workload(model, _cluster(4, 8), 32, zero_implementation=impl))
               for impl in ("fsdp", "deepspeed")}
    spans, inside = tuple(range(32)), tuple(range(8))

    fsdp, deepspeed = (kernels[i].dp_collective_rate("allgather", spans, 1) for i in ("fsdp", "deepspeed"))
    # a topology-aware ring moves 3/4 of the buffer once through each node's
    # 1600 Gb/s; DeepSpeed's traffic does so once per GPU of the node
    network = 0.75 / (1600e9 / 8 * COLLECTIVE_BANDWIDTH_EFFICIENCY)
    assert deepspeed - fsdp == pytest.approx(7 * network, rel=1e-9)
    assert kernels["deepspeed"].dp_collective_rate("allgather", inside, 1) == \
        kernels["fsdp"].dp_collective_rate("allgather", inside, 1)
    assert kernels["deepspeed"].dp_collective_rate("allreduce", spans, 1) == \
        kernels["fsdp"].dp_collective_rate("allreduce", spans, 1)


def test_unknown_zero_implementation_is_refused() -> None:
    from hetplan.plan.workload import Workload
    from hetplan.errors import HetplanError

    with pytest.raises(HetplanError, match="ZeRO implementation"):
        Workload(gpt_decoder("m", 2, 64, 4, 32, vocab=100), _cluster(1, 2), 2, zero_implementation="megatron")


def test_fp32_gradients_double_the_sync_and_add_two_bytes_per_parameter() -> None:
    """Megatron's bf16 main_grad / FSDP's fp32 reduce: gradients are 4 bytes,
    held and all-reduced (25 MiB buckets of them, so the latency count doubles too)."""
    from hetplan.cluster.io import load_cluster
    from hetplan.cost.model import CostModel
    from hetplan.plan.workload import Workload
    from hetplan.search.baselines.uniform import uniform_plan

    model = gpt_decoder("m", 4, 1024, 16, 512, vocab=1000)
    cluster = load_cluster("16xA100-80GB")
    costs = []
    for optimizer in ("adam-mixed", "adam-mixed-fp32-grads"):
        workload = Workload(model, cluster, 16, optimizer=optimizer)
        cost = CostModel(workload)
        plan = uniform_plan(workload, 16, 1, 1, 1)
        costs.append((cost.stage_timing(plan.stages[0], 16).grad_sync_s, cost.estimate(plan).peak_memory_bytes[0]))
    (sync16, mem16), (sync32, mem32) = costs
    assert sync32 == pytest.approx(2 * sync16, rel=1e-9)
    assert mem32 - mem16 == pytest.approx(2 * model.total_params, rel=1e-6)


def test_deepspeed_bf16_optimizer_holds_two_gradient_copies_and_reduces_fp32() -> None:
    """DeepSpeed's BF16 optimizer: bf16 + fp32 gradients (4 bytes/param more
    than plain mixed Adam, even under ZeRO-1), the fp32 ones all-reduced."""
    from hetplan.cluster.io import load_cluster
    from hetplan.cost.model import CostModel
    from hetplan.plan.workload import Workload
    from hetplan.search.baselines.uniform import uniform_plan

    model = gpt_decoder("m", 4, 1024, 16, 512, vocab=1000)
    cluster = load_cluster("16xA100-80GB")
    found = {}
    for optimizer in ("adam-mixed", "adam-mixed-fp32-grads", "adam-bf16-deepspeed"):
        workload = Workload(model, cluster, 16, optimizer=optimizer)
        cost = CostModel(workload)
        plan = uniform_plan(workload, 16, 1, 1, 1, zero=1)
        found[optimizer] = (cost.stage_timing(plan.stages[0], 16).grad_sync_s, cost.estimate(plan).peak_memory_bytes[0])
    assert found["adam-bf16-deepspeed"][0] == pytest.approx(found["adam-mixed-fp32-grads"][0], rel=1e-9)
    assert found["adam-bf16-deepspeed"][1] - found["adam-mixed"][1] == pytest.approx(4 * model.total_params, rel=1e-6)


def test_fp8_matmuls_speed_up_only_gpus_that_have_them() -> None:
    from hetplan.cluster.io import load_cluster
    from hetplan.cost.model import CostModel
    from hetplan.plan.workload import Workload
    from hetplan.errors import HetplanError
    from hetplan.search.baselines.uniform import uniform_plan

    model = gpt_decoder("m", 4, 2048, 16, 2048, vocab=1000)

    def step(cluster: str, fp8: bool) -> float:
        workload = Workload(model, load_cluster(cluster), 8, fp8=fp8)
        return CostModel(workload).estimate(uniform_plan(workload, 8, 1, 1, 1)).iteration_time_s

    bf16, fp8 = step("8xH100", False), step("8xH100", True)
    assert fp8 < bf16 < 2 * fp8  # faster matmuls, but attention and elementwise work stay 16-bit
    with pytest.raises(HetplanError, match="no FP8"):
        step("8xA100-80GB", True)
    with pytest.raises(HetplanError, match="16-bit"):
        Workload(gpt_decoder("m32", 2, 256, 4, 64, vocab=100, dtype_bytes=4), load_cluster("8xH100"), 8, fp8=True)


def test_sustained_matmul_rate_for_fitted_measured_and_unmeasured_gpus():
    """Fitted GPUs keep their fraction; a GPU with a measured best-shape rate but
    no published run (B200, MI300X) sustains the mean fitted fraction of it, never
    the benchmark rate whole; an unmeasured one the large-GEMM rate."""
    import numpy as np

    from hetplan.cluster.catalog import get_gpu
    from hetplan.cost.compute import gemm_efficiency
    from hetplan.cost.constants import DEFAULT_SUSTAINED_MATMUL_FRACTION, GEMM_EFFICIENCY, SUSTAINED_MATMUL_FRACTION

    def best(name: str) -> float:
        return float(gemm_efficiency(get_gpu(name), np.array([0.0]), 1)[0])

    fitted = SUSTAINED_MATMUL_FRACTION
    assert DEFAULT_SUSTAINED_MATMUL_FRACTION == pytest.approx(sum(fitted.values()) / len(fitted))
    assert best("H100") == pytest.approx(get_gpu("H100").matmul_efficiency * fitted["H100"])
    assert best("H200") == pytest.approx(GEMM_EFFICIENCY * fitted["H200"])
    for name in ("B200", "MI300X"):
        gpu = get_gpu(name)
        assert gpu.matmul_efficiency > 0
        assert best(name) == pytest.approx(gpu.matmul_efficiency * DEFAULT_SUSTAINED_MATMUL_FRACTION)
    assert best("T4") == pytest.approx(GEMM_EFFICIENCY)


def test_attention_kernel_is_an_option_kept_in_the_plan_file(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    """--attention-kernel reaches the cost model (cuDNN's kernel is faster on
    H100 at 8k tokens), is written to the plan file, read back by estimate,
    and shown in the header; an unknown name is one error line."""
    from hetplan.cli import main
    from setting_roundtrip import estimate_keeps_setting

    args = ["estimate", "--model", "llama3-8b", "--cluster", "8xH100", "--global-batch", "8", "--tp", "1",
            "--pp", "1", "--dp", "8", "--micro-batch", "1", "--zero", "3"]
    times = {}
    for kernel in ("flash2", "cudnn"):
        kept, times[kernel], out = estimate_keeps_setting(args, "--attention-kernel", kernel, "attention_kernel",
                                                          tmp_path, capsys)
        assert kept == kernel and ("cudnn attention" in out) == (kernel == "cudnn")
    assert times["cudnn"] < times["flash2"]
    with pytest.raises(SystemExit) as exc:
        main([*args, "--attention-kernel", "flash9"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "hetplan: error:" in err and "flash9" in err


def test_planning_for_megatron_costs_its_attention_kernel(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    """--target megatron: Megatron-LM trains through Transformer Engine, so the
    plans are costed with cuDNN's attention unless --attention-kernel says otherwise."""
    import json

    from hetplan.cli import main

    args = ["plan", "--model", "llama3-8b", "--cluster", "8xH100", "--global-batch", "8", "--planner", "uniform",
            "--top", "1", "--quiet"]
    for extra, kernel in ((["--target", "megatron"], "cudnn"), (["--target", "torchtitan"], "flash2"),
                          (["--target", "megatron", "--attention-kernel", "flash2"], "flash2")):
        path = tmp_path / "p.json"
        assert main([*args, *extra, "--json", str(path)]) == 0
        capsys.readouterr()
        assert json.loads(path.read_text())["settings"]["attention_kernel"] == kernel


def test_tp_comm_overlap_exposes_only_what_outlasts_the_compute() -> None:
    """Llama 3 70B at tp4 on 8 H100: with the overlap the TP communication of
    each layer is pipeline.overlapped_exposure of its time without it under
    the layer's forward + backward compute; the step gets faster, nothing else
    changes (memory, compute)."""
    from hetplan.cluster.presets import homogeneous_cluster
    from hetplan.cost.model import CostModel
    from hetplan.cost.pipeline import overlapped_exposure
    from hetplan.plan.workload import Workload
    from hetplan.model.presets import get_model
    from hetplan.search.baselines.uniform import uniform_plan

    cluster = homogeneous_cluster(8, "H100", 8)
    kernels, estimates = {}, {}
    for overlap in (False, True):
        workload = Workload(get_model("llama3-70b"), cluster, 16, tp_comm_overlap=overlap)
        cost = CostModel(workload)
        plan = uniform_plan(workload, 1, 4, 2, 1, zero=0, recompute="full", sequence_parallel=True)
        kernels[overlap], estimates[overlap] = cost.kernel, cost.estimate(plan)
    gpu, group = cluster.devices[0].gpu, (0, 1, 2, 3)
    times = kernels[False].layer_times(gpu, 1, 4, "full", True)
    link = kernels[False].tp_link(group)
    plain = kernels[False].tp_comm_time("full", 1, link, times)
    hidden = kernels[True].tp_comm_time("full", 1, link, times)
    expected = overlapped_exposure(plain, times.fwd_s + times.bwd_s + times.recompute_s,
                                   kernels[True].overlap_slowdown)
    assert np.any(plain > 0)
    assert np.allclose(hidden, expected) and np.all(hidden <= plain) and hidden.sum() < plain.sum()
    assert estimates[True].iteration_time_s < estimates[False].iteration_time_s
    assert estimates[True].peak_memory_bytes == estimates[False].peak_memory_bytes


def test_tp_overlap_is_kept_in_the_plan_file_and_named_at_export(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    """--tp-overlap reaches the estimate, the plan file keeps it, and exporting
    that plan tells the user how the tool turns it on (the export cannot)."""
    import json

    from hetplan.cli import main

    path = tmp_path / "p.json"
    args = ["estimate", "--model", "llama3-8b", "--cluster", "8xH100", "--global-batch", "8", "--tp", "4",
            "--pp", "1", "--dp", "2", "--micro-batch", "1", "--sequence-parallel"]
    assert main([*args, "--json", str(tmp_path / "plain.json")]) == 0
    assert main([*args, "--tp-overlap", "--fp8", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "TP communication overlapped" in out
    data = json.loads(path.read_text())
    plain = json.loads((tmp_path / "plain.json").read_text())
    assert data["settings"]["tp_comm_overlap"] is True and plain["settings"]["tp_comm_overlap"] is False
    assert main(["export", str(path), "--format", "megatron"]) == 0
    err = capsys.readouterr().err
    assert "--tp-comm-overlap" in err and "--fp8-format" in err
    assert main(["export", str(tmp_path / "plain.json"), "--format", "megatron"]) == 0
    assert "--tp-comm-overlap" not in capsys.readouterr().err


@pytest.mark.parametrize("tp, sequence_parallel", [(1, False), (2, False), (2, True)])
def test_fp8_keeps_linear_inputs_in_one_byte(tp: int, sequence_parallel: bool) -> None:
    """A GPT block (4h MLP, fused attention) keeps for backward, as the inputs
    of its linears: the QKV input and the first MLP input (norm outputs, 2sh
    each, not split by TP), the output-projection input (2sh) and the second
    MLP input (8sh). FP8 training keeps them at one byte an element: 7sh less
    per sample, of which TP divides 5sh (all 7 with sequence parallelism)."""
    from hetplan.cost.model import CostModel
    from hetplan.plan.workload import Workload

    seq, hidden = 512, 1024
    model = _block_model(seq, fused=True, hidden=hidden)
    layer = model.layers[0]
    sh = seq * hidden
    assert layer.act_linear_input_bytes == 14 * sh and layer.act_linear_input_replicated_bytes == 4 * sh

    def kept(fp8: bool) -> float:
        workload = Workload(model, _cluster(1, 2), 2, fp8=fp8)
        return float(CostModel(workload).kernel.activation_bytes(tp, "none", sequence_parallel)[0])

    expected = 7 * sh / tp if sequence_parallel else 2 * sh + 5 * sh / tp
    assert kept(False) - kept(True) == pytest.approx(expected)
    # full recompute keeps the block's 16-bit input either way; its rebuilt working set shrinks alike
    workload = Workload(model, _cluster(1, 2), 2, fp8=True)
    plain = Workload(model, _cluster(1, 2), 2)
    k8, k16 = CostModel(workload).kernel, CostModel(plain).kernel
    assert k8.activation_bytes(tp, "full", sequence_parallel)[0] == k16.activation_bytes(tp, "full",
                                                                                          sequence_parallel)[0]
    assert (k16.backward_working_bytes(tp, "full", sequence_parallel)[0]
            - k8.backward_working_bytes(tp, "full", sequence_parallel)[0]) == pytest.approx(expected)
