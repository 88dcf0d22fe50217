"""Sailor-style stages whose dp replicas run different TP degrees
(``Stage.replica_tp``, hetplan.runtime.mixed) reproduce the single-process reference."""

from __future__ import annotations

from rt_helpers import assert_matches_reference, mixed_plan, run, train_worker, write_plan

STEPS = 2


def test_one_stage_of_tp2_and_tp1_replicas_with_uneven_split_matches_reference(tmp_path) -> None:
    plan = mixed_plan([(range(0, 6), (2, 1), (3, 1))], micro=4)
    results = run(train_worker, plan.num_devices, write_plan(tmp_path, plan), STEPS)
    assert_matches_reference(results[0], steps=STEPS)
