"""Context parallelism (CP) and expert parallelism (EP) in the runtime.

``hetplan train``'s trainer (gloo; in processes forked from a server that has
imported torch): tiny-moe under ep2, ep2 x dp2 (per-layer ZeRO 3/2/1/0),
ep2 x pp2, tp2 x dp2 (expert TP, ZeRO-3), ep2 x tp2 (expert TP), and tiny-gpt
under cp2 x tp2, cp2 x pp2 match the single-process loss and parameters within
1e-5 (fp32); cp2 x ep2 (ZeRO-3 over the CP ranks) the same end to end with
``hetplan train --verify`` (torchrun). Each run also checks the expert weights'
shards. Plus the refusals before any process starts (the pieces without
processes are in tests/test_runtime_cp_ep_units.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace

import pytest

from hetplan.cli import main
from hetplan.plan.file import save_plan
from hetplan.plan.spec import Plan, uniform_stage
from hetplan.search.common.layer_splits import even_split
from rt_helpers import assert_matches_reference, run, train_worker

STEPS = 2  # two optimizer steps: the second starts from parameters the first changed
ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def cp_ep_plan(model: str, dp: int = 1, cp: int = 1, tp: int = 1, pp: int = 1, ep: int = 1, gbs: int = 8,
               dp_split: tuple[int, ...] | None = None, sp: bool = False, zero: int | tuple[int, ...] = 0) -> Plan:
    """Devices 0.. in order: TP innermost, then CP, then DP, then PP; one sample per replica per micro-batch.
    ``zero``: one ZeRO stage for every layer, or one per layer (embed, layers.0-3, head)."""
    per = dp * cp * tp
    zeros = zero if isinstance(zero, tuple) else (zero,) * 6
    stages = []
    for j, layers in enumerate(even_split(6, pp)):
        stage = uniform_stage(list(layers), list(range(j * per, (j + 1) * per)), dp, tp, dp, sequence_parallel=sp)
        strategies = tuple(replace(s, zero=zeros[i]) for s, i in zip(stage.strategies, stage.layers))
        stages.append(replace(stage, cp=cp, ep=ep, dp_split=dp_split or stage.dp_split, strategies=strategies))
    micro = sum(stages[0].dp_split)
    return Plan(model, f"local-cpu-{per * pp}", gbs, micro, gbs // micro, "1f1b", tuple(stages), planner="test")


def _hetplan(*args: str, timeout: float = 400) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.path.join(ROOT, "src"), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "hetplan.cli", *args], capture_output=True, text=True,
                          env=env, timeout=timeout, cwd=ROOT)


# --- end to end: hetplan train --verify ---------------------------------------------------------------
# layers.1 and layers.3 of tiny-moe are MoE: 4 experts (dim 0) of width 256 (fc_weight dim 2); rank 0's shard
FC1, FC3 = "layers.1.mlp.experts.fc_weight", "layers.3.mlp.experts.fc_weight"
CASES = {
    "ep2": ("tiny-moe", dict(dp=2, ep=2), {FC1: [2, 64, 256]}),
    # two expert-data-parallel copies of each expert shard; layer 1 ZeRO-3 shards its experts over them
    # (FSDP on the edp mesh), layer 3 ZeRO-1 shards their optimizer states over them (hetplan.runtime.zero1)
    "ep2xdp2": ("tiny-moe", dict(dp=4, ep=2, zero=(0, 0, 3, 2, 1, 0)), {FC1: [1, 64, 256], FC3: [2, 64, 256]}),
    "ep2xpp2": ("tiny-moe", dict(dp=2, ep=2, pp=2), {FC1: [2, 64, 256]}),
    "tp2xdp2": ("tiny-moe", dict(dp=2, tp=2, zero=3), {FC1: [2, 64, 128]}),  # expert TP, FSDP over dp
    "ep2xtp2": ("tiny-moe", dict(dp=2, ep=2, tp=2), {FC1: [2, 64, 128]}),  # expert TP inside each EP rank
    "cp2xep2": ("tiny-moe", dict(cp=2, ep=2, zero=3), {FC1: [2, 64, 256]}),  # dense weights ZeRO-3 over cp
    "cp2xtp2": ("tiny-gpt", dict(cp=2, tp=2), {}),
    "cp2xpp2": ("tiny-gpt", dict(cp=2, pp=2), {}),
}


def _check_summary(case: str, summary: dict) -> None:
    """The layout names CP where the plan has it; rank 0 really holds its experts' shard, no more."""
    _, degrees, shards = CASES[case]
    if degrees.get("cp", 1) > 1:
        assert f"cp={degrees['cp']}" in summary["layout"], summary["layout"]
    for name, local_shape in shards.items():
        glob, local, placements = summary["parameters"][name]
        assert list(glob) == [4, 64, 256] and list(local) == local_shape, (name, glob, local, placements)


FORKED = [case for case in CASES if case != "cp2xep2"]


@pytest.mark.slow
@pytest.mark.parametrize("case", FORKED)
def test_train_matches_single_process(case: str, tmp_path) -> None:
    """The trainer ``hetplan train`` runs, in processes forked from a server that has imported torch (a
    torchrun start and a torch import per rank less than the command), against the single-process run."""
    model, degrees, _ = CASES[case]
    plan = cp_ep_plan(model, **degrees)
    path = str(tmp_path / "p.json")
    save_plan(path, plan)
    result = run(train_worker, plan.num_devices, path, STEPS, {"export": True})[0]
    assert_matches_reference(result, steps=STEPS, spec_name=model)
    _check_summary(case, result)


@pytest.mark.slow
def test_hetplan_train_verify_matches_single_process_under_cp2xep2(tmp_path) -> None:
    """The same from the command line, with its own ``--verify``, for the plan with both CP and EP."""
    model, degrees, _ = CASES["cp2xep2"]
    path = str(tmp_path / "p.json")
    save_plan(path, cp_ep_plan(model, **degrees))
    out = tmp_path / "out"
    proc = _hetplan("train", "--model", model, "--plan", path, "--steps", str(STEPS), "--verify", "--out", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "verify: OK" in proc.stdout, proc.stdout
    _check_summary("cp2xep2", json.loads((out / "summary.json").read_text()))


# --- refused before any process starts ----------------------------------------------------------------
@pytest.mark.parametrize("model, degrees, dp_split, sp, message", [
    ("tiny-gpt", dict(dp=2, ep=2), None, False, "has no mixture-of-experts layers"),
    ("tiny-moe", dict(dp=3, ep=3, gbs=6), None, False, "ep=3 does not divide the 4 experts"),
    ("tiny-moe", dict(dp=2, ep=2), (3, 1), False, "splits micro-batches unevenly"),
    ("tiny-gpt", dict(cp=2, tp=2), None, True, "sequence parallelism together with cp or ep"),
    ("tiny-moe", dict(tp=2), None, True, "sequence parallelism with the mixture-of-experts layer 'layers.1'"),
])
def test_unsupported_cp_ep_plans_are_refused_in_one_line(model, degrees, dp_split, sp, message, tmp_path,
                                                         capsys) -> None:
    """``hetplan train`` in this process (torch imported already: a process start less)."""
    path = str(tmp_path / "p.json")
    save_plan(path, cp_ep_plan(model, dp_split=dp_split, sp=sp, **degrees))
    code = main(["train", "--plan", path, "--steps", "1"])
    said = capsys.readouterr()
    assert code == 2, said.out + said.err
    lines = said.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hetplan: error:") and message in lines[0], said.err
    assert "processes" not in said.out  # nothing started
