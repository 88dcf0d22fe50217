"""Pictures as standalone SVG (no plotting library needed): a pipeline timeline
(which micro-batch runs where, when), peak memory per GPU by category against
capacity, and where the step time goes.

Our own SVG rather than matplotlib: no extra dependency (the planner side needs
only numpy), byte-for-byte deterministic output (no fonts, timestamps or ids
that change between runs), and each picture is one self-contained string that
works as a ``.svg`` file and inline in the HTML report (``report/html.py``).

Nothing may be clipped: every picture's width is computed from its longest
text (``text_width`` errs on the wide side for a sans-serif font) as well as
from its plot area.
"""

from __future__ import annotations

from html import escape
from typing import Sequence

from hetplan.cost.memory import MEMORY_CATEGORIES
from hetplan.cost.model import CostModel
from hetplan.plan.workload import Workload
from hetplan.plan.spec import Estimate, Plan
from hetplan.simulate.events import Event
from hetplan.units import format_time

_FWD = "#4C78A8"
_BWD = "#F58518"
_OOM = "#E45756"
_MARK = "#222222"
FONT_SIZE = 11
TITLE_SIZE = 13
# One colour per memory category (MEMORY_CATEGORIES), and for a peak a profile
# measured as one number (not split by category).
MEMORY_COLOURS = {"params": "#4C78A8", "grads": "#72B7B2", "optimizer": "#F58518", "activations": "#54A24B",
                  "loss": "#EECA3B", "buffers": "#B279A2"}
UNSPLIT = ("peak (measured, not split)", "#9D9D9D")
# The parts of the step time, in the order of report/text.py's breakdown table.
TIME_PARTS = (("compute (bottleneck stage)", "compute_s", "#4C78A8"),
              ("pipeline bubble", "bubble_s", "#BAB0AC"),
              ("pipeline p2p", "p2p_s", "#72B7B2"),
              ("data-parallel sync (exposed)", "dp_sync_s", "#F58518"),
              ("tensor-parallel comm", "tp_comm_s", "#E45756"),
              ("recompute", "recompute_s", "#B279A2"),
              ("activation offload (exposed)", "offload_s", "#9D755D"),
              ("optimizer step", "optimizer_s", "#54A24B"))
GIB = 2**30


def text_width(text: str, size: float = FONT_SIZE) -> float:
    """A generous estimate of ``text``'s width in a sans-serif font (px): the
    widest common glyphs (digits, most lower case) are about 0.64 em."""
    return len(text) * size * 0.64


def svg_document(width: float, height: float, body: list[str]) -> str:
    """One standalone SVG picture of ``body`` (its elements) on white."""
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height:.0f}" '
            f'viewBox="0 0 {width:.0f} {height:.0f}" font-family="sans-serif" font-size="{FONT_SIZE}">\n'
            f'<rect width="100%" height="100%" fill="white"/>\n' + "\n".join(body) + "\n</svg>\n")


def _legend(items: Sequence[tuple[str, str, bool]], x0: float, y: float) -> tuple[list[str], float]:
    """Swatches in a row (``(label, colour, outline_only)``); returns the SVG and the row's right end."""
    body, x = [], x0
    for label, colour, outline in items:
        fill = f'fill="none" stroke="{colour}" stroke-width="1.5"' if outline else f'fill="{colour}"'
        body.append(f'<rect x="{x:.1f}" y="{y - 9:.1f}" width="10" height="10" {fill}/>'
                    f'<text x="{x + 14:.1f}" y="{y:.1f}">{escape(label)}</text>')
        x += 14 + text_width(label) + 14
    return body, x - 14


