"""Pipelines whose processes share fewer CPU cores than there are processes.

``local-cpu-N`` runs N processes on one machine. With more processes than
cores the operating system shares the cores among the busy processes
(processor sharing): a process computes at ``min(1, cores / busy)`` of a
core. ``hetplan profile`` times every layer with all N processes busy at once,
so a profiled time is the time at ``min(1, cores / N)`` of a core. Data and
tensor parallelism keep every process busy and run at the profiled speed; a
pipeline does not: while its first micro-batches fill it and its last ones
drain it, the idle stages wait in a blocking receive and give their cores to
the busy ones, which then run faster than profiled (measured on a 2-core
machine: ``local-cpu-4``, pp 4, 1F1B, 0.29 s per step where the closed form at
the profiled speed gives 0.41 s; ``benchmarks/bench_prediction_cpu.py``).

``pipeline_time`` replays the schedule (``hetplan.simulate.schedule``) with
processor sharing: at every moment each running action advances at the speed
its stage's processes get from the cores, relative to the profiled speed.
With at least as many cores as processes it equals the event simulator's
makespan (every speed 1).
"""

from __future__ import annotations

from typing import Sequence
from hetplan.simulate.schedule import Action, build_schedule

EPS = 1e-12


def speed(busy: int, cores: int, profiled_processes: int) -> float:
    """How much faster than profiled a process computes while ``busy``
    processes share ``cores`` (the profile ran ``profiled_processes`` at once)."""
    return min(1.0, cores / max(1, busy)) / min(1.0, cores / max(1, profiled_processes))


def pipeline_time(schedule_name: str, fwd_s: Sequence[float], bwd_s: Sequence[float], p2p_s: Sequence[float],
                  num_micro_batches: int, stage_processes: Sequence[int], cores: int,
                  profiled_processes: int) -> float:
    """Makespan of one step's pipeline (forward and backward of every
    micro-batch through every stage, profiled-speed times ``fwd_s``/``bwd_s``
    per stage and one-way ``p2p_s`` per boundary) on shared cores."""
    schedule = build_schedule(schedule_name, len(fwd_s), num_micro_batches)
    num_stages = len(schedule)
    position = [0] * num_stages
    done: dict[tuple[int, str, int], float] = {}
    running: dict[int, list[float]] = {}  # stage -> [profiled seconds left]
    now = 0.0
    while True:
        arrivals = []
        for j in range(num_stages):
            if j in running or position[j] >= len(schedule[j]):
                continue
            ready = _ready_at(schedule[j][position[j]], j, num_stages, done, p2p_s)
            if ready is None:
                continue
            if ready <= now + EPS:
                action = schedule[j][position[j]]
                running[j] = [fwd_s[j] if action.kind == "F" else bwd_s[j]]
            else:
                arrivals.append(ready)
        if not running:
            if not arrivals:
                if any(position[j] < len(schedule[j]) for j in range(num_stages)):
                    raise RuntimeError("schedule deadlocks: an action waits for one that never runs")
                return now
            now = min(arrivals)
            continue
        rate = speed(sum(stage_processes[j] for j in running), cores, profiled_processes)
        step = min(min(left for left, in running.values()) / rate, *(a - now for a in arrivals)) if arrivals \
            else min(left for left, in running.values()) / rate
        now += step
        for j in list(running):
            running[j][0] -= step * rate
            if running[j][0] <= EPS:
                action = schedule[j][position[j]]
                done[(j, action.kind, action.micro_batch)] = now
                position[j] += 1
                del running[j]


def _ready_at(action: Action, stage: int, num_stages: int, done: dict[tuple[int, str, int], float],
              p2p_s: Sequence[float]) -> float | None:
    """When ``action``'s input has arrived on ``stage`` (None: not yet sent)."""
    kind, i = action.kind, action.micro_batch
    if kind == "F":
        if stage == 0:
            return 0.0
        sent = done.get((stage - 1, "F", i))
        return None if sent is None else sent + p2p_s[stage - 1]
    if stage == num_stages - 1:
        return done.get((stage, "F", i))
    sent = done.get((stage + 1, "B", i))
    return None if sent is None else sent + p2p_s[stage]
