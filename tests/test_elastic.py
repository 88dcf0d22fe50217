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

import pytest

from hetplan.app import elastic
from hetplan.app.elastic import Attempt, lost_devices, train_elastic, with_stragglers
from hetplan.app.straggler import STRAGGLER_FILE
from hetplan.cli import main
from hetplan.errors import HetplanError
from hetplan.plan.file import read_plan_file
from hetplan.plan.layout import PlanLayout
from hetplan.runtime.checkpoint_dirs import MANIFEST
from hetplan.runtime.launch import RankExit
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


def test_run_elastic_refuses_a_plan_for_several_nodes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plan = _plan(tmp_path, "metis-uneven-a", capsys)
    assert main(["run", plan, "--elastic", "--checkpoint-dir", str(tmp_path / "ck"), "--", "train.py"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--elastic supervises one machine, and this plan spans" in err and len(err.splitlines()) == 1


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