def timeline_svg(events: Sequence[Event], stage_labels: Sequence[str], title: str = "",
                 table_time_s: float | None = None) -> str:
    """One row per stage; blue = forward, orange = backward, label = micro-batch.

    ``table_time_s``: the step time the tables print (``Estimate.iteration_time_s``).
    The simulated pipeline can end after it (the closed form is an estimate of
    the schedule, and the table's time adds gradient sync and the optimizer
    step), so the axis runs to whichever is later and a dashed marker labelled
    "step time in the table" shows where the table's time falls."""
    num_stages = len(stage_labels)
    sim_end = max((e.end_s for e in events), default=0.0)
    end = max(sim_end, table_time_s or 0.0) or 1.0
    left = max(60.0, max((text_width(label) for label in stage_labels), default=0.0) + 12)
    plot = 900.0
    top = 30 + (18 if table_time_s else 0)
    row = 28
    scale = plot / end
    body = [f'<text x="4" y="18" font-size="{TITLE_SIZE}">{escape(title)}</text>']
    for j, label in enumerate(stage_labels):
        y = top + j * row
        body.append(f'<text x="4" y="{y + row * 0.65:.1f}">{escape(label)}</text>')
        body.append(f'<line x1="{left:.1f}" y1="{y + row - 2}" x2="{left + plot:.1f}" y2="{y + row - 2}" '
                    f'stroke="#ddd"/>')
    for e in events:
        x, w = left + e.start_s * scale, max((e.end_s - e.start_s) * scale, 0.5)
        y = top + e.stage * row + 2
        color = _FWD if e.kind == "F" else _BWD
        body.append(f'<rect x="{x:.2f}" y="{y}" width="{w:.2f}" height="{row - 6}" fill="{color}" '
                    f'stroke="white" stroke-width="0.5"><title>{e.kind}{e.micro_batch} '
                    f'{e.start_s * 1e3:.2f}-{e.end_s * 1e3:.2f} ms</title></rect>')
        if w > 14:
            body.append(f'<text x="{x + w / 2:.1f}" y="{y + row * 0.55:.1f}" fill="white" '
                        f'text-anchor="middle">{e.micro_batch}</text>')
    rows_end = top + num_stages * row
    axis_y = rows_end + 14
    ticks = [end * k / 5 for k in range(6)]
    last_label = ""
    for t in ticks:
        last_label = format_time(t) if t > 0 else "0"
        body.append(f'<text x="{left + t * scale:.1f}" y="{axis_y}" text-anchor="middle" class="tick">'
                    f'{last_label}</text>')
    width = left + plot + text_width(last_label) / 2 + 8
    if table_time_s:
        x = left + table_time_s * scale
        label = f"step time in the table: {format_time(table_time_s)}"
        anchor, right = ("end", x + 3) if x - 3 - text_width(label) >= 0 else ("start", x + 3 + text_width(label))
        body.append(f'<line x1="{x:.1f}" y1="{top - 14}" x2="{x:.1f}" y2="{rows_end + 2}" stroke="{_MARK}" '
                    f'stroke-width="1.5" stroke-dasharray="4,3" class="table-time" '
                    f'data-seconds="{table_time_s!r}"/>')
        body.append(f'<text x="{x - 3 if anchor == "end" else x + 3:.1f}" y="{top - 6}" text-anchor="{anchor}">'
                    f'{escape(label)}</text>')
        width = max(width, right + 8)
    legend = [("forward", _FWD, False), ("backward", _BWD, False)]
    legend_body, legend_end = _legend(legend, left, axis_y + 18)
    body += legend_body
    if table_time_s and sim_end > 0:
        note = f"simulated pipeline ends at {format_time(sim_end)}"
        body.append(f'<text x="{legend_end + 20:.1f}" y="{axis_y + 18}">{escape(note)}</text>')
        legend_end += 20 + text_width(note)
    width = max(width, legend_end + 8, 4 + text_width(title, TITLE_SIZE) + 8)
    return svg_document(width, axis_y + 30, body)


