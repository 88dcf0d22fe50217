"""Pipeline iteration time from per-stage times (AMP eq. 4-5, Metis eq. 1).

With ``m`` micro-batches, per-micro-batch stage times ``t_j`` (forward +
backward) and one-way p2p times ``c_j`` between stage j and j+1::

    T = (m − 1) · max_j t_j + Σ_j t_j + 2 · Σ_j c_j

The first micro-batch crosses every stage and link forward and the last one
crosses them backward (the ``Σ`` terms); in between the slowest stage sets the
pace. Interleaved 1F1B with ``v`` model chunks per device shrinks the fill and
drain by ``v`` (Narayanan et al. 2021 §2.2.2) but crosses each link ``v`` times:
``T = m·max t + (Σ t − max t)/v + 2v·Σ c``. For v = 1 both formulas agree.
"""

from __future__ import annotations

from typing import Sequence


def pipeline_time(stage_times: Sequence[float], p2p_times: Sequence[float], num_micro_batches: int,
                  virtual_stages: int = 1) -> float:
    """Time for ``num_micro_batches`` to pass forward and backward through the pipeline."""
    if not stage_times:
        return 0.0
    slowest = max(stage_times)
    v = max(1, virtual_stages)
    return num_micro_batches * slowest + (sum(stage_times) - slowest) / v + 2.0 * v * sum(p2p_times)


def bubble_time(stage_times: Sequence[float], virtual_stages: int = 1) -> float:
    """The fill-and-drain part of ``pipeline_time`` (time not spent at the bottleneck)."""
    if not stage_times:
        return 0.0
    return (sum(stage_times) - max(stage_times)) / max(1, virtual_stages)
