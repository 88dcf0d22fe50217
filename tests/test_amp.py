"""The amp planner: AMP's cost (eq. 3-5) by hand, its order, OOM visibility,
exactness against the exhaustive oracle, determinism, and the CLI."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from collections import defaultdict

import pytest

from hetplan.cluster.presets import get_cluster
from hetplan.cluster.spec import ClusterSpec, NodeSpec
from hetplan.cost.model import CostModel
from hetplan.plan.workload import Workload
from hetplan.model.presets import get_model, gpt_decoder
from hetplan.search import get_planner
from hetplan.search.amp import AMPPlanner, AmpCostModel
from hetplan.search.common.degrees import enumerate_degrees
from hetplan.search.exhaustive import ExhaustivePlanner, all_splits
from hetplan.search.common.placement import heuristic_placement
from hetplan.search.baselines.uniform import uniform_plan
from hetplan.plan.validate import validate_plan

GBPS = 1e9 / 8


def two_node_cluster(per_node: int = 2) -> ClusterSpec:
    """V100s (100 Gbps inside) + T4s (50 Gbps inside), 10 Gbps between."""
    return ClusterSpec(f"v100-t4-{2 * per_node}", (NodeSpec("V100-16GB", per_node, 100.0, 10.0, name="a"),
                                                   NodeSpec("T4", per_node, 50.0, 10.0, name="b")), 10.0)


def test_amp_cost_by_hand() -> None:
    workload = Workload(get_model("tiny-gpt"), two_node_cluster(), 8)
    cost_model = CostModel(workload)
    amp = AmpCostModel(cost_model)
    model, cluster = workload.model, workload.cluster
    # pp=2, dp=2, tp=1, mbs=1 → gas 4; stage 0 on the V100 node, stage 1 on the T4 node
    devices = heuristic_placement(4, 2, 2, 1)
    assert devices == ((0, 1), (2, 3))
    terms = amp.terms(devices, 2, 1, 1)
    bounds = (0, 2, model.num_layers)

    def t_layer(index: int, device: int) -> float:
        fwd, bwd, _ = cost_model.kernel.layer_time(index, cluster.devices[device].gpu, 1, 1)
        return fwd + bwd

    stage = [sum(t_layer(i, 0) for i in range(0, 2)), sum(t_layer(i, 2) for i in range(2, model.num_layers))]
    e = model.layers[1].output_bytes * 1 / (10.0 * GBPS)  # v / b across the 10 Gbps network
    pipeline = (4 - 1) * max(stage) + e + sum(stage)  # eq. 5 (both pipelines alike)
    assert model.dtype_bytes == 4 and workload.state_bytes[1] == 4  # tiny-gpt trains in fp32: 4-byte gradients
    grads = [sum(model.layers[i].params for i in range(0, 2)) * 4,
             sum(model.layers[i].params for i in range(2, model.num_layers)) * 4]
    # the LM head is tied to the embedding, but they sit on different stages: each syncs its own copy
    sync = max(2 * (2 - 1) * grads[0] / (2 * 100.0 * GBPS), 2 * (2 - 1) * grads[1] / (2 * 50.0 * GBPS))  # eq. 3
    cost = amp.cost(terms, 4, bounds)
    assert cost.pipeline_s == pytest.approx(pipeline, rel=1e-12)
    assert cost.dp_sync_s == pytest.approx(sync, rel=1e-12)
    assert cost.total_s == pytest.approx(pipeline + sync, rel=1e-12)  # eq. 4
    # the same through a Plan
    plan = uniform_plan(workload, 2, 1, 2, 1, layer_split=[range(0, 2), range(2, model.num_layers)])
    assert amp.plan_cost(plan).total_s == pytest.approx(cost.total_s, rel=1e-12)


def test_tensor_parallel_layer_time_adds_eq3_allreduces() -> None:
    workload = Workload(get_model("gpt2-amp"), get_cluster("amp-homogeneous"), 32)
    cost_model = CostModel(workload)
    amp = AmpCostModel(cost_model)
    prefix = amp.layer_times((0, 1), 2)
    index = 3
    fwd, bwd, _ = cost_model.kernel.layer_time(index, workload.cluster.devices[0].gpu, 2, 2)
    allreduce = 2 * (2 - 1) * workload.model.layers[index].tp_comm_bytes * 2 / (2 * 50.0 * GBPS)
    assert prefix[index + 1] - prefix[index] == pytest.approx(fwd + bwd + 2 * allreduce)


def test_heterogeneous_stages_use_their_own_gpu_type() -> None:
    """The T4 stage gets fewer layers than the V100 stages (not a 0.75/0.25 blend)."""
    workload = Workload(get_model("gpt2-amp"), get_cluster("amp-heterogeneous"), 32)
    best = next(c for c in AMPPlanner().search(workload) if (c.pp, c.dp, c.tp, c.micro_batch) == (4, 4, 1, 1))
    sizes = best.partition.sizes
    assert sizes[3] < min(sizes[:3])  # stage 3 runs on the g4dn (T4) node


def test_ranked_by_amp_cost_and_oom_visible() -> None:
    """AMP's list keeps AMP's order even when plans do not fit; each RankedPlan
    carries the shared estimate, and an OOM plan says so."""
    workload = Workload(get_model("gpt2-amp"), get_cluster("amp-heterogeneous"), 32, memory_limit_bytes=5 << 30)
    ranked = get_planner("amp").plan(workload, top_k=12)
    costs = [r.planner_cost_s for r in ranked]
    assert all(c is not None for c in costs) and costs == sorted(costs)
    fits = [r.estimate.fits for r in ranked]
    assert False in fits and True in fits
    # an OOM plan ranked ahead of a fitting one: AMP's objective ignores memory (§4.5)
    assert any(not fits[i] and fits[j] for i in range(len(fits)) for j in range(i + 1, len(fits)))
    for r in ranked:
        validate_plan(r.plan, workload.model, workload.cluster)
        assert r.plan.notes[0].startswith("AMP rank")
        assert any("out of memory" in n for n in r.plan.notes) == (not r.estimate.fits)


def test_reference_dp_gives_the_same_search() -> None:
    """Running the paper's DP instead of the fast solver finds the same eq. 5
    optimum for every strategy. (Among splits tied on eq. 5 — with one
    micro-batch every split costs Σ t + e — the two may pick different ones,
    whose DP sync then differs; the paper leaves that choice open.)"""
    workload = Workload(get_model("gpt2-amp"), get_cluster("8xV100-16GB"), 8)
    key = lambda c: (c.pp, c.dp, c.tp, c.micro_batch)
    fast = {key(c): c for c in AMPPlanner("fast").search(workload)}
    reference = {key(c): c for c in AMPPlanner("reference").search(workload)}
    assert fast.keys() == reference.keys()
    for k, a in fast.items():
        b = reference[k]
        assert math.isclose(a.partition.cost_s, b.partition.cost_s, rel_tol=1e-9)
        assert math.isclose(a.cost.pipeline_s, b.cost.pipeline_s, rel_tol=1e-9)


def test_degrees_respect_nodes_heads_and_batch() -> None:
    workload = Workload(get_model("gpt2-amp"), get_cluster("amp-heterogeneous"), 32)
    degrees = enumerate_degrees(workload)
    assert all(pp * dp * tp == 16 and tp <= 4 and 32 % dp == 0 and pp <= 26 for pp, dp, tp in degrees)
    assert (1, 16, 1) in degrees and (8, 2, 1) in degrees and (4, 1, 4) in degrees
    assert not any(tp == 8 for _, _, tp in degrees)


# --- exhaustive oracle -------------------------------------------------------------------
def _exhaustive_by_strategy(workload: Workload) -> dict[tuple[int, int, int, int, tuple], list[tuple]]:
    """AMP's cost (total, pipeline) of every plan of the space, by strategy."""
    amp = AmpCostModel(CostModel(workload))
    table: dict[tuple[int, int, int, int, tuple], list[tuple]] = defaultdict(list)
    for strategy, bounds in ExhaustivePlanner("amp").plans(workload):
        terms = amp.terms(strategy.placement, strategy.dp, strategy.tp, strategy.micro_batch)
        gas = workload.global_batch_size // (strategy.dp * strategy.micro_batch)
        cost = amp.cost(terms, gas, bounds)
        key = (strategy.pp, strategy.dp, strategy.tp, strategy.micro_batch, strategy.placement)
        table[key].append((cost.total_s, cost.pipeline_s, bounds))
    return table


