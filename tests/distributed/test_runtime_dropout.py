"""Dropout under every kind of plan draws the masks of the single-process run
(hetplan.runtime.dropout): loss and parameters equal the reference with dropout
0.1 within 1e-5, for DP (even and uneven), TP, TP + sequence parallelism,
pipelining (1F1B with recomputation, interleaved), a Metis-style heterogeneous plan, and a user's
model with torch's nn.Dropout; torch dropout under TP is refused before start."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from dropout_helpers import P, assert_matches, reference, user_worker
from rt_helpers import hetero_plan, make_plan, run, run_raw, train_worker, write_plan

CASES = {
    "dp2": dict(dp=2, micro=2),  # 4 micro-batches of 1 sample per replica
    "dp2-uneven-3:1": dict(dp=2, dp_split=(3, 1)),
    "tp2": dict(tp=2, micro=4),
    "tp2-sp-selective": dict(tp=2, sp=True, micro=4, recompute="selective"),
    "pp2-1f1b-full-recompute": dict(pp=2, micro=2, recompute="full"),
    "pp2-interleaved": dict(pp=2, micro=2, schedule="interleaved-1f1b", virtual=2, split=[range(0, 4), range(4, 6)]),
}


@pytest.mark.parametrize("name", list(CASES))
def test_dropout_matches_single_process(name: str, tmp_path) -> None:
    plan = make_plan(**CASES[name])
    results = run(train_worker, plan.num_devices, write_plan(tmp_path, plan), 3, {"dropout": P})
    assert_matches(results[0])


def test_dropout_heterogeneous_plan_matches_single_process(tmp_path) -> None:
    """dp2 with a 3:1 split, then tp2: the rows of a micro-batch change owners between stages."""
    plan = hetero_plan([(range(0, 3), 2, 1, (3, 1), 0), (range(3, 6), 1, 2, (4,), 0)], 4, "1f1b")
    results = run(train_worker, plan.num_devices, write_plan(tmp_path, plan), 3, {"dropout": P})
    assert_matches(results[0])


def test_dropout_changes_training_and_seed_changes_masks() -> None:
    """The masks matter (dropout 0.1 trains differently from 0), a seed gives the
    same run twice, and another seed other masks."""
    from dropout_helpers import _reference

    with_dropout, state = reference(P, 0)
    assert reference(0.0, 0)[0] != pytest.approx(with_dropout, rel=1e-4)
    fresh_losses, fresh_state = _reference.__wrapped__(P, 0, 3, 8, False)  # not the cached run
    assert fresh_losses == with_dropout
    assert all((fresh_state[k] == v).all() for k, v in state.items())
    assert _reference.__wrapped__(P, 1, 3, 8, False)[0] != pytest.approx(with_dropout, rel=1e-4)


def test_users_nn_dropout_under_pp2_and_dp2(tmp_path) -> None:
    plan = make_plan(pp=2, dp=2, micro=2, gbs=8)
    results = run(user_worker, plan.num_devices, write_plan(tmp_path, plan))
    assert_matches(results[0], user_model=True)


def test_users_nn_dropout_under_tp_is_refused(tmp_path) -> None:
    plan = make_plan(tp=2, micro=4)
    results = run_raw(user_worker, 2, write_plan(tmp_path, plan), timeout_s=90)
    for r in results:
        assert r.exitcode != 0 and "tensor-parallel stage" in str(r.error), r


def test_cli_train_verify_with_dropout(tmp_path) -> None:
    """`hetplan train --dropout 0.1 --verify` end to end (torchrun, dp2 x tp2 with SP)."""
    plan_path = write_plan(tmp_path, make_plan(dp=2, tp=2, sp=True, micro=2))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "hetplan", "train", "--plan", plan_path, "--steps", "2",
                           "--dropout", "0.1", "--verify"], capture_output=True, text=True, env=env, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "verify: OK" in proc.stdout
