"""The replay check (hetplan.app.replay, hetplan.runtime.replay): one training
step of hetplan's runtime on fake tensors, against the H100 measurements, and
what ``hetplan plan`` / ``estimate`` make of it."""

from __future__ import annotations

import json
import os
import sys
import tempfile
from dataclasses import replace
from typing import Any

import pytest

from hetplan.app import plan as plan_api
from hetplan.app.replay import ReplayCheck, ReplayOutcome, replay_check, replay_record, replay_top, rerank
from hetplan.app.estimate import UniformSetting, estimate
from hetplan.cost.memory import framework_overhead_bytes
from hetplan.cost.model import CostModel
from hetplan.plan.file import read_plan_file, resolve_model, save_plan
from hetplan.plan.spec import LayerStrategy, Plan, RankedPlan, Stage
from hetplan.plan.workload import Workload

pytest.importorskip("torch")

H100 = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "data", "h100")
GIB = 1 << 30
USABLE_H100 = 79.1787109375 * GIB  # what the card reported (cost/constants.py DEVICE_REPORTED_FRACTION)
OVERHEAD = 1 << 30  # cost/constants.py FRAMEWORK_OVERHEAD_BYTES, added to the replayed tensors as to the analytic peak


def _measured(name: str) -> dict:
    with open(os.path.join(H100, "h100-runs.json"), encoding="utf-8") as f:
        runs = json.load(f)["runs"]
    return next(r for r in runs if r["name"] == name)


def _replay_file(name: str) -> int:
    from hetplan.runtime.replay import replay_plan

    pf = read_plan_file(os.path.join(H100, f"{name}.json"))
    return replay_plan(pf.plan(), resolve_model(pf, None)).peak_bytes


def test_replay_matches_the_h100_peak_and_catches_its_oom() -> None:
    """gpt3-1.3b 8 x 2 measured 42.7 GiB (torch.cuda.max_memory_allocated); the
    llama1b 8 x 2 plan ran out of memory on the card."""
    peak = _replay_file("A_g13_mb8") / GIB
    measured = _measured("A_g13_mb8")["measured"]["peak_memory_gib"]
    assert abs(peak - measured) <= 0.02 * measured, (peak, measured)
    assert _replay_file("D8_llama1b") + OVERHEAD > USABLE_H100


def _fits_column(text: str, row: int) -> str:
    line = next(line for line in text.splitlines() if line.startswith(f"{row}  "))
    return line.split("  ")[-1].strip()


