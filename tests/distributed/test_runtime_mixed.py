"""Sailor-style stages whose dp replicas run different TP degrees
(``Stage.replica_tp``, hetplan.runtime.mixed) reproduce the single-process reference."""

from __future__ import annotations

import pytest
import torch

from hetplan.runtime.checkpoint_dirs import checkpoint_dir
from rt_helpers import (TOL, assert_matches_reference, make_plan, mixed_plan, reference, replica_state_worker, run,
                        train_worker, write_plan)

STEPS = 2


def test_one_stage_of_tp2_and_tp1_replicas_with_uneven_split_matches_reference(tmp_path) -> None:
    """Replica 0 at tp 2 (ranks 0, 1) takes 3 samples of each micro-batch, replica 1 at tp 1 (rank 2) one:
    both start from the same weights, sharded differently, and every rank ends on the reference's."""
    plan = mixed_plan([(range(0, 6), (2, 1), (3, 1))], micro=4)
    results = run(replica_state_worker, plan.num_devices, write_plan(tmp_path, plan), STEPS)
    for name, value in results[0]["start"].items():
        assert torch.equal(results[2]["start"][name], value), f"{name}: replicas start from different weights"
    for result in results:
        assert_matches_reference(result, steps=STEPS)


def test_pipeline_whose_first_stage_mixes_tp_degrees_trains_as_hetplan_train_does(tmp_path) -> None:
    """Stage 0: a tp-1 replica (1 sample) and a tp-2 replica (3); stage 1: one tp-1 replica. The trainer
    (what ``hetplan train --verify`` runs) matches the reference; the embedding tied to the head crosses
    stages. Its checkpoint (the stage's replicas hold one tensor in two layouts) continues in one process."""
    plan = mixed_plan([(range(0, 3), (1, 2), (1, 3)), (range(3, 6), (1,), (4,))], micro=4)
    ckpt = str(tmp_path / "ckpt")
    results = run(train_worker, plan.num_devices, write_plan(tmp_path, plan), STEPS,
                  dict(checkpoint_dir=ckpt, checkpoint_every=STEPS))
    assert_matches_reference(results[0], steps=STEPS)
    resumed = run(train_worker, 1, write_plan(tmp_path, make_plan(micro=4), "one.json"), STEPS + 1,
                  dict(load_from=checkpoint_dir(ckpt, STEPS)))
    assert resumed[0]["losses"] == pytest.approx(reference(STEPS + 1)[0][STEPS:], rel=TOL)


@pytest.mark.slow
def test_hetplan_train_verify_runs_a_stage_of_mixed_tp_degrees(tmp_path) -> None:
    """Issue 35 item 3 from the command line: ``hetplan train --verify`` on a
    stage whose replicas run TP 2 and TP 1 with an uneven split (3 processes)
    checks its losses against one process and passes."""
    import os
    import subprocess
    import sys

    plan = write_plan(tmp_path, mixed_plan([(range(0, 6), (2, 1), (3, 1))], micro=4))
    root = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
    env = {**os.environ, "PYTHONPATH": os.path.join(root, "src"), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "hetplan.cli", "train", "--plan", plan, "--steps", "2", "--verify"],
                          capture_output=True, text=True, env=env, timeout=300, cwd=root)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "3 processes" in proc.stdout and "verify: OK" in proc.stdout, proc.stdout
