"""hetplan's step-time predictions for its own runtime against what it
measured on one H100 (benchmarks/data/h100/h100-runs.json: ``hetplan train``
step times, and a ``hetplan profile`` of the same GPU, prof_g13.json),
docs/cost-model.md "Time of hetplan's runtime".

Issue 29's targets: median |error| <= 10%, every run within 20%, the
gpt3-1.3b plans in the measured order (Spearman >= 0.9), and the profile-based
estimates within 10%. The full-recomputation run C_g13_rc met the 20% bound once
the model reran only what torch's checkpoint reruns (its early stop skips each
block's last matmul and the LM head; the loss is outside the checkpoint), and
the profiled rows met 10% once the loss, which the profile's head leaves out,
was added to a measured head. The compiled run (``hetplan train --compile``) is
costed from inductor's fused kernels (``runtime_time(compiled=True)``) and held
to the same bounds; it was not predicted at all before."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from hetplan.app.estimate import UniformSetting, estimate
from hetplan.app.planning import plan

DATA = Path(__file__).resolve().parent.parent / "benchmarks" / "data" / "h100"
RUNS = json.loads((DATA / "h100-runs.json").read_text())
MEDIAN_TOLERANCE = 0.10  # issue 29
MAX_TOLERANCE = 0.20  # issue 29
PROFILE_TOLERANCE = 0.10  # issue 29
RANK_AGREEMENT = 0.9  # Spearman within the gpt3-1.3b workload, issue 29
# the recorded plans without recomputation, by micro-batch size (h100-runs.json "what")
RECORDED_MICRO_BATCH = {"A_g13_mb8": 8, "B_g13_mb4": 4, "B2_g13_mb2": 2}
# B2_g13_mb2 was a tune trial: its plan is the CLI's uniform one
UNIFORM = {"B2_g13_mb2": UniformSetting(dp=1, tp=1, pp=1, micro_batch=2)}


def _measured(run: dict) -> float | None:
    m = run["measured"]
    return m.get("median_step_s_after_2") or m.get("median_step_s")


def _predicted(run: dict, **settings: object) -> float:
    if run["name"] in UNIFORM:
        result = estimate(UNIFORM[run["name"]], model="gpt3-1.3b", cluster="1xH100", global_batch=16, **settings)
    else:
        result = estimate(DATA / run["plan_file"], **settings)
    return result.ranked.estimate.iteration_time_s


# ``hetplan train --compile`` of A_g13_mb8's plan (h100-runs.json "yardsticks"), costed with --compile
COMPILED = {"A_g13_mb8_compiled": ("A_g13_mb8", "hetplan_train_compile_A_g13_mb8")}


def _compiled_runs() -> dict[str, tuple[float, float]]:
    """(predicted, measured) seconds of the compiled runs (``COMPILED``)."""
    found = {}
    for name, (plan_run, record) in COMPILED.items():
        run = next(r for r in RUNS["runs"] if r["name"] == plan_run)
        found[name] = (_predicted(run, compile=True), RUNS["yardsticks"][record]["median_step_s_after_2"])
    return found


@pytest.fixture(scope="module")
def errors() -> dict[str, tuple[float, float]]:
    """(predicted, measured) seconds of every run that trained, eager and compiled."""
    eager = {r["name"]: (_predicted(r), _measured(r)) for r in RUNS["runs"] if _measured(r) is not None}
    return {**eager, **_compiled_runs()}


def _relative(pair: tuple[float, float]) -> float:
    return pair[0] / pair[1] - 1.0


def test_median_error(errors):
    table = {name: f"{_relative(p):+.1%}" for name, p in errors.items()}
    assert np.median([abs(_relative(p)) for p in errors.values()]) <= MEDIAN_TOLERANCE, table


def test_gpt3_plans_in_measured_order(errors):
    """Spearman's rank correlation of predicted and measured step time over the gpt3-1.3b runs
    (the compiled one included: it must rank first, as it measured)."""
    pairs = [p for name, p in errors.items() if "g13" in name]
    predicted = np.argsort(np.argsort([p[0] for p in pairs]))
    measured = np.argsort(np.argsort([p[1] for p in pairs]))
    n = len(pairs)
    spearman = 1.0 - 6.0 * float(((predicted - measured) ** 2).sum()) / (n * (n * n - 1))
    assert n == 5 and spearman >= RANK_AGREEMENT


def test_every_run_within_max_error(errors):
    table = {name: f"{_relative(p):+.1%}" for name, p in errors.items()}
    assert max(abs(_relative(p)) for p in errors.values()) <= MAX_TOLERANCE, table


def test_profile_based_estimates():
    profile = str(DATA / RUNS["profile"]["file"])
    for name in RUNS["profile"]["estimates_with_profile_s"]:
        run = next(r for r in RUNS["runs"] if r["name"] == name)
        assert _predicted(run, profile=profile) == pytest.approx(_measured(run), rel=PROFILE_TOLERANCE), name


def test_fresh_plan_ranks_the_recorded_plans_in_measured_order(errors):
    """``hetplan plan`` for the recorded workload (docs/cost-model.md "Time of
    hetplan's runtime"): its first plan is 16 x 1 without recomputation
    (unmeasured; predicted to fit), the recorded plans it lists follow in the
    measured order, and the recomputing 16 x 1 (C_g13_rc) is not listed: the
    same plan fits without recomputation, which is faster."""
    ranked = plan("gpt3-1.3b", "1xH100", 16, top=10, replay=0).plans
    settings = [(r.plan.micro_batch_size, {s.recompute for st in r.plan.stages for s in st.strategies})
                for r in ranked]
    assert settings[0] == (16, {"none"}) and ranked[0].estimate.fits
    by_size = {size: name for name, size in RECORDED_MICRO_BATCH.items()}
    listed = [by_size[size] for size, recompute in settings if size in by_size and recompute == {"none"}]
    assert len(listed) >= 2 and listed == sorted(listed, key=lambda name: errors[name][1])
    assert all(recompute == {"none"} for _, recompute in settings)