def test_the_replay_catches_a_plan_the_analytic_model_calls_fitting(capsys: pytest.CaptureFixture,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A tiny model's plans, replayed; at a memory limit between one plan's analytic and replayed peak
    the analytic model alone calls it fitting and the replay does not: ``hetplan estimate`` says so."""
    from hetplan.cli import main

    first = plan_api("tiny-gpt", "local-cpu-2", 8, top=3, replay=3)
    short = [(r, c) for r, c in zip(first.plans, first.report.replay.checks) if c.peak_bytes > r.estimate.max_memory_bytes]
    assert short, "the analytic model is short of no replayed plan"
    ranked, check = max(short, key=lambda rc: rc[1].peak_bytes - rc[0].estimate.max_memory_bytes)
    limit = (ranked.estimate.max_memory_bytes + check.peak_bytes) / 2
    monkeypatch.setenv("HETPLAN_REPLAY", "1")  # estimate's default (tests/conftest.py turns it off)
    plan_file = os.path.join(tempfile.mkdtemp(), "p.json")
    save_plan(plan_file, ranked.plan)
    assert main(["estimate", plan_file, "--model", "tiny-gpt", "--cluster", "local-cpu-2",
                 "--memory-limit", f"{limit / 2**20:.4f}MiB"]) == 0
    text = capsys.readouterr().out
    assert ranked.estimate.max_memory_bytes < limit < check.peak_bytes
    assert _fits_column(text, 1) == "OOM (replay)"
    assert "do not fit by it and are ranked last" in text


def test_plan_never_recommends_a_plan_the_replay_shows_out_of_memory() -> None:
    """``rerank`` moves the plans whose replay does not fit after those that fit (or were not
    replayed), each group in its order: the first plan is one that fits while any does."""
    plans = plan_api("tiny-gpt", "local-cpu-2", 8, top=4, replay=0).plans
    checks = (ReplayCheck(2, 1, False, 0.0), None, ReplayCheck(1, 2, True, 0.0), ReplayCheck(3, 1, False, 0.0))
    order, outcome = rerank(plans, ReplayOutcome(checks))
    assert order == [plans[1], plans[2], plans[0], plans[3]]
    assert outcome.checks == (None, checks[2], checks[0], checks[3])


def test_llama1b_best_plan_fits_by_the_replay() -> None:
    """The issue's "done when": the best plan for llama1b.json on one H100 (seq 2048, gbs 16) fits by the replay."""
    result = plan_api(os.path.join(H100, "llama1b.json"), "1xH100", 16, seq_len=2048, top=1, replay=1)
    check = result.report.replay.checks[0]
    assert check is not None and check.fits and check.peak_bytes <= USABLE_H100
    assert result.record()["plans"][0]["replay"]["peak_memory_bytes"] == check.peak_bytes


def _untimed(text: str) -> str:
    """The output less its search time (wall clock)."""
    return "\n".join(line for line in text.splitlines() if "searched in" not in line)


def test_no_replay_prints_the_analytic_table_only(capsys: pytest.CaptureFixture) -> None:
    """``--no-replay`` prints what ``hetplan plan`` printed before the replay existed."""
    from hetplan.cli import main

    args = ["plan", "--model", "tiny-gpt", "--cluster", "local-cpu-2", "--global-batch", "8", "--quiet"]
    assert main([*args, "--no-replay", "--replay", "2"]) == 0
    off = _untimed(capsys.readouterr().out)
    assert main([*args, "--replay", "0"]) == 0
    assert _untimed(capsys.readouterr().out) == off
    header = next(line for line in off.splitlines() if line.startswith("#  plan"))
    assert header.split() == ["#", "plan", "iter", "time", "samples/s", "tokens/s", "MFU", "max", "mem/GPU", "fits", "runs",
                              "on"]
    assert "replay" not in off


def test_replay_is_skipped_in_one_line_without_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    result = plan_api("tiny-gpt", "local-cpu-2", 8, top=2, replay=0)
    monkeypatch.setitem(sys.modules, "hetplan.runtime.replay", None)  # import fails as without torch
    outcome = replay_top(result.plans, result.workload, 2)
    assert outcome == ReplayOutcome((None, None), outcome.skipped)
    assert outcome.line().startswith("note: replay skipped: torch is not installed")


def _analytic_tensors(ranked: RankedPlan, workload: Workload, device: int) -> int:
    """The analytic peak of ``device`` less the framework overhead (the replay counts tensors only)."""
    cpu = workload.cluster.devices[device].gpu.name.upper() == "CPU"
    return ranked.estimate.peak_memory_bytes[device] - framework_overhead_bytes(cpu)


def test_an_offloading_plan_replays_its_device_and_host_bytes_apart(capsys: pytest.CaptureFixture) -> None:
    """Activation offload replays (refused before: the pool told parameters by data pointer, 0 for
    every fake tensor, and its host copies counted as the device's): the offloaded activations are
    host bytes, only device bytes count against the GPU, the device peak is below the same plan's
    without offload and within 5% of the analytic one (fetched copies one layer ahead, as on a GPU;
    tiny-gpt was 6.5% above it before the analytic model counted an offloaded block's backward
    gradients, ``runtime_memory.backward_gradients``)."""
    from hetplan.runtime.replay import replay_plan

    def replayed(offload: bool) -> tuple[RankedPlan, Workload, ReplayCheck, Any]:
        result = estimate(UniformSetting(dp=1, tp=1, pp=1, micro_batch=2, offload=offload), model="tiny-gpt",
                          cluster="local-cpu-1", global_batch=4, replay=False)
        replay = replay_plan(result.ranked.plan, result.workload.model)
        return result.ranked, result.workload, replay_check(replay, result.ranked, result.workload, 0.0), replay

    ranked, workload, check, replay = replayed(True)
    _, _, kept, _ = replayed(False)
    outcome = ReplayOutcome((check,))
    print(outcome.line(), f"device {check.peak_bytes} B, host {check.host_peak_bytes} B (kept on device: {kept.peak_bytes} B)")
    assert "not replayed" not in outcome.line() and check.fits
    assert 0 < check.host_peak_bytes and check.peak_bytes < kept.peak_bytes
    stage = replay.stages[0]
    assert stage.host_peak_bytes == check.host_peak_bytes
    analytic = _analytic_tensors(ranked, workload, stage.device)
    assert abs(analytic - stage.peak_bytes) <= 0.05 * stage.peak_bytes, (stage, analytic)
    assert replay_record(check)["host_peak_memory_bytes"] == check.host_peak_bytes
    assert "not replayed" not in capsys.readouterr().out


def test_a_heterogeneous_pipeline_replays_each_stage_and_share_on_its_own_gpu(tmp_path) -> None:
    """A Metis-style plan on a V100-32GB + 3 P100 cluster: stage 0 runs two replicas taking 3 and
    1 samples of each micro-batch (ZeRO-3) on the V100 and a P100, stage 1 one replica with tp=2 on
    two P100 (heterogeneous: refused before, its executor sends shapes as data). Each stage and share
    is replayed at its own batch share (the 3-sample replica holds more), within 5% of the analytic
    peak of its GPU, and checked against the memory of every GPU it stands for."""
    from hetplan.runtime.replay import replay_plan

    cluster = tmp_path / "mixed.yaml"
    cluster.write_text("name: mixed\ninter_node_bandwidth_gbps: 100\nnodes:\n"
                       "  - {gpu: V100-32GB, gpus: 1, intra_node_bandwidth_gbps: 1200}\n"
                       "  - {gpu: P100, gpus: 3, intra_node_bandwidth_gbps: 640}\n")
    layer = LayerStrategy(3, "none")
    stages = (Stage((0, 1, 2), (0, 1), 2, 1, (3, 1), (layer,) * 3), Stage((3, 4, 5), (2, 3), 1, 2, (4,), (layer,) * 3))
    path = tmp_path / "hetero.json"
    save_plan(str(path), Plan("tiny-gpt", str(cluster), 4, 4, 1, "1f1b", stages, planner="test"))
    result = estimate(str(path), model="tiny-gpt", cluster=str(cluster), replay=False)
    replay = replay_plan(result.ranked.plan, result.workload.model)
    assert [(s.stage, s.rank, s.devices) for s in replay.stages] == [(0, 0, (0,)), (0, 1, (1,)), (1, 2, (2, 3))]
    assert replay.stages[0].peak_bytes > replay.stages[1].peak_bytes
    for s in replay.stages:
        analytic = _analytic_tensors(result.ranked, result.workload, s.device)
        assert abs(analytic - s.peak_bytes) <= 0.05 * s.peak_bytes, (s, analytic)
    check = replay_check(replay, result.ranked, result.workload, 0.0)
    gpus = {d.gpu.name for d in result.workload.cluster.devices}
    assert len(gpus) == 2 and check.fits and "not replayed" not in ReplayOutcome((check,)).line()
    p100 = result.ranked.estimate.memory_capacity_bytes[3]
    assert check.capacity_bytes == p100 < result.ranked.estimate.memory_capacity_bytes[0]  # the fullest: a P100
    # device 3 (stage 1's second TP rank, not replayed itself) is checked by the rank that stands for it
    caps = {**result.ranked.estimate.memory_capacity_bytes, 3: replay.stages[2].peak_bytes}
    short = RankedPlan(result.ranked.plan, replace(result.ranked.estimate, memory_capacity_bytes=caps))
    assert not replay_check(replay, short, result.workload, 0.0).fits


def test_a_pkg_mod_build_model_is_replayed() -> None:
    """A ``pkg.mod:build`` model's plan replays (its build checks read real example inputs first)."""
    result = plan_api("tests.smp_models:gpt_lm", "local-cpu-2", 8, top=1, replay=1)
    check = result.report.replay.checks[0]
    assert check is not None and check.fits and not result.report.replay.notes


def test_a_plan_file_written_with_the_replay_reads_back(tmp_path) -> None:
    """``hetplan plan --json`` records each plan's replay; the file is still a plan file that
    ``estimate``, ``train --plan`` and ``replan`` read (it was refused: "unknown key 'replay'")."""
    result = plan_api("tiny-gpt", "local-cpu-2", 8, top=2, replay=1)
    path = tmp_path / "q.json"
    path.write_text(json.dumps(result.record()))
    assert json.loads(path.read_text())["plans"][0]["replay"]["peak_memory_bytes"] > 0
    pf = read_plan_file(str(path))
    assert pf.plans[0] == result.best.plan


def _replays_near_the_analytic_peak(setting: object, model: str, cluster: str, stage_ranks: list,
                                    tolerance: float, global_batch: int = 8) -> None:
    """Replay ``setting``: its stages' first ranks are ``stage_ranks``, each holds at least its
    parameters, gradients and optimizer states, and is within ``tolerance`` of the analytic peak."""
    from hetplan.runtime.replay import replay_plan

    result = estimate(setting, model=model, cluster=cluster, global_batch=global_batch, replay=False)
    plan = result.ranked.plan
    replay = replay_plan(plan, result.workload.model)
    states = CostModel(result.workload).resident_state_bytes(plan)
    assert [(s.stage, s.rank) for s in replay.stages] == stage_ranks
    for s in replay.stages:
        analytic = result.ranked.estimate.peak_memory_bytes[s.device] - framework_overhead_bytes(True)
        assert s.peak_bytes > sum(states[s.device].values()), (s, states[s.device])
        assert abs(analytic - s.peak_bytes) <= tolerance * s.peak_bytes, (s, analytic)


# One plan of each non-pipelined kind the runtime trains (local-cpu-2, global batch 8): plain data
# parallelism on DDP, ZeRO-1/2 on FSDP2, TP with and without sequence parallelism, selective and full
# recomputation, CP, EP, fp32 and bf16 mixed precision, one and several micro-batches, ZeRO-3 with and
# without recomputation (its peak inside a layer's backward: cost/zero3.py).
NON_PIPELINED = {
    "dp2-ddp-fp32-2mb": (UniformSetting(dp=2, tp=1, pp=1, micro_batch=2), "tiny-gpt"),
    "dp2-ddp-bf16-1mb": (UniformSetting(dp=2, tp=1, pp=1, micro_batch=4), "tiny-llama-bf16"),
    "dp2-zero1-bf16-2mb": (UniformSetting(dp=2, tp=1, pp=1, zero=1, micro_batch=2), "tiny-llama-bf16"),
    "dp2-zero2-2mb": (UniformSetting(dp=2, tp=1, pp=1, zero=2, micro_batch=2), "tiny-gpt"),
    "tp2-sp-selective-bf16": (UniformSetting(dp=1, tp=2, pp=1, sequence_parallel=True, recompute="selective",
                                             micro_batch=4), "tiny-llama-bf16"),
    "tp2-full-fp32": (UniformSetting(dp=1, tp=2, pp=1, recompute="full", micro_batch=8), "tiny-gpt"),
    "cp2-bf16": (UniformSetting(dp=1, tp=1, pp=1, cp=2, micro_batch=2), "tiny-llama-bf16"),
    "dp2-ep2-moe": (UniformSetting(dp=2, tp=1, pp=1, ep=2, micro_batch=2), "tiny-moe"),
    "dp2-ddp-moe": (UniformSetting(dp=2, tp=1, pp=1, micro_batch=2), "tiny-moe"),
    "dp2-zero3-1mb": (UniformSetting(dp=2, tp=1, pp=1, zero=3, micro_batch=4), "tiny-gpt"),
    "dp2-zero3-full-2mb": (UniformSetting(dp=2, tp=1, pp=1, zero=3, recompute="full", micro_batch=2), "tiny-gpt"),
    "dp2-zero3-bf16-2mb": (UniformSetting(dp=2, tp=1, pp=1, zero=3, micro_batch=2), "tiny-llama-bf16"),
}


@pytest.mark.parametrize("kind", list(NON_PIPELINED))
def test_the_analytic_peak_of_a_non_pipelined_plan_is_its_replayed_peak(kind: str) -> None:
    """Issue 28 item 4: for the non-pipelined plan kinds the runtime trains, the analytic peak
    (less the framework overhead) is within 5% of the replayed peak of the runtime's own step
    (docs/cost-model.md lists each effect; before them DDP was -11.9%, ZeRO-1 -12.3%, CP -13.1%, and
    ZeRO-3 +6.6%, -9.8% with full recompute, +9.2% in bf16)."""
    setting, model = NON_PIPELINED[kind]
    _replays_near_the_analytic_peak(setting, model, "local-cpu-2", [(0, 0)], 0.05)


def test_every_parallel_dimension_of_a_pipeline_replays() -> None:
    """An interleaved pipeline (pp 2 x 2 chunks) with context and tensor parallelism: a later
    stage with dp x cp > 1, CP, interleaving and TP on ranks replayed one after another (refused
    before; lifted as they were, the later stage's FSDP2 shards came out empty, CP stopped at
    aten.nonzero and TP at the last rank's destroyed process group). Each replayed stage holds at
    least its parameters, gradients and optimizer states, and is within 30% of the analytic peak
    (docs/cost-model.md lists what the analytic model leaves out)."""
    _replays_near_the_analytic_peak(UniformSetting(dp=1, tp=2, pp=2, cp=2, micro_batch=2, schedule="interleaved-1f1b",
                                                   virtual_stages=2), "tiny-llama-bf16", "local-cpu-8",
                                    [(0, 0), (1, 4)], 0.3)


# Plan kinds of a pipeline the runtime trains, 4 micro-batches: (setting, model, cluster, ranks); tiny-gpt
# pp2 x dp2 ZeRO-3 without recomputation is test_a_pipelined_zero3_stage_reshards_every_micro_batch's plan.
PIPELINED = {
    "interleaved-fp32": (UniformSetting(dp=1, tp=1, pp=2, micro_batch=1, schedule="interleaved-1f1b",
                                        virtual_stages=2), "tiny-gpt", "local-cpu-2", [(0, 0), (1, 1)]),
    "1f1b-bf16-tp2": (UniformSetting(dp=1, tp=2, pp=2, micro_batch=1), "tiny-llama-bf16", "local-cpu-4",
                      [(0, 0), (1, 2)]),
    "1f1b-bf16-dp2-zero3-full": (UniformSetting(dp=2, tp=1, pp=2, zero=3, recompute="full", micro_batch=1),
                                 "tiny-llama-bf16", "local-cpu-4", [(0, 0), (1, 2)]),
    "1f1b-fp32-dp2-ddp": (UniformSetting(dp=2, tp=1, pp=2, micro_batch=1), "tiny-gpt", "local-cpu-4",
                          [(0, 0), (1, 2)]),
    # MoE routing sizes its buffers by the tokens per expert (``bincount``, host reads of the counts):
    # the replay routes evenly and reads the counts as values, through EP's all-to-all too
    "1f1b-moe-dp2-ep2": (UniformSetting(dp=2, tp=1, pp=2, ep=2, micro_batch=1), "tiny-moe", "local-cpu-4",
                         [(0, 0), (1, 2)]),
}


@pytest.mark.parametrize("kind", sorted(PIPELINED))
def test_pipelined_plans_replay_within_5_percent_of_the_analytic_peak(kind: str) -> None:
    """Issue 28 item 4: the analytic model and the replay agree within 5% on every stage of a
    pipelined plan (cost/pipeline_memory.py: torch pipelining's receive buffers, the new gradient
    beside ``.grad``, interleaved 1F1B's micro-batches per chunk; before them the interleaved and
    the TP plan's first stages were 8% short)."""
    setting, model, cluster, ranks = PIPELINED[kind]
    _replays_near_the_analytic_peak(setting, model, cluster, ranks, 0.05, global_batch=4 * setting.dp)


def test_a_pipelined_zero3_stage_reshards_every_micro_batch() -> None:
    """torch pipelining turns a stage's gradient sync and resharding off until the last
    micro-batch (stage.py backward_maybe_with_nosync); the runtime keeps ZeRO-3's per-micro-batch
    reduce-scatter and reshard (spine.keep_plan_sharding), so each replayed stage (tiny-gpt pp2 x
    dp2 ZeRO-3, fp32, 4 micro-batches) is within 5% of the analytic peak of ZeRO-3's per-layer
    moments (cost/zero3.py). Holding whole gradients and gathered weights put the replay 6-8% above
    an analytic peak that was itself 3-7% above this one; before the moments it was +3.0% / +6.8%."""
    from hetplan.runtime.replay import replay_plan

    result = estimate(UniformSetting(dp=2, tp=1, pp=2, zero=3, micro_batch=1), model="tiny-gpt",
                      cluster="local-cpu-4", global_batch=8, replay=False)
    replay = replay_plan(result.ranked.plan, result.workload.model)
    assert [(s.stage, s.rank) for s in replay.stages] == [(0, 0), (1, 2)]
    for s in replay.stages:
        analytic = result.ranked.estimate.peak_memory_bytes[s.device] - framework_overhead_bytes(True)
        assert abs(analytic - s.peak_bytes) <= 0.05 * s.peak_bytes, (s, analytic)


def test_plans_not_replayed_for_one_reason_share_one_note_naming_their_rows() -> None:
    """The demo's three heterogeneous plans gave three long identical notes; one note per reason
    names the table's rows, and the rows follow the re-ranking."""
    ok, oom = ReplayCheck(1, 2, True, 0.1), ReplayCheck(3, 2, False, 0.1)
    outcome = ReplayOutcome((oom, None, None, ok), unreplayed=("", "why a", "why a", ""))
    assert outcome.notes == ("plans #2, #3 not replayed: why a",)
    _, reranked = rerank(["p1", "p2", "p3", "p4"], outcome)  # the plan out of memory by its replay goes last
    assert reranked.notes == ("plans #1, #2 not replayed: why a",)
    assert ReplayOutcome((None,), unreplayed=("why b",)).notes == ("plan #1 not replayed: why b",)


def _mixed_stage(layers: range, first: int, degrees: tuple[int, ...], split: tuple[int, ...]) -> Stage:
    """A stage of replicas with their own TP degrees (``Stage.replica_tp``), devices from ``first`` on."""
    devices = tuple(range(first, first + sum(degrees)))
    return Stage(tuple(layers), devices, len(degrees), max(degrees), split, (LayerStrategy(),) * len(layers),
                 replica_tp=degrees if len(set(degrees)) > 1 else None)


def test_each_replica_of_a_pipeline_stage_of_mixed_tp_degrees_replays_on_its_own_gpu(tmp_path) -> None:
    """Issue 35 item 3's plan of tests/distributed/test_runtime_mixed.py on two GPU types: stage 0
    runs a tp-1 replica (1 sample of each micro-batch, a V100) beside a tp-2 one (3 samples, two
    P100), stage 1 one replica (a P100). Refused before (one rank per stage, and the stage's
    gather of its parameter layouts stopped on the fake process group): each replica of the
    mixed stage replays through runtime/mixed.py, is reported with its degree, share and GPU type
    against that GPU's memory, and is within 5% of the kernel's per-replica peak
    (cost/replica_tp.py). Stage 1, the heterogeneous executor's last stage, is within 5% too (it
    was +6.6% while the analytic model held the logits until each micro-batch's backward, as
    torch pipelining does; the executor, runtime/hetero.py, frees them after the loss:
    pipeline_memory.freed_logits_bytes)."""
    from hetplan.runtime.replay import replay_plan

    cluster = tmp_path / "mixed.yaml"
    cluster.write_text("name: mixed\ninter_node_bandwidth_gbps: 100\nnodes:\n"
                       "  - {gpu: V100-32GB, gpus: 1, intra_node_bandwidth_gbps: 1200}\n"
                       "  - {gpu: P100, gpus: 3, intra_node_bandwidth_gbps: 640}\n")
    stages = (_mixed_stage(range(0, 3), 0, (1, 2), (1, 3)), _mixed_stage(range(3, 6), 3, (1,), (4,)))
    path = tmp_path / "mixed.json"
    save_plan(str(path), Plan("tiny-gpt", str(cluster), 8, 4, 2, "1f1b", stages, planner="test"))
    result = estimate(str(path), model="tiny-gpt", cluster=str(cluster), replay=False)
    replay = replay_plan(result.ranked.plan, result.workload.model)
    assert [(s.stage, s.rank, s.devices) for s in replay.stages] == [(0, 1, (1, 2)), (0, 0, (0,)), (1, 3, (3,))]
    for s in replay.stages:
        analytic = _analytic_tensors(result.ranked, result.workload, s.device)
        assert abs(analytic - s.peak_bytes) <= 0.05 * s.peak_bytes, (s, analytic)
    check = replay_check(replay, result.ranked, result.workload, 0.0)
    capacity = result.ranked.estimate.memory_capacity_bytes
    assert [(r.stage, r.tp, r.samples, r.gpu, r.gpus, r.capacity_bytes) for r in check.replicas] == [
        (0, 2, 3, "P100", 2, capacity[1]), (0, 1, 1, "V100-32GB", 1, capacity[0])]
    assert [r.peak_bytes - OVERHEAD for r in check.replicas] == [s.peak_bytes for s in replay.stages[:2]]
    line = ReplayOutcome((check,)).line()
    assert "replay of plan #1, stage 0, tp2 replica(s) taking 3 sample(s) of each micro-batch on 2x P100" in line
    assert "not replayed" not in line and check.fits
    assert replay_record(check)["replicas"][1]["gpu"] == "V100-32GB"


def test_a_stage_of_tp2_and_tp1_replicas_replays_each_near_its_analytic_peak() -> None:
    """One stage, a tp-2 replica taking 3 samples of each micro-batch and a tp-1 replica taking 1
    (tests/distributed/test_runtime_mixed.py's first plan): both replay, each within 5% of its
    analytic peak; the plan goes through ``hetplan estimate``'s replay with no note."""
    from hetplan.runtime.replay import replay_plan

    stage = _mixed_stage(range(0, 6), 0, (2, 1), (3, 1))
    plan = Plan("tiny-gpt", "local-cpu-3", 8, 4, 2, "1f1b", (stage,), planner="test")
    path = os.path.join(tempfile.mkdtemp(), "p.json")
    save_plan(path, plan)
    result = estimate(path, model="tiny-gpt", cluster="local-cpu-3", replay=False)
    replay = replay_plan(result.ranked.plan, result.workload.model)
    assert [(s.stage, s.rank, s.devices) for s in replay.stages] == [(0, 0, (0, 1)), (0, 2, (2,))]
    for s in replay.stages:
        analytic = _analytic_tensors(result.ranked, result.workload, s.device)
        assert abs(analytic - s.peak_bytes) <= 0.05 * s.peak_bytes, (s, analytic)


# Plans whose one-step replay (optimizer states made first; a pipeline's stages initialized first) is held
# to the two-step replay: ZeRO-1's sharded optimizer, DDP's buckets, MoE routing's valued tensors, FSDP2
# with full recompute; pipelines of each torch pipelining schedule, bf16 pp2 x tp2 among them (its first
# step's peak, shape inference included, was 1,396,300 B against the second's 1,302,644 B), with MoE's
# expert parallelism and with offloaded activations (host bytes).
ONE_STEP = {
    "dp2-zero1-bf16-2mb": NON_PIPELINED["dp2-zero1-bf16-2mb"],
    "dp2-ep2-moe": NON_PIPELINED["dp2-ep2-moe"],
    "dp2-zero3-full-bf16": (UniformSetting(dp=2, tp=1, pp=1, zero=3, recompute="full", micro_batch=2),
                            "tiny-llama-bf16"),
    "pp2-tp2-bf16-1f1b": (UniformSetting(dp=1, tp=2, pp=2, micro_batch=2), "tiny-llama-bf16"),
    "pp2-dp2-zero3-full-gpipe": (UniformSetting(dp=2, tp=1, pp=2, zero=3, recompute="full", micro_batch=1,
                                                schedule="gpipe"), "tiny-llama-bf16"),
    "pp2-interleaved": (UniformSetting(dp=1, tp=1, pp=2, micro_batch=2, schedule="interleaved-1f1b",
                                       virtual_stages=2), "tiny-gpt"),
    "pp2-dp2-ep2-moe": (UniformSetting(dp=2, tp=1, pp=2, ep=2, micro_batch=1), "tiny-moe"),
    "pp2-full-offload": (UniformSetting(dp=1, tp=1, pp=2, recompute="full", offload=True, micro_batch=1),
                         "tiny-gpt"),
}


@pytest.mark.parametrize("kind", sorted(ONE_STEP))
def test_a_one_step_replay_peaks_where_the_second_of_two_steps_does(kind: str) -> None:
    """The replay makes the optimizer's states and the loss the step before leaves (and, pipelined,
    runs the schedule's stage initialization), then replays one step
    (``replay_rank(states_first=True)``): its peak is the second of two replayed steps' to the
    byte (4 bytes short before the pending loss was made: the step before's 0-dim loss, held
    through the next step)."""
    from hetplan.runtime.replay import replay_plan

    setting, model = ONE_STEP[kind]
    cluster = "local-cpu-2" if setting.dp * setting.tp * setting.pp <= 2 else "local-cpu-4"
    result = estimate(setting, model=model, cluster=cluster, global_batch=8, replay=False)
    plan, spec = result.ranked.plan, result.workload.model
    one, two = (replay_plan(plan, spec, states_first=first) for first in (True, False))
    assert [(s.peak_bytes, s.host_peak_bytes) for s in one.stages] == \
        [(s.peak_bytes, s.host_peak_bytes) for s in two.stages]


def test_fsdp2_chunks_made_when_asked_are_its_chunks() -> None:
    """``ChunkViews`` (the replay's stand-in for FSDP2's ``_chunk_with_empty``) gives the same views:
    sizes, strides, storage offsets, empty padding, over sizes below, at and above the chunk count."""
    import torch
    from torch.distributed.fsdp._fully_shard._fsdp_common import _chunk_with_empty

    from hetplan.runtime.replay import ChunkViews

    for size in range(0, 11):
        for chunks in (1, 3, 4, 8):
            tensor = torch.empty(size, 3)
            views, lazy = _chunk_with_empty(tensor, chunks, 0), ChunkViews(tensor, chunks, 0)
            assert len(lazy) == len(views) == chunks
            for index in (*range(chunks), -1):
                a, b = views[index], lazy[index]
                assert (a.shape, a.stride(), a.storage_offset()) == (b.shape, b.stride(), b.storage_offset())
                assert b.numel() == 0 or b.untyped_storage()._cdata == tensor.untyped_storage()._cdata
