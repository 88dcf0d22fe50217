"""``app.rounds``: allocations planned in rounds, in forked workers with two
or more jobs, their answers in the order given."""

from __future__ import annotations

import os

import pytest

from hetplan.app.rounds import Rounds, can_fork


def where(index: int, beat_s: float) -> tuple[int, float, int]:
    """The task back, with the process that ran it."""
    return index, beat_s, os.getpid()


@pytest.mark.skipif(not can_fork(), reason="this platform cannot fork: rounds run in one process")
def test_two_jobs_run_in_workers_and_answer_in_order():
    with Rounds(where, 2) as rounds:
        first = rounds.run([(0, 1.0), (1, 2.0)])
        second = rounds.run([(2, 3.0)])  # a round of one runs here
    assert [f[:2] for f in first] == [(0, 1.0), (1, 2.0)] and second[0][:2] == (2, 3.0)
    assert all(f[2] != os.getpid() for f in first) and second[0][2] == os.getpid()
    assert [len(r) for r in rounds.cpu_s] == [2, 1]
    assert rounds.critical_cpu_s() == pytest.approx(max(rounds.cpu_s[0]) + rounds.cpu_s[1][0])


def test_one_job_runs_here():
    with Rounds(where, 1) as rounds:
        found = rounds.run([(5, 0.5)])
    assert found == [(5, 0.5, os.getpid())] and rounds.jobs == 1