@pytest.mark.parametrize("model,cluster,gbs", [
    ("tiny-gpt", "8xV100-16GB", 8),       # one node: AMP's placement is the only one
    ("tiny-gpt", "8xV100-16GB", 16),
    ("tiny-gpt", "two-node", 8),          # 2 V100 + 2 T4 nodes: placements differ
    ("tiny-gpt", "two-node-8", 8),        # 4 V100 + 4 T4
    ("tiny-gpt", "metis-uneven-a", 8),    # uneven nodes (1 V100, 1 P100, 2 P100)
    ("gpt2-6", "two-node-8", 16),         # GPT-2 medium blocks, 6 of them: compute-bound layers
    ("gpt2-6", "8xV100-16GB", 16),
])
def test_amp_is_exact_within_its_space(model: str, cluster: str, gbs: int) -> None:
    """On ≤ 8 GPUs the exhaustive enumeration of AMP's space, scored by AMP's
    own objective, agrees with amp. Where the best of the whole space beats
    amp, the test names why: a placement other than AMP's heuristic one, or
    the DP-sync term of eq. 4, which AMP's layer assignment (eq. 5) ignores."""
    spec = {"two-node": two_node_cluster(2), "two-node-8": two_node_cluster(4)}.get(cluster) or get_cluster(cluster)
    spec_model = gpt_decoder("gpt2-6", num_layers=6, hidden=1024, heads=16, seq=1024) if model == "gpt2-6" \
        else get_model(model)
    workload = Workload(spec_model, spec, gbs)
    candidates = AMPPlanner().search(workload)
    table = _exhaustive_by_strategy(workload)
    n = workload.cluster.num_devices
    # 1. per strategy (AMP's placement), AMP's split is the eq. 5 optimum over all splits
    for c in candidates:
        key = (c.pp, c.dp, c.tp, c.micro_batch, heuristic_placement(n, c.pp, c.dp, c.tp))
        assert math.isclose(c.cost.pipeline_s, min(p for _, p, _ in table[key]), rel_tol=1e-9)
        assert len(table[key]) == len(list(all_splits(workload.model.num_layers, c.pp)))
    # 2. the whole space never beats amp unless for a named reason
    amp_best = candidates[0].cost.total_s
    space_best = min(t for rows in table.values() for t, _, _ in rows)
    assert space_best <= amp_best * (1 + 1e-9)
    same_placement = {k: r for k, r in table.items() if k[4] == heuristic_placement(n, *k[:3])}
    same_placement_best = min(t for rows in same_placement.values() for t, _, _ in rows)
    reasons = []
    if same_placement_best < amp_best * (1 - 1e-9):
        # with AMP's own placement a plan beats amp: it is no better on eq. 5 (AMP is exact there) but has a
        # smaller DP sync — eq. 4's sync term is not part of the layer assignment's objective (eq. 5), and
        # among splits tied on eq. 5 the paper does not say which to take
        reasons.append("dp-sync")
        key, rows = min(same_placement.items(), key=lambda kr: min(t for t, _, _ in kr[1]))
        total, pipeline, _ = min(rows)
        amp_same = next(c for c in candidates if (c.pp, c.dp, c.tp, c.micro_batch) == key[:4])
        assert pipeline >= amp_same.cost.pipeline_s * (1 - 1e-9)
        assert total - pipeline < amp_same.cost.dp_sync_s
    if space_best < same_placement_best * (1 - 1e-9):
        reasons.append("placement")  # a placement other than AMP's heuristic one is better
        assert workload.cluster.num_nodes > 1
    print(f"{model} on {cluster} gbs {gbs}: amp {amp_best:.6g} s, best with AMP's placement "
          f"{same_placement_best:.6g} s, best of the space {space_best:.6g} s; differences: {reasons or 'none'}")


