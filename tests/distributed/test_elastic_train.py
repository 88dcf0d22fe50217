"""``hetplan train --elastic``: a rank killed mid-run, the run re-planned for the devices left and continued
from the newest checkpoint, with the losses a run of the new plan from that checkpoint has.

Four processes on ``local-cpu-4`` (tiny-gpt, global batch 8): the best plan is dp4. A rank kills itself
with SIGKILL right after a step's checkpoint (``HETPLAN_FAULT_KILL``), a second one while a checkpoint is
written (``HETPLAN_FAULT_KILL_SAVE``), and a rank works 4x slower (``HETPLAN_FAULT_SLOW``):
hetplan.runtime.faults.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hetplan.cli import main
from hetplan.model.presets import get_model
from hetplan.plan.file import read_plan_file
from hetplan.runtime.build import model_build
from hetplan.runtime.launch import check_results, free_port, run_local
from hetplan.runtime.reference import build_reference, make_optimizer, train_reference, training_batch
from rt_helpers import train_worker

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def _hetplan(*args: str, faults: str = "", save_faults: str = "", slow: str = "") -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.path.join(ROOT, "src"), "OMP_NUM_THREADS": "1",
           "HETPLAN_FAULT_KILL": faults, "HETPLAN_FAULT_KILL_SAVE": save_faults, "HETPLAN_FAULT_SLOW": slow}
    return subprocess.run([sys.executable, "-m", "hetplan.cli", *args], capture_output=True, text=True, env=env,
                          timeout=600, cwd=ROOT)


def _plan(tmp_path: Path, cluster: str) -> str:
    plan = str(tmp_path / "p.json")  # in this process: a process less to start
    assert main(["plan", "--model", "tiny-gpt", "--cluster", cluster, "--global-batch", "8", "--quiet",
                 "--json", plan]) == 0
    return plan


def _losses(out: Path) -> tuple[int, list[float]]:
    summary = json.loads((out / "summary.json").read_text())
    return summary["start_step"], summary["losses"]


def _uninterrupted_losses(steps: int) -> list[float]:
    """The losses of tiny-gpt trained in one process on the steps' batches (global batch 8, seed 0)."""
    how = model_build(get_model("tiny-gpt"))
    model = build_reference(how.build, 0)
    batches = [training_batch(get_model("tiny-gpt"), how, 8, step, 0)[:2] for step in range(steps)]
    return train_reference(model, batches, how.loss, make_optimizer(model.parameters(), "sgd", None), clip=1.0)


def _from_checkpoint(plan: str, processes: int, steps: int, checkpoint: str) -> list[float]:
    """The losses of ``plan`` trained from ``checkpoint`` to ``steps`` (processes forked from a server that
    has imported torch: cheaper than a ``hetplan train`` of its own; all on this machine for a multi-node plan)."""
    ranks = run_local(train_worker, processes, (plan, steps, {"load_from": checkpoint, "export": False}),
                      timeout_s=240, env={"HETPLAN_ONE_MACHINE": "1"})
    return check_results(ranks)[0]["losses"]


@pytest.mark.slow
def test_two_kills_and_a_straggler_the_run_replans_three_times_and_continues_as_the_new_plan_would(
        tmp_path: Path) -> None:
    """4 processes; rank 1 killed after step 4 (3 left), rank 0 killed while step 8's checkpoint is written
    (2 left, from step 6), rank 1 of those works 4x slower: at step 10's checkpoint the run stops and goes
    on from it with a plan that gives that device less (``--restart-cost 0``: any gain pays)."""
    plan = _plan(tmp_path, "local-cpu-4")
    ckpt, out = tmp_path / "ck", tmp_path / "out"
    proc = _hetplan("train", "--plan", plan, "--steps", "12", "--checkpoint-dir", str(ckpt), "--checkpoint-every",
                    "2", "--elastic", "--restart-cost", "0", "--out", str(out), "--timeout", "60", faults="1:4:4",
                    save_faults="0:8:3", slow="1:4:2")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "rank 1 " in proc.stderr and "killed by SIGKILL" in proc.stderr
    assert "re-planned for the 3 devices left" in proc.stdout and "re-planned for the 2 devices left" in proc.stdout
    assert proc.stdout.count("resuming from") == 3 and proc.stdout.count("fp32, 2 processes") == 2
    # rank 0 died while step 8's checkpoint was written: that one is skipped as incomplete, the third run
    # started from step 6's, and only the steps since it were lost
    assert "skipping checkpoint" in proc.stderr and "step_00000008: it is incomplete" in proc.stderr
    # the straggler: reported once, at step 10's checkpoint, re-planned with its measured rate
    assert proc.stdout.count("straggler: rank 1 (device 1)") == 1 and "stopping to re-plan" in proc.stdout
    assert "re-planned with device 1 " in proc.stdout and "continuing from " + str(ckpt / "step_00000010") in proc.stdout
    split = read_plan_file(str(ckpt / "plan-replan-3.json")).plan().stages[0].dp_split
    assert split[0] > split[1]
    start, losses = _losses(out)
    assert start == 10 and len(losses) == 2
    # data order: each step's last printed loss (4, 3, 2, then 2 processes unevenly) is the uninterrupted run's
    printed = {int(k): float(v) for k, v in re.findall(r"^step +(\d+) +loss ([\d.]+)", proc.stdout, re.M)}
    assert sorted(printed) == list(range(1, 13))
    torch.testing.assert_close([printed[k] for k in range(1, 13)], _uninterrupted_losses(12), rtol=1e-5, atol=0)
    assert _from_checkpoint(str(ckpt / "plan-replan-3.json"), 2, 12, str(ckpt / "step_00000010")) == losses


