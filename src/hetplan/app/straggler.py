"""Stragglers: a rank that does its share of each step persistently slower than the plan says.

Every rank of ``hetplan train`` times its own work of each step (``runtime/trainer.py``). A synchronous
step takes as long as its slowest rank, so the step time cannot name the slow one; each rank's own busy
time can: on CPU processes the main thread's CPU time (``time.thread_time``), which a rank waiting for its
peers in a collective does not accumulate (gloo waits in its own threads). On GPUs the step is timed by
CUDA events on the rank's stream, read once they completed (``runtime/busy_clock.py``); that span also holds
the time the stream waits for a collective, so there a straggler shows only through its work outside them.

The plan gives some ranks the same work: the same stage, rows and GPU type (``peer_groups``). A rank
whose busy time is ``STRAGGLER_FACTOR`` times the median of its peers', over the median of at least
``MIN_STEPS`` steps, is slower than the plan says: a straggler. A rank without such a peer is not
checked (a stage of one rank; after a straggler re-plan, the straggler's device has a type of its own).

Under ``--elastic`` the ranks check at each checkpoint: with a straggler, the plan's own planner re-plans
for the cluster with that device as slow as measured (``weigh_replan``; often an uneven split that gives
it less), and when the predicted gain over the steps left beats the restart cost (the launch's own start,
measured), the ranks stop right after the checkpoint and the supervisor (``hetplan.app.elastic``) starts
the new plan from it.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any, Sequence

from hetplan.app.replan import replan_slower

# Slowdown (busy time over the median of the ranks with the same work) from which a rank is reported.
# The ranks of one plan on this machine's CPU processes differ by up to 1.18x when none is slowed (per-rank
# thread CPU time of tiny-gpt dp4 on 2 cores shared with other work, medians of 6 steps, largest over
# smallest: summary.json rank_busy_s); a rank slowed 3x measures 3.02x. 1.5 leaves room on both sides.
STRAGGLER_FACTOR = 1.5
# Steps whose median is compared: one slow step (a page fault, a checkpoint write) is no straggler.
MIN_STEPS = 3
# Set by the --elastic supervisor for each launch: when it started it (time.time(), this machine's clock:
# the launch's start to its first step is what a restart costs), and the restart cost the user gave
# (--restart-cost) instead of that measure.
LAUNCHED_AT_ENV = "HETPLAN_ELASTIC_LAUNCHED_AT"
RESTART_COST_ENV = "HETPLAN_ELASTIC_RESTART_S"
# What a launch's ranks leave in the checkpoint directory when they stop to be re-planned around stragglers.
STRAGGLER_FILE = "stragglers.json"
# The exit status of a rank that stopped to be re-planned (after its checkpoint): not 1 (an error) or 2
# (a HetplanError, hetplan.io.argtypes.EXIT_USAGE).
EXIT_REPLAN = 3


@dataclass(frozen=True)
class Straggler:
    """A rank slower than its plan says: ``slowdown`` times its peers' median busy time."""

    rank: int
    device: int
    slowdown: float
    steps: int

    def line(self) -> str:
        return (f"straggler: rank {self.rank} (device {self.device}) did its share of each step {self.slowdown:.1f}x "
                f"slower than the ranks the plan gives the same work (median of {self.steps} steps; reported from "
                f"{STRAGGLER_FACTOR:g}x)")

    def record(self) -> dict[str, Any]:
        return {"rank": self.rank, "device": self.device, "slowdown": self.slowdown, "steps": self.steps}


def peer_groups(layout: Any, cluster: Any) -> list[list[int]]:
    """Groups of ranks the plan gives the same work: the same stage, the same rows of each micro-batch and
    the same GPU type (``cluster`` None: not told apart by type); a rank alone in its group has no peer
    and is not checked. Ranks with other shares or types are not compared: a step's fixed costs (the
    optimizer, each forward's overhead) make time per row differ between shares, far from the plan's
    proportions on a small model."""
    groups: dict[tuple[int, int, str], list[int]] = {}
    for rank in range(layout.world_size):
        pos = layout.position(rank)
        rows = layout.stage_split(pos.pp_index)[pos.dp_index]
        gpu = cluster.devices[pos.device].gpu.name if cluster is not None else ""
        groups.setdefault((pos.pp_index, rows, gpu), []).append(rank)
    return [ranks for ranks in groups.values() if len(ranks) > 1]


def find_stragglers(busy_s: Sequence[Sequence[float]], devices: Sequence[int], peers: Sequence[Sequence[int]]
                    ) -> list[Straggler]:
    """The ranks whose median busy time is at least ``STRAGGLER_FACTOR`` times the median of their peers'
    (``peers``: groups of ranks with the same work, ``peer_groups``). ``busy_s[r]``: rank r's busy
    seconds of each step; none before ``MIN_STEPS`` steps."""
    steps = min((len(b) for b in busy_s), default=0)
    if steps < MIN_STEPS:
        return []
    typical_of = [statistics.median(b[-steps:]) for b in busy_s]
    found = []
    for group in peers:
        for rank in group:
            typical = statistics.median([typical_of[r] for r in group if r != rank])
            if typical > 0 and typical_of[rank] / typical >= STRAGGLER_FACTOR:
                found.append(Straggler(rank, devices[rank], round(typical_of[rank] / typical, 2), steps))
    return sorted(found, key=lambda s: s.rank)


@dataclass(frozen=True)
class Verdict:
    """Whether to stop and re-plan around stragglers, and the line that says why."""

    replan: bool
    line: str


def worth_replanning(step_s: float, new_over_old: float, steps_left: int, restart_s: float) -> bool:
    """Whether a re-plan whose step takes ``new_over_old`` of the current one (both predicted with the
    stragglers as slow as measured) saves more than the restart costs over the ``steps_left`` steps of
    ``step_s`` seconds (measured)."""
    return step_s * (1.0 - new_over_old) * steps_left > restart_s


def weigh_replan(plan_path: str, stragglers: Sequence[Straggler], step_s: float, steps_left: int,
                 restart_s: float) -> Verdict:
    """The plan's own planner re-plans for its cluster with the stragglers as slow as measured
    (``hetplan.app.replan.replan_slower``); re-plan when the predicted gain beats the restart cost."""
    slow = {s.device: s.slowdown for s in stragglers}
    replan = replan_slower(plan_path, slow, replay=0)
    saved = step_s * (1.0 - replan.slowdown) * steps_left
    go = worth_replanning(step_s, replan.slowdown, steps_left, restart_s)
    line = (f"--elastic: with device(s) {', '.join(map(str, sorted(slow)))} as slow as measured, "
            f"{replan.result.best.plan.describe()} would take {100 * (replan.slowdown - 1):+.1f}% a step: "
            f"{saved:.1f} s over the {steps_left} steps left against a restart of {restart_s:.1f} s: "
            + ("stopping to re-plan" if go else "going on with this plan"))
    return Verdict(go, line)
