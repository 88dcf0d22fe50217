"""``hetplan compare`` as text: the workload, then one row per planner (its
best plan, step time, throughput, speed-up over the baseline, search time)."""

from __future__ import annotations

from hetplan.app.compare import CompareResult, PlannerOutcome
from hetplan.report.runs import LEGEND as RUNS_ON_LEGEND, runs_on_cell
from hetplan.report.text import table, workload_header
from hetplan.export.target import candidate_count, tool_name
from hetplan.units import format_time


def compare_text(result: CompareResult) -> str:
    """What ``hetplan compare`` prints; with a named target, how much slower
    each planner's best plan the tool runs is than its best overall."""
    extra = ""
    if result.explicit_target and result.tool:
        extra = (f"target   {tool_name(result.tool)}: each planner's best plan it can run, of its "
                 f"{candidate_count(1)} best (the uniform planner's where it can run none); 'vs own best': "
                 "slower than the planner's best")
    base = result.baseline
    head = ["planner", "best plan", "iter time", "samples/s", f"vs {base.planner if base else '-'}", "fits",
            "runs on", "search"]
    right = [False, False, True, True, True, False, False, True]
    if result.explicit_target:
        head.insert(-1, "vs own best")
        right.insert(-1, True)
    rows = [_row(result, o) for o in result.outcomes]
    return f"{workload_header(result.workload, extra)}\n\n{table(head, rows, right)}\n{RUNS_ON_LEGEND}"


def _row(result: CompareResult, o: PlannerOutcome) -> list[str]:
    search = f"{o.search_time_s:.2f} s"
    if o.best is None:
        row = [o.planner, f"no plan: {o.error}", "-", "-", "-", "no", "-", search]
        if result.explicit_target:
            row.insert(-1, "-")
        return row
    e = o.best.estimate
    plan = o.best.plan.describe()
    if o.target is not None and o.target.source != o.planner:
        plan += f" [{o.target.source} fallback]"
    row = [o.planner, plan, format_time(e.iteration_time_s), f"{e.samples_per_s:.2f}",
           f"{result.speedup(o):.2f}x", "yes" if e.fits else "OOM", runs_on_cell(result.runs_on(o)), search]
    if result.explicit_target and o.target is not None:
        row.insert(-1, f"+{100 * o.target.slowdown:.1f}%")
    return row
