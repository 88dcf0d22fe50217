"""Metis-style plans: stages with different (dp, tp) and uneven, stage-specific
splits of each micro-batch, run by hetplan's own executor (hetplan.runtime.hetero),
reproduce the single-process reference."""

from __future__ import annotations

import pytest

from rt_helpers import assert_matches_reference, assert_structure, hetero_plan, run, train_worker, write_plan

CASES = {
    # (layers, dp, tp, dp_split, zero) per stage
    "dp2-uneven-then-tp2-1f1b": ([(range(0, 3), 2, 1, (3, 1), 0), (range(3, 6), 1, 2, (4,), 0)], 4, "1f1b"),
    "tp2-then-dp2-uneven-zero3-gpipe": ([(range(0, 2), 1, 2, (4,), 0), (range(2, 6), 2, 1, (1, 3), 3)], 4, "gpipe"),
    "three-stages-1-2-1": ([(range(0, 2), 1, 1, (2,), 0), (range(2, 4), 2, 1, (1, 1), 0),
                            (range(4, 6), 1, 1, (2,), 0)], 2, "1f1b"),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_heterogeneous_plan_matches_single_process(name: str, tmp_path) -> None:
    stages, micro, schedule = CASES[name]
    plan = hetero_plan(stages, micro, schedule)
    results = run(train_worker, plan.num_devices, write_plan(tmp_path, plan))
    assert_matches_reference(results[0])
    assert_structure(plan, results)
    for r in results[1:]:
        assert r["losses"] == pytest.approx(results[0]["losses"], rel=1e-6)
