"""``hetplan choose``'s output: the frontier (or the one answer) as a table,
and the frontier as an SVG chart of time to train against $ (``report/svg.py``'s
style: our own deterministic SVG, nothing clipped)."""

from __future__ import annotations

from html import escape

from hetplan.app.choose import ChooseResult, ChooseSummary
from hetplan.report.svg import FONT_SIZE, TITLE_SIZE, svg_document, text_width
from hetplan.report.text import table
from hetplan.units import format_count, format_time

CHOOSE_HEADERS = ("#", "allocation", "GPUs", "$/hour", "iter time", "days", "GPU $", "egress $", "total $", "plan")
_POINT = "#4C78A8"


def choose_rows(result: ChooseResult) -> list[list[str]]:
    """A row per point: allocation, GPUs, price, iteration, days, $ (GPUs,
    egress, total), plan."""
    return [[str(i), p.allocation.label, str(p.allocation.gpus),
             f"{p.allocation.usd_per_hour:,.2f}", format_time(p.iteration_s), f"{p.hours / 24:,.2f}", f"{p.gpu_usd:,.0f}", f"{p.egress_usd:,.0f}",
             f"{p.usd:,.0f}", p.best.plan.describe()] for i, p in enumerate(result.points, 1)]


def choose_header(result: ChooseResult) -> str:
    """What was asked and how much searching it took."""
    if result.objective == "deadline":
        asked = f"the cheapest within {result.limit:,.1f} hours"
    elif result.objective == "budget":
        asked = f"the fastest within ${result.limit:,.0f}"
    else:
        asked = "the frontier of time to train vs $"
    return (f"choose   {asked}, {format_count(result.tokens)} tokens, pool {result.pool.name!r}\n"
            f"search   {result.allocations} allocations: {result.planned} planned ({result.no_plan} without a plan, "
            f"{result.outrun} outrun: no plan faster than the answer needs), "
            f"{result.pruned} pruned by bounds, {result.unplanned} left unplanned"
            f"{f', {result.jobs} at a time' if result.jobs > 1 else ''} "
            f"({'proven' if result.proven else 'not proven'})\n"
            f"method   {result.search}")


def choose_text(result: ChooseResult) -> str:
    """What ``hetplan choose`` prints."""
    lines = [choose_header(result), ""]
    if result.points:
        lines.append(table(CHOOSE_HEADERS, choose_rows(result),
                           [True, False, True, True, True, True, True, True, True, False]))
    else:
        lines.append("no allocation meets the " + ("deadline" if result.objective == "deadline" else "budget") + ".")
    lines += ["", *(f"note: {n}" for n in result.notes)]
    return "\n".join(lines)


def frontier_svg(result: ChooseSummary, title: str = "") -> str:
    """The points as a chart: days to train (x) against total $ (y), each
    labelled with its number in the table, the frontier joined by a line."""
    points = [(p.hours / 24, p.usd) for p in result.points]
    title = title or f"time to train vs cost: pool {result.pool}"
    left, top, plot_w, plot_h = 80.0, 40.0, 480.0, 300.0
    x_max = max(x for x, _ in points) * 1.1 or 1.0
    y_max = max(y for _, y in points) * 1.1 or 1.0

    def at(x: float, y: float) -> tuple[float, float]:
        return left + plot_w * x / x_max, top + plot_h * (1 - y / y_max)

    body = [f'<text x="{left:.0f}" y="{top - 18:.0f}" font-size="{TITLE_SIZE}">{escape(title)}</text>',
            f'<line x1="{left}" y1="{top + plot_h}" x2="{left + plot_w}" y2="{top + plot_h}" stroke="#222"/>',
            f'<line x1="{left}" y1="{top}" x2="{left}" y2="{top + plot_h}" stroke="#222"/>']
    for k in range(5):
        x, y = x_max * k / 4, y_max * k / 4
        px, _ = at(x, 0)
        _, py = at(0, y)
        body.append(f'<text x="{px:.1f}" y="{top + plot_h + 16:.1f}" text-anchor="middle">{x:,.1f}</text>')
        body.append(f'<text x="{left - 6:.1f}" y="{py + 4:.1f}" text-anchor="end">${y:,.0f}</text>')
    body.append(f'<text x="{left + plot_w / 2:.0f}" y="{top + plot_h + 34:.0f}" text-anchor="middle">'
                f'days to train</text>')
    path = " ".join(f"{'M' if i == 0 else 'L'}{a:.1f},{b:.1f}" for i, (a, b) in enumerate(at(x, y) for x, y in points))
    body.append(f'<path d="{path}" fill="none" stroke="{_POINT}" stroke-width="1.5"/>')
    for i, (x, y) in enumerate(points, 1):
        px, py = at(x, y)
        body.append(f'<circle cx="{px:.1f}" cy="{py:.1f}" r="4" fill="{_POINT}"/>')
        body.append(f'<text x="{px + 6:.1f}" y="{py - 6:.1f}">{i}</text>')
    legend_y = top + plot_h + 56
    labels = [f"{i}: {escape(p.label)}" for i, p in enumerate(result.points, 1)]
    for k, label in enumerate(labels):
        body.append(f'<text x="{left:.0f}" y="{legend_y + k * (FONT_SIZE + 4):.0f}">{label}</text>')
    width = max(left + plot_w + 40, left + max(text_width(t) for t in [*labels, title]) + 20)
    height = legend_y + len(labels) * (FONT_SIZE + 4) + 10
    return svg_document(width, height, body)


FRONTIER_HEADERS = ("#", "allocation", "GPUs", "iter time", "days", "total $", "plan")


def frontier_table(result: ChooseSummary) -> str:
    """The points of a summary as a text table (the report's frontier section)."""
    rows = [[str(i), p.label, str(p.gpus), format_time(p.iteration_s),
             f"{p.hours / 24:,.2f}", f"{p.usd:,.0f}", p.plan] for i, p in enumerate(result.points, 1)]
    return table(FRONTIER_HEADERS, rows, [True, False, True, True, True, True, False])
