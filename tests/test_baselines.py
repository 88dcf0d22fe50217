"""Baselines: Megatron's heuristics, AMP's random search, and the exhaustive oracle."""

from __future__ import annotations

import itertools
import math

import pytest

from hetplan.cluster.presets import get_cluster
from hetplan.cluster.spec import ClusterSpec, NodeSpec
from hetplan.cost.model import CostModel
from hetplan.plan.workload import Workload
from hetplan.errors import HetplanError
from hetplan.model.presets import get_model
from hetplan.search import get_planner
from hetplan.search.exhaustive import ExhaustivePlanner
from hetplan.search.baselines.megatron import MegatronPlanner, layer_split, megatron_degrees
from hetplan.search.common.partition import balanced_partition
from hetplan.search.common.placement import canonical_placements, count_canonical_placements, heuristic_placement
from hetplan.search.baselines.random_search import RandomPlanner
from hetplan.search.baselines.uniform import uniform_plan
from hetplan.search.common.degrees import divisors
from hetplan.search.common.layer_splits import block_split
from hetplan.plan.validate import validate_plan


# --- megatron -------------------------------------------------------------------------------
def test_megatron_picks_pure_data_parallelism_when_the_model_fits() -> None:
    workload = Workload(get_model("gpt2-amp"), get_cluster("amp-heterogeneous"), 32)
    best = get_planner("megatron").plan(workload, 1)[0]
    assert [(s.dp, s.tp) for s in best.plan.stages] == [(16, 1)] and best.estimate.fits


@pytest.mark.parametrize("limit_gib", [0, 4, 3])
def test_megatron_uses_the_smallest_tp_pp_that_fits(limit_gib: int) -> None:
    """Each proposal's tp x pp is the smallest that fits for its micro-batch
    size (checked against every smaller valid (tp, pp) with both split rules)."""
    workload = Workload(get_model("gpt2-amp"), get_cluster("amp-homogeneous"), 32,
                        memory_limit_bytes=limit_gib << 30)
    cost_model = CostModel(workload)
    proposals = MegatronPlanner().candidates(workload, cost_model)
    assert proposals
    for plan in proposals:
        stage = plan.stages[0]
        u = plan.micro_batch_size // stage.dp
        product = stage.tp * plan.pp
        assert cost_model.estimate(plan).fits
        assert stage.tp <= 4  # inside a g4dn node
        for tp, pp in megatron_degrees(workload):
            dp = 16 // (tp * pp)
            if tp * pp >= product or 32 % (dp * u):
                continue
            for rule in ("layers", "parameters"):
                smaller = uniform_plan(workload, dp, tp, pp, u, layer_split=layer_split(workload, pp, rule))
                assert not cost_model.estimate(smaller).fits
    if limit_gib:
        assert min(p.stages[0].tp * p.pp for p in proposals) > 1  # pure DP no longer fits


def test_megatron_layer_split_rules() -> None:
    workload = Workload(get_model("transgan-het"), get_cluster("amp-hetero-model"), 64)
    assert layer_split(workload, 4, "layers") == block_split(workload.model, 4)
    by_params = layer_split(workload, 4, "parameters")
    bounds = balanced_partition([float(layer.params) for layer in workload.model.layers], 4)
    assert [r.start for r in by_params] + [by_params[-1].stop] == list(bounds)
    with pytest.raises(HetplanError, match="split rule"):
        layer_split(workload, 4, "flops")


# --- random ---------------------------------------------------------------------------------
def test_random_search_is_reproducible_and_valid() -> None:
    workload = Workload(get_model("gpt2-amp"), get_cluster("amp-heterogeneous"), 32)
    first = RandomPlanner(num_samples=50, seed=1).sample(workload)
    again = RandomPlanner(num_samples=50, seed=1).sample(workload)
    other = RandomPlanner(num_samples=50, seed=2).sample(workload)
    assert [p.to_dict() for p in first] == [p.to_dict() for p in again]
    assert [p.to_dict() for p in first] != [p.to_dict() for p in other]
    assert len(first) == 50
    degrees = set()
    for plan in first:
        validate_plan(plan, workload.model, workload.cluster)
        for stage in plan.stages:
            for group in stage.tp_groups():
                assert len({workload.cluster.devices[d].node for d in group}) == 1
        degrees.add((plan.pp, plan.stages[0].dp, plan.stages[0].tp))
    assert len(degrees) >= 6  # it really samples the space
    ranked = RandomPlanner(num_samples=50, seed=1).plan(workload, 5)
    times = [r.estimate.iteration_time_s for r in ranked]
    assert times == sorted(times) and ranked[0].estimate.fits


