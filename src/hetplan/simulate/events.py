"""Event simulator: replay a pipeline schedule action by action.

Each stage runs its action list in order. A forward of micro-batch i on stage j
starts when stage j is free and stage j−1's forward of i has arrived (its end +
p2p time); a backward starts when stage j is free and stage j+1's backward of i
has arrived. A link carries one transfer at a time in each direction (activations
forward, gradients back: a full-duplex link), in the order they are sent, so a
link slower than the stages sets the pace. The simulator gives the exact makespan of the schedule under those
rules, which checks the closed-form pipeline formula of ``cost/pipeline.py``
and draws timelines.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from hetplan.simulate.schedule import Action


@dataclass(frozen=True)
class Event:
    stage: int
    kind: str
    micro_batch: int
    start_s: float
    end_s: float


def simulate(schedule: Sequence[Sequence[Action]], fwd_s: Sequence[float], bwd_s: Sequence[float],
             p2p_s: Sequence[float]) -> list[Event]:
    """Replay ``schedule`` with per-stage forward/backward times and one-way p2p
    times between consecutive stages; returns every action's start and end."""
    num_stages = len(schedule)
    done: dict[tuple[int, str, int], float] = {}
    position = [0] * num_stages
    free_at = [0.0] * num_stages
    link_free: dict[tuple[int, str], float] = {}  # (link j between stage j and j+1, direction) -> free from
    events: list[Event] = []
    remaining = sum(len(a) for a in schedule)
    while remaining:
        progressed = False
        for j in range(num_stages):
            if position[j] >= len(schedule[j]):
                continue
            action = schedule[j][position[j]]
            i = action.micro_batch
            if action.kind == "F":
                dep = (j - 1, "F", i) if j > 0 else None
                ready = done.get(dep, None) if dep else 0.0
                link = p2p_s[j - 1] if j > 0 else 0.0
                channel = (j - 1, "F")
                duration = fwd_s[j]
            else:
                dep = (j + 1, "B", i) if j < num_stages - 1 else (j, "F", i)
                ready = done.get(dep, None)
                link = p2p_s[j] if j < num_stages - 1 else 0.0
                channel = (j, "B")
                duration = bwd_s[j]
            if ready is None:
                continue
            arrival = max(ready, link_free.get(channel, 0.0)) + link
            if link:
                link_free[channel] = arrival
            start = max(free_at[j], arrival)
            end = start + duration
            done[(j, action.kind, i)] = end
            free_at[j] = end
            events.append(Event(j, action.kind, i, start, end))
            position[j] += 1
            remaining -= 1
            progressed = True
        if not progressed:
            raise RuntimeError("schedule deadlocks: an action waits for one that never runs")
    return events


def makespan(events: Sequence[Event]) -> float:
    return max(e.end_s for e in events) if events else 0.0
