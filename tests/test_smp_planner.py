"""The ``smp`` planner: SageMaker's tree partition (Appendix C) and its plans.

Algorithm pieces against hand-computed and brute-force answers; the planner
on three module trees (tests/smp_models.py) through the Python API and the CLI.
Training the plans: tests/distributed/test_smp_train.py.
"""

from __future__ import annotations

import itertools
import os
import random
import subprocess
import sys

import numpy as np
import pytest

from hetplan.cluster.io import load_cluster
from hetplan.cost.model import CostModel
from hetplan.plan.workload import Workload
from hetplan.errors import HetplanError
from hetplan.model.presets import get_model
from hetplan.search.registry import get_planner
from hetplan.search.smp import SMPPlanner
from hetplan.search.smp.planner import smp_split
from hetplan.search.smp.tree import balanced_segments, dhondt_seats, dhondt_sets, module_tree

TESTS = os.path.dirname(os.path.abspath(__file__))


# --- D'Hondt ---------------------------------------------------------------------------------
def test_dhondt_hand_computed() -> None:
    # quotients: A .5 .25 .167, B .3 .15, C .2 -> seats A, B, A, C
    assert dhondt_seats([0.5, 0.3, 0.2], 4) == [2, 1, 1]
    # Algorithm 3 hands devices out in that order: 0 -> A, 1 -> B, 2 -> A, 3 -> C
    assert dhondt_sets([0, 1, 2, 3], [0.5, 0.3, 0.2]) == [[0, 2], [1], [3]]
    # small segments get no device (they join a neighbour), as the paper intends
    assert dhondt_seats([0.9, 0.05, 0.05], 2) == [2, 0, 0]


def test_dhondt_minimises_largest_cost_per_seat_ratio() -> None:
    """The paper's footnote: D'Hondt minimises the largest seats/cost ratio; check against every allocation."""
    rng = random.Random(3)
    for _ in range(200):
        costs = [rng.uniform(0.05, 1.0) for _ in range(rng.randint(1, 4))]
        seats = rng.randint(1, 6)
        got = dhondt_seats(costs, seats)
        assert sum(got) == seats
        best = min(max(s / c for s, c in zip(alloc, costs))
                   for alloc in itertools.product(range(seats + 1), repeat=len(costs)) if sum(alloc) == seats)
        assert max(s / c for s, c in zip(got, costs)) == pytest.approx(best)


# --- balanced segments (eq. 2-3) --------------------------------------------------------------
def brute_force_segments(costs: list[float], k: int) -> float:
    n = len(costs)
    best = float("inf")
    for cuts in itertools.combinations(range(1, n), k - 1):
        bounds = (0, *cuts, n)
        best = min(best, max(sum(costs[a:b]) for a, b in zip(bounds, bounds[1:])))
    return best


def test_balanced_segments_equal_brute_force_optimum() -> None:
    rng = random.Random(7)
    for _ in range(300):
        n = rng.randint(1, 8)
        costs = [rng.choice([0.0, rng.uniform(0, 1)]) for _ in range(n)]
        k = rng.randint(1, n)
        segs = balanced_segments(costs, k)
        assert len(segs) == k and all(len(s) > 0 for s in segs)
        assert [i for s in segs for i in s] == list(range(n))
        assert max(sum(costs[i] for i in s) for s in segs) == pytest.approx(brute_force_segments(costs, k))


def test_balanced_segments_hand_computed() -> None:
    assert balanced_segments([1, 2, 3, 4, 5], 2) == [range(0, 3), range(3, 5)]  # 6 | 9, the only optimum
    assert balanced_segments([1, 2, 3, 4, 5], 3) == [range(0, 3), range(3, 4), range(4, 5)]  # 6 | 4 | 5
    # several optima (largest 4): the earliest cuts win
    assert balanced_segments([3, 1, 1, 1, 2, 2], 3) == [range(0, 1), range(1, 4), range(4, 6)]
    assert balanced_segments([1, 2], 5) == [range(0, 1), range(1, 2)]  # never more segments than items


# --- the tree and alpha ------------------------------------------------------------------------
NAMES = ["embed", "layers.0", "layers.1", "layers.2", "layers.3", "head"]
MEMORY = np.array([100.0, 1, 1, 1, 1, 100])  # embedding and head hold the memory
COMPUTE = np.array([0.0, 1, 1, 1, 1, 0])  # the blocks do the compute


def stages(alpha: float, pp: int = 2) -> list[list[str]]:
    split = smp_split(module_tree(NAMES), MEMORY, COMPUTE, alpha, pp)
    return [[NAMES[i] for i in r] for r in split.stages]


def test_module_tree_follows_module_paths() -> None:
    root = module_tree(NAMES)
    assert [c.name for c in root.children] == ["embed", "layers", "head"]
    assert [c.name for c in root.children[1].children] == [f"layers.{i}" for i in range(4)]
    scattered = module_tree(["a.x", "b", "a.y"])  # 'a' is not consecutive: its children join the root
    assert [c.name for c in scattered.children] == ["a.x", "b", "a.y"]


def test_alpha_one_balances_memory() -> None:
    # C(root's children) ~ [100, 8, 100] (the container counts its blocks twice, Appendix C.3):
    # segments [embed | layers, head], one device each
    assert stages(1.0) == [["embed"], ["layers.0", "layers.1", "layers.2", "layers.3", "head"]]