# --- exhaustive -----------------------------------------------------------------------------
def _orbit_key(cluster, placement) -> tuple:
    """A placement up to swapping GPUs within a node and swapping identical nodes."""
    labels = [cluster.devices[d].node for stage in placement for d in stage]
    kinds = {q: (cluster.nodes[q].gpu.name, cluster.nodes[q].num_gpus, cluster.nodes[q].intra_bandwidth_gbps,
                 cluster.node_inter_gbps(q)) for q in range(cluster.num_nodes)}
    rename: dict[int, int] = {}
    counters: dict[tuple, int] = {}
    out = []
    for q in labels:
        if q not in rename:
            rename[q] = counters.get(kinds[q], 0)
            counters[kinds[q]] = rename[q] + 1
        out.append((kinds[q], rename[q]))
    return tuple(out)


def _two_pairs() -> ClusterSpec:
    """Two identical P100 nodes and two identical T4 nodes, one GPU each."""
    return ClusterSpec("two-pairs", (NodeSpec("P100", 1, 126.0), NodeSpec("P100", 1, 126.0),
                                     NodeSpec("T4", 1, 126.0), NodeSpec("T4", 1, 126.0)), 16.0)


@pytest.mark.parametrize("cluster_name,pp,dp,tp", [
    ("metis-uneven-a", 2, 2, 1), ("metis-uneven-a", 4, 1, 1), ("metis-uneven-b", 1, 4, 1),
    ("metis-uneven-d", 2, 4, 1),  # 8 GPUs in nodes of 1 + 1 + 2 + 4
    ("metis-t4-v100-8", 2, 2, 2),  # 4 T4 + 4 V100, TP pairs
    ("two-pairs", 4, 1, 1),  # identical nodes: only one placement per orbit is kept
])
def test_canonical_placements_cover_every_placement_once(cluster_name: str, pp: int, dp: int, tp: int) -> None:
    cluster = _two_pairs() if cluster_name == "two-pairs" else get_cluster(cluster_name)
    canonical = list(canonical_placements(cluster, pp, dp, tp))
    assert count_canonical_placements(cluster, pp, dp, tp) == len(canonical)
    keys = [_orbit_key(cluster, p) for p in canonical]
    assert len(set(keys)) == len(keys)  # no orbit twice
    everything = set()
    for perm in itertools.permutations(range(cluster.num_devices)):
        stages = tuple(tuple(perm[j * dp * tp:(j + 1) * dp * tp]) for j in range(pp))
        groups = [s[r * tp:(r + 1) * tp] for s in stages for r in range(dp)]
        if all(len({cluster.devices[d].node for d in g}) == 1 for g in groups):
            everything.add(_orbit_key(cluster, stages))
    assert everything == set(keys)  # every valid placement is represented


def test_symmetric_placements_cost_the_same() -> None:
    """What the symmetry reduction assumes: swapping GPUs inside a node leaves
    the shared cost model's estimate unchanged."""
    workload = Workload(get_model("tiny-gpt"), get_cluster("metis-uneven-d"), 8)
    cost_model = CostModel(workload)
    base = uniform_plan(workload, 2, 1, 4, 1)
    swapped_stages = []
    swap = {4: 7, 7: 4, 5: 6, 6: 5}  # inside the 4-GPU node
    for stage in base.stages:
        swapped_stages.append(type(stage)(stage.layers, tuple(swap.get(d, d) for d in stage.devices), stage.dp,
                                          stage.tp, stage.dp_split, stage.strategies))
    swapped = base.with_changes(stages=tuple(swapped_stages))
    a, b = cost_model.estimate(base), cost_model.estimate(swapped)
    assert a.iteration_time_s == pytest.approx(b.iteration_time_s, rel=1e-12)
    assert a.max_memory_bytes == b.max_memory_bytes


