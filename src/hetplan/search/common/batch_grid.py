"""The batch sizes Galvatron's batch-size loop walks (Galvatron-BMW Alg. 1)."""

from __future__ import annotations

from typing import Iterable


def batch_grid(step: int, linear_steps: int = 8, growth: float = 1.125, limit: int = 1 << 22) -> Iterable[int]:
    """Batch sizes the loop walks: step·1 … step·linear_steps, then step·k with
    k growing by ``growth`` (so a search covers batches of thousands in a few
    dozen steps)."""
    k = 1
    while step * k <= limit:
        yield step * k
        k = k + 1 if k < linear_steps else max(k + 1, int(round(k * growth)))
