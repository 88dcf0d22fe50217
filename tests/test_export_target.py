"""``hetplan plan/compare --target TOOL``: the ranking keeps only plans the
tool can run (the export itself decides: ``hetplan.export.tools.exportable``), and
says how much slower the best of them is than the best plan overall;
``hetplan export --index K`` exports the K-th plan of a ranked file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hetplan.cli import load_workload, build_parser, main
from hetplan.errors import HetplanError
from hetplan.export.tools import TARGETS, exportable, render
from hetplan.plan.file import read_plan_file
from hetplan.search import get_planner
from hetplan.export.target import candidate_count, plans_for_target, slowdown

LLAMA = ["--model", "llama3-8b", "--cluster", "64xH100", "--global-batch", "512"]
HETERO = ["--model", "gpt3-1.3b", "--cluster", "metis-p100-v100-16", "--global-batch", "64"]


def _plan_json(tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str]) -> tuple[dict, str, Path]:
    path = tmp_path / "plans.json"
    code = main(["plan", *argv, "--quiet", "--json", str(path)])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return json.loads(path.read_text()), captured.out, path


def _version(argv: list[str]) -> str:
    return argv[argv.index("--torchtitan-version") + 1] if "--torchtitan-version" in argv else "0.3"


def _check_target_file(data: dict, path: Path, tool: str, version: str = "0.3") -> None:
    """Every plan of the file exports; the slowdown is the ratio of predicted
    step times; the best plan overall is what the tool refuses, or the best."""
    pf = read_plan_file(path)  # the --target keys are part of the plan file
    model, cluster = pf.model, pf.cluster
    assert data["target"] == tool and pf.plans
    exports = set()
    for k, plan in enumerate(pf.plans, 1):
        result = render(plan, model, tool, cluster, version)  # raises if the tool cannot run it
        exports.add((result.text, tuple(sorted(result.files.items()))))
    assert len(exports) == len(pf.plans)  # no plan twice under another name
    best_s = data["plans"][0]["estimate"]["iteration_time_s"]
    overall = data["best_overall"]
    overall_s = overall["estimate"]["iteration_time_s"]
    assert data["slowdown"] >= 0
    assert data["slowdown"] == pytest.approx(best_s / overall_s - 1, rel=1e-12, abs=1e-15)
    assert all(p["estimate"]["iteration_time_s"] >= best_s for p in data["plans"])
    from hetplan.plan.spec import Plan

    refusal = exportable(Plan.from_dict(overall["plan"]), model, tool, cluster, version)
    assert overall["refusal"] == refusal
    assert (refusal == "") == (data["slowdown"] == 0)
    assert data["target_notes"]


@pytest.mark.parametrize("tool", TARGETS)
def test_target_keeps_only_plans_the_tool_runs(tool, tmp_path, capsys):
    data, out, path = _plan_json(tmp_path, capsys, [*LLAMA, "--target", tool])
    _check_target_file(data, path, tool)
    line = next(l for l in out.splitlines() if l.startswith("best plan "))
    assert "can run:" in line and "s/step" in line
    assert ("slower than the best plan overall" in line and "not exportable:" in line) or "(0.0% slower)" in line
    if data["best_overall"]["refusal"]:
        assert f"{100 * data['slowdown']:.1f}% slower" in line


def test_megatron_on_64_h100_costs_its_zero_2(tmp_path, capsys):
    """The best plan overall shards gradients (ZeRO-2), which Megatron-LM's
    distributed optimizer does not: the best Megatron plan is slower."""
    data, out, _ = _plan_json(tmp_path, capsys, [*LLAMA, "--target", "megatron"])
    assert data["slowdown"] > 0 and "ZeRO-2" in data["best_overall"]["refusal"]
    assert all(s["strategies"][0]["zero"] in (0, 1) for p in data["plans"] for s in p["plan"]["stages"])


def test_torchtitan_0_2_refuses_what_0_3_runs(tmp_path, capsys):
    argv = [*LLAMA, "--target", "torchtitan", "--torchtitan-version", "0.2"]
    data, _, path = _plan_json(tmp_path, capsys, argv)
    assert data["torchtitan_version"] == "0.2"
    _check_target_file(data, path, "torchtitan", "0.2")


@pytest.mark.parametrize("tool", TARGETS)
def test_heterogeneous_cluster_gives_an_exportable_plan_or_one_clear_line(tool, tmp_path, capsys):
    path = tmp_path / "plans.json"
    code = main(["plan", *HETERO, "--target", tool, "--quiet", "--json", str(path)])
    captured = capsys.readouterr()
    if code == 2:
        assert captured.err.startswith("hetplan: error: no plan") and captured.err.count("\n") == 1
        return
    assert code == 0, captured.err
    data = json.loads(path.read_text())
    _check_target_file(data, path, tool)
    # the heterogeneity-aware best plan is refused (one (dp, tp) per stage, even splits): a real slowdown
    assert data["best_overall"]["refusal"]


def test_no_plan_the_tool_runs_is_one_line(capsys):
    assert main(["plan", "--model", "bert-huge-32", "--cluster", "galvatron-8x-titan", "--global-batch", "32",
                 "--target", "megatron", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("hetplan: error: no plan Megatron-LM can run")
    assert "family 'bert'" in err


def test_falls_back_to_uniform_when_no_planner_plan_runs():
    """torchtitan splits only its own (Llama) models into stages and runs one
    (dp, tp): none of Metis's plans for GPT-3 on a mixed cluster, so the
    uniform planner's plans stand in, and the note says so."""
    args = build_parser().parse_args(["plan", *HETERO])
    workload = load_workload(args)
    ranked = get_planner("metis").plan(workload, candidate_count(2))
    assert all(exportable(r.plan, workload.model, "torchtitan", workload.cluster) for r in ranked)
    for mode in ("merge", "fallback"):
        result = plans_for_target(ranked, workload, "torchtitan", 2, "metis", mode)
        assert result.source == "uniform" and all(r.plan.planner == "uniform" for r in result.plans)
        assert "can run none of metis's" in result.notes[0] and "uniform planner's" in result.notes[0]
        assert result.best_overall is ranked[0] and result.slowdown == pytest.approx(
            result.best.estimate.iteration_time_s / ranked[0].estimate.iteration_time_s - 1)
        assert not any(exportable(r.plan, workload.model, "torchtitan", workload.cluster) for r in result.plans)


