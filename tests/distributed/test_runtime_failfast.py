"""An ill-fitting plan fails fast on every rank with one clear message, and nothing hangs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import replace

from hetplan.plan.spec import uniform_stage
from rt_helpers import build_worker, make_plan, run_raw, write_plan

LIMIT_S = 90.0  # far below any collective timeout a hang would hit


def _all_fail_with(results, *needles: str) -> str:
    errors = [r.error for r in results]
    assert all(r.exitcode not in (0, None) for r in results), [(r.rank, r.exitcode, r.error) for r in results]
    for e in errors:
        assert all(n in e for n in needles), errors
        assert "HetplanError" in e or "PlanNotSupportedError" in e or "InvalidPlanError" in e, errors
    return errors[0]


def _run(plan, world: int, tmp_path, *args):
    t0 = time.monotonic()
    results = run_raw(build_worker, world, write_plan(tmp_path, plan), *args, timeout_s=LIMIT_S)
    assert time.monotonic() - t0 < LIMIT_S
    return results


def test_world_size_differs_from_plan(tmp_path) -> None:
    results = _run(make_plan(dp=2, micro=2), 3, tmp_path)
    msg = _all_fail_with(results, "runs on 2 processes", "3 were started")
    assert "\n" not in msg


def test_module_name_missing_from_model(tmp_path) -> None:
    results = _run(make_plan(pp=2, micro=2), 2, tmp_path, "three-blocks")
    _all_fail_with(results, "'layers.3'", "is not a module of the model")


def test_heads_not_divisible_by_tp(tmp_path) -> None:
    # caught from the ModelSpec before any process group exists ...
    results = _run(make_plan(tp=3, micro=1, cluster="local-cpu-3"), 3, tmp_path)
    _all_fail_with(results, "tp=3 does not divide the 4 attention heads")
    # ... and from the module itself when the model does not match its spec (every rank, also
    # the stage that holds no attention layer)
    results = _run(make_plan(tp=2, pp=2, micro=2, split=[range(0, 1), range(1, 6)]), 4, tmp_path, "three-heads")
    _all_fail_with(results, "tp=2 does not divide the 3 attention heads of layer 'layers.0'")


def test_heterogeneous_plan_with_sequence_parallelism_is_rejected(tmp_path) -> None:
    plan = make_plan(pp=2, micro=2)
    s0, s1 = plan.stages
    plan = replace(plan, cluster="local-cpu-3", stages=(s0, uniform_stage(s1.layers, [1, 2], 1, 2, 2, 0, "none", True)))
    results = _run(plan, 3, tmp_path)
    _all_fail_with(results, "sequence parallelism in a plan whose stages differ")


def test_changing_batch_shape_under_pipelining_fails_instead_of_hanging(tmp_path) -> None:
    results = _run(make_plan(pp=2, micro=2), 2, tmp_path, "preset", 2, True)
    _all_fail_with(results, "batch shapes changed")


def test_cli_rejects_bad_plan_with_one_line(tmp_path) -> None:
    path = write_plan(tmp_path, make_plan(tp=3, micro=1, cluster="local-cpu-3"))
    env = {**os.environ, "PYTHONPATH": os.path.join(os.path.dirname(__file__), "..", "..", "src")}
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "hetplan.cli", "train", "--plan", path, "--steps", "1"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("hetplan: error: "), proc.stderr
    assert "does not divide the 4 attention heads" in lines[0]
    assert "Traceback" not in proc.stderr + proc.stdout
    assert time.monotonic() - t0 < 60
    json.loads(open(path).read())
