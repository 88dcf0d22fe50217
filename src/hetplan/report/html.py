"""One self-contained HTML page about a plan file (``hetplan report``).

The page holds, for the chosen plan (``--index``, 1 = the file's best): the
workload (model, cluster, batch, precision), the plan and why it is fast, every
plan of the file re-estimated with the file's workload, where the step time
goes (table and stacked bar), the simulated pipeline timeline, memory per GPU
by category against capacity, time and cost to train, and optionally a
what-if table (``report/whatif.py``).

Self-contained: inline CSS and inline SVG (``report/svg.py``), no JavaScript,
no network, no external fonts; the page renders the same offline, in a mail
attachment or a CI artifact. The output is deterministic (no timestamps).

Tables are the command line's own text tables (``report/text.py``) inside
``<pre>``, not re-built HTML tables: the page then says exactly what
``hetplan plan`` / ``estimate`` print, number for number, with one piece of
formatting code to maintain, and a reader can paste a table into an issue as
is. The pictures carry what a table cannot show at a glance.

Charts are our own SVG rather than matplotlib: no extra dependency,
deterministic output, and a picture that is part of the page's text.

Every string that comes from a file (model, cluster, GPU and layer names, plan
notes, the file's path) is HTML-escaped.
"""

from __future__ import annotations

from html import escape
from typing import Any, Sequence

from hetplan import __version__
from hetplan.app.report import PlanReport, file_report
from hetplan.app.choose import HEURISTIC, ChooseSummary
from hetplan.app.whatif import WhatIfResult
from hetplan.plan.file import PlanFile
from hetplan.report.svg import breakdown_svg, memory_svg, timeline_svg
from hetplan.report.trace import stage_labels as dimension_labels
from hetplan.report.text import breakdown, ranked_table, report_memory_table, workload_header
from hetplan.report.training import training_lines
from hetplan.report.choose import frontier_svg, frontier_table
from hetplan.report.whatif import whatif_table
from hetplan.simulate.plan import closed_form_pipeline_s, makespan, simulate_plan
from hetplan.units import format_time

CSS = """
body { font-family: sans-serif; margin: 24px auto; max-width: 1240px; padding: 0 16px; color: #222;
       background: #fff; line-height: 1.4; }
h1 { font-size: 22px; margin: 0 0 4px 0; }
h2 { font-size: 17px; margin: 28px 0 8px 0; border-bottom: 1px solid #ddd; padding-bottom: 3px; }
p.sub { color: #555; margin: 0 0 12px 0; }
nav a { margin-right: 12px; font-size: 13px; color: #2a5d9f; }
pre { font-family: monospace; font-size: 12px; background: #f7f7f7; border: 1px solid #e3e3e3;
      padding: 8px; overflow-x: auto; }
pre strong { background: #fff3c4; font-weight: bold; }
.chart { overflow-x: auto; margin: 8px 0; }
.chart svg { display: block; }
ul { margin: 6px 0; padding-left: 22px; }
li { margin: 2px 0; }
.note { color: #555; font-size: 13px; }
.error { color: #b00020; }
footer { margin-top: 32px; color: #777; font-size: 12px; }
"""

SECTIONS = (("workload", "Workload"), ("plan", "Chosen plan"), ("alternatives", "Plans in the file"),
            ("time", "Step time"), ("timeline", "Pipeline timeline"), ("memory", "Memory per GPU"),
            ("training", "Time and cost to train"), ("whatif", "What if"), ("choose", "Choosing the GPUs"))
_OPTIONAL = ("whatif", "choose")


def _pre(text: str, strong_line: int | None = None) -> str:
    lines = [escape(line) for line in text.splitlines()]
    if strong_line is not None and 0 <= strong_line < len(lines):
        lines[strong_line] = f"<strong>{lines[strong_line]}</strong>"
    return "<pre>" + "\n".join(lines) + "</pre>"


