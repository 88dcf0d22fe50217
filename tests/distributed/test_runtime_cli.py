"""End to end from the command line, with torchrun: plan, train --verify, run a user script."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def _hetplan(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.path.join(ROOT, "src"), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "hetplan.cli", *args], capture_output=True, text=True,
                          env=env, timeout=timeout, cwd=ROOT)


@pytest.mark.slow
def test_plan_then_train_verify_on_two_processes(tmp_path) -> None:
    plan = str(tmp_path / "p.json")
    proc = _hetplan("plan", "--model", "tiny-gpt", "--cluster", "local-cpu-2", "--global-batch", "8",
                    "--json", plan)
    assert proc.returncode == 0, proc.stderr
    proc = _hetplan("train", "--model", "tiny-gpt", "--plan", plan, "--steps", "3", "--verify")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "2 processes" in out
    assert len(re.findall(r"^step +\d+  loss ", out, re.M)) == 3, out  # one line per step, from rank 0
    assert "verify: OK" in out, out


@pytest.mark.slow
def test_run_starts_a_user_script_with_the_plan(tmp_path) -> None:
    plan = str(tmp_path / "p.json")
    proc = _hetplan("estimate", "--model", "tiny-gpt", "--cluster", "local-cpu-2", "--global-batch", "8",
                    "--tp", "1", "--pp", "2", "--dp", "1", "--micro-batch", "2", "--json", plan)
    assert proc.returncode == 0, proc.stderr
    export = str(tmp_path / "model.pt")
    proc = _hetplan("run", plan, "--", os.path.join(ROOT, "examples", "train.py"), "--steps", "2",
                    "--export", export)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "step    2" in proc.stdout, proc.stdout
    import torch

    from hetplan.model import get_model
    from hetplan.runtime.models import build_preset_model

    state = torch.load(export)
    model = build_preset_model(get_model("tiny-gpt"))
    model.load_state_dict(state)  # the export loads into the unsplit model


THREE_NODES = """name: three-small-nodes
inter_node_bandwidth_gbps: 10.0
nodes:
- {name: a, gpu: A100-40GB, gpus: 2, intra_node_bandwidth_gbps: 300.0, inter_node_bandwidth_gbps: 10.0}
- {name: b, gpu: V100-16GB, gpus: 1, intra_node_bandwidth_gbps: 150.0, inter_node_bandwidth_gbps: 10.0}
- {name: c, gpu: T4, gpus: 1, intra_node_bandwidth_gbps: 50.0, inter_node_bandwidth_gbps: 10.0}
"""


@pytest.mark.slow
def test_metis_plan_for_three_nodes_trains_and_verifies_on_one_machine(tmp_path) -> None:
    """The heterogeneous plans that are hetplan's reason to exist can be tried here:
    `hetplan train` runs a plan for several nodes as local processes (and says so)."""
    cluster = tmp_path / "three.yaml"
    cluster.write_text(THREE_NODES)
    plan = str(tmp_path / "p.json")
    proc = _hetplan("plan", "--planner", "metis", "--model", "tiny-gpt", "--cluster", str(cluster),
                    "--global-batch", "8", "--json", plan, "--quiet")
    assert proc.returncode == 0, proc.stderr
    from hetplan.planfile import read_plan_file
    from hetplan.runtime.launch import plan_nodes

    pf = read_plan_file(plan)
    best = pf.plan()
    assert len(plan_nodes(best, pf.cluster)) > 1
    assert any(len(set(s.dp_split)) > 1 for s in best.stages), best  # an uneven data split
    cluster.unlink()  # the plan file holds the cluster
    proc = _hetplan("train", "--model", "tiny-gpt", "--plan", plan, "--steps", "2", "--verify")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "nodes of 'three-small-nodes'; hetplan train runs its" in proc.stdout, proc.stdout
    assert "verify: OK" in proc.stdout, proc.stdout
