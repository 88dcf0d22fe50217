"""``hetplan.app``: planning and costing from Python give what the command
line prints and writes for the same inputs (the CLI is a thin layer over the
same calls), and one plan's report says the same in text and in HTML."""

from __future__ import annotations

import html
import json
import re
from pathlib import Path
from typing import Any

import pytest

import hetplan.app as app
from hetplan.cli import main
from hetplan.errors import HetplanError
from hetplan.plan.spec import Plan
from hetplan.report.text import estimate_text, plan_text

SEARCH_TIME = re.compile(r"searched in \d+\.\d+ s")


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """stdout of ``hetplan ARGV`` run here, less its ``wrote PATH`` lines and its search time."""
    capsys.readouterr()
    assert main(list(argv)) == 0
    out = capsys.readouterr().out
    return SEARCH_TIME.sub("searched in -", "\n".join(line for line in out.splitlines()
                                                      if not line.startswith("wrote ")))


def _as_written(record: dict[str, Any]) -> dict[str, Any]:
    """``record`` as its JSON file reads back (lists for tuples), less the search time."""
    return {k: v for k, v in json.loads(json.dumps(record)).items() if k != "search_time_s"}


# model, cluster, batch ("auto": the planner chooses), planner, target: the default target, a named
# tool (the record adds what the restriction cost) and a planner that searches the batch size
PLANS = [("gpt3-1.3b", "metis-t4-v100-16", 64, "auto", None),
         ("tiny-llama-bf16", "8xH100", 64, "auto", "megatron"),
         ("tiny-gpt", "local-cpu-4", "auto", "galvatron", None)]


@pytest.mark.parametrize("model, cluster, batch, planner, target", PLANS)
def test_plan_from_python_is_what_the_cli_prints_and_writes(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                            model: str, cluster: str, batch: int | str,
                                                            planner: str, target: str | None) -> None:
    path = tmp_path / "plan.json"
    argv = ["plan", "--model", model, "--cluster", cluster, "--global-batch", str(batch), "--planner", planner,
            "--top", "3", "--tokens", "300B", "--price-per-gpu-hour", "2", "--json", str(path)]
    printed = _cli(capsys, *argv, *(["--target", target] if target else []))
    result = app.plan(model=model, cluster=cluster, global_batch=batch, planner=planner, top=3, target=target,
                      tokens=300e9, prices={"*": 2.0})
    written = json.loads(path.read_text())
    assert _as_written(result.record()) == _as_written(written)
    assert ("best_overall" in written) == (target is not None)
    assert SEARCH_TIME.sub("searched in -", plan_text(result.report)) == printed
    assert Plan.from_dict(written["plans"][0]["plan"]) == result.best.plan


def test_estimate_from_python_is_what_the_cli_prints_and_writes(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "estimate.json"
    printed = _cli(capsys, "estimate", "--model", "gpt2-amp", "--cluster", "16xA100-80GB", "--global-batch", "64",
                   "--tp", "2", "--pp", "2", "--dp", "4", "--micro-batch", "2", "--recompute", "selective",
                   "--memory-limit", "40GB", "--json", str(path))
    setting = app.UniformSetting(dp=4, tp=2, pp=2, micro_batch=2, recompute="selective")
    result = app.estimate(setting, model="gpt2-amp", cluster="16xA100-80GB", global_batch=64, memory_limit="40GB")
    assert _as_written(result.record()) == _as_written(json.loads(path.read_text()))
    assert estimate_text(result.report) == printed
    # the plan file it wrote, costed again: from Python and by 'hetplan estimate FILE'
    again = app.estimate(str(path))
    assert estimate_text(again.report) == _cli(capsys, "estimate", str(path)) == printed


def test_python_options_are_checked_as_the_cli_checks_them() -> None:
    with pytest.raises(HetplanError, match="global_batch takes a number of samples or 'auto'"):
        app.plan(model="tiny-gpt", cluster="local-cpu-2", global_batch="lots")
    with pytest.raises(HetplanError, match="does not search the batch size"):
        app.plan(model="tiny-gpt", cluster="local-cpu-2", global_batch="auto", planner="uniform")
    with pytest.raises(HetplanError, match="--virtual-stages needs --schedule interleaved-1f1b"):
        app.estimate(app.UniformSetting(dp=2, tp=1, pp=2, micro_batch=1, virtual_stages=2), model="tiny-gpt",
                     cluster="local-cpu-4", global_batch=8)


def test_the_html_page_says_what_estimate_prints(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """One report, two renderers: the page holds the step-time breakdown (with
    the CP/EP label of an expert-parallel plan) and the notes on the model
    (fine-grained experts) exactly as ``hetplan estimate`` prints them."""
    path, page = tmp_path / "moe.json", tmp_path / "moe.html"
    printed = _cli(capsys, "estimate", "--model", "deepseek-v2-lite", "--cluster", "16xH100", "--global-batch", "64",
                   "--tp", "1", "--pp", "2", "--dp", "8", "--ep", "4", "--micro-batch", "1", "--zero", "1",
                   "--json", str(path))
    _cli(capsys, "report", str(path), "-o", str(page))
    text = html.unescape(page.read_text(encoding="utf-8"))
    breakdown = printed.split("\n\n")[2]
    assert breakdown.startswith("time goes to") and "(+ CP K/V, EP all-to-all)" in breakdown
    notes = [line.removeprefix("note: ") for line in printed.splitlines() if line.startswith("note: ")]
    assert notes and "fine-grained" in notes[0]
    for expected in (breakdown, *notes):
        assert expected in text, expected
