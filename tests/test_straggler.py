"""Straggler detection (``hetplan.app.straggler``) on given busy times: the threshold, the steps it
needs, the plan's uneven shares, and peers only within a stage (the run with a slowed rank:
tests/distributed/test_elastic_train.py)."""

from __future__ import annotations

from hetplan.app.straggler import MIN_STEPS, STRAGGLER_FACTOR, Straggler, find_stragglers, rank_work
from hetplan.cluster.presets import get_cluster
from hetplan.plan.layout import PlanLayout
from hetplan.plan.spec import LayerStrategy, Plan, Stage

STEPS = [1.0] * MIN_STEPS


def _layout(*stages: tuple[tuple[int, ...], int, tuple[int, ...]]) -> PlanLayout:
    """A plan of stages (devices, layers, data split) of a 4-layer model on local-cpu-4."""
    first, out = 0, []
    for devices, layers, split in stages:
        out.append(Stage(layers=tuple(range(first, first + layers)), devices=devices, dp=len(devices), tp=1, dp_split=split,
                         strategies=(LayerStrategy(),) * layers))
        first += layers
    plan = Plan(stages=tuple(out), micro_batch_size=8, num_micro_batches=1, global_batch_size=8,
                cluster="local-cpu-4", model="m", schedule="1f1b")
    return PlanLayout.from_plan(plan, [f"l{i}" for i in range(first)])


def test_a_rank_slower_than_its_peers_by_the_factor_is_a_straggler() -> None:
    busy = [STEPS, [1.18 * t for t in STEPS], [3 * t for t in STEPS], STEPS]
    found = find_stragglers(busy, [1.0] * 4, [10, 11, 12, 13], [[0, 1, 2, 3]])
    assert found == [Straggler(2, 12, 3.0, MIN_STEPS)]
    assert find_stragglers([STEPS, [(STRAGGLER_FACTOR - 0.01) * t for t in STEPS]], [1.0, 1.0], [0, 1],
                           [[0, 1]]) == []


def test_one_slow_step_or_too_few_steps_is_no_straggler() -> None:
    spike = [1.0] * (MIN_STEPS - 1) + [10.0]
    assert find_stragglers([STEPS, spike], [1.0, 1.0], [0, 1], [[0, 1]]) == []
    assert find_stragglers([[1.0] * (MIN_STEPS - 1), [5.0] * (MIN_STEPS - 1)], [1.0, 1.0], [0, 1], [[0, 1]]) == []


def test_the_plans_uneven_shares_and_stages_set_what_each_rank_should_take() -> None:
    uneven = _layout(((0, 1, 2), 4, (3, 3, 2)))
    work = rank_work(uneven, get_cluster("local-cpu-4"), 4)
    assert work[0] == work[1] and abs(work[2] / work[0] - 2 / 3) < 1e-12
    busy = [STEPS, STEPS, [2 / 3 * t for t in STEPS]]  # the smaller share takes less time: as planned
    assert find_stragglers(busy, work, [0, 1, 2], [[0, 1, 2]]) == []
    # two stages of one rank: a stage's layers cost what they cost, no peer to compare with
    piped = _layout(((0,), 1, (8,)), ((1,), 3, (8,)))
    assert find_stragglers([STEPS, [9 * t for t in STEPS]], rank_work(piped, get_cluster("local-cpu-4"), 4),
                           [0, 1], [[0], [1]]) == []