def _items(lines: Sequence[str], css: str = "") -> str:
    cls = f' class="{css}"' if css else ""
    return "<ul>" + "".join(f"<li{cls}>{escape(line)}</li>" for line in lines) + "</ul>"


def stage_labels(plan: Any, workload: Any) -> list[str]:
    """The timeline's row labels: the stage's number and every dimension it runs
    (``report.trace.stage_labels``)."""
    return [f"stage {j}: {label}" for j, label in enumerate(dimension_labels(plan, workload))]


def report_html(plan_file: PlanFile, index: int = 1, tokens: float | None = None,
                prices: dict[str, float] | None = None, whatif: Sequence[WhatIfResult] | None = None,
                whatif_planner: str = "", choose: ChooseSummary | None = None) -> str:
    """The page for plan ``index`` of ``plan_file``.
    ``tokens`` / ``prices``: as ``hetplan plan --tokens / --price-per-gpu-hour``;
    ``whatif``: ``hetplan.app.whatif.run_whatif``'s results, made by ``whatif_planner``;
    ``choose``: a ``hetplan choose`` answer, drawn as its frontier."""
    return report_page(file_report(plan_file, index, tokens, prices), plan_file.path, index, len(plan_file.plans),
                       whatif, whatif_planner, choose)


def report_page(report: PlanReport, path: str, index: int, count: int,
                whatif: Sequence[WhatIfResult] | None = None, whatif_planner: str = "",
                choose: ChooseSummary | None = None) -> str:
    """The page of ``report`` (plan ``index`` of the ``count`` in the file at ``path``)."""
    workload, plan, estimate = report.workload, report.chosen.plan, report.chosen.estimate
    title = f"hetplan report: {workload.model.name} on {workload.cluster.name}"
    out = ["<!DOCTYPE html>", '<html lang="en">', "<head>", '<meta charset="utf-8">',
           '<meta name="viewport" content="width=device-width, initial-scale=1">',
           f"<title>{escape(title)}</title>", f"<style>{CSS}</style>", "</head>", "<body>",
           f"<h1>{escape(title)}</h1>",
           f'<p class="sub">plan {index} of {count} in {escape(path)}: '
           f"{escape(format_time(estimate.iteration_time_s))} per step, "
           f"{estimate.tokens_per_s:,.0f} tokens/s, {'fits' if estimate.fits else 'OUT OF MEMORY'}</p>",
           "<nav>" + "".join(f'<a href="#{sid}">{name}</a>' for sid, name in SECTIONS
                             if sid not in _OPTIONAL or {"whatif": whatif, "choose": choose}[sid] is not None)
           + "</nav>"]
    out += ['<section id="workload">', "<h2>Workload</h2>", _pre(workload_header(workload)), "</section>"]
    out += _plan_section(report)
    out += _alternatives_section(report, index)
    out += ['<section id="time">', "<h2>Where the step time goes</h2>",
            '<div class="chart">' + breakdown_svg(estimate, "step time by part (they add up to the total)")
            + "</div>", _pre(breakdown(estimate, report.cp_ep)), "</section>"]
    out += _timeline_section(report)
    out += ['<section id="memory">', "<h2>Memory per GPU</h2>",
            '<p class="note">Peak memory of each GPU by category, inside the outline of its capacity; '
            "stages left to right, the GPU type under each.</p>",
            '<div class="chart">' + memory_svg(plan, estimate, workload, "peak memory per GPU", report.memory)
            + "</div>", _pre(report_memory_table(report)), "</section>"]
    out += ['<section id="training">', "<h2>Time and cost to train</h2>", _items(training_lines(report.training))]
    if not (report.tokens and report.prices is not None):  # say how to add them
        out.append(_items(["add --tokens N (e.g. 300B) for days and GPU-hours, --price-per-gpu-hour for the cost"],
                          "note"))
    out.append("</section>")
    if whatif is not None:
        out += _whatif_section(whatif, whatif_planner, report.tokens)
    if choose is not None:
        out += _choose_section(choose)
    out += [f"<footer>hetplan {escape(__version__)} report of {escape(path)}</footer>", "</body>", "</html>", ""]
    return "\n".join(out)


