"""The runtime's plan layout, launcher commands and CLI, without starting processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace

import pytest

from hetplan.plan.spec import Plan, uniform_stage
from hetplan.plan.layout import PlanLayout, PlanNotSupportedError

NAMES = ["embed", "layers.0", "layers.1", "layers.2", "layers.3", "head"]
ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))


def plan(dp=1, tp=1, pp=1, micro=None, split=None, schedule="1f1b", virtual=1, gbs=8, devices=None, dp_split=None):
    micro = micro or dp
    split = split or [range(0, 6)] if pp == 1 else split
    stages = []
    for j, layers in enumerate(split):
        devs = devices[j] if devices else list(range(j * dp * tp, (j + 1) * dp * tp))
        st = uniform_stage(layers, devs, dp, tp, micro if not dp_split else dp)
        if dp_split:
            st = replace(st, dp_split=tuple(dp_split))
        stages.append(st)
    micro = sum(dp_split) if dp_split else micro
    return Plan("tiny-gpt", f"local-cpu-{dp * tp * pp}", gbs, micro, gbs // micro, schedule, tuple(stages),
                virtual_stages=virtual)


def test_positions_tp_innermost_and_mesh():
    p = plan(dp=2, tp=2, pp=2, micro=2, split=[range(0, 3), range(3, 6)])
    lay = PlanLayout.from_plan(p, NAMES)
    assert lay.world_size == 8
    assert lay.mesh_ranks() == [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]
    pos = lay.position(6)
    assert (pos.pp_index, pos.dp_index, pos.tp_index) == (1, 1, 0)
    assert lay.chunk_names(pos.chunks[0]) == ["layers.2", "layers.3", "head"]


def test_devices_out_of_order_map_to_ranks_by_id():
    p = plan(pp=2, micro=1, split=[range(0, 3), range(3, 6)], devices=[[5], [2]])
    lay = PlanLayout.from_plan(p, NAMES)
    assert lay.devices == (2, 5)
    assert lay.position(0).pp_index == 1 and lay.position(1).pp_index == 0
    assert lay.mesh_ranks() == [[[1]], [[0]]]


def test_interleaved_chunks_keep_layer_counts_per_device():
    p = plan(pp=2, micro=1, split=[range(0, 4), range(4, 6)], schedule="interleaved-1f1b", virtual=2)
    lay = PlanLayout.from_plan(p, NAMES)
    assert lay.schedule == "interleaved-1f1b"
    assert lay.chunk_layers == ((0, 1), (2,), (3, 4), (5,))
    assert lay.position(0).chunks == (0, 2) and lay.position(1).chunks == (1, 3)
    per_device = [sum(len(lay.chunk_layers[c]) for c in lay.position(r).chunks) for r in range(2)]
    assert per_device == [4, 2]


def test_schedule_fallbacks_are_noted():
    lay = PlanLayout.from_plan(plan(pp=2, micro=4, split=[range(0, 3), range(3, 6)], gbs=4), NAMES)
    assert lay.schedule == "gpipe" and any("GPipe" in n for n in lay.notes)  # 1 micro-batch < 2 stages
    lay = PlanLayout.from_plan(plan(pp=2, micro=1, split=[range(0, 3), range(3, 6)], schedule="interleaved-1f1b"),
                               NAMES)
    assert lay.schedule == "1f1b" and any("1F1B" in n for n in lay.notes)


def test_uneven_split_loss_scale_and_samples():
    lay = PlanLayout.from_plan(plan(dp=2, dp_split=(3, 1)), NAMES)
    assert lay.loss_scale(0) == pytest.approx(3 * 2 / 8) and lay.loss_scale(1) == pytest.approx(1 * 2 / 8)
    assert lay.local_sample_indices(0) == [0, 1, 2, 4, 5, 6]
    assert lay.local_sample_indices(1) == [3, 7]
    # with equal shares the scale is 1/m, the usual gradient-accumulation average
    lay = PlanLayout.from_plan(plan(dp=2, micro=2), NAMES)
    assert lay.loss_scale(0) == pytest.approx(1 / 4)


def test_heterogeneous_plans_are_laid_out_per_stage():
    p = plan(pp=2, micro=4, split=[range(0, 3), range(3, 6)], dp=2, dp_split=(3, 1))
    s0, s1 = p.stages
    het = replace(p, stages=(s0, uniform_stage(s1.layers, [2, 3], 1, 2, 4)))
    lay = PlanLayout.from_plan(het, NAMES)
    assert lay.heterogeneous and lay.world_size == 4
    assert lay.stage_mesh_ranks(0) == [[0], [1]] and lay.stage_mesh_ranks(1) == [[2, 3]]
    assert lay.position(1).samples_per_micro_batch == 1 and lay.position(3).samples_per_micro_batch == 4
    assert lay.local_sample_indices(1, stage=0) == [3, 7]
    assert lay.loss_scale(0) == pytest.approx(4 / 8)  # the last stage: one replica of 4 samples, 2 micro-batches
    with pytest.raises(Exception, match="no single pp x dp x tp mesh"):
        lay.mesh_ranks()


def mixed(replica_tp=(2, 1), dp_split=(3, 1), **stage) -> Plan:
    """One stage whose replicas run different TP degrees (Stage.replica_tp), devices 0.. replica after replica."""
    st = uniform_stage(range(0, 6), list(range(len(replica_tp) * max(replica_tp))), len(replica_tp),
                       max(replica_tp), len(replica_tp), **stage)
    st = replace(st, devices=tuple(range(sum(replica_tp))), dp_split=dp_split, replica_tp=replica_tp)
    return Plan("tiny-gpt", f"local-cpu-{sum(replica_tp)}", 8, sum(dp_split), 8 // sum(dp_split), "1f1b", (st,))


def test_a_stage_of_mixed_tp_degrees_lays_out_each_replica_with_its_own():
    p = mixed(replica_tp=(1, 2, 4), dp_split=(1, 1, 2))
    stage = p.stages[0]
    assert [stage.replica_devices(r) for r in range(3)] == [(0,), (1, 2), (3, 4, 5, 6)]
    data = json.loads(json.dumps(p.to_dict()))
    assert Plan.from_dict(data) == p and data["stages"][0]["replica_tp"] == [1, 2, 4]
    assert "replica_tp" not in plan().to_dict()["stages"][0]  # plans without it read and write as before
    lay = PlanLayout.from_plan(p, NAMES)
    assert lay.heterogeneous and lay.world_size == 7
    assert lay.stage_mesh_ranks(0) == [[0], [1, 2], [3, 4, 5, 6]]
    assert [(lay.position(r).dp_index, lay.position(r).tp_index) for r in (0, 2, 5)] == [(0, 0), (1, 1), (2, 2)]
    assert [lay.replica_tp(0, r) for r in range(3)] == [1, 2, 4]
    assert lay.position(4).samples_per_micro_batch == 2
    assert "heterogeneous [dp3 tp1+2+4 split 1:1:2]" in lay.describe()


@pytest.mark.parametrize("change, message", [
    ({"replica_tp": (2, 3)}, r"replica_tp \[2, 3\] must have dp=2 entries, each dividing tp=3"),
    ({"zero": 1}, "with ZeRO > 0"),
    ({"sequence_parallel": True}, "with sequence parallelism"),
])
def test_a_stage_of_mixed_tp_degrees_refuses_what_the_runtime_does_not_run(change, message):
    p = mixed(**change)
    with pytest.raises(PlanNotSupportedError, match=message):
        PlanLayout.from_plan(p, NAMES)


def test_unsupported_plans_say_why():
    p = plan(pp=2, micro=2, split=[range(0, 3), range(3, 6)], dp=2)
    s0, s1 = p.stages
    bad = replace(p, stages=(s0, uniform_stage(s1.layers, [2, 3], 1, 2, 2, sequence_parallel=True)))
    with pytest.raises(PlanNotSupportedError, match="sequence parallelism in a plan whose stages differ"):
        PlanLayout.from_plan(bad, NAMES)
    bad = replace(p, stages=(s0, uniform_stage(s1.layers, [2, 3], 1, 2, 2)), schedule="interleaved-1f1b",
                  virtual_stages=2)
    with pytest.raises(PlanNotSupportedError, match="interleaved 1F1B needs equal"):
        PlanLayout.from_plan(bad, NAMES)
    with pytest.raises(PlanNotSupportedError, match="cover layers"):
        PlanLayout.from_plan(plan(), NAMES[:-1])


def test_torchrun_commands_per_node_for_a_multi_node_plan(tmp_path):
    from hetplan.runtime.launch import plan_nodes, torchrun_commands

    # amp-heterogeneous: 3 nodes of 4 V100 + 1 node of 4 T4; use GPUs 2-5 (nodes 0 and 1)
    p = Plan("tiny-gpt", "amp-heterogeneous", 8, 2, 4, "1f1b",
             (uniform_stage(range(0, 3), [2, 3], 2, 1, 2), uniform_stage(range(3, 6), [4, 5], 2, 1, 2)))
    assert plan_nodes(p) == [(0, [2, 3]), (1, [4, 5])]
    cmds = torchrun_commands(p, "plan.json", ["train.py", "--x", "1"], master_addr="10.0.0.1")
    assert [n for n, _ in cmds] == [0, 1]
    assert "--node-rank=0" in cmds[0][1] and "--node-rank=1" in cmds[1][1]
    assert all("--nnodes=2" in c and "--nproc-per-node=2" in c and "HETPLAN_PLAN=" in c for _, c in cmds)
    assert cmds[0][1].endswith("train.py --x 1")


def _cli(*args):
    env = {**os.environ, "PYTHONPATH": os.path.join(ROOT, "src")}
    return subprocess.run([sys.executable, "-m", "hetplan.cli", *args], capture_output=True, text=True, env=env,
                          timeout=120)


def test_run_print_lists_commands_without_torch(tmp_path):
    from hetplan.plan.file import save_plan

    p = Plan("tiny-gpt", "amp-heterogeneous", 8, 2, 4, "1f1b",
             (uniform_stage(range(0, 3), [0, 1, 2, 3], 2, 2, 2), uniform_stage(range(3, 6), [12, 13, 14, 15], 2, 2, 2)))
    path = str(tmp_path / "p.json")
    save_plan(path, p)
    proc = _cli("run", path, "--master-addr", "host0", "--", "train.py")
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line and not line.startswith("#")]
    assert len(lines) == 2 and "--node-rank=1" in lines[1] and "--master-addr=host0" in lines[0]
    assert "# node 3 (GPUs 12, 13, 14, 15)" in proc.stdout
    proc = _cli("run", path)
    assert proc.returncode == 2 and "no training script" in proc.stderr


def test_importing_the_runtime_cli_does_not_import_torch():
    code = "import sys, hetplan.runtime.cli, hetplan.runtime, hetplan.plan.layout; print('torch' in sys.modules)"
    env = {**os.environ, "PYTHONPATH": os.path.join(ROOT, "src")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert out.stdout.strip() == "False", out.stderr


def test_latest_checkpoint_ignores_incomplete_ones(tmp_path):
    from hetplan.runtime.checkpoint_dirs import MANIFEST, checkpoint_dir, latest_checkpoint

    assert latest_checkpoint(str(tmp_path / "none")) is None
    for step, complete in ((1, True), (2, True), (3, False)):
        d = checkpoint_dir(str(tmp_path), step)
        os.makedirs(d)
        if complete:
            open(os.path.join(d, MANIFEST), "w").close()
    notes: list[str] = []
    assert latest_checkpoint(str(tmp_path), note=notes.append) == (checkpoint_dir(str(tmp_path), 2), 2)
    assert len(notes) == 1 and "step_00000003" in notes[0]
