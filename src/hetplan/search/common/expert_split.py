"""Uneven expert splits on mixed GPUs (``plan.Stage.ep_split``).

Metis splits a micro-batch over unequal GPUs in proportion to their speed;
the routed experts of a MoE layer split the same way. EP rank ``r`` of a stage
holds ``n_r`` of the E experts and, with routing spread evenly over experts,
runs ``n_r / E`` of its EP group's expert work (``CostKernel.row_experts``).
The split that finishes first minimises the slowest rank's ``n_r / rate_r``:
give each expert in turn to the rank whose time would grow least, every rank
keeping at least one.
"""

from __future__ import annotations

from typing import Sequence

from hetplan.cost.compute import matmul_rate
from hetplan.plan.workload import Workload


def position_rates(workload: Workload, devices: Sequence[int], rows: int, tp: int, ep: int) -> list[float]:
    """Per EP rank: the sustained matmul rate of the slowest GPU holding it
    (rank ``i % ep`` of the stage's ``rows`` = dp·cp TP groups, ``plan.Stage``)."""
    gpus = workload.cluster.devices
    dtype = workload.model.dtype_bytes
    rates = [min(matmul_rate(gpus[d].gpu, dtype) for d in devices[i * tp:(i + 1) * tp]) for i in range(rows)]
    return [min(rates[i] for i in range(r, rows, ep)) for r in range(ep)]


def speed_expert_split(workload: Workload, devices: Sequence[int], rows: int, tp: int,
                       ep: int) -> tuple[int, ...] | None:
    """Experts per EP rank in proportion to its GPUs' speed (module
    docstring), or None where an even split is as good (equal GPUs, one
    expert per rank, or MoE layers of different expert counts)."""
    counts = {layer.num_experts for layer in workload.model.layers if layer.is_moe}
    if ep <= 1 or len(counts) != 1:
        return None
    experts = counts.pop()
    rates = position_rates(workload, devices, rows, tp, ep)
    if experts <= ep or len(set(rates)) == 1:
        return None
    held = [1] * ep
    for _ in range(experts - ep):
        # ties go to the lowest rank: deterministic
        rank = min(range(ep), key=lambda r: ((held[r] + 1) / rates[r], r))
        held[rank] += 1
    return None if len(set(held)) == 1 else tuple(held)
