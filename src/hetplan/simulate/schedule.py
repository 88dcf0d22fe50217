"""Pipeline schedules as tiny action lists, in the spirit of
``torch.distributed.pipelining``: for each stage, the ordered list of
(forward | backward, micro-batch) it runs. They can be printed, saved and
replayed by the event simulator.
"""

from __future__ import annotations

from dataclasses import dataclass

from hetplan.errors import HetplanError


@dataclass(frozen=True)
class Action:
    """One unit of work on a stage: ``kind`` "F" or "B" for micro-batch ``micro_batch``."""

    kind: str
    micro_batch: int

    def __str__(self) -> str:
        return f"{self.kind}{self.micro_batch}"


def gpipe(num_stages: int, num_micro_batches: int) -> list[list[Action]]:
    """All forwards, then all backwards (GPipe): every stage keeps m activations."""
    return [[Action("F", i) for i in range(num_micro_batches)]
            + [Action("B", i) for i in reversed(range(num_micro_batches))] for _ in range(num_stages)]


def one_f_one_b(num_stages: int, num_micro_batches: int) -> list[list[Action]]:
    """1F1B (PipeDream-flush): stage j warms up with pp − j − 1 forwards, then
    alternates one forward and one backward, then drains the backwards."""
    schedules = []
    for j in range(num_stages):
        warmup = min(num_stages - j - 1, num_micro_batches)
        actions = [Action("F", i) for i in range(warmup)]
        next_f, next_b = warmup, 0
        while next_f < num_micro_batches:
            actions.append(Action("F", next_f))
            next_f += 1
            actions.append(Action("B", next_b))
            next_b += 1
        actions += [Action("B", i) for i in range(next_b, num_micro_batches)]
        schedules.append(actions)
    return schedules


def build_schedule(name: str, num_stages: int, num_micro_batches: int) -> list[list[Action]]:
    if name == "gpipe":
        return gpipe(num_stages, num_micro_batches)
    if name in ("1f1b", "interleaved-1f1b"):
        # interleaving is simulated at stage granularity as 1F1B; its bubble
        # reduction is in the closed-form estimate (cost/pipeline.py)
        return one_f_one_b(num_stages, num_micro_batches)
    raise HetplanError(f"unknown schedule {name!r}")


def format_schedule(schedule: list[list[Action]]) -> str:
    """One line per stage, e.g. 'stage 0: F0 F1 F2 B0 F3 B1 B2 B3'."""
    return "\n".join(f"stage {j}: " + " ".join(map(str, actions)) for j, actions in enumerate(schedule))
