"""hetplan's memory predictions for its own runtime against what it measured
on one H100 (benchmarks/data/h100: ``hetplan train`` peaks, out-of-memory
runs, the memory the card reported). The prediction compared is the peak
less ``FRAMEWORK_OVERHEAD_BYTES`` (CUDA context, workspaces, allocator
slack), which ``torch.cuda.max_memory_allocated`` does not count."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hetplan.cli import main
from hetplan.cluster.io import load_cluster
from hetplan.cost.model import CostModel
from hetplan.plan.workload import Workload
from hetplan.cost.constants import (
    FRAMEWORK_OVERHEAD_BYTES, OPTIMIZER_STATE_BYTES, OPTIMIZER_STEP_TEMPORARIES, RUNTIME_OPTIMIZER, RUNTIME_STATE_BYTES,
)
from hetplan.model.load import load_model
from hetplan.search.baselines.uniform import uniform_plan
from hetplan.units import GIB

DATA = Path(__file__).resolve().parent.parent / "benchmarks" / "data" / "h100"
# The runs of the table (hetplan at 5127f53): within 10%. C_g13_rc then
# held its weight copies for the whole step (data README), 2 bytes a parameter
# more than today's runtime: it is the one far from 0.
RECORDED_TOLERANCE = 0.10
# The runs of today's runtime (runtime-runs.json), predicted before they ran: within 3%.
CURRENT_TOLERANCE = 0.03
# B2_g13_mb2 was a tune trial: its plan is the CLI's uniform one
RECORDED_ARGS = {"B2_g13_mb2": ["--model", "gpt3-1.3b", "--micro-batch", "2"]}


def _estimate(args: list[str], tmp_path: Path) -> dict:
    out = tmp_path / "estimate.json"
    assert main(["estimate", *args, "--json", str(out)]) == 0
    return json.loads(out.read_text())["plans"][0]["estimate"]


def _allocated_gib(estimate: dict) -> float:
    return (estimate["max_memory_bytes"] - FRAMEWORK_OVERHEAD_BYTES) / GIB


def _uniform_args(args: list[str]) -> list[str]:
    return ["--cluster", "1xH100", "--global-batch", "16", "--tp", "1", "--pp", "1", "--dp", "1",
            *[str(DATA / a) if a.endswith(".json") else a for a in args]]


@pytest.mark.parametrize("run", [r["name"] for r in json.loads((DATA / "h100-runs.json").read_text())["runs"]])
def test_recorded_runs(run, tmp_path, capsys):
    """Every measured peak of the issue's table within 10%, and both runs that
    ran out of memory predicted not to fit the memory the card reports."""
    entry = next(r for r in json.loads((DATA / "h100-runs.json").read_text())["runs"] if r["name"] == run)
    args = _uniform_args(RECORDED_ARGS[run]) if run in RECORDED_ARGS else [str(DATA / entry["plan_file"])]
    estimate = _estimate(args, tmp_path)
    capsys.readouterr()
    measured = entry["measured"].get("peak_memory_gib")
    if measured is None:
        assert "out of memory" in entry["measured"]["outcome"]
        assert not estimate["fits"]
        assert estimate["memory_capacity_bytes"]["0"] == pytest.approx(79.18 * GIB, rel=1e-3)
    else:
        assert estimate["fits"]
        assert _allocated_gib(estimate) == pytest.approx(measured, rel=RECORDED_TOLERANCE)


@pytest.fixture(scope="module")
def llama1b():
    return load_model(str(DATA / "llama1b.json"), seq_len=2048)


CURRENT = json.loads((DATA / "runtime-runs.json").read_text())


@pytest.mark.parametrize("run", [r["name"] for r in CURRENT["runs"]])
def test_current_runtime_runs(run, llama1b):
    """The runs of today's runtime, SGD, selective and full recomputation and a
    second GPT size among them, within 3%."""
    entry = next(r for r in CURRENT["runs"] if r["name"] == run)
    args = dict(zip(entry["args"][::2], entry["args"][1::2]))
    model = llama1b if args["--model"] == "llama1b.json" else load_model(args["--model"])
    workload = Workload(model, load_cluster("1xH100"), 16, target="hetplan",
                        optimizer="sgd-fp32" if entry["optimizer"] == "sgd" else "")
    plan = uniform_plan(workload, 1, 1, 1, int(args["--micro-batch"]), recompute=args.get("--recompute", "none"))
    estimate = CostModel(workload).estimate(plan)
    predicted = (estimate.peak_memory_bytes[0] - FRAMEWORK_OVERHEAD_BYTES) / GIB
    assert predicted == pytest.approx(entry["peak_memory_gib"], rel=CURRENT_TOLERANCE)


def test_capacity_is_what_the_card_reports():
    workload = Workload(load_model("gpt3-1.3b"), load_cluster("1xH100"), 16, target="hetplan")
    assert workload.device_capacity_bytes(0) == pytest.approx(CURRENT["device"]["total_memory_gib"] * GIB, abs=1)


def test_best_llama_plan_fits(tmp_path, capsys):
    """The planner's best plan for the Llama-3.2-1B-class model on one H100 is
    predicted to fit, and is neither of the two that ran out of memory."""
    out = tmp_path / "plans.json"
    assert main(["plan", "--model", str(DATA / "llama1b.json"), "--seq-len", "2048", "--cluster", "1xH100",
                 "--global-batch", "16", "--json", str(out)]) == 0
    capsys.readouterr()
    best = json.loads(out.read_text())["plans"][0]
    stage = best["plan"]["stages"][0]
    assert best["estimate"]["fits"]
    recompute = {s["recompute"] for s in stage["strategies"]}
    assert not (recompute == {"none"} and best["plan"]["micro_batch_size"] >= 8)


def test_every_optimizer_names_a_runtime_optimizer():
    """Any optimizer a plan names is costed as one the runtime runs (AdamW or
    SGD with momentum), with its fp32 states."""
    assert set(RUNTIME_OPTIMIZER) == set(OPTIMIZER_STATE_BYTES)
    assert set(RUNTIME_OPTIMIZER.values()) == set(RUNTIME_STATE_BYTES) == set(OPTIMIZER_STEP_TEMPORARIES)
