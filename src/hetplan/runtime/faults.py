"""Fault injection for the tests of ``--elastic`` (torch-free): a rank killed after a step, killed while
it writes a checkpoint, or made slower than its plan says.

Every variable holds ``RANK:VALUE[:WORLD]`` items separated by commas; ``WORLD`` limits an item to a run
of that many processes, so a re-planned run (another world size) is not hit again. Every rank reads all
items: the ranks meet at a barrier before one dies, so the step's checkpoint is complete on every rank.
"""

from __future__ import annotations

import os

KILL_ENV = "HETPLAN_FAULT_KILL"  # RANK:STEP[:WORLD]: SIGKILL after the step (and its checkpoint)
KILL_SAVE_ENV = "HETPLAN_FAULT_KILL_SAVE"  # RANK:STEP[:WORLD]: SIGKILL while the step's checkpoint is written
SLOW_ENV = "HETPLAN_FAULT_SLOW"  # RANK:FACTOR[:WORLD]: the rank's work takes FACTOR times as long


def _items(env: str, world_size: int) -> list[tuple[int, str]]:
    """(rank, value) of the items of ``env`` for a run of ``world_size`` processes; malformed ones are skipped."""
    out = []
    for item in os.environ.get(env, "").split(","):
        parts = [p.strip() for p in item.split(":")]
        if len(parts) not in (2, 3) or not parts[0].isdigit():
            continue
        if len(parts) == 3 and (not parts[2].isdigit() or int(parts[2]) != world_size):
            continue
        out.append((int(parts[0]), parts[1]))
    return out


def fault_kills(world_size: int, env: str = KILL_ENV) -> dict[int, int]:
    """Rank -> the step after which (``KILL_ENV``) or while whose checkpoint (``KILL_SAVE_ENV``) it kills
    itself, in a run of ``world_size`` processes."""
    return {rank: int(value) for rank, value in _items(env, world_size) if value.isdigit()}


def fault_slowdown(rank: int, world_size: int) -> float:
    """How many times slower ``SLOW_ENV`` makes this rank's work (1.0: not slowed)."""
    for r, value in _items(SLOW_ENV, world_size):
        try:
            factor = float(value)
        except ValueError:
            continue
        if r == rank and factor >= 1.0:
            return factor
    return 1.0
