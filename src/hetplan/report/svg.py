"""Pictures as standalone SVG (no plotting library needed): a pipeline timeline
(which micro-batch runs where, when) and peak memory per GPU against capacity."""

from __future__ import annotations

from html import escape
from typing import Sequence

from hetplan.cost.workload import Workload
from hetplan.plan import Estimate, Plan
from hetplan.simulate.events import Event

_FWD = "#4C78A8"
_BWD = "#F58518"
_OK = "#54A24B"
_OOM = "#E45756"


def _svg(width: int, height: int, body: list[str]) -> str:
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
            f'font-family="sans-serif" font-size="11">\n<rect width="100%" height="100%" fill="white"/>\n'
            + "\n".join(body) + "\n</svg>\n")


def timeline_svg(events: Sequence[Event], stage_labels: Sequence[str], title: str = "") -> str:
    """One row per stage; blue = forward, orange = backward, label = micro-batch."""
    num_stages = len(stage_labels)
    end = max(e.end_s for e in events) if events else 1.0
    left, top, row, width = 150, 30, 28, 900
    scale = width / end
    body = [f'<text x="{left}" y="18" font-size="13">{escape(title)}</text>']
    for j, label in enumerate(stage_labels):
        y = top + j * row
        body.append(f'<text x="4" y="{y + row * 0.65:.1f}">{escape(label)}</text>')
        body.append(f'<line x1="{left}" y1="{y + row - 2}" x2="{left + width}" y2="{y + row - 2}" stroke="#ddd"/>')
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
    axis_y = top + num_stages * row + 14
    for k in range(6):
        t = end * k / 5
        body.append(f'<text x="{left + t * scale:.1f}" y="{axis_y}" text-anchor="middle">{t * 1e3:.1f} ms</text>')
    body.append(f'<rect x="{left}" y="{axis_y + 8}" width="10" height="10" fill="{_FWD}"/>'
                f'<text x="{left + 14}" y="{axis_y + 17}">forward</text>'
                f'<rect x="{left + 80}" y="{axis_y + 8}" width="10" height="10" fill="{_BWD}"/>'
                f'<text x="{left + 94}" y="{axis_y + 17}">backward</text>')
    return _svg(left + width + 20, axis_y + 30, body)


def memory_svg(plan: Plan, estimate: Estimate, workload: Workload, title: str = "") -> str:
    """A bar per GPU: peak memory against its capacity, grouped by stage."""
    devices = [d for s in plan.stages for d in s.devices]
    cap_max = max(estimate.memory_capacity_bytes[d] for d in devices)
    top_value = max(cap_max, max(estimate.peak_memory_bytes[d] for d in devices))
    left, top, height = 60, 30, 220
    bar = max(6, min(28, 900 // max(1, len(devices))))
    body = [f'<text x="{left}" y="18" font-size="13">{escape(title)}</text>']
    x = left
    for j, stage in enumerate(plan.stages):
        start = x
        for d in stage.devices:
            used, cap = estimate.peak_memory_bytes[d], estimate.memory_capacity_bytes[d]
            h_cap = height * cap / top_value
            h_used = height * used / top_value
            gpu = workload.cluster.devices[d].gpu.name
            body.append(f'<rect x="{x}" y="{top + height - h_cap:.1f}" width="{bar - 2}" height="{h_cap:.1f}" '
                        f'fill="none" stroke="#999"/>')
            body.append(f'<rect x="{x}" y="{top + height - h_used:.1f}" width="{bar - 2}" height="{h_used:.1f}" '
                        f'fill="{_OK if used <= cap else _OOM}"><title>GPU {d} ({gpu}): '
                        f'{used / 2**30:.2f} of {cap / 2**30:.1f} GiB</title></rect>')
            x += bar
        body.append(f'<text x="{(start + x) / 2:.1f}" y="{top + height + 14}" text-anchor="middle">stage {j}</text>')
        x += bar // 2
    for k in range(5):
        value = top_value * k / 4
        y = top + height - height * k / 4
        body.append(f'<text x="{left - 6}" y="{y + 4:.1f}" text-anchor="end">{value / 2**30:.0f} GiB</text>')
    return _svg(x + 20, top + height + 30, body)