def test_alpha_zero_balances_compute() -> None:
    # compute only: 'layers' gets both devices (embed and head join their neighbours), split 2 + 2
    assert stages(0.0) == [["embed", "layers.0", "layers.1"], ["layers.2", "layers.3", "head"]]


def test_a_leaf_given_several_devices_is_reported() -> None:
    split = smp_split(module_tree(["a", "b"]), np.array([9.0, 1.0]), np.array([9.0, 1.0]), 0.5, 2)
    assert not split.stages and "'a'" in split.uncut


def test_alpha_out_of_range_is_refused() -> None:
    with pytest.raises(HetplanError, match="alpha"):
        SMPPlanner(alpha=1.5)


# --- the planner on ModelSpecs --------------------------------------------------------------------
def test_planner_on_a_preset_is_ranked_by_the_shared_cost_model() -> None:
    workload = Workload(get_model("tiny-gpt"), load_cluster("local-cpu-4"), 8)
    ranked = get_planner("smp").plan(workload, top_k=50)
    cost = CostModel(workload)
    assert {len(r.plan.stages) for r in ranked} == {1, 2, 4}
    for r in ranked:
        assert r.plan.planner == "smp" and all(s.tp == 1 for s in r.plan.stages)
        assert r.estimate == cost.estimate(r.plan)
    times = [(0 if r.estimate.fits else 1, r.estimate.iteration_time_s) for r in ranked]
    assert times == sorted(times)


def test_forced_pipeline_degree_that_does_not_divide_is_refused() -> None:
    workload = Workload(get_model("tiny-gpt"), load_cluster("local-cpu-4"), 8)
    with pytest.raises(HetplanError, match="pp=3 does not divide"):
        SMPPlanner(pp=3).plan(workload)


# --- module trees given as Python code (needs torch) ------------------------------------------
@pytest.fixture(scope="module")
def traced() -> dict:
    pytest.importorskip("torch")
    sys.path.insert(0, TESTS)
    from hetplan.model.load import load_model

    return {name: load_model(f"smp_models:{name}") for name in ("gpt", "resnet", "encdec", "encdec_two_inputs")}


def test_layers_are_the_runtime_pipeline_units(traced: dict) -> None:
    names = {k: [layer.name for layer in spec.layers] for k, spec in traced.items()}
    assert names["resnet"] == ["stem", "blocks.0", "blocks.1", "blocks.2", "blocks.3", "head"]  # skips stay inside
    assert names["encdec"] == ["embed", "encoder.layers.0", "encoder.layers.1", "encoder.final",
                               "decoder.layers.0", "decoder.layers.1", "head"]
    assert names["gpt"][:5] == ["embed", "layers.0", "layers.1", "layers.2", "layers.3"]
    assert traced["resnet"].runtime.pipeline == ""
    assert "is not exactly the model's inputs" in traced["encdec_two_inputs"].runtime.pipeline


@pytest.mark.parametrize("name", ["gpt", "resnet", "encdec"])
def test_smp_partitions_each_module_tree(traced: dict, name: str) -> None:
    spec = traced[name]
    workload = Workload(spec, load_cluster("local-cpu-4"), 8)
    for pp in (2, 4):
        plan = SMPPlanner(pp=pp).plan(workload, top_k=1)[0].plan
        covered = [i for s in plan.stages for i in s.layers]
        assert len(plan.stages) == pp and covered == list(range(spec.num_layers))
        assert "SMP tree partition" in plan.notes[0]


def test_model_that_is_no_chain_gets_one_stage(traced: dict) -> None:
    workload = Workload(traced["encdec_two_inputs"], load_cluster("local-cpu-4"), 8)
    ranked = SMPPlanner().plan(workload, top_k=10)
    assert {len(r.plan.stages) for r in ranked} == {1}
    with pytest.raises(HetplanError, match="cannot pipeline this model"):
        SMPPlanner(pp=2).plan(workload)


def test_python_object_path() -> None:
    torch = pytest.importorskip("torch")
    sys.path.insert(0, TESTS)
    import smp_models

    from hetplan.model.source import module_spec

    spec = module_spec(smp_models.ResNet(), (torch.zeros(2, 3, 8, 8),), name="my-resnet")
    ranked = SMPPlanner(pp=2).plan(Workload(spec, load_cluster("local-cpu-4"), 8), top_k=1)
    assert ranked[0].plan.model == "my-resnet" and len(ranked[0].plan.stages) == 2


def run_cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": TESTS + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, "-m", "hetplan", *args], capture_output=True, text=True, env=env,
                          timeout=300)


def test_cli_plan_with_module_function() -> None:
    pytest.importorskip("torch")
    out = run_cli("plan", "--planner", "smp", "--smp-pp", "2", "--smp-alpha", "0.5", "--model",
                  "smp_models:resnet", "--cluster", "local-cpu-4", "--global-batch", "8", "--top", "1")
    assert out.returncode == 0, out.stderr
    assert "SMP tree partition (alpha=0.5): stem..blocks.1; blocks.2..head" in out.stdout


def test_cli_errors_are_one_line() -> None:
    pytest.importorskip("torch")
    out = run_cli("plan", "--planner", "smp", "--model", "smp_models:nothing_here", "--cluster", "local-cpu-4",
                  "--global-batch", "8")
    assert out.returncode == 2 and out.stderr.startswith("hetplan: error: model 'smp_models:nothing_here'")
    assert len(out.stderr.strip().splitlines()) == 1
