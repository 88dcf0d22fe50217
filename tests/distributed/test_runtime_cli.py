"""End to end from the command line, with torchrun: plan, train --verify, run a user script."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def _hetplan(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.path.join(ROOT, "src"), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "hetplan.cli", *args], capture_output=True, text=True,
                          env=env, timeout=timeout, cwd=ROOT)


@pytest.mark.slow
def test_plan_then_train_verify_on_two_processes(tmp_path) -> None:
    plan = str(tmp_path / "p.json")
    proc = _hetplan("plan", "--model", "tiny-gpt", "--cluster", "local-cpu-2", "--global-batch", "8",
                    "--json", plan)
    assert proc.returncode == 0, proc.stderr
    proc = _hetplan("train", "--model", "tiny-gpt", "--plan", plan, "--steps", "3", "--verify")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "2 processes" in out
    assert len(re.findall(r"^step +\d+  loss ", out, re.M)) == 3, out  # one line per step, from rank 0
    assert "verify: OK" in out, out


@pytest.mark.slow
def test_run_starts_a_user_script_with_the_plan(tmp_path) -> None:
    plan = str(tmp_path / "p.json")
    proc = _hetplan("estimate", "--model", "tiny-gpt", "--cluster", "local-cpu-2", "--global-batch", "8",
                    "--tp", "1", "--pp", "2", "--dp", "1", "--micro-batch", "2", "--json", plan)
    assert proc.returncode == 0, proc.stderr
    export = str(tmp_path / "model.pt")
    proc = _hetplan("run", plan, "--", os.path.join(ROOT, "examples", "train.py"), "--steps", "2",
                    "--export", export)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "step    2" in proc.stdout, proc.stdout
    import torch

    from hetplan.model import get_model
    from hetplan.runtime.models import build_preset_model

    state = torch.load(export)
    model = build_preset_model(get_model("tiny-gpt"))
    model.load_state_dict(state)  # the export loads into the unsplit model