def test_elastic_needs_a_checkpoint_directory_and_no_verify(tmp_path: Path) -> None:
    plan = str(tmp_path / "p.json")
    for args, message in ((["--elastic"], "--elastic needs --checkpoint-dir"),
                          (["--elastic", "--checkpoint-dir", str(tmp_path), "--verify"], "exclude each other")):
        proc = _hetplan("train", "--plan", plan, *args)
        assert proc.returncode == 2 and message in proc.stderr, proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1


@pytest.mark.slow
def test_run_elastic_starts_the_users_script_again_with_the_new_plan_and_its_checkpoints(tmp_path: Path) -> None:
    """``hetplan run --elastic``: rank 1 of examples/train.py dies while step 4's checkpoint is written; the
    script starts again on the one device left and resumes from step 2's, the newest complete one."""
    plan = _plan(tmp_path, "local-cpu-2")
    ckpt = tmp_path / "ck"
    proc = _hetplan("run", plan, "--elastic", "--checkpoint-dir", str(ckpt), "--timeout", "60", "--",
                    os.path.join(ROOT, "examples", "train.py"), "--steps", "6", "--checkpoint-every", "2",
                    save_faults="1:4:2")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "hetplan run: rank 1 " in proc.stderr and "killed by SIGKILL" in proc.stderr
    assert "hetplan run: --elastic: re-planned for the 1 devices left" in proc.stdout
    assert f"continuing from {ckpt / 'step_00000002'} (step 2)" in proc.stdout
    assert f"resumed from {ckpt / 'step_00000002'}" in proc.stdout
    assert [int(k) for k in re.findall(r"^step +(\d+) ", proc.stdout, re.M)] == [1, 2, 3, 4, 3, 4, 5, 6]
    assert (ckpt / "step_00000006" / "hetplan-manifest.json").is_file()


TWO_NODES = """name: two-nodes
inter_node_bandwidth_gbps: 10
nodes:
  - {gpu: CPU, gpus: 2, intra_node_bandwidth_gbps: 10, count: 2}
"""


@pytest.mark.slow
def test_two_node_supervisors_agree_on_the_lost_device_and_go_on_with_the_same_plan(tmp_path: Path) -> None:
    """Two supervisors on this machine stand in for two nodes of 2 processes (one store, node 0's): rank 3
    (node 1) is killed after step 2's checkpoint; both re-plan for the same 3 devices and go on from step 2,
    with the losses a run of that plan from that checkpoint has."""
    (tmp_path / "two.yaml").write_text(TWO_NODES)
    plan = _plan(tmp_path, str(tmp_path / "two.yaml"))
    ckpt, out = tmp_path / "ck", tmp_path / "out"
    endpoint = f"127.0.0.1:{free_port()}"
    env = {**os.environ, "PYTHONPATH": os.path.join(ROOT, "src"), "OMP_NUM_THREADS": "1", "HETPLAN_FAULT_KILL": "3:2:4"}
    nodes = [subprocess.Popen([sys.executable, "-m", "hetplan.cli", "train", "--plan", plan, "--steps", "4",
                               "--checkpoint-dir", str(ckpt), "--checkpoint-every", "2", "--elastic", "--nnodes", "2",
                               "--node-rank", str(rank), "--rdzv-endpoint", endpoint, "--out", str(out),
                               "--timeout", "60"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                              cwd=ROOT) for rank in (0, 1)]
    said = [node.communicate(timeout=600) for node in nodes]
    shown = "\n".join(f"node {rank}:\n{stdout}{stderr}" for rank, (stdout, stderr) in enumerate(said))
    for node, (stdout, stderr) in zip(nodes, said):
        assert node.returncode == 0, shown
        assert "rank 3 (stage 0 of 1: embed..head, dp 3 of 4, device 3;" in stderr and "killed by SIGKILL" in stderr, shown
    replanned = [re.search(r"--elastic: re-planned for the 3 devices left without device\(s\) 3: (.*)", stdout)
                 for stdout, _ in said]
    assert replanned[0] and replanned[1] and replanned[0].group(1) == replanned[1].group(1), shown
    assert "3 processes, 2 on node 0 of 2" in said[0][0] and "3 processes, 1 on node 1 of 2" in said[1][0], shown
    new_plan = str(ckpt / "plan-replan-1.json")
    assert read_plan_file(new_plan).cluster.num_devices == 3
    start, losses = _losses(out)
    assert start == 2 and len(losses) == 2
    assert _from_checkpoint(new_plan, 3, 4, str(ckpt / "step_00000002")) == losses
