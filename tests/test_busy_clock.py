"""Each rank's step clock (``hetplan.runtime.busy_clock``): chosen by device type; on CUDA, events read only
once complete, never waited for during the run; the straggler check fed by such clocks."""

from __future__ import annotations

import torch

from hetplan.app.straggler import find_stragglers
from hetplan.runtime.busy_clock import EventClock, ThreadTimeClock, busy_clock


class FakeGPU:
    """A stream whose work the test runs: each step takes ``step_ms``; ``done`` steps have run."""

    def __init__(self, step_ms: float) -> None:
        self.step_ms, self.recorded, self.done = step_ms, 0, 0
        self.waits = 0

    def event(self) -> FakeEvent:
        return FakeEvent(self)


class FakeEvent:
    """``torch.cuda.Event(enable_timing=True)`` on a FakeGPU: the n-th event recorded completes with step n // 2."""

    def __init__(self, gpu: FakeGPU) -> None:
        self.gpu, self.index = gpu, -1

    def record(self) -> None:
        self.index, self.gpu.recorded = self.gpu.recorded, self.gpu.recorded + 1

    def query(self) -> bool:
        return self.index // 2 < self.gpu.done

    def elapsed_time(self, end: FakeEvent) -> float:
        assert self.query() and end.query(), "elapsed_time of an event not yet complete (CUDA raises)"
        return self.gpu.step_ms

    def synchronize(self) -> None:
        self.gpu.waits += 1
        self.gpu.done = (self.index + 2) // 2


def test_the_clock_is_chosen_by_device_type() -> None:
    assert isinstance(busy_clock(torch.device("cpu")), ThreadTimeClock)
    assert isinstance(busy_clock(torch.device("cuda", 0)), EventClock)  # no event made before a step


def test_events_are_read_once_complete_without_waiting_for_the_gpu() -> None:
    gpu = FakeGPU(step_ms=20.0)
    clock = EventClock(gpu.event)
    for _ in range(3):  # the host runs three steps ahead: none has run on the GPU
        clock.start()
        clock.stop()
    assert clock.read() == [] and gpu.waits == 0
    gpu.done = 2
    assert clock.read() == [0.02, 0.02]
    assert clock.drain() == [0.02, 0.02, 0.02] and gpu.waits == 1  # the end of the run waits for the last step


def test_the_straggler_check_names_the_gpu_whose_events_take_longer() -> None:
    """Two peers (same work): rank 1's steps take 3x on its GPU; rank 0's last step has not completed, so
    the check compares the steps both have read."""
    gpus = [FakeGPU(10.0), FakeGPU(30.0)]
    clocks = [EventClock(gpu.event) for gpu in gpus]
    for _ in range(4):
        for clock in clocks:
            clock.start()
            clock.stop()
    gpus[0].done, gpus[1].done = 3, 4
    found = find_stragglers([clock.read() for clock in clocks], [0, 1], [[0, 1]])
    assert [(s.rank, s.slowdown, s.steps) for s in found] == [(1, 3.0, 3)]
    assert all(gpu.waits == 0 for gpu in gpus)
