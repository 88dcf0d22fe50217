"""Every listed plan says which code runs it, and each tool that cannot run the
best is pointed to the listed plan it runs or to --target (issue 33, item 1)."""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import pytest

from hetplan.cli import main

from hetplan.cluster.presets import get_cluster
from hetplan.cost.model import CostModel
from hetplan.export.target import runners
from hetplan.model.presets import get_model
from hetplan.plan.spec import LayerStrategy, RankedPlan
from hetplan.plan.workload import Workload
from hetplan.report.runs import best_per_tool_lines, runs_on_cell
from hetplan.report.text import ranked_table
from hetplan.search.baselines.uniform import uniform_plan


def test_a_uniform_plan_runs_everywhere_and_a_mixed_one_only_on_hetplan() -> None:
    workload = Workload(get_model("llama3-8b"), get_cluster("8xH100"), 16)
    uniform = uniform_plan(workload, 8, 1, 1, 2, zero=0, recompute="full")
    stage = uniform.stages[0]
    mixed_rc = (LayerStrategy(recompute="full"),) * 9 + (LayerStrategy(),) * (stage.num_layers - 9)
    mixed = replace(uniform, stages=(replace(stage, strategies=mixed_rc),))
    started = time.process_time()
    codes = [runners(uniform, workload), runners(mixed, workload)]
    assert time.process_time() - started < 1.0  # cheap enough for every listed plan
    assert codes[0] == ("hetplan", "torchtitan", "megatron", "deepspeed") and codes[1] == ("hetplan",)
    cost = CostModel(workload)
    ranked = [RankedPlan(mixed, cost.estimate(mixed)), RankedPlan(uniform, cost.estimate(uniform))]
    assert [runs_on_cell(c) for c in codes] == ["HTMD", "H"]
    assert ranked_table(ranked, runs_on=codes[::-1]).splitlines()[2].endswith(" H")
    lines = best_per_tool_lines(ranked, codes[::-1], (1, 2))
    ratio = ranked[1].estimate.iteration_time_s / ranked[0].estimate.iteration_time_s
    assert lines[0] == (f"torchtitan runs plan #2 at {ratio:.2f}x the step time of #1 "
                        "(hetplan plan --target torchtitan may find a faster one)")
    assert len(lines) == 3 and all("--target" in line for line in lines)


def test_export_refusal_names_the_target(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "p.json"
    assert main(["plan", "--top", "2", "--json", str(path)]) == 0  # the demo's best plans: per-stage tp, hetplan only
    capsys.readouterr()
    assert main(["export", str(path), "--format", "megatron"]) == 2
    error = capsys.readouterr().err.strip()
    assert error.endswith("make plans Megatron-LM runs with 'hetplan plan ... --target megatron'")
    assert error.count("\n") == 0


def test_compare_says_where_each_planners_best_runs(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["compare", "--planners", "uniform"]) == 0
    out = capsys.readouterr().out.splitlines()
    head = out.index(next(line for line in out if line.startswith("planner ")))
    assert "runs on" in out[head] and out[-1].startswith("runs on: H hetplan's runtime")
    column = out[head].index("runs on")
    assert out[head + 2][column:column + 7].strip() in {"H", "HT", "HM", "HD", "HTM", "HTD", "HMD", "HTMD"}
