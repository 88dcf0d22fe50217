"""Timing regions on one process, and the statistics ``hetplan profile`` keeps.

On CPU a region is timed by the wall clock (``time.perf_counter``): gloo's
collectives and CPU kernels have finished when the call returns. On a GPU,
kernels run asynchronously, so a region is timed by CUDA events recorded on
the current stream and read after one synchronize at the end (a synchronize
between regions would add its own latency to each).
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Sequence


class Stopwatch:
    """``sw.start(); ...; sw.mark(); ...; sw.mark(); sw.laps()`` -> seconds per region."""

    def __init__(self, device: Any) -> None:
        self.cuda = getattr(device, "type", "cpu") == "cuda"
        self._marks: list[Any] = []

    @property
    def name(self) -> str:
        return "cuda-events" if self.cuda else "perf_counter"

    def start(self) -> None:
        self._marks = []
        self.mark()

    def mark(self) -> None:
        if self.cuda:
            import torch

            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._marks.append(event)
        else:
            self._marks.append(time.perf_counter())

    def laps(self) -> list[float]:
        """Seconds between consecutive marks."""
        pairs = zip(self._marks, self._marks[1:])
        if self.cuda:
            import torch

            torch.cuda.synchronize()
            return [a.elapsed_time(b) / 1e3 for a, b in pairs]
        return [b - a for a, b in pairs]


def median(samples: Sequence[float]) -> float:
    return float(statistics.median(samples))


def iqr(samples: Sequence[float]) -> float:
    """Interquartile range (0 for fewer than two samples): the spread one
    outlier (a page fault, a context switch) does not dominate."""
    if len(samples) < 2:
        return 0.0
    q1, _, q3 = statistics.quantiles(samples, n=4, method="inclusive")
    return float(q3 - q1)
