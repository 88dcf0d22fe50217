"""The ``--elastic`` supervisor (``hetplan.app.elastic``) without processes: which devices a failed launch
lost, what it re-plans, and the one-line ends (the run with real processes: tests/distributed/test_elastic_train.py)."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from torch.distributed import HashStore

from hetplan.app import elastic
from hetplan.app.elastic import Attempt, lost_devices, train_elastic, with_stragglers
from hetplan.app.straggler import STRAGGLER_FILE
from hetplan.cli import main
from hetplan.errors import HetplanError
from hetplan.plan.file import read_plan_file
from hetplan.plan.layout import PlanLayout
from hetplan.runtime.checkpoint_dirs import MANIFEST
from hetplan.runtime.launch import RankExit, failure_line
from hetplan.runtime.nodes import NodeGroup, NodeLaunch, Report, decide, nodes_left
from hetplan.runtime.faults import KILL_ENV as FAULT_ENV, fault_kills


def _plan(tmp_path: Path, cluster: str, capsys: pytest.CaptureFixture[str]) -> str:
    path = str(tmp_path / "p.json")
    assert main(["plan", "--model", "tiny-gpt", "--cluster", cluster, "--global-batch", "8", "--quiet", "--no-replay",
                 "--json", path]) == 0
    capsys.readouterr()
    return path


def _args(plan: str, tmp_path: Path) -> argparse.Namespace:
    return argparse.Namespace(plan=plan, checkpoint_dir=str(tmp_path))


def test_the_lost_devices_are_the_ranks_killed_not_those_torchrun_stopped(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pf = read_plan_file(_plan(tmp_path, "local-cpu-4", capsys))
    layout = PlanLayout.from_plan(pf.plan(1), [layer.name for layer in pf.model.layers])
    exits = [RankExit(0, -signal.SIGTERM, 10), RankExit(1, -signal.SIGKILL, 11), RankExit(2, 1, 12),
             RankExit(3, -signal.SIGTERM, 13)]
    assert lost_devices(exits, layout) == (layout.position(1).device,)
    assert lost_devices([RankExit(0, 1, 10)], layout) == ()


def test_a_rank_that_aborted_after_its_peer_was_killed_is_not_lost(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A rank whose peer vanished mid-collective may abort itself (SIGABRT), at
    times before the supervisor reaped the killed one: whatever order the exits
    come in, the lost device is the killed rank's alone, and the failure line
    names that rank. A rank that aborted with no other killed is lost."""
    pf = read_plan_file(_plan(tmp_path, "local-cpu-2", capsys))
    layout = PlanLayout.from_plan(pf.plan(1), [layer.name for layer in pf.model.layers])
    aborted, killed = RankExit(0, -signal.SIGABRT, 10), RankExit(1, -signal.SIGKILL, 11)
    for exits in ([aborted, killed], [killed, aborted]):
        assert lost_devices(exits, layout) == (layout.position(1).device,)
        line = failure_line(exits, str(tmp_path), lambda r: f"rank {r} of 2")
        assert "(rank 1 of 2;" in line and "killed by SIGKILL" in line, line
    assert lost_devices([aborted, RankExit(1, -signal.SIGTERM, 11)], layout) == (layout.position(0).device,)


