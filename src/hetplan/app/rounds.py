"""Planning several allocations of ``hetplan choose`` at once (``--jobs``).

The search hands out allocations in rounds of ``jobs``: each round's are
planned side by side in forked worker processes, and their answers are read in
the search's order once the round is done. The answer therefore depends on
``jobs`` (an allocation is told the time to beat of the points found before
its round) but never on which worker finishes first or on the machine's load.
Workers are forked (they inherit the planner, pool and workload, nothing is
sent but an index and a time); where the platform cannot fork, the rounds run
in this process.
"""

from __future__ import annotations

import multiprocessing
import os
import time
from multiprocessing.pool import Pool as WorkerPool
from types import TracebackType
from typing import Any, Callable, Sequence

# What the workers plan with: set before the fork, inherited by it.
_STATE: dict[str, Callable[[int, float], Any]] = {}


def can_fork() -> bool:
    """Whether worker processes can inherit the search (POSIX ``fork``)."""
    return "fork" in multiprocessing.get_all_start_methods()


def _quiet() -> None:
    """Workers show no progress: the lines of two would interleave."""
    os.environ["HETPLAN_PROGRESS"] = "0"


def _measured(plan: Callable[[int, float], Any], task: tuple[int, float]) -> tuple[Any, float]:
    """One task's answer and the CPU seconds it took in the process that ran it."""
    start = time.process_time()
    found = plan(*task)
    return found, time.process_time() - start


def _in_worker(task: tuple[int, float]) -> tuple[Any, float]:
    return _measured(_STATE["plan"], task)


def critical_cpu_s(rounds_cpu_s: Sequence[Sequence[float]]) -> float:
    """CPU seconds of the slowest task of each round, summed: the time the
    rounds take on ``jobs`` idle cores, whatever else the machine runs."""
    return sum(max(round_s, default=0.0) for round_s in rounds_cpu_s)


class Rounds:
    """Runs rounds of ``plan(index, beat_s)`` calls: in this process with one
    job, else in ``jobs`` forked workers (made at the first round of two or
    more tasks, ended on ``close``)."""

    def __init__(self, plan: Callable[[int, float], Any], jobs: int) -> None:
        self.plan = plan
        self.jobs = jobs if can_fork() else 1
        self.cpu_s: list[tuple[float, ...]] = []  # each round's tasks' CPU seconds, in order
        self._workers: WorkerPool | None = None

    def run(self, tasks: Sequence[tuple[int, float]]) -> list[Any]:
        """The answers of one round of at most ``jobs`` tasks, in their order."""
        if len(tasks) < 2 or self.jobs < 2:
            timed = [_measured(self.plan, task) for task in tasks]
        else:
            if self._workers is None:
                _STATE["plan"] = self.plan
                self._workers = multiprocessing.get_context("fork").Pool(self.jobs, initializer=_quiet)
            timed = self._workers.map(_in_worker, tasks, chunksize=1)
        self.cpu_s.append(tuple(cpu for _, cpu in timed))
        return [found for found, _ in timed]

    def critical_cpu_s(self) -> float:
        return critical_cpu_s(self.cpu_s)

    def close(self) -> None:
        if self._workers is not None:
            self._workers.close()
            self._workers.join()
            self._workers = None
        _STATE.clear()

    def __enter__(self) -> "Rounds":
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 trace: TracebackType | None) -> None:
        if kind is not None and self._workers is not None:
            self._workers.terminate()
        self.close()
