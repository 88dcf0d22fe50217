"""Stragglers: a rank that does its share of each step persistently slower than the plan says.

Every rank of ``hetplan train`` times its own work of each step (``runtime/trainer.py``). A synchronous
step takes as long as its slowest rank, so the step time cannot name the slow one; each rank's own busy
time can: on CPU processes the main thread's CPU time (``time.thread_time``), which a rank waiting for its
peers in a collective does not accumulate (gloo waits in its own threads). On GPUs the busy time would be
the CUDA time of the rank's own kernels; that timing is not built, so the check runs on CPU processes only.

The plan says how much work each rank has: its rows of the batch times its stage's layers, over its
device's peak rate (``rank_work``). A rank whose busy time per unit of work is ``STRAGGLER_FACTOR`` times
the median of the other ranks of its pipeline stage, over the median of at least ``MIN_STEPS`` steps, is
a straggler (a stage with one rank has no peer to compare with).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

# Slowdown (busy time per unit of the plan's work, over its stage peers' median) from which a rank is reported.
# The ranks of one plan on this machine's CPU processes differ by up to 1.18x when none is slowed (per-rank
# thread CPU time of tiny-gpt dp4 on 2 cores shared with other work, medians of 6 steps, largest over
# smallest: summary.json rank_busy_s); a rank slowed 3x measures 3.02x. 1.5 leaves room on both sides.
STRAGGLER_FACTOR = 1.5
# Steps whose median is compared: one slow step (a page fault, a checkpoint write) is no straggler.
MIN_STEPS = 3


@dataclass(frozen=True)
class Straggler:
    """A rank slower than its plan says: ``slowdown`` times its peers' median time per unit of work."""

    rank: int
    device: int
    slowdown: float
    steps: int

    def line(self) -> str:
        return (f"straggler: rank {self.rank} (device {self.device}) did its share of each step {self.slowdown:.1f}x "
                f"slower than the plan's other ranks of its stage (median of {self.steps} steps; reported from "
                f"{STRAGGLER_FACTOR:g}x)")

    def record(self) -> dict[str, Any]:
        return {"rank": self.rank, "device": self.device, "slowdown": self.slowdown, "steps": self.steps}


def rank_work(layout: Any, cluster: Any, dtype_bytes: int, known_slow: Mapping[int, float] | None = None
              ) -> list[float]:
    """Each rank's work in a step as the plan splits it, in seconds at its device's peak rate (relative
    units: only the ratios between ranks matter): its rows of the batch times its stage's layers, over its
    device's peak FLOP/s times the stage's tp (each rank of a TP group does 1/tp of the work), times a slowdown already known for its device (``known_slow``: device -> factor)."""
    work = []
    for rank in range(layout.world_size):
        pos = layout.position(rank)
        stage = layout.plan.stages[pos.pp_index]
        rows = layout.stage_split(pos.pp_index)[pos.dp_index]
        rate = cluster.devices[pos.device].gpu.peak_flops_for(dtype_bytes) * stage.tp  # a 1/tp share each
        work.append(rows * len(stage.layers) / rate * (known_slow or {}).get(pos.device, 1.0))
    return work


def find_stragglers(busy_s: Sequence[Sequence[float]], work: Sequence[float], devices: Sequence[int],
                    peers: Sequence[Sequence[int]]) -> list[Straggler]:
    """The ranks whose median busy time per unit of ``work`` is at least ``STRAGGLER_FACTOR`` times the
    median of their peers' (``peers``: groups of ranks doing the same layers, the ranks of a pipeline
    stage; another stage's layers cost differently per FLOP). ``busy_s[r]``: rank r's busy seconds of each
    step; none before ``MIN_STEPS`` steps."""
    steps = min((len(b) for b in busy_s), default=0)
    if steps < MIN_STEPS:
        return []
    per_work = [statistics.median(b[-steps:]) / w for b, w in zip(busy_s, work)]
    found = []
    for group in peers:
        for rank in group:
            others = [per_work[r] for r in group if r != rank]
            typical = statistics.median(others) if others else 0.0
            if typical > 0 and per_work[rank] / typical >= STRAGGLER_FACTOR:
                found.append(Straggler(rank, devices[rank], round(per_work[rank] / typical, 2), steps))
    return sorted(found, key=lambda s: s.rank)
