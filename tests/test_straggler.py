"""Stragglers (``hetplan.app.straggler``) on given busy times: the threshold, the steps it needs, which
ranks are peers; the re-plan with a device as slow as measured and when it is worth a restart (the run
with a slowed rank: tests/distributed/test_elastic_train.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from hetplan.app.replan import slowed_cluster
from hetplan.app.straggler import (
    MIN_STEPS, STRAGGLER_FACTOR, Straggler, find_stragglers, peer_groups, weigh_replan, worth_replanning,
)
from hetplan.cli import main
from hetplan.cluster.presets import get_cluster
from hetplan.plan.layout import PlanLayout
from hetplan.plan.spec import LayerStrategy, Plan, Stage

STEPS = [1.0] * MIN_STEPS


def _layout(*stages: tuple[tuple[int, ...], int, tuple[int, ...]]) -> PlanLayout:
    """A plan of stages (devices, layers, data split) of a model of as many layers on local-cpu-4."""
    first, out = 0, []
    for devices, layers, split in stages:
        out.append(Stage(layers=tuple(range(first, first + layers)), devices=devices, dp=len(devices), tp=1,
                         dp_split=split, strategies=(LayerStrategy(),) * layers))
        first += layers
    plan = Plan(stages=tuple(out), micro_batch_size=8, num_micro_batches=1, global_batch_size=8,
                cluster="local-cpu-4", model="m", schedule="1f1b")
    return PlanLayout.from_plan(plan, [f"l{i}" for i in range(first)])


def test_a_rank_slower_than_its_peers_by_the_factor_is_a_straggler() -> None:
    busy = [STEPS, [1.18 * t for t in STEPS], [3 * t for t in STEPS], STEPS]
    assert find_stragglers(busy, [10, 11, 12, 13], [[0, 1, 2, 3]]) == [Straggler(2, 12, 3.0, MIN_STEPS)]
    # two peers: each is compared with the other, so only the slow one is reported
    assert find_stragglers([STEPS, [2 * t for t in STEPS]], [0, 1], [[0, 1]]) == [Straggler(1, 1, 2.0, MIN_STEPS)]
    assert find_stragglers([STEPS, [(STRAGGLER_FACTOR - 0.01) * t for t in STEPS]], [0, 1], [[0, 1]]) == []


def test_one_slow_step_or_too_few_steps_is_no_straggler() -> None:
    spike = [1.0] * (MIN_STEPS - 1) + [10.0]
    assert find_stragglers([STEPS, spike], [0, 1], [[0, 1]]) == []
    assert find_stragglers([[1.0] * (MIN_STEPS - 1), [5.0] * (MIN_STEPS - 1)], [0, 1], [[0, 1]]) == []


def test_peers_have_the_same_stage_rows_and_gpu_type() -> None:
    cluster = get_cluster("local-cpu-4")
    assert peer_groups(_layout(((0, 1, 2), 4, (3, 3, 2))), cluster) == [[0, 1]]
    assert peer_groups(_layout(((0,), 1, (8,)), ((1,), 3, (8,))), cluster) == []
    assert peer_groups(_layout(((0, 1), 2, (4, 4)), ((2, 3), 2, (4, 4))), cluster) == [[0, 1], [2, 3]]
    slowed = slowed_cluster(cluster, {1: 2.0})  # a straggler re-planned around is a type of its own
    assert peer_groups(_layout(((0, 1, 2, 3), 4, (2, 2, 2, 2))), slowed) == [[0, 2, 3]]
    assert peer_groups(_layout(((0, 1, 2, 3), 4, (2, 2, 2, 2))), None) == [[0, 1, 2, 3]]  # no cluster: no types


def test_the_slowed_cluster_keeps_device_ids_and_links_and_divides_the_rates() -> None:
    cluster = get_cluster("8xA100-80GB")
    slowed = slowed_cluster(cluster, {3: 2.0})
    assert slowed.num_devices == 8 and [len(slowed.node_devices(n)) for n in range(slowed.num_nodes)] == [3, 1, 4]
    assert slowed.devices[3].gpu.peak_flops == cluster.devices[3].gpu.peak_flops / 2
    assert slowed.devices[3].gpu.catalog_name == "A100-80GB" and slowed.devices[4].gpu == cluster.devices[4].gpu
    assert all(slowed.link_gbps(a, b) == cluster.link_gbps(a, b) for a in range(8) for b in range(8) if a != b)


def test_a_replan_is_worth_it_when_the_time_it_saves_beats_the_restart() -> None:
    assert worth_replanning(step_s=2.0, new_over_old=0.5, steps_left=100, restart_s=99.0)  # saves 100 s
    assert not worth_replanning(step_s=2.0, new_over_old=0.5, steps_left=100, restart_s=100.0)
    assert not worth_replanning(step_s=2.0, new_over_old=1.1, steps_left=100, restart_s=0.0)  # slower


def test_the_plans_own_planner_gives_a_slow_device_less_when_that_pays(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plan = str(tmp_path / "p.json")
    assert main(["plan", "--model", "tiny-gpt", "--cluster", "local-cpu-2", "--global-batch", "8", "--quiet",
                 "--no-replay", "--json", plan]) == 0
    capsys.readouterr()
    slow = [Straggler(1, 1, 4.0, MIN_STEPS)]
    verdict = weigh_replan(plan, slow, step_s=1.0, steps_left=100, restart_s=10.0)
    assert verdict.replan and "stopping to re-plan" in verdict.line and "split 7:1" in verdict.line
    late = weigh_replan(plan, slow, step_s=1.0, steps_left=2, restart_s=10.0)
    assert not late.replan and late.line.endswith("going on with this plan")
