"""Pipeline partitions for Galvatron: the ideally balanced partition of
Galvatron-Base, and Galvatron-BMW's memory- and time-balanced partitions and
bi-objective adjustment (§IV-B, Alg. 2, Appendix B).

A partition is a tuple of stage sizes (layer counts, summing to the model's
layers). Per-layer stage costs are given by a callable so that the 1F1B memory
imbalance is modelled: stage ``j`` keeps ``min(P − j, m)`` micro-batches of
activations in flight, so a layer costs more memory on an early stage.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np


Partition = tuple[int, ...]


def partition_ranges(partition: Partition) -> list[range]:
    out, start = [], 0
    for size in partition:
        out.append(range(start, start + size))
        start += size
    return out


@dataclass(frozen=True)
class StageCostModel:
    """Additive per-layer costs of a stage plus non-additive peaks.

    ``additive[j, l]``: what layer ``l`` adds on stage ``j``; ``peak[j, l]``: a
    per-layer peak (the stage pays the largest, e.g. the recompute working set
    of a checkpointed layer); ``constant``: paid by every stage.
    """

    additive: np.ndarray
    peak: np.ndarray | None = None
    constant: float = 0.0

    def stage_cost(self, j: int, layers: range) -> float:
        if not len(layers):
            return self.constant
        total = float(self.additive[j, layers.start:layers.stop].sum()) + self.constant
        if self.peak is not None:
            total += float(self.peak[j, layers.start:layers.stop].max())
        return total

    def stage_costs(self, partition: Partition) -> list[float]:
        return [self.stage_cost(j, r) for j, r in enumerate(partition_ranges(partition))]

    def range_costs(self, j: int) -> np.ndarray:
        """cost[a, b] of stage ``j`` holding layers a..b-1 (inf where b <= a)."""
        add = self.additive[j]
        n = len(add)
        infinite = ~np.isfinite(add)  # a layer that cannot run on this stage
        prefix = np.concatenate([[0.0], np.cumsum(np.where(infinite, 0.0, add))])
        bad = np.concatenate([[0], np.cumsum(infinite)])
        cost = prefix[None, :] - prefix[:, None] + self.constant  # (n+1, n+1): [a, b]
        cost = np.where(bad[None, :] - bad[:, None] > 0, np.inf, cost)
        if self.peak is not None:
            peak = np.where(np.arange(n)[None, :] >= np.arange(n)[:, None],
                            np.nan_to_num(self.peak[j], posinf=0.0)[None, :], -np.inf)
            running = np.maximum.accumulate(peak, axis=1)  # running[a, c] = max peak[a..c]
            extra = np.full((n + 1, n + 1), 0.0)
            extra[:n, 1:] = running
            cost = cost + extra
        valid = np.arange(n + 1)[None, :] > np.arange(n + 1)[:, None]
        return np.where(valid, cost, np.inf)


def min_max_partition(costs: StageCostModel, num_layers: int, pp: int) -> Partition | None:
    """The contiguous partition into ``pp`` stages (each ≥ 1 layer) minimising
    the largest stage cost, by dynamic programming over stage boundaries
    (ties: the total cost, then earlier boundaries); None if every partition
    has an infinite stage."""
    if pp == 1:
        return (num_layers,)
    if pp > num_layers:
        raise ValueError(f"cannot split {num_layers} layers into {pp} stages")
    best = costs.range_costs(0)[0]  # best[b]: bottleneck of stages 0..j holding layers 0..b-1
    total = best.copy()
    args = []
    for j in range(1, pp):
        cost = costs.range_costs(j)  # [a, b]
        cand = np.maximum(best[:, None], cost)
        tot = total[:, None] + cost
        low = cand.min(axis=0)
        ties = cand <= low + 1e-12 * np.abs(low)  # lexicographic: bottleneck, then total
        arg = np.where(ties, tot, np.inf).argmin(axis=0)
        cols = np.arange(num_layers + 1)
        best = cand[arg, cols]
        total = tot[arg, cols]
        args.append(arg)
    if not np.isfinite(best[num_layers]):
        return None
    sizes = []
    b = num_layers
    for j in range(pp - 1, 0, -1):
        a = int(args[j - 1][b])
        sizes.append(b - a)
        b = a
    sizes.append(b)
    out = tuple(reversed(sizes))
    assert sum(out) == num_layers and min(out) >= 1
    return out


def adjust_candidates(partition: Partition, stage_times: Sequence[float]) -> list[Partition]:
    """PP_Partition_Adjust (Alg. 2 line 13): move a boundary layer of the slowest
    stage to the adjacent stage (the first layer backwards, the last layer
    forwards)."""
    slowest = max(range(len(partition)), key=lambda j: (stage_times[j], -j))
    if partition[slowest] <= 1:
        return []
    out = []
    sizes = list(partition)
    if slowest > 0:
        moved = sizes.copy()
        moved[slowest] -= 1
        moved[slowest - 1] += 1
        out.append(tuple(moved))
    if slowest < len(sizes) - 1:
        moved = sizes.copy()
        moved[slowest] -= 1
        moved[slowest + 1] += 1
        out.append(tuple(moved))
    return out


def validate_adjustment(new_times: Sequence[float], new_memory: Sequence[float], old_max_time: float,
                        memory_limit: Sequence[float], time_balanced_max_memory: float) -> bool:
    """The three rules of §IV-B: no stage slower than the old maximum, none over
    its memory budget, none over the time-balanced partition's largest memory."""
    if max(new_times) > old_max_time * (1 + 1e-12):
        return False
    if any(mem > cap for mem, cap in zip(new_memory, memory_limit)):
        return False
    return max(new_memory) <= time_balanced_max_memory * (1 + 1e-12)