def test_each_launch_runs_the_plan_made_without_the_devices_the_last_one_lost(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plan = _plan(tmp_path, "local-cpu-4", capsys)
    launches: list[tuple[int, bool]] = []

    def launch(path: str, resume: bool) -> Attempt:
        devices = read_plan_file(path).cluster.num_devices
        launches.append((devices, resume))
        return Attempt(True) if devices == 2 else Attempt(False, f"rank 0 of {devices} killed", lost=(0,))

    assert train_elastic(_args(plan, tmp_path), launch) == 0
    assert launches == [(4, False), (3, True), (2, True)]
    out = capsys.readouterr()
    assert out.out.count("--elastic: re-planned") == 2 and "rank 0 of 4 killed" in out.err
    assert json.loads((tmp_path / "plan-replan-2.json").read_text())["cluster_spec"]["nodes"][0]["gpus"] == 2


def test_a_failure_that_lost_no_device_ends_in_its_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plan = _plan(tmp_path, "local-cpu-2", capsys)
    assert train_elastic(_args(plan, tmp_path), lambda path, resume: Attempt(False, "rank 1 failed: boom")) == 1
    assert capsys.readouterr().err.strip() == "hetplan: error: rank 1 failed: boom"


def test_nothing_left_to_plan_on_is_one_error(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plan = _plan(tmp_path, "local-cpu-2", capsys)
    with pytest.raises(HetplanError, match="rank 0 killed; --elastic cannot re-plan: .*nothing is left to plan on"):
        train_elastic(_args(plan, tmp_path), lambda path, resume: Attempt(False, "rank 0 killed", lost=(0, 1)))


def test_a_cluster_that_keeps_losing_devices_stops_after_the_last_replan(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    plan = _plan(tmp_path, "local-cpu-4", capsys)
    monkeypatch.setattr(elastic, "MAX_REPLANS", 2)
    calls: list[str] = []

    def launch(path: str, resume: bool) -> Attempt:
        calls.append(path)
        return Attempt(False, "rank 0 killed", lost=(0,))

    assert train_elastic(_args(plan, tmp_path), launch) == 1
    assert len(calls) == 3 and "re-planned 2 times already" in capsys.readouterr().err


def test_fault_injection_names_rank_step_and_world_size(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(FAULT_ENV, "1:4:4, 0:7:3,2:9,bad,3:x")
    assert fault_kills(4) == {1: 4, 2: 9}
    assert fault_kills(3) == {0: 7, 2: 9}


def test_the_replan_line_says_where_the_new_run_starts(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """No checkpoint yet: step 0, said once; a newer checkpoint a kill cut short (no manifest) is passed over."""
    plan = _plan(tmp_path, "local-cpu-4", capsys)
    kills = iter([Attempt(False, "rank 1 killed", lost=(1,)), Attempt(False, "rank 0 killed", lost=(0,))])

    def launch(path: str, resume: bool) -> Attempt:
        if not resume:
            return next(kills)
        (tmp_path / "step_00000002").mkdir(exist_ok=True)
        (tmp_path / "step_00000002" / MANIFEST).write_text("{}")
        (tmp_path / "step_00000004").mkdir(exist_ok=True)  # its save did not finish
        return next(kills, Attempt(True))

    assert train_elastic(_args(plan, tmp_path), launch) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if "--elastic: re-planned" in line]
    assert lines[0].endswith(f"no complete checkpoint in {tmp_path} yet: the new plan starts from step 0")
    assert lines[1].endswith(f"continuing from {tmp_path / 'step_00000002'} (step 2)")


@pytest.mark.parametrize("flags, message", [
    ([], "--elastic needs --checkpoint-dir"),
    (["--checkpoint-dir", "CK", "--print"], "--elastic supervises the processes it starts on this machine"),
])
def test_run_elastic_flags_are_one_line_each(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                             flags: list[str], message: str) -> None:
    plan = _plan(tmp_path, "local-cpu-2", capsys)
    flags = [str(tmp_path / "ck") if f == "CK" else f for f in flags]
    assert main(["run", plan, "--elastic", *flags, "--", "train.py"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"hetplan: error: {message}") and len(err.splitlines()) == 1


def test_run_elastic_of_a_plan_for_several_nodes_asks_for_the_node_flags(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plan = _plan(tmp_path, "metis-uneven-a", capsys)
    assert main(["run", plan, "--elastic", "--checkpoint-dir", str(tmp_path / "ck"), "--", "train.py"]) == 2
    err = capsys.readouterr().err.strip()
    assert "this plan spans 3 nodes: run 'hetplan run PLAN --elastic --nnodes 3 --node-rank I" in err
    assert len(err.splitlines()) == 1


def test_every_node_computes_the_same_plan_from_the_same_file_and_lost_devices(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Multi-node agreement (docs/elastic.md): two "nodes", separate interpreters with other hash seeds,
    given the lost devices in another order, write the same plan file (but for the search's wall time)."""
    plan = _plan(tmp_path, "metis-uneven-d", capsys)
    code = ("import sys; from hetplan.app.replan import replan_file; from hetplan.app.records import write_json; "
            "write_json(sys.argv[2], replan_file(sys.argv[1], sys.argv[3:]).result.record())")
    written = []
    for node, (seed, lost) in enumerate((("0", ["3", "node:0"]), ("1", ["gpu:0", "3"]))):
        out = tmp_path / f"node{node}.json"
        env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": os.pathsep.join(sys.path)}
        subprocess.run([sys.executable, "-c", code, plan, str(out), *lost], check=True, env=env, timeout=120)
        written.append({k: v for k, v in json.loads(out.read_text()).items() if k != "search_time_s"})
    assert written[0] == written[1]
    assert written[0]["cluster_spec"]["name"].endswith("without GPU 0, 3")


def test_ranks_stopped_for_a_straggler_are_replanned_with_its_measured_rate(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plan = _plan(tmp_path, "local-cpu-2", capsys)
    (tmp_path / STRAGGLER_FILE).write_text(json.dumps({"slow": {"1": 4.0}, "line": "stopping to re-plan"}))
    stopped = with_stragglers(Attempt(False, "rank 0 exited with 3", status=1), str(tmp_path))
    assert stopped.slow == ((1, 4.0),) and not (tmp_path / STRAGGLER_FILE).exists()
    assert with_stragglers(Attempt(False, "boom"), str(tmp_path)) == Attempt(False, "boom")  # read once
    plans = []

    def launch(path: str, resume: bool) -> Attempt:
        plans.append(read_plan_file(path))
        return Attempt(True) if resume else stopped

    assert train_elastic(_args(plan, tmp_path), launch) == 0
    assert "re-planned with device 1 4.00x slower (measured)" in capsys.readouterr().out
    new = plans[1]
    assert new.cluster.num_devices == 2 and new.cluster.devices[1].gpu.peak_flops_fp32 * 4 == pytest.approx(
        new.cluster.devices[0].gpu.peak_flops_fp32)
    assert new.plan().stages[0].dp_split == (7, 1)  # the slow device takes less of the batch


def test_restart_cost_without_elastic_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plan = _plan(tmp_path, "local-cpu-2", capsys)
    assert main(["train", "--plan", plan, "--restart-cost", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("hetplan: error: --restart-cost weighs --elastic's re-plans") and len(err.splitlines()) == 1


TWO_NODES = """name: two-nodes
inter_node_bandwidth_gbps: 10
nodes:
  - {gpu: CPU, gpus: 2, intra_node_bandwidth_gbps: 10, count: 2}
"""


def _two_node_plan(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> str:
    (tmp_path / "two.yaml").write_text(TWO_NODES)
    return _plan(tmp_path, str(tmp_path / "two.yaml"), capsys)


def test_the_nodes_decision_is_the_union_of_their_losses_and_a_silent_node_loses_all() -> None:
    peer_lost = Report(False, (), "rank 0 failed: Connection reset by peer", 1)
    killed = Report(False, (3,), "rank 3 stopped: killed by SIGKILL", 1)
    assert decide([peer_lost, killed], [[0, 1], [2, 3]], 90) == Report(False, (3,), killed.line, 1)
    silent = decide([peer_lost, None], [[0, 1], [2, 3]], 90)
    assert silent.lost == (2, 3) and silent.line.startswith("node(s) 1 of the launch did not report within 90 s")
    assert decide([Report(True), Report(True)], [[0, 1], [2, 3]], 90) == Report(True)


def test_each_machine_keeps_its_node_after_a_replan(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cluster = read_plan_file(_two_node_plan(tmp_path, capsys)).cluster
    assert nodes_left(cluster, [0, 1], [3]) == [0, 1]
    assert nodes_left(cluster, [0, 1], [0, 1]) == [None, 0]  # node 0's devices gone: machine 1 is node 0 now
    assert nodes_left(cluster, [0, 1], [2, 3]) == [0, None]


def _group(store: Any, me: int) -> NodeGroup:
    return NodeGroup(store, me, 2, 29400, timeout_s=0.5, where=[0, 1])


def test_two_supervisors_read_one_decision_and_a_late_node_learns_it_was_left_out(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The first proposal written wins (the store's compare_set): node 0 gives up on node 1 after its wait and
    decides without it; node 1 reports later, reads that decision and leaves with one line."""
    plan = _two_node_plan(tmp_path, capsys)
    store = HashStore()
    store.set("addr/0", "10.0.0.1")
    store.set("addr/1", "10.0.0.2")
    first, second = _group(store, 0), _group(store, 1)
    assert first.enter(plan) == NodeLaunch(2, 0, "10.0.0.1", 29401)
    assert second.enter(plan) == NodeLaunch(2, 1, "10.0.0.1", 29401)
    decision = first.agree(Report(False, (), "rank 0 failed: Connection reset by peer", 1))
    assert decision.lost == (2, 3) and first.where == [0, None]
    with pytest.raises(HetplanError, match="the other nodes decided without this one"):
        second.agree(Report(False, (3,), "rank 3 killed", 1))


def test_both_nodes_reporting_agree_on_the_killed_rank_and_the_next_launch(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plan = _two_node_plan(tmp_path, capsys)
    store = HashStore()
    store.set("addr/0", "10.0.0.1")
    store.set("addr/1", "10.0.0.2")
    groups = [_group(store, 0), _group(store, 1)]
    for group in groups:
        group.enter(plan)
    store.set("launch0/report/1", Report(False, (3,), "rank 3 killed", 1).text())  # node 1 reported first
    assert groups[0].agree(Report(False, (), "rank 0 lost a peer", 1)) == Report(False, (3,), "rank 3 killed", 1)
    assert groups[1].agree(Report(False, (3,), "rank 3 killed", 1)).lost == (3,)
    assert groups[0].where == groups[1].where == [0, 1]


def test_a_lost_store_is_one_line() -> None:
    class Gone:
        def check(self, keys: list[str]) -> bool:
            raise RuntimeError("Connection reset by peer")

    with pytest.raises(HetplanError, match="the nodes' store on the node started with --node-rank 0 is gone"):
        _group(Gone(), 1).wait_for(["launch0/report/0"], 1.0)


def test_run_checks_the_node_flags_against_the_plan(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plan = _two_node_plan(tmp_path, capsys)
    assert main(["run", plan, "--elastic", "--checkpoint-dir", str(tmp_path / "ck"), "--nnodes", "3", "--node-rank",
                 "0", "--rdzv-endpoint", "h:1", "--", "train.py"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("hetplan: error: --nnodes 3: the plan runs on 2 node(s)") and len(err.splitlines()) == 1


@pytest.mark.parametrize("flags, message", [
    (["--nnodes", "2"], "--nnodes, --node-rank and --rdzv-endpoint go together"),
    (["--nnodes", "3", "--node-rank", "0", "--rdzv-endpoint", "h:1", "--elastic"], "--nnodes 3: the plan runs on 2"),
    (["--nnodes", "2", "--node-rank", "2", "--rdzv-endpoint", "h:1", "--elastic"], "--node-rank 2: give 0..1"),
    (["--nnodes", "2", "--node-rank", "0", "--rdzv-endpoint", "h", "--elastic"], "--rdzv-endpoint 'h': give HOST:PORT"),
    (["--nnodes", "2", "--node-rank", "0", "--rdzv-endpoint", "h:1"], "--nnodes runs a multi-node --elastic run"),
])
def test_node_flags_are_one_line_each(tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str],
                                      message: str) -> None:
    plan = _two_node_plan(tmp_path, capsys)
    assert main(["train", "--plan", plan, "--checkpoint-dir", str(tmp_path / "ck"), *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"hetplan: error: {message}") and len(err.splitlines()) == 1, err
