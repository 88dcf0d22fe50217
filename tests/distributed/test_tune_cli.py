"""``hetplan tune`` end to end: real trials (torchrun, gloo) of tiny-gpt on two CPU processes."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def _hetplan(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.path.join(ROOT, "src"), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "hetplan", *args], capture_output=True, text=True, env=env,
                          timeout=timeout, cwd=ROOT)


@pytest.mark.slow
def test_tune_measures_the_top_plans_and_writes_the_fastest(tmp_path) -> None:
    from hetplan.plan.file import read_plan_file
    from hetplan.app.tune import read_measurements

    out = str(tmp_path / "best.json")
    proc = _hetplan("tune", "--model", "tiny-gpt", "--cluster", "local-cpu-2", "--top-k", "2", "--steps", "2",
                    "--warmup", "1", "-o", out)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "trial 1/2: " in proc.stderr and "trial 2/2: " in proc.stderr, proc.stderr
    assert "best by measurement: " in proc.stdout, proc.stdout
    trials = read_measurements(str(tmp_path / "best.measurements.json"))
    assert len(trials) == 2
    ok = [t for t in trials if t.ok]
    assert ok, [t.status for t in trials]
    for t in ok:
        assert t.device == "cpu" and len(t.measured_step_times_s) == 2 and t.measured_step_s > 0
        assert t.measured_peak_memory_bytes and t.measured_peak_memory_bytes > 10 * 2**20  # RSS: torch alone
    fastest = min(ok, key=lambda t: t.measured_step_s)
    plan_file = read_plan_file(out)
    assert plan_file.plan(1) == fastest.plan
    assert len({t.plan.describe() for t in trials}) == 2  # two different kinds of plan
    proc = _hetplan("estimate", out)
    assert proc.returncode == 0, proc.stderr
    assert fastest.plan.describe() in proc.stdout