def _plan_section(report: PlanReport) -> list[str]:
    out = ['<section id="plan">', "<h2>Chosen plan</h2>", _pre(report.chosen.plan.describe()),
           "<p>Why this plan:</p>", _items(report.why)]
    notes = [*report.plan_notes, *report.model_notes]
    if notes:
        out += ['<p class="note">Notes:</p>', _items(notes, "note")]
    return out + ["</section>"]


def _alternatives_section(report: PlanReport, index: int) -> list[str]:
    out = ['<section id="alternatives">', "<h2>Plans in the file</h2>",
           f"<p>Every plan of the file, re-estimated with the model, cluster and settings it embeds "
           f"(# = its place in the file; the highlighted row is plan {index}, which this page describes).</p>"]
    if report.ranked:
        table = ranked_table(report.ranked, runs_on=report.runs_on)
        if list(report.positions) != list(range(1, len(report.ranked) + 1)):  # a skipped plan shifts the numbering
            table += "\n(file positions: " + ", ".join(str(k) for k in report.positions) + ")"
        row = report.chosen_row
        out.append(_pre(table, None if row is None else 2 + row))
    if report.problems:
        out.append(_items(report.problems, "error"))
    return out + ["</section>"]


def _timeline_section(report: PlanReport) -> list[str]:
    workload, plan, estimate = report.workload, report.chosen.plan, report.chosen.estimate
    events = simulate_plan(report.cost_model, plan, estimate)
    pipeline = closed_form_pipeline_s(estimate)
    return ['<section id="timeline">', "<h2>Pipeline timeline</h2>",
            f'<p class="note">The schedule replayed event by event with the cost model\'s stage times '
            f"(blue forward, orange backward, numbers are micro-batches). Simulated pipeline "
            f"{escape(format_time(makespan(events)))}, closed form {escape(format_time(pipeline))}; the step time "
            f"in the tables ({escape(format_time(estimate.iteration_time_s))}, dashed line) is the closed form plus "
            f"the exposed data-parallel sync and the optimizer step.</p>",
            '<div class="chart">' + timeline_svg(events, stage_labels(plan, workload), plan.describe(),
                                                 estimate.iteration_time_s) + "</div>", "</section>"]


def _choose_section(choose: ChooseSummary) -> list[str]:
    what = {"frontier": "the frontier of time to train against $ (no point is both slower and dearer than "
                        "another)", "deadline": "the cheapest allocation within the deadline",
            "budget": "the fastest allocation within the budget"}[choose.objective]
    proof = "proven: every other allocation was planned or ruled out by a bound" if choose.proven else \
        f"not proven: {choose.search or HEURISTIC}, the search stopped at its planner-call budget"
    out = ['<section id="choose">', "<h2>Choosing the GPUs</h2>",
           f"<p>From <code>hetplan choose</code> on pool {escape(choose.pool)}: {what} ({proof}).</p>"]
    if choose.points:
        out += ['<div class="chart">' + frontier_svg(choose) + "</div>", _pre(frontier_table(choose))]
    else:
        out.append(_items(["no allocation met the limit"], "note"))
    return out + ["</section>"]


def _whatif_section(whatif: Sequence[WhatIfResult], planner: str, tokens: float | None) -> list[str]:
    what = whatif[0].label.split("=")[0] if whatif else ""
    out = ['<section id="whatif">', "<h2>What if</h2>",
           f"<p>The best plan ({escape(planner or 'planner')}) of the same model as {escape(what)} "
           "changes; everything else as in the file.</p>", _pre(whatif_table(whatif, tokens))]
    errors = [f"{r.label}: {r.error}" for r in whatif if r.error]
    if errors:
        out.append(_items(errors, "error"))
    return out + ["</section>"]