def _nice_step(top_value: float, ticks: int = 4) -> float:
    """A round step (1, 2, 2.5 or 5 times a power of ten) giving about ``ticks`` intervals."""
    raw = top_value / ticks if top_value > 0 else 1.0
    power = 10 ** _floor_log10(raw)
    for m in (1, 2, 2.5, 5, 10):
        if m * power >= raw:
            return m * power
    return 10 * power


def _floor_log10(x: float) -> int:
    k = 0
    while x >= 10:
        x, k = x / 10, k + 1
    while x < 1:
        x, k = x * 10, k - 1
    return k


def memory_svg(plan: Plan, estimate: Estimate, workload: Workload, title: str = "",
               breakdown: dict[int, dict[str, int]] | None = None) -> str:
    """A bar per GPU, grouped by stage, stacked by category (params, grads,
    optimizer, activations, loss, buffers: ``CostModel.memory_breakdown``, computed
    here when not given) inside an outline of that GPU's capacity; the stage
    and its GPU type under each group. A peak a profile measured as one
    number is drawn unsplit. Each bar's segments carry ``data-category`` and
    ``data-bytes``; they add up to the estimate's peak."""
    if breakdown is None:
        breakdown = CostModel(workload).memory_breakdown(plan)
    devices = [d for s in plan.stages for d in s.devices]
    cap_max = max(estimate.memory_capacity_bytes[d] for d in devices)
    top_value = max(cap_max, max(estimate.peak_memory_bytes[d] for d in devices))
    step = _nice_step(top_value / GIB) * GIB
    axis_top = step * -(-top_value // step)
    tick_labels = [f"{step * k / GIB:g} GiB" for k in range(int(round(axis_top / step)) + 1)]
    left = max(text_width(t) for t in tick_labels) + 12
    top, height = 56, 220
    bar = max(6, min(28, 900 // max(1, len(devices))))
    scale = height / axis_top

    def y_of(value: float) -> float:
        return top + height - value * scale

    body = [f'<text x="4" y="18" font-size="{TITLE_SIZE}">{escape(title)}</text>']
    for k, label in enumerate(tick_labels):
        y = y_of(step * k)
        body.append(f'<line x1="{left - 3:.1f}" y1="{y:.1f}" x2="{left:.1f}" y2="{y:.1f}" stroke="#999"/>'
                    f'<text x="{left - 6:.1f}" y="{y + 4:.1f}" text-anchor="end">{label}</text>')
    x = left + bar / 2
    unsplit = False
    for j, stage in enumerate(plan.stages):
        gpus = "+".join(sorted({workload.cluster.devices[d].gpu.name for d in stage.devices}))
        names = [f"stage {j}", gpus]
        group = max(len(stage.devices) * bar, max(text_width(n) for n in names) + 8)
        start = x
        x_bar = start + (group - len(stage.devices) * bar) / 2
        for d in stage.devices:
            used, cap = estimate.peak_memory_bytes[d], estimate.memory_capacity_bytes[d]
            parts = breakdown.get(d)
            segments = [(k, parts[k], MEMORY_COLOURS[k]) for k in MEMORY_CATEGORIES] if parts else \
                [("peak", used, UNSPLIT[1])]
            unsplit = unsplit or not parts
            split = ", ".join(f"{k} {v / GIB:.2f}" for k, v, _ in segments)
            body.append(f'<g class="gpu" data-device="{d}" data-peak-bytes="{used}" data-capacity-bytes="{cap}">'
                        f'<title>GPU {d} ({escape(workload.cluster.devices[d].gpu.name)}), stage {j}: '
                        f'{used / GIB:.2f} of {cap / GIB:.1f} GiB ({split} GiB)</title>')
            level = 0.0
            for name, value, colour in segments:
                if value <= 0:
                    continue
                h = value * scale
                body.append(f'<rect x="{x_bar:.1f}" y="{y_of(level) - h:.2f}" width="{bar - 2}" height="{h:.2f}" '
                            f'fill="{colour}" data-category="{name}" data-bytes="{value}"/>')
                level += value
            over = used > cap
            body.append(f'<rect x="{x_bar:.1f}" y="{y_of(cap):.2f}" width="{bar - 2}" height="{cap * scale:.2f}" '
                        f'fill="none" stroke="{_OOM if over else "#333"}" stroke-width="{2 if over else 1}" '
                        f'class="capacity"/>')
            if over:
                body.append(f'<text x="{x_bar + (bar - 2) / 2:.1f}" y="{y_of(used) - 3:.1f}" text-anchor="middle" '
                            f'fill="{_OOM}" font-size="9">OOM</text>')
            body.append("</g>")
            x_bar += bar
        mid = start + group / 2
        body.append(f'<text x="{mid:.1f}" y="{top + height + 14}" text-anchor="middle">stage {j}</text>'
                    f'<text x="{mid:.1f}" y="{top + height + 28}" text-anchor="middle" fill="#555" '
                    f'class="gpu-type">{escape(gpus)}</text>')
        x = start + group + bar / 2
    legend = [(k, MEMORY_COLOURS[k], False) for k in MEMORY_CATEGORIES]
    if unsplit:
        legend.append((UNSPLIT[0], UNSPLIT[1], False))
    legend.append(("capacity", "#333", True))
    legend_body, legend_end = _legend(legend, 4, 36)
    body += legend_body
    width = max(x + 8, legend_end + 8, 4 + text_width(title, TITLE_SIZE) + 8)
    return svg_document(width, top + height + 40, body)


def breakdown_svg(estimate: Estimate, title: str = "") -> str:
    """The step time as one horizontal bar stacked by what it goes to (the
    parts of ``report/text.py``'s breakdown table, which add up to the total),
    with a legend giving each part's time and share."""
    total = estimate.iteration_time_s
    plot, left, top, bar_h = 900.0, 4.0, 30, 26
    scale = plot / total
    parts = [(name, getattr(estimate, attr), colour) for name, attr, colour in TIME_PARTS
             if getattr(estimate, attr) > 1e-9]
    body = [f'<text x="4" y="18" font-size="{TITLE_SIZE}">{escape(title)}</text>']
    x = left
    for name, seconds, colour in parts:
        w = seconds * scale
        share = 100 * seconds / total
        body.append(f'<rect x="{x:.2f}" y="{top}" width="{w:.2f}" height="{bar_h}" fill="{colour}" '
                    f'stroke="white" stroke-width="0.5" data-part="{escape(name)}" data-seconds="{seconds!r}">'
                    f'<title>{escape(name)}: {format_time(seconds)} ({share:.1f}%)</title></rect>')
        label = f"{share:.0f}%"
        if w > text_width(label) + 6:
            body.append(f'<text x="{x + w / 2:.1f}" y="{top + bar_h * 0.65:.1f}" fill="white" '
                        f'text-anchor="middle">{label}</text>')
        x += w
    axis_y = top + bar_h + 14
    body.append(f'<text x="{left:.1f}" y="{axis_y}">0</text>')
    total_label = f"{format_time(total)} per step"
    body.append(f'<text x="{left + plot:.1f}" y="{axis_y}" text-anchor="end">{escape(total_label)}</text>')
    # the legend, wrapped into rows no wider than the bar
    y, x, right, widest = axis_y + 20, left, left + plot, left + plot
    for name, seconds, colour in parts:
        label = f"{name} {format_time(seconds)} ({100 * seconds / total:.1f}%)"
        item = 14 + text_width(label) + 16
        if x > left and x + item > right:
            x, y = left, y + 18
        body.append(f'<rect x="{x:.1f}" y="{y - 9}" width="10" height="10" fill="{colour}"/>'
                    f'<text x="{x + 14:.1f}" y="{y}">{escape(label)}</text>')
        widest = max(widest, x + item - 16)
        x += item
    width = max(widest + 8, 4 + text_width(title, TITLE_SIZE) + 8)
    return svg_document(width, y + 12, body)