def test_fallback_mode_keeps_the_planners_own_plans():
    args = build_parser().parse_args(["plan", *LLAMA])
    workload = load_workload(args)
    ranked = get_planner("auto").plan(workload, candidate_count(1))
    result = plans_for_target(ranked, workload, "megatron", 1, "auto", "fallback")
    assert result.source == "auto" and any(result.best is r for r in ranked)
    with pytest.raises(HetplanError, match="unknown target"):
        plans_for_target(ranked, workload, "modules", 1, "auto")


def test_slowdown_compares_time_per_sample_when_batches_differ():
    from dataclasses import replace

    args = build_parser().parse_args(["plan", "--model", "tiny-llama-bf16", "--cluster", "8xH100",
                                      "--global-batch", "16"])
    workload = load_workload(args)
    fast = get_planner("uniform").plan(workload, 1)[0]
    assert slowdown(fast, fast) == 0
    double = replace(fast, plan=replace(fast.plan, global_batch_size=32))  # same step time, twice the samples
    assert slowdown(fast, double) == pytest.approx(1.0)


def test_compare_target(tmp_path, capsys):
    path = tmp_path / "compare.json"
    assert main(["compare", *LLAMA, "--planners", "auto,uniform,megatron", "--target", "torchtitan",
                 "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "target   torchtitan" in out and "vs own best" in out
    rows = json.loads(path.read_text())
    args = build_parser().parse_args(["plan", *LLAMA])
    workload = load_workload(args)
    from hetplan.plan.spec import Plan

    for row in rows:
        assert row["target"] == "torchtitan" and row["slowdown"] >= 0 and row["source"]
        plan = Plan.from_dict(row["plan"])
        assert exportable(plan, workload.model, "torchtitan", workload.cluster) == ""
        best = row["best_overall"]
        assert row["slowdown"] == pytest.approx(row["iteration_time_s"] / best["estimate"]["iteration_time_s"] - 1)
        assert best["refusal"] == exportable(Plan.from_dict(best["plan"]), workload.model, "torchtitan",
                                             workload.cluster)


def test_export_index_picks_the_kth_plan(tmp_path, capsys):
    """'hetplan export --index K' exports the K-th plan of a ranked file (here
    one made with --target, whose plans all export)."""
    _, _, path = _plan_json(tmp_path, capsys, [*LLAMA, "--target", "megatron", "--top", "3"])
    pf = read_plan_file(path)
    assert len(pf.plans) == 3
    texts = []
    for k in (1, 2, 3):
        assert main(["export", str(path), "--format", "megatron", "--index", str(k)]) == 0
        out = capsys.readouterr().out
        expected = render(pf.plan(k), pf.model, "megatron", pf.cluster).text
        assert expected in out
        texts.append(expected)
    assert len(set(texts)) == 3
    assert main(["export", str(path), "--format", "megatron", "--index", "4"]) == 2
    assert "use --index 1..3" in capsys.readouterr().err


def test_plan_without_target_is_for_the_runtime_and_unchanged(tmp_path, capsys):
    data, out, _ = _plan_json(tmp_path, capsys, ["--model", "tiny-llama-bf16", "--cluster", "8xH100",
                                                 "--global-batch", "16"])
    assert "target" not in data and "best_overall" not in data and "best plan " not in out
    assert data["settings"]["target"] == "hetplan"  # plans for hetplan's runtime (hetplan.export.target.plan_target)


def test_megatron_target_searches_zero_1_and_interleaving():
    """Planning Mixtral-8x7B for Megatron-LM on 64 H100: the uniform plans the
    tool runs include its distributed optimizer (ZeRO-1) and virtual pipeline
    (interleaved 1F1B), so the best is at least as fast as NeMo's own recipe
    for it (tp1 pp4 ep8, 8 virtual stages, distributed optimizer) costed the
    same way, and Megatron-LM runs it."""
    from hetplan.cluster.presets import get_cluster
    from hetplan.cost.model import CostModel
    from hetplan.plan.workload import Workload
    from hetplan.model.presets import get_model
    from hetplan.search.baselines.uniform import uniform_plan
    from hetplan.export.target import uniform_plans_for

    workload = Workload(get_model("mixtral-8x7b"), get_cluster("64xH100"), 256, attention_kernel="cudnn")
    ranked, can, total = uniform_plans_for(workload, "megatron", 3)
    assert 0 < can < total
    plans = [r.plan for r in ranked]
    assert exportable(plans[0], workload.model, "megatron", workload.cluster) == ""
    nemo = uniform_plan(workload, 16, 1, 4, 1, zero=1, schedule="interleaved-1f1b", virtual_stages=8, ep=8)
    assert exportable(nemo, workload.model, "megatron", workload.cluster) == ""
    recipe_s, fits = CostModel(workload).quick(nemo)
    assert fits and ranked[0].estimate.iteration_time_s <= recipe_s
    assert any(p.schedule == "interleaved-1f1b" for p in plans) and \
        any(st.zero == 1 for p in plans for s in p.stages for st in s.strategies)
