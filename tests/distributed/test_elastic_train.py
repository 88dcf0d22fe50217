"""``hetplan train --elastic``: a rank killed mid-run, the run re-planned for the devices left and continued
from the newest checkpoint, with the losses a run of the new plan from that checkpoint has.

Four processes on ``local-cpu-4`` (tiny-gpt, global batch 8): the best plan is dp4. A rank kills itself
with SIGKILL right after a step's checkpoint (``HETPLAN_FAULT_KILL``, the trainer's fault injection).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def _hetplan(*args: str, faults: str = "") -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.path.join(ROOT, "src"), "OMP_NUM_THREADS": "1",
           "HETPLAN_FAULT_KILL": faults}
    return subprocess.run([sys.executable, "-m", "hetplan.cli", *args], capture_output=True, text=True, env=env,
                          timeout=600, cwd=ROOT)


def _plan(tmp_path: Path, cluster: str) -> str:
    plan = str(tmp_path / "p.json")
    proc = _hetplan("plan", "--model", "tiny-gpt", "--cluster", cluster, "--global-batch", "8", "--quiet",
                    "--json", plan)
    assert proc.returncode == 0, proc.stderr
    return plan


def _losses(out: Path) -> tuple[int, list[float]]:
    summary = json.loads((out / "summary.json").read_text())
    return summary["start_step"], summary["losses"]


@pytest.mark.slow
def test_two_ranks_killed_the_run_replans_twice_and_continues_as_the_new_plan_would(tmp_path: Path) -> None:
    plan = _plan(tmp_path, "local-cpu-4")
    ckpt, out = tmp_path / "ck", tmp_path / "out"
    proc = _hetplan("train", "--plan", plan, "--steps", "9", "--checkpoint-dir", str(ckpt), "--checkpoint-every",
                    "2", "--elastic", "--out", str(out), "--timeout", "60", faults="1:4:4,0:7:3")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "rank 1 " in proc.stderr and "killed by SIGKILL" in proc.stderr
    assert "re-planned for the 3 devices left" in proc.stdout and "re-planned for the 2 devices left" in proc.stdout
    assert proc.stdout.count("resuming from") == 2 and proc.stdout.count("fp32, 2 processes") == 1
    # the second kill came after step 7: the last run started from step 6's checkpoint, one step lost
    start, losses = _losses(out)
    assert start == 6 and len(losses) == 3
    replanned = ckpt / "plan-replan-2.json"
    assert json.loads(replanned.read_text())["cluster_spec"]["nodes"][0]["gpus"] == 2
    alone = tmp_path / "alone"
    proc = _hetplan("train", "--plan", str(replanned), "--steps", "9", "--load", str(ckpt / "step_00000006"),
                    "--out", str(alone))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert _losses(alone) == (start, losses)


def test_elastic_needs_a_checkpoint_directory_and_no_verify(tmp_path: Path) -> None:
    plan = str(tmp_path / "p.json")
    for args, message in ((["--elastic"], "--elastic needs --checkpoint-dir"),
                          (["--elastic", "--checkpoint-dir", str(tmp_path), "--verify"], "exclude each other")):
        proc = _hetplan("train", "--plan", plan, *args)
        assert proc.returncode == 2 and message in proc.stderr, proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1
