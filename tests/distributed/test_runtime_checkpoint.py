"""Checkpoints: save under one plan, load under another; kill a run and resume it.

The uninterrupted run is the single-process reference (every correct plan
reproduces it to 1e-5), so "the same loss as the uninterrupted run" is checked
against it, step by step, and on the final parameters. SGD with momentum:
a resumed run only matches if the optimizer state was restored too.
"""

from __future__ import annotations

import pytest

from hetplan.runtime.checkpoint import checkpoint_dir, latest_checkpoint
from rt_helpers import TOL, assert_matches_reference, hetero_plan, make_plan, reference, run, run_raw, train_worker, write_plan


def _assert_continues(result: dict, steps: int, start: int) -> None:
    ref_losses, _ = reference(steps)
    assert result["start_step"] == start
    assert len(result["losses"]) == steps - start
    for got, want in zip(result["losses"], ref_losses[start:]):
        assert abs(got - want) <= TOL * abs(want), (result["losses"], ref_losses)
    assert_matches_reference({**result, "losses": ref_losses[:start] + result["losses"]}, steps)


@pytest.mark.slow
def test_checkpoint_saved_under_one_plan_loads_under_others(tmp_path) -> None:
    ckpt = str(tmp_path / "ckpt")
    saver = make_plan(pp=2, dp=2, micro=2, zero=3)  # 4 processes: pipelined, ZeRO-3 sharded, tied copies
    run(train_worker, 4, write_plan(tmp_path, saver, "a.json"), 2,
        dict(checkpoint_dir=ckpt, checkpoint_every=2, export=False))
    assert latest_checkpoint(ckpt) == (checkpoint_dir(ckpt, 2), 2)
    # a different dp/tp/pp/ZeRO continues with the loss of the uninterrupted run
    loader = make_plan(tp=2, micro=4, recompute="full")
    results = run(train_worker, 2, write_plan(tmp_path, loader, "b.json"), 3,
                  dict(load_from=checkpoint_dir(ckpt, 2)))
    _assert_continues(results[0], 3, 2)
    # a Metis-style plan too (stage 0: 2 replicas taking 3:1 of each micro-batch, stage 1: tp=2)
    het = hetero_plan([(range(0, 3), 2, 1, (3, 1), 0), (range(3, 6), 1, 2, (4,), 0)], micro=4)
    results = run(train_worker, 4, write_plan(tmp_path, het, "h.json"), 3, dict(load_from=checkpoint_dir(ckpt, 2)))
    _assert_continues(results[0], 3, 2)
    # and so does a single process
    results = run(train_worker, 1, write_plan(tmp_path, make_plan(micro=2), "c.json"), 3,
                  dict(load_from=checkpoint_dir(ckpt, 2)))
    _assert_continues(results[0], 3, 2)


@pytest.mark.slow
def test_killed_run_resumes_with_the_same_loss_curve(tmp_path) -> None:
    ckpt = str(tmp_path / "ckpt")
    path = write_plan(tmp_path, make_plan(pp=2, tp=2, micro=2))
    killed = run_raw(train_worker, 4, path, 4, dict(checkpoint_dir=ckpt, checkpoint_every=1, die_after=2,
                                                    export=False))
    assert all(r.exitcode == -9 for r in killed), [(r.rank, r.exitcode, r.error) for r in killed]
    assert latest_checkpoint(ckpt) == (checkpoint_dir(ckpt, 2), 2)
    resumed = run(train_worker, 4, path, 4, dict(checkpoint_dir=ckpt, checkpoint_every=1, resume=True))
    _assert_continues(resumed[0], 4, 2)
