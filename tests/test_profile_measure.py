"""hetplan profile: the ProfileDB format, the measurements, the collective fits and the command."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from hetplan.cli import main
from hetplan.cluster.io import load_cluster
from hetplan.errors import HetplanError
from hetplan.model.presets import get_model
from hetplan.profile import load_profile
from hetplan.profile.db import (LOSS_KEY, ChainPoint, CollectiveFit, CollectivePoint, DataParallelPoint, HostPoint,
                                ProfileDB, ProfileEntry, Unsupported)
from hetplan.runtime.profiling.collectives import bus_factor, fit_alpha_beta, message_sizes
from hetplan.runtime.profiling.job import (ProfileJob, batch_sizes, chain_layers, data_parallel_measurements,
                                           distinct_layers)

MODEL = "tiny-gpt"


def _full_db() -> ProfileDB:
    entries = [ProfileEntry("blk", "CPU", 1, 1, 0.002, 0.004, 1000, 1e-4, 2e-4),
               ProfileEntry("blk", "CPU", 2, 1, 0.003, 0.005, 600, 1e-4, 2e-4, 0.001, 0.002)]
    return ProfileDB(entries,
                     collectives=[CollectivePoint("all_reduce", 2, "intra", 1024, 3e-5, 0.27)],
                     fits=[CollectiveFit("all_reduce", 2, "intra", 2.5e-5, 9.0, 9.0)],
                     unsupported=[Unsupported("all_to_all", 2, "intra", "RuntimeError: no")],
                     chains=[ChainPoint("CPU", 1, 1, ("blk", "blk"), 0.005, 0.009)],
                     data_parallel=[DataParallelPoint("blk", "CPU", 1, 2, 3, 1000, 0.001, 0.003),
                                    DataParallelPoint("emb", "CPU", 1, 2, 3, 3000, 0.001, 0.001)],
                     host=[HostPoint("CPU", 2.5e-5, 35)],
                     machine={"hostname": "h", "torch": "2.x", "threads": 1, "cores": 2},
                     settings={"model": "m", "tp": [1, 2], "repeats": 3})


# --- the file format ---------------------------------------------------------------------------------
def test_round_trip_keeps_everything(tmp_path) -> None:
    db = _full_db()
    path = tmp_path / "p.json"
    path.write_text(db.to_json())
    back = load_profile(path)
    assert back.entries() == db.entries()
    assert back.collectives == db.collectives and back.fits == db.fits and back.unsupported == db.unsupported
    assert back.data_parallel == db.data_parallel and back.chains == db.chains and back.host == db.host
    assert back.machine == db.machine and back.settings == db.settings
    assert json.loads(path.read_text())["format"] == "hetplan-profile"


def test_old_files_with_entries_only_still_load(tmp_path) -> None:
    path = tmp_path / "old.json"
    old = {"entries": [{"layer": "blk", "gpu": "T4", "tp": 1, "batch": 4, "fwd_s": 0.01, "bwd_s": 0.02,
                        "memory_bytes": 5}]}
    path.write_text(json.dumps(old))
    db = load_profile(path)
    assert db.lookup("blk", "T4", 1, 4) == (0.01, 0.02)
    assert db.collectives == [] and db.machine == {}
    assert json.loads(db.to_json())["entries"] == old["entries"]  # entries are written back as they were


@pytest.mark.parametrize("change, named", [
    (lambda d: d.update(extra=1), "extra"),
    (lambda d: d["entries"][0].update(fwd_ms=1), "fwd_ms"),
    (lambda d: d["collectives"][0].update(latency=1), "latency"),
    (lambda d: d["machine"].update(gpu_clock=1), "gpu_clock"),
    (lambda d: d["entries"][0].update(tp=True), "tp"),
    (lambda d: d["fits"][0].pop("alpha_s"), "alpha_s"),
    (lambda d: d["data_parallel"][0].update(zero=1), "zero must be one of 0, 2, 3"),
    (lambda d: d["data_parallel"][0].pop("params"), "params"),
    (lambda d: d["chains"][0].update(layers="blk"), "layers"),
    (lambda d: d["host"][0].update(op_s=0), "op_s and ops must be positive"),
    (lambda d: d["host"][0].pop("ops"), "ops"),
])
def test_unknown_or_bad_keys_are_one_error_naming_them(tmp_path, change, named) -> None:
    data = _full_db().to_dict()
    change(data)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(HetplanError, match=named):
        load_profile(path)


def test_data_parallel_rate_is_the_measured_extra_per_parameter() -> None:
    db = _full_db()
    # (1 + 1 ms) over 4000 parameters forward, (3 + 1 ms) backward
    assert db.data_parallel_rate("CPU", 1, 2, 3) == pytest.approx((0.002 / 4000, 0.004 / 4000))
    assert db.data_parallel_rate("CPU", 1, 2, 0) is None  # not measured: the analytic model stays
    assert db.data_parallel_rate("CPU", 2, 2, 3) is None and db.data_parallel_rate("T4", 1, 2, 3) is None


def test_chain_factor_is_the_chain_over_its_layers_one_by_one() -> None:
    db = _full_db()
    # two blocks one by one: 2 x (2 + 4) ms; chained: 5 + 9 ms
    assert db.chain_factor("CPU", 1, 1) == pytest.approx(14 / 12)
    assert db.chain_factor("CPU", 1, 8) == pytest.approx(14 / 12)  # the nearest measured batch
    assert db.chain_factor("CPU", 2, 1) == 1.0 and db.chain_factor("T4", 1, 1) == 1.0  # none measured there


def test_the_chain_holds_each_layer_kind_and_a_repeated_one_twice() -> None:
    assert [layer.name for layer in chain_layers(get_model(MODEL))] == ["embed", "layers.0", "layers.1", "head"]


def test_data_parallel_is_measured_at_every_dp_degree_beside_each_tp() -> None:
    job = ProfileJob(get_model(MODEL), load_cluster("local-cpu-4"), (1, 2), (1, 2))
    kinds = {(tp, ranks, zero) for _, tp, ranks, zero in data_parallel_measurements(job)}
    assert kinds == {(tp, ranks, zero) for tp, ranks in [(1, 2), (1, 4), (2, 2)] for zero in (0, 2, 3)}


def test_lookup_takes_the_measured_tp_collectives_out() -> None:
    """The cost model adds TP communication itself: the profile gives it compute time."""
    db = _full_db()
    assert db.lookup("blk", "CPU", 2, 1) == pytest.approx((0.002, 0.003))
    assert db.lookup("blk", "CPU", 1, 1) == pytest.approx((0.002, 0.004))
    assert db.lookup("blk", "CPU", 2, 2) == pytest.approx((0.004, 0.006))  # composed from batch 1


# --- collective curves ---------------------------------------------------------------------------------
def test_fit_recovers_known_alpha_and_bandwidth() -> None:
    alpha, bandwidth = 25e-6, 12e9
    sizes = message_sizes(64 * 2**20)
    alpha_fit, bw_fit = fit_alpha_beta(sizes, [alpha + s / bandwidth for s in sizes])
    assert alpha_fit == pytest.approx(alpha, rel=0.01) and bw_fit == pytest.approx(bandwidth, rel=0.01)
    # with noise of +-2% the fit stays close, and alpha is never negative
    noisy = [(alpha + s / bandwidth) * (1.02 if i % 2 else 0.98) for i, s in enumerate(sizes)]
    alpha_n, bw_n = fit_alpha_beta(sizes, noisy)
    assert alpha_n > 0 and bw_n == pytest.approx(bandwidth, rel=0.05)
    # a curve that does not grow with size has no bandwidth
    with pytest.raises(ValueError):
        fit_alpha_beta(sizes, [1e-3] * len(sizes))


def test_nccl_tests_conventions() -> None:
    assert bus_factor("all_reduce", 4) == 1.5 and bus_factor("all_gather", 4) == 0.75
    assert bus_factor("reduce_scatter", 2) == 0.5 and bus_factor("broadcast", 8) == 1 and bus_factor("p2p", 2) == 1
    assert message_sizes(8192) == [1024, 2048, 4096, 8192]
    assert message_sizes(5000) == [1024, 2048, 4096, 5000]
    assert batch_sizes(4) == (1, 2, 4) and batch_sizes(6) == (1, 2, 4, 6) and batch_sizes(1) == (1,)


# --- saved activations ------------------------------------------------------------------------------------
def test_saved_activation_bytes_match_a_hand_count() -> None:
    torch = pytest.importorskip("torch")
    from hetplan.runtime.profiling.measure import SavedBytes

    module = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU())
    for batch in (1, 2, 5):
        x = torch.randn(batch, 4, requires_grad=True)
        with SavedBytes(module) as saved:
            module(x).sum().backward()
        # Linear saves its input (batch x 4 fp32; its weight is a parameter, not
        # counted), ReLU its output (batch x 3 fp32)
        assert saved.bytes == batch * 4 * 4 + batch * 3 * 4


# --- measuring (several processes) -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def measured() -> ProfileDB:
    pytest.importorskip("torch")
    from hetplan.runtime.profiling.measure import local_worker
    from hetplan.runtime.launch import check_results, run_local

    job = ProfileJob(get_model(MODEL), load_cluster("local-cpu-2"), (1, 2), (1, 2, 4), warmup=1, repeats=2,
                     comm_max_bytes=4096)
    values = check_results(run_local(local_worker, 2, (job,), timeout_s=240, env={"HETPLAN_NUM_THREADS": "1"}))
    assert values[1] is None  # rank 0 alone returns the profile
    return ProfileDB.from_dict(values[0])


@pytest.mark.distributed
def test_every_layer_kind_tp_and_batch_is_measured(measured: ProfileDB) -> None:
    spec = get_model(MODEL)
    kinds = distinct_layers(spec)
    assert [layer.name for layer in kinds] == ["embed", "layers.0", "head"]  # four blocks, profiled once
    assert len(measured) == len(kinds) * 2 * 3 + 3  # and the loss at tp 1, each batch
    assert {e.batch for e in measured.entries() if e.layer == LOSS_KEY} == {1, 2, 4}
    for layer in kinds:
        for tp in (1, 2):
            for batch in (1, 2, 4):
                assert measured.lookup(layer.profile_key, "CPU", tp, batch) is not None
    for e in measured.entries():
        assert e.fwd_s > 0 and e.bwd_s > 0 and math.isfinite(e.fwd_s + e.bwd_s)
        assert e.memory_bytes > 0 and e.fwd_spread_s >= 0
        if e.tp == 1:
            assert e.tp_comm_fwd_s == e.tp_comm_bwd_s == 0
    assert [h.gpu for h in measured.host] == ["CPU"] and measured.host_op_s("CPU") > 0
    block = spec.layers[1].profile_key
    tp2 = [e for e in measured.entries() if e.layer == block and e.tp == 2]
    assert all(e.tp_comm_fwd_s > 0 and e.tp_comm_bwd_s > 0 for e in tp2)  # two all-reduces each way (Megatron)
    assert measured.machine["processes"] == 2 and measured.machine["backend"] == "gloo"
    assert measured.machine["cores"] >= 1
    assert measured.settings["model"] == MODEL


@pytest.mark.distributed
def test_block_activations_grow_exactly_with_the_batch(measured: ProfileDB) -> None:
    block = get_model(MODEL).layers[1].profile_key
    for tp in (1, 2):
        mem = {e.batch: e.memory_bytes for e in measured.entries() if e.layer == block and e.tp == tp}
        # parameters and gradients stay; the saved activations double with the batch
        assert mem[4] - mem[2] == 2 * (mem[2] - mem[1]) > 0
    one = {e.tp: e.memory_bytes for e in measured.entries() if e.layer == block and e.batch == 1}
    assert one[2] < one[1]  # a TP shard holds less


@pytest.mark.distributed
def test_chains_are_measured_at_every_tp_and_batch(measured: ProfileDB) -> None:
    assert {(c.tp, c.batch) for c in measured.chains} == {(tp, b) for tp in (1, 2) for b in (1, 2, 4)}
    for c in measured.chains:
        assert c.fwd_s > 0 and c.bwd_s > 0 and len(c.layers) == 4
        assert 0 < measured.chain_factor("CPU", c.tp, c.batch) < 10


@pytest.mark.distributed
def test_data_parallel_wrappers_are_measured_for_every_layer_kind(measured: ProfileDB) -> None:
    spec = get_model(MODEL)
    keys = {layer.profile_key for layer in distinct_layers(spec) if layer.params > 0}
    points = {(d.layer, d.tp, d.ranks, d.zero): d for d in measured.data_parallel}
    assert set(points) == {(k, 1, 2, z) for k in keys for z in (0, 2, 3)}  # tp 2 leaves no room for dp on 2
    for d in points.values():
        assert d.params > 0 and d.fwd_extra_s >= 0 and d.bwd_extra_s >= 0
    block = spec.layers[1].profile_key
    # ZeRO-3 gathers the block's weights before its forward; ZeRO-0 adds nothing there but hooks
    assert points[block, 1, 2, 3].fwd_extra_s > 0 and points[block, 1, 2, 0].bwd_extra_s > 0
    assert measured.data_parallel_rate("CPU", 1, 2, 3) is not None


@pytest.mark.distributed
def test_collective_curves_cover_every_op(measured: ProfileDB) -> None:
    ops = {c.op for c in measured.collectives} | {u.op for u in measured.unsupported}
    assert ops == {"all_reduce", "all_gather", "reduce_scatter", "broadcast", "p2p", "all_to_all"}
    for c in measured.collectives:
        assert c.ranks == 2 and c.link == "intra" and c.time_s > 0 and c.busbw_gbps > 0
    assert sorted({c.bytes for c in measured.collectives if c.op == "all_reduce"}) == [1024, 2048, 4096]


# --- the command ---------------------------------------------------------------------------------------
def _hetplan(*argv: str, timeout: int = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "hetplan", *argv], capture_output=True, text=True, timeout=timeout)


@pytest.mark.distributed
def test_profile_command_writes_a_file_estimate_uses(tmp_path) -> None:
    pytest.importorskip("torch")
    from hetplan.cost.compute import layer_times
    from hetplan.cost.layers import layer_arrays

    out = tmp_path / "profile.json"
    run = _hetplan("profile", "--model", MODEL, "--cluster", "local-cpu-2", "--max-micro-batch", "2",
                   "--repeats", "2", "--warmup", "1", "--comm-max-bytes", "4KiB", "-o", str(out))
    assert run.returncode == 0, run.stderr[-3000:]
    assert "[1/" in run.stderr and "left" in run.stderr  # progress lines
    assert f"wrote {out}" in run.stdout
    est = _hetplan("estimate", "--profile", str(out), "--model", MODEL, "--cluster", "local-cpu-2",
                   "--tp", "2", "--pp", "1", "--dp", "1", "--micro-batch", "2", "--global-batch", "4")
    assert est.returncode == 0, est.stderr
    # the cost model takes the measured times for every layer, with the TP
    # collectives they held where the profile timed them inside the layer,
    # scaled by what chaining them in one micro-batch added
    db = load_profile(out)
    chained = db.chain_factor("CPU", 2, 2)
    spec = get_model(MODEL)
    gpu = load_cluster("local-cpu-2").devices[0].gpu
    times = layer_times(layer_arrays(spec), gpu, 2, 2, "none", spec.dtype_bytes, profile=db)
    for i, layer in enumerate(spec.layers):
        inside = db.includes_tp_comm(layer.profile_key, "CPU", 2)
        assert bool(times.tp_comm_inside[i]) == inside
        fwd, bwd = db.lookup(layer.profile_key, "CPU", 2, 2, with_tp_comm=inside)
        assert (times.fwd_s[i], times.bwd_s[i]) == pytest.approx((fwd * chained, bwd * chained))


def test_gpu_cluster_prints_a_torchrun_command_per_node(tmp_path, capsys) -> None:
    out = tmp_path / "p.json"
    assert main(["profile", "--model", MODEL, "--cluster", "16xA100-80GB", "-o", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    commands = [line for line in lines if "torch.distributed.run" in line]
    assert len(commands) == 2 and not out.exists()
    for k, command in enumerate(commands):
        assert f"--node-rank={k}" in command and "--nproc-per-node=8" in command and "--worker" in command
        assert "--tp 1,2,4" in command  # powers of two dividing 8 and tiny-gpt's 4 heads
    # what a node runs is a valid command line
    from hetplan.cli import build_parser

    flags = commands[0].split(" hetplan profile ", 1)[1].split()
    args = build_parser().parse_args(["profile", *flags])
    assert args.worker and args.tp == (1, 2, 4) and args.comm_max_bytes == 2**30


@pytest.mark.parametrize("argv, says", [
    (["--tp", "4"], "more than the 2 processes"),
    (["--cluster", "local-cpu-3", "--tp", "2"], "does not divide"),
    (["--comm-max-bytes", "12"], "1KiB"),
    (["--repeats", "0"], "positive"),
    (["--max-micro-batch", "x"], "whole number"),
    (["--model", "bert-huge-32"], "cannot profile"),
    (["-o", "/nonexistent/dir/p.json"], "does not exist"),
])
def test_bad_flags_are_one_error_line(argv, says, tmp_path, capsys) -> None:
    pytest.importorskip("torch")
    base = {"--model": MODEL, "--cluster": "local-cpu-2", "-o": str(tmp_path / "p.json")}
    for flag, value in zip(argv[::2], argv[1::2]):
        base[flag] = value
    full = ["profile", *[x for kv in base.items() for x in kv]]
    try:
        code = main(full)
    except SystemExit as exc:  # argparse's own errors
        code = exc.code
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("hetplan: error:") and says in err[0], err
    assert not os.path.exists(tmp_path / "p.json")
