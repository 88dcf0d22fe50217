"""Plan labels say what the plan does: partial recompute, per-layer tp; token
counts as people say them (issue 33, item 4)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from hetplan.cli import main

from hetplan.plan.layout import PlanLayout
from hetplan.plan.spec import LayerStrategy, Plan, uniform_stage
from hetplan.report.training import training_lines


def _plan_with(strategies: tuple[LayerStrategy, ...]) -> Plan:
    stage = replace(uniform_stage(range(len(strategies)), [0, 1, 2, 3], 1, 4, 1), strategies=strategies)
    return Plan("tiny-gpt", "local-cpu-4", 2, 1, 2, "1f1b", (stage,))


def test_partial_recompute_is_counted_not_called_full() -> None:
    partial = (LayerStrategy(recompute="full"),) * 9 + (LayerStrategy(),) * 17
    label = _plan_with(partial).describe()
    assert " rc:9/26" in label and "rc:full" not in label
    assert " rc:full " in _plan_with((LayerStrategy(recompute="full"),) * 26).describe()
    mixed = (LayerStrategy(recompute="selective"),) * 4 + (LayerStrategy(),) * 22
    assert " rc:selective:4/26" in _plan_with(mixed).describe()


def test_per_layer_tp_is_shown() -> None:
    layers = (LayerStrategy(tp=2),) * 3 + (LayerStrategy(),) * 2
    assert " ltp 2×3/4/4 " in _plan_with(layers).describe()
    assert "ltp" not in _plan_with((LayerStrategy(),) * 5).describe()


def test_tokens_are_printed_with_a_unit() -> None:
    numbers = {"gpu_hours_per_billion_tokens": 1.0, "tokens_per_step": 1.0, "gpus": 8.0,
               "tokens": 1e12, "steps": 10.0, "days": 1.0, "gpu_hours": 2.0}
    assert training_lines(numbers)[-1].startswith("1T tokens: ")


def test_plan_output_explains_itself_once(capsys: pytest.CaptureFixture[str]) -> None:
    """The demo's wordings: the notation legend once, the bound once as '% above',
    CPU processes not GPUs, no 'a amp-space'."""
    assert main(["plan", "--model", "tiny-gpt", "--cluster", "local-cpu-4", "--global-batch", "8"]) == 0
    out = capsys.readouterr().out
    assert out.count("plan notation:") == 1 and "docs/report.md#plan-notation" in out
    assert out.count("lower bound") == 2  # the explanation's line and auto's note, which gives no second number
    assert "% above the lower bound" in out and "within" not in out.split("lower bound")[0].splitlines()[-1]
    assert "(4 CPU processes)" in out and "a amp-space" not in out


def test_readme_commands_paste_as_they_read() -> None:
    """A `|` in a README command line is a shell pipe when pasted: one choice per command line."""
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    commands = [line for line in readme.splitlines() if line.startswith(".venv/bin/hetplan")]
    assert commands and not [line for line in commands if "|" in line.split("#")[0]]


def test_the_training_header_says_the_plans_zero_and_schedule() -> None:
    """A one-stage 'z2 ... 1f1b' plan runs its micro-batches in order (gpipe): the
    header says so and keeps ZeRO-2, rather than a bare 'gpipe' with no ZeRO."""
    stage = uniform_stage(range(3), [0, 1], 2, 1, 4, zero=2)
    plan = Plan("tiny-gpt", "local-cpu-2", 8, 4, 2, "1f1b", (stage,))
    header = PlanLayout.from_plan(plan, ["embed", "block", "head"]).describe()
    assert "gpipe (plan: 1f1b; one stage runs micro-batches in order) zero=2 micro-batches=2" in header