def test_single_node_amp_matches_exhaustive_exactly() -> None:
    workload = Workload(get_model("tiny-gpt"), get_cluster("8xV100-16GB"), 8)
    best = ExhaustivePlanner("amp").plan(workload, 1)[0]
    amp = get_planner("amp").plan(workload, 1)[0]
    assert best.planner_cost_s == pytest.approx(amp.planner_cost_s, rel=1e-12)


# --- determinism and CLI ---------------------------------------------------------------------
_SCRIPT = """
import json
from hetplan.cluster.presets import get_cluster
from hetplan.plan.workload import Workload
from hetplan.model.presets import get_model, gpt_decoder
from hetplan.search import get_planner
out = {}
w = Workload(get_model("gpt2-amp"), get_cluster("amp-heterogeneous"), 32)
for name in ("amp", "megatron", "random"):
    out[name] = [r.to_dict() for r in get_planner(name).plan(w, 20)]
small = Workload(get_model("tiny-gpt"), get_cluster("metis-uneven-a"), 8)
out["exhaustive"] = [r.to_dict() for r in get_planner("exhaustive").plan(small, 5)]
print(json.dumps(out, sort_keys=True))
"""


def test_same_ranked_list_whatever_the_hash_seed() -> None:
    outputs = []
    for seed in ("0", "4242"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        result = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, env=env,
                                timeout=300)
        assert result.returncode == 0, result.stderr
        outputs.append(result.stdout)
    assert outputs[0] == outputs[1]
    assert len(json.loads(outputs[0])["amp"]) == 20


def test_cli_plan_and_compare(tmp_path) -> None:
    out = tmp_path / "amp.json"
    result = subprocess.run([sys.executable, "-m", "hetplan.cli", "plan", "--planner", "amp", "--top", "4",
                             "--json", str(out)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "planner cost" in result.stdout and "AMP rank 1" in result.stdout
    plans = json.loads(out.read_text())["plans"]
    assert [p["planner_cost_s"] for p in plans] == sorted(p["planner_cost_s"] for p in plans)
    assert all("fits" in p["estimate"] for p in plans)
    rows_path = tmp_path / "compare.json"
    result = subprocess.run([sys.executable, "-m", "hetplan.cli", "compare", "--planners", "amp,megatron,random",
                             "--json", str(rows_path)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    rows = {r["planner"]: r for r in json.loads(rows_path.read_text())}
    assert set(rows) == {"amp", "megatron", "random"}
    for row in rows.values():
        for key in ("iteration_time_s", "samples_per_s", "fits", "search_time_s", "plan"):
            assert key in row
    assert rows["amp"]["speedup"] > 1.4
