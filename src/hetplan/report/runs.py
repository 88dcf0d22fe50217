"""Where each listed plan runs: the "runs on" column of ``plan``/``compare``/
``report`` and, for each tool that cannot run the best plan, which listed plan
it can run and at what time against the best, or the ``--target`` that finds one."""

from __future__ import annotations

from typing import Sequence

from hetplan.export.target import RUNNERS, tool_name
from hetplan.plan.spec import RankedPlan

INITIALS = {"hetplan": "H", "torchtitan": "T", "megatron": "M", "deepspeed": "D"}
LEGEND = "runs on: " + ", ".join(f"{INITIALS[t]} {tool_name(t)}" for t in RUNNERS)


def runs_on_cell(codes: Sequence[str]) -> str:
    """'HTMD', 'H', or '-' where no code runs the plan."""
    return "".join(INITIALS[t] for t in RUNNERS if t in codes) or "-"


def best_per_tool_lines(ranked: Sequence[RankedPlan], runs_on: Sequence[Sequence[str]],
                        positions: Sequence[int]) -> list[str]:
    """For each code that cannot run the first listed plan: the first listed plan it
    runs and its step time over the first's, or the ``--target`` to search for one."""
    if not ranked or not runs_on:
        return []
    best_s = ranked[0].estimate.iteration_time_s
    lines = []
    for tool in RUNNERS:
        if tool in runs_on[0]:
            continue
        row = next((k for k, codes in enumerate(runs_on) if tool in codes), None)
        if row is None:
            lines.append(f"{tool_name(tool)} runs none of these plans: hetplan plan --target {tool} finds its best")
        else:
            ratio = ranked[row].estimate.iteration_time_s / best_s
            lines.append(f"{tool_name(tool)} runs plan #{positions[row]} at {ratio:.2f}x the step time of #"
                         f"{positions[0]} (hetplan plan --target {tool} may find a faster one)")
    return lines
