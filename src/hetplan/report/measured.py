"""Measured against predicted, as text: ``hetplan tune``'s trials
(``result_table``, ``verdict``) and ``hetplan calibrate``'s fit (``fit_report``)."""

from __future__ import annotations

import statistics
from typing import Sequence

from hetplan.app.calibrate import FitResult, Observation
from hetplan.app.tune import TuneResult
from hetplan.report.text import table
from hetplan.units import format_bytes


# --- hetplan tune ------------------------------------------------------------------------------
def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.4g}"


def result_table(result: TuneResult) -> str:
    """The trials by measured step time, with the predictions beside them."""
    rows = []
    for i, (t, rank) in enumerate(zip(result.trials, result.planner_ranks), 1):
        error = t.error
        rows.append([i if t.ok else "-", t.plan.describe(), rank, _seconds(t.predicted_step_s),
                     _seconds(t.measured_step_s), "-" if error is None else f"{100 * error:+.1f}%",
                     format_bytes(t.predicted_peak_memory_bytes),
                     "-" if t.measured_peak_memory_bytes is None else format_bytes(t.measured_peak_memory_bytes)
                     + (" RSS" if t.device == "cpu" else ""),
                     t.status if len(t.status) <= 70 else t.status[:67] + "..."])
    headers = ["#", "plan", "planner #", "predicted step (s)", "measured step (s)", "error", "predicted peak/GPU",
               "measured peak", "status"]
    return table(headers, rows, [True, False, True, True, True, True, True, True, False])


def verdict(result: TuneResult) -> str:
    """Which plan measured fastest, and whether the planner's #1 agreed."""
    best = result.best
    if best is None:
        return "no plan finished: no measured best"
    rank = result.planner_ranks[0]
    text = f"best by measurement: {best.plan.describe()} ({best.measured_step_s:.4g} s/step, the planner's #{rank})"
    if rank == 1:
        return text + "; the planner's own #1 agreed"
    first = next((t for t, r in zip(result.trials, result.planner_ranks) if r == 1), None)
    if first is None:
        return text + "; the planner's #1 was not tried"
    if not first.ok:
        return text + f"; the planner's #1 {first.status}"
    slower = 100 * (first.measured_step_s / best.measured_step_s - 1)  # type: ignore[operator]  # measured plans only
    return text + f"; the planner's #1 ({first.plan.describe()}) measured {first.measured_step_s:.4g} s/step, " \
                  f"{slower:.1f}% slower"


# --- hetplan calibrate -------------------------------------------------------------------------
def fit_report(result: FitResult, observations: Sequence[Observation]) -> list[str]:
    """The fitted factors and, per plan, the error before and after."""
    lines = ["Fitted factors (measured / modelled rate or time):"]
    for p, ok in zip(result.parameters, result.identifiable):
        value = {"compute": result.calibration.compute(p.key), "bandwidth": result.calibration.bandwidth(p.key),
                 "latency": result.calibration.latency_scale}[p.kind]
        lines.append(f"  {p.label:<28} {value:8.3f}" if ok else
                     f"  {p.label:<28} {'1':>8}  (no measured plan depends on it: not fitted)")
    before, after = result.errors(observations, False), result.errors(observations, True)
    lines += ["", f"{'plan':<44} {'measured':>10} {'before':>10} {'error':>8} {'after':>10} {'error':>8}"]
    for o, b, a, eb, ea in zip(observations, result.before_s, result.after_s, before, after):
        lines.append(f"{_short(o.name):<44} {o.measured_step_s:10.4g} {b:10.4g} {eb:+8.1%} {a:10.4g} {ea:+8.1%}")
    lines.append(f"{'median |error|':<44} {'':>10} {'':>10} {statistics.median(map(abs, before)):8.1%} "
                 f"{'':>10} {statistics.median(map(abs, after)):8.1%}")
    return lines


def _short(name: str) -> str:
    return name if len(name) <= 44 else "..." + name[-41:]
