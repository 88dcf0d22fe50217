"""``hetplan replan``: a plan file re-planned for the GPUs that are left.

The re-plan must be the plan a user gets by writing the smaller cluster by hand and planning again with
the same settings (the planners are deterministic, so every node that re-plans agrees), and every
mistake in ``--without`` is one line.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hetplan.app.replan import cluster_without, layer_moves, lost_devices
from hetplan.cli import main
from hetplan.cluster.io import load_cluster
from hetplan.cluster.spec import ClusterSpec, NodeSpec
from hetplan.plan.file import read_plan_file

MODEL, CLUSTER, BATCH = "gpt3-1.3b", "galvatron-16x-a100", "64"


def _plan_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> Path:
    path = tmp_path / "plan.json"
    assert main(["plan", "--model", MODEL, "--cluster", CLUSTER, "--global-batch", BATCH, "--quiet",
                 "--json", str(path)]) == 0
    capsys.readouterr()
    return path


def _hand_written_cluster(tmp_path: Path, gpus_per_node: list[int]) -> Path:
    """The preset's nodes (A100-40GB, 2400 Gb/s NVLink, 100 Gb/s between nodes) with fewer GPUs, as a
    user would write the cluster that is left."""
    nodes = "".join(f"  - {{name: node-{i}, gpu: A100-40GB, gpus: {n}, intra_node_bandwidth_gbps: 2400}}\n"
                    for i, n in enumerate(gpus_per_node))
    path = tmp_path / "left.yaml"
    path.write_text(f"name: lab-left\ninter_node_bandwidth_gbps: 100\nnodes:\n{nodes}")
    return path


def _best(path: Path) -> tuple[str, float]:
    data = json.loads(path.read_text())
    best = data["plans"][0]
    return json.dumps(best["plan"]["stages"], sort_keys=True), best["estimate"]["iteration_time_s"]


@pytest.mark.parametrize("without,left", [(["5"], [7, 8]), (["node:0"], [8]), (["gpu:3", "12"], [7, 7])])
def test_replan_equals_planning_the_cluster_that_is_left(tmp_path: Path, capsys: pytest.CaptureFixture[str], without: list[str],
                                                       left: list[int]) -> None:
    plan = _plan_file(tmp_path, capsys)
    new = tmp_path / "new.json"
    assert main(["replan", str(plan), "--without", *without, "--quiet", "--json", str(new)]) == 0
    out = capsys.readouterr().out
    assert f"{sum(left)} GPUs left" in out and "old plan" in out
    direct = tmp_path / "direct.json"
    assert main(["plan", "--model", MODEL, "--cluster", str(_hand_written_cluster(tmp_path, left)),
                 "--global-batch", BATCH, "--quiet", "--json", str(direct)]) == 0
    assert _best(new) == _best(direct)
    replanned = read_plan_file(new)
    assert replanned.cluster.num_devices == sum(left)
    assert replanned.plan(1).global_batch_size == int(BATCH)  # validated against the smaller cluster


def test_the_new_plan_file_is_estimated_and_re_planned_the_same_twice(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plan = _plan_file(tmp_path, capsys)
    first, second = tmp_path / "a.json", tmp_path / "b.json"
    for out in (first, second):
        assert main(["replan", str(plan), "--without", "node:1", "--quiet", "--json", str(out)]) == 0
    assert _best(first) == _best(second)
    assert main(["estimate", str(first)]) == 0
    assert "8 GPUs" in capsys.readouterr().out


def test_every_layer_moves_once_from_its_old_stage_to_its_new_one(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pf = read_plan_file(_plan_file(tmp_path, capsys))
    old, new = pf.plan(1), pf.plan(3)
    moves = layer_moves(old, new, pf.model.num_layers)
    covered = [layer for m in moves for layer in range(m.first, m.last + 1)]
    assert covered == list(range(pf.model.num_layers))
    for m in moves:
        for layer in range(m.first, m.last + 1):
            assert layer in old.stages[m.old_stage].layers and layer in new.stages[m.new_stage].layers


def test_a_bandwidth_matrix_keeps_the_rows_of_the_gpus_left() -> None:
    matrix = [[0.0 if i == j else float(10 * i + j + 1) for j in range(4)] for i in range(4)]
    cluster = ClusterSpec("m", (NodeSpec("A100-80GB", 2, 600.0), NodeSpec("H100", 2, 900.0)), 100.0,
                          bandwidth_matrix_gbps=tuple(map(tuple, matrix)))
    left = cluster_without(cluster, (1,))
    assert [n.num_gpus for n in left.nodes] == [1, 2] and [d.gpu.name for d in left.devices] == \
        ["A100-80GB", "H100", "H100"]
    assert left.bandwidth_matrix_gbps == tuple(tuple(matrix[i][j] for j in (0, 2, 3)) for i in (0, 2, 3))
    assert [n.gpu.name for n in cluster_without(cluster, (0, 1)).nodes] == ["H100"]


@pytest.mark.parametrize("without,message", [
    (["16"], "has GPUs 0..15"),
    (["node:2"], "has nodes 0..1"),
    (["rack:1"], "give a GPU id (5 or gpu:5) or a node"),
    (["node:0", "node:1"], "nothing is left to plan on"),
    (["-1"], "give a GPU id"),
])
def test_bad_without_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str], without: list[str],
                                    message: str) -> None:
    plan = _plan_file(tmp_path, capsys)
    assert main(["replan", str(plan), "--without", *without]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hetplan: error: ") and message in err and len(err.strip().splitlines()) == 1


def test_a_plan_file_without_its_cluster_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = json.loads(_plan_file(tmp_path, capsys).read_text())
    old = tmp_path / "names-only.json"
    old.write_text(json.dumps([data["plans"][0]]))  # format 1: the plan alone
    assert main(["replan", str(old), "--without", "1"]) == 2
    assert "format 1" in capsys.readouterr().err


def test_a_node_is_named_by_index_or_name() -> None:
    cluster = load_cluster(CLUSTER)
    assert lost_devices(cluster, ["node:1"]) == lost_devices(cluster, ["node:node-1"]) == tuple(range(8, 16))