def test_exhaustive_is_the_oracle_for_the_other_planners() -> None:
    workload = Workload(get_model("tiny-gpt"), get_cluster("metis-uneven-a"), 8)
    best = get_planner("exhaustive").plan(workload, 1)[0]
    assert best.estimate.fits
    ranked = ExhaustivePlanner().ranked(workload)
    assert len(ranked) == ExhaustivePlanner().count(workload)
    for name in ("amp", "megatron", "random"):
        other = get_planner(name).plan(workload, 50)
        fitting = [r.estimate.iteration_time_s for r in other if r.estimate.fits]
        assert best.estimate.iteration_time_s <= min(fitting) * (1 + 1e-12), name
    # AMP's heuristic placement is one of the enumerated ones
    placements = set(canonical_placements(workload.cluster, 2, 2, 1))
    assert heuristic_placement(4, 2, 2, 1) in placements


def test_exhaustive_refuses_huge_spaces() -> None:
    workload = Workload(get_model("gpt2-amp"), get_cluster("amp-heterogeneous"), 32)
    with pytest.raises(HetplanError, match="exhaustive space has"):
        ExhaustivePlanner(max_plans=10_000).plan(workload)


def test_exhaustive_counts_all_splits() -> None:
    workload = Workload(get_model("tiny-gpt"), get_cluster("8xV100-16GB"), 8)
    planner = ExhaustivePlanner()
    strategies = list(planner.strategies(workload))
    assert {(s.pp, s.dp, s.tp) for s in strategies} == {(pp, 8 // (pp * tp), tp) for tp in (1, 2, 4)
                                                        for pp in divisors(8 // tp) if pp <= 6}
    n = workload.model.num_layers
    assert planner.count(workload) == sum(math.comb(n - 1, s.pp - 1) for s in strategies)


# --- uniform: interleaved 1F1B --------------------------------------------------------------


def test_uniform_offers_every_allowed_interleaving_of_each_pipelined_plan() -> None:
    """Each 1F1B plan with pp > 1 and micro-batches a multiple of pp comes with
    interleaved variants for every chunk count its smallest stage holds
    (INTERLEAVE_CHOICES), the same layers, devices and strategies; none other."""
    from hetplan.search.baselines.uniform import INTERLEAVE_CHOICES, UniformPlanner

    workload = Workload(get_model("gpt3-1.3b"), get_cluster("16xA100-80GB"), 32)
    plans = list(UniformPlanner(interleave_choices=INTERLEAVE_CHOICES).candidates(workload))
    assert not any(p.schedule == "interleaved-1f1b" for p in UniformPlanner().candidates(workload))
    interleaved = [p for p in plans if p.schedule == "interleaved-1f1b"]
    base = {p.to_dict()["stages"].__repr__() + str(p.micro_batch_size): p for p in plans if p.schedule == "1f1b"}
    expected = 0
    for plan in base.values():
        if plan.pp > 1 and plan.num_micro_batches % plan.pp == 0:
            fewest = min(s.num_layers for s in plan.stages)
            expected += sum(1 for v in INTERLEAVE_CHOICES if v <= fewest)
    assert interleaved and len(interleaved) == expected
    for plan in interleaved:
        assert plan.pp > 1 and plan.num_micro_batches % plan.pp == 0
        assert plan.virtual_stages <= min(s.num_layers for s in plan.stages)
        twin = base[plan.to_dict()["stages"].__repr__() + str(plan.micro_batch_size)]
        assert twin.stages == plan.stages and validate_plan(plan, workload.model, workload.cluster) is None


def test_interleaving_wins_where_the_pipeline_bubble_dominates() -> None:
    """Few micro-batches through many stages: the uniform planner's best plan is
    the fastest of all its candidates, and an interleaved one (its bubble is
    1/v of 1F1B's for the same stages)."""
    from hetplan.search.baselines.uniform import INTERLEAVE_CHOICES, UniformPlanner

    workload = Workload(get_model("gpt3-1.3b"), get_cluster("16xA100-80GB"), 8, memory_limit_bytes=6 << 30)
    cost = CostModel(workload)
    planner = UniformPlanner(interleave_choices=INTERLEAVE_CHOICES)
    best = planner.plan(workload, 1, cost)[0]
    brute = min(t for t, fits in (cost.quick(p) for p in planner.candidates(workload, cost)) if fits)
    assert best.estimate.iteration_time_s == pytest.approx(brute, rel=1e-9)
    assert best.plan.schedule == "interleaved-1f1b", best.plan.describe()
