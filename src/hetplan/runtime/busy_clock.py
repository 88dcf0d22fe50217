"""Each rank's own time of each training step, for the straggler check (hetplan.app.straggler).

On CPU processes: the main thread's CPU time (``time.thread_time``) over the step; a rank waiting for its
peers in a gloo collective takes none (gloo waits in its own threads). On CUDA the host thread only queues
the kernels and runs ahead of the GPU, so a host clock around the step times the launches: the step is
timed by two CUDA events on the rank's current stream, recorded before and after it. The pair is read
only once its end event has completed (``event.query()``, which does not wait), at a later step or a
checkpoint, so timing adds no host synchronization to the step; the steps whose events are not complete
yet are left for a later read (``drain`` reads them all at the end of the run, where the losses sync anyway).
"""

from __future__ import annotations

import time
from typing import Any, Callable, Protocol


class Event(Protocol):
    """What ``EventClock`` uses of ``torch.cuda.Event(enable_timing=True)``."""

    def record(self) -> None: ...

    def query(self) -> bool: ...

    def elapsed_time(self, end: Any) -> float: ...

    def synchronize(self) -> None: ...


class ThreadTimeClock:
    """CPU processes: the step's thread CPU time, known as soon as the step returns."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._start = 0.0

    def start(self) -> None:
        self._start = time.thread_time()

    def elapsed(self) -> float:
        """This thread's CPU seconds since ``start`` (the slowed-rank fault spends a multiple of them)."""
        return time.thread_time() - self._start

    def stop(self) -> None:
        self.times.append(self.elapsed())

    def read(self) -> list[float]:
        return self.times

    def drain(self) -> list[float]:
        return self.times


class EventClock:
    """CUDA: a pair of events around each step, read without waiting once the step has run on the GPU."""

    def __init__(self, new_event: Callable[[], Event]) -> None:
        self.times: list[float] = []
        self._new_event = new_event
        self._begin: Event | None = None
        self._pending: list[tuple[Event, Event]] = []

    def start(self) -> None:
        self._begin = self._new_event()
        self._begin.record()

    def elapsed(self) -> float:
        """No host-side measure of the GPU's work: the slowed-rank fault is for CPU processes."""
        return 0.0

    def stop(self) -> None:
        end = self._new_event()
        end.record()
        assert self._begin is not None, "EventClock.stop without start"
        self._pending.append((self._begin, end))
        self._begin = None
        self.read()

    def read(self) -> list[float]:
        """Seconds of each step whose events have completed, in order (a step still running ends the read:
        the ones after it run after it on the same stream)."""
        while self._pending and self._pending[0][1].query():
            begin, end = self._pending.pop(0)
            self.times.append(begin.elapsed_time(end) / 1e3)  # elapsed_time is in milliseconds
        return self.times

    def drain(self) -> list[float]:
        """Every step's seconds, waiting for the last step's end event (the end of the run)."""
        if self._pending:
            self._pending[-1][1].synchronize()
        return self.read()


BusyClock = ThreadTimeClock | EventClock


def busy_clock(device: Any) -> BusyClock:
    """The step clock of a rank on ``device``: CUDA events on a GPU, the thread's CPU time otherwise."""
    if getattr(device, "type", "cpu") == "cuda":
        import torch  # only on a CUDA rank, where the trainer has imported it already

        return EventClock(lambda: torch.cuda.Event(enable_timing=True))
    return ThreadTimeClock()
