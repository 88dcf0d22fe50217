"""The planners choose activation offloading where memory is short, as the cost
model ranks it against recomputation (issue 12, item 5).

Brute force: every plan of the space (degrees, micro-batch, ZeRO, layer split,
per-stage recomputation x offloading) costed with ``CostModel.quick``; the
planners' best must equal its best. The GPUs are chosen so that each side
wins: a slow-compute GPU on a fast host link (offloading hides behind
compute) and a fast GPU whose PCIe link cannot keep up (recomputation is
cheaper)."""

from __future__ import annotations

import itertools
import json
from dataclasses import replace

import pytest

from hetplan.cluster.catalog import GPU_CATALOG
from hetplan.cluster.spec import ClusterSpec, NodeSpec
from hetplan.cost.model import CostModel
from hetplan.plan.workload import Workload
from hetplan.errors import HetplanError
from hetplan.model.presets import gpt_decoder
from hetplan.plan.spec import Estimate, Plan
from hetplan.search.auto import AutoPlanner
from hetplan.search.baselines.uniform import UniformPlanner, uniform_plan
from hetplan.search.common.degrees import divisors
from hetplan.cost.stage import StageOption

GIB = 1 << 30
RECOMPUTE = ("none", "selective", "full")
# 8 blocks, hidden 2048, 2,048-token sequences: ~0.5 GB of saved activations
# per block and sample, 6 GB of model states.
LONG = gpt_decoder("long-seq", 8, 2048, 16, 2048, vocab=8000)
# An H100 that computes at 10 TFLOP/s (a tenth of its tensor rate) on its PCIe 5
# host link (GPU_HOST_LINK by its catalog name): transfers hide behind compute.
SLOW_H100 = replace(GPU_CATALOG["H100"], name="H100-slow", peak_flops=10e12, derived_from="H100")


def _workload(gpu: object, gpus: int, limit_gib: float, search_offload: bool = True, model=LONG) -> Workload:
    cluster = ClusterSpec(f"{gpus}x", (NodeSpec(gpu, gpus, 600.0, 0.0, name="n0"),), 100.0)
    return Workload(model, cluster, 8, memory_limit_bytes=int(limit_gib * GIB), search_offload=search_offload)


def _uniform_space(workload: Workload, offload: bool = True) -> list[Plan]:
    """Every uniform plan, by brute force (no pruning), with or without offloading."""
    n, plans = workload.cluster.num_devices, []
    for tp, pp in itertools.product(divisors(n), divisors(n)):
        dp = n // (tp * pp)
        if dp * tp * pp != n or workload.global_batch_size % dp:
            continue
        for u, zero, recompute, off in itertools.product(divisors(workload.global_batch_size // dp), (0, 2, 3),
                                                          RECOMPUTE, (False, True) if offload else (False,)):
            if zero and dp == 1:
                continue
            plans.append(uniform_plan(workload, dp, tp, pp, u, zero, recompute, offload=off))
    return plans


def _best(cost: CostModel, plans: list[Plan]) -> tuple[float, Plan]:
    scored = [(cost.quick(p), p) for p in plans]
    fitting = [(t, p) for (t, fits), p in scored if fits]
    assert fitting, "brute force found no fitting plan"
    return min(fitting, key=lambda item: item[0])


def _strategies(plan: Plan) -> set[tuple[str, bool]]:
    return {(s.recompute, s.offload) for stage in plan.stages for s in stage.strategies}


def _short_of_memory(cost: CostModel) -> None:
    """No plan fits without saving activation memory."""
    plain = [p for p in _uniform_space(cost.workload, offload=False)
             if _strategies(p) == {("none", False)}]
    assert plain and not any(cost.quick(p)[1] for p in plain)


@pytest.mark.parametrize("gpu, limit_gib", [(SLOW_H100, 8), ("H100", 8), ("T4", 8), (SLOW_H100, 10)])
def test_uniform_picks_the_brute_force_best_of_recompute_and_offload(gpu: object, limit_gib: float) -> None:
    """One GPU: nothing fits without recomputation or offloading; the uniform
    planner's best is the best of every micro-batch x {none, selective, full}
    x {offload, not}."""
    workload = _workload(gpu, 1, limit_gib)
    cost = CostModel(workload)
    if limit_gib == 8:
        _short_of_memory(cost)
    best_s, best = _best(cost, _uniform_space(workload))
    got = UniformPlanner().plan(workload, 1, cost)[0]
    assert got.estimate.iteration_time_s == pytest.approx(best_s, rel=1e-12)
    assert _strategies(got.plan) == _strategies(best)


def _auto_space(workload: Workload) -> list[Plan]:
    """Auto's exact space on one node, by brute force: every uniform-degree
    layout, every contiguous split, every stage's ZeRO x recompute x offload."""
    n, layers, gbs = workload.cluster.num_devices, workload.model.num_layers, workload.global_batch_size
    plans = []
    for tp, pp in itertools.product(divisors(n), divisors(n)):
        dp = n // (tp * pp)
        if dp * tp * pp != n or gbs % dp:
            continue
        for u in divisors(gbs // dp):
            mbs = dp * u
            options = [StageOption(tuple(range(j * dp * tp, (j + 1) * dp * tp)), dp, tp, (u,) * dp, zero, rc, tp > 1,
                                   off) for j in range(pp) for zero in ((0, 2, 3) if dp > 1 else (0,)) for rc in RECOMPUTE
                       for off in (False, True)]
            per_stage = [[o for o in options if o.devices[0] == j * dp * tp] for j in range(pp)]
            for cuts in itertools.combinations(range(1, layers), pp - 1):
                bounds = (0, *cuts, layers)
                for choice in itertools.product(*per_stage):
                    stages = tuple(o.stage(range(bounds[j], bounds[j + 1])) for j, o in enumerate(choice))
                    plans.append(Plan(workload.model.name, workload.cluster.name, gbs, mbs, gbs // mbs, "1f1b", stages,
                                      planner="brute"))
    return plans


@pytest.mark.parametrize("gpu, gpus, limit_gib", [(SLOW_H100, 1, 8), ("H100", 1, 8), (SLOW_H100, 2, 7),
                                                   ("T4", 2, 7)])
def test_auto_exact_solve_matches_brute_force_with_offload(gpu: object, gpus: int, limit_gib: float) -> None:
    """Auto's exact solve (no seed planners) equals the brute-force optimum of
    its space with offloading, per stage, next to recomputation."""
    workload = _workload(gpu, gpus, limit_gib)
    cost = CostModel(workload)
    best_s, best = _best(cost, _auto_space(workload))
    got = AutoPlanner(sources=(), contained=()).plan(workload, 1, cost)[0]
    assert got.estimate.iteration_time_s == pytest.approx(best_s, rel=1e-9), (got.plan.describe(), best.describe())


def test_offload_beats_full_recompute_on_slow_compute_with_a_fast_host_link() -> None:
    """Slow compute, fast host link: offloading hides its transfers behind
    compute, so the planners' best offloads and is strictly faster than every
    plan that only recomputes; with offloading off they recompute."""
    on, off = _workload(SLOW_H100, 1, 8.5), _workload(SLOW_H100, 1, 8.5, search_offload=False)
    for make in (UniformPlanner, lambda: AutoPlanner(sources=(), contained=()), AutoPlanner):
        with_offload = make().plan(on, 1)[0]
        without = make().plan(off, 1)[0]
        assert any(offload for _, offload in _strategies(with_offload.plan))
        assert not any(offload for _, offload in _strategies(without.plan))
        assert {rc for rc, _ in _strategies(without.plan)} != {"none"}  # it had to recompute
        assert with_offload.estimate.iteration_time_s < without.estimate.iteration_time_s * (1 - 1e-3)
    # the same degrees and micro-batch: offloading alone against full recomputation alone
    cost = CostModel(on)
    offloaded, recomputed = (cost.estimate(uniform_plan(on, 1, 1, 1, 1, 0, rc, offload=o))
                             for rc, o in (("none", True), ("full", False)))
    assert offloaded.fits and recomputed.fits
    assert offloaded.iteration_time_s < recomputed.iteration_time_s


def test_recompute_beats_offload_on_a_fast_gpu_with_slow_pcie() -> None:
    """A fast GPU whose host link is slow next to its compute (H100 on PCIe 5):
    moving the activations costs more than recomputing them, so with
    offloading allowed the planners choose the same recomputing plan."""
    on, off = _workload("H100", 1, 8), _workload("H100", 1, 8, search_offload=False)
    cost = CostModel(on)
    _short_of_memory(cost)
    for make in (UniformPlanner, AutoPlanner):
        with_offload = make().plan(on, 1, cost)[0]
        assert not any(offload for _, offload in _strategies(with_offload.plan))
        assert with_offload.estimate.iteration_time_s == pytest.approx(make().plan(off, 1)[0].estimate.iteration_time_s)
    # the best plan that offloads more than checkpointed inputs (those cost nothing
    # extra here: a tie) is slower than the best that only recomputes
    space = _uniform_space(on)
    offloading = _best(cost, [p for p in space if _strategies(p) & {("none", True), ("selective", True)}])[0]
    recomputing = _best(cost, [p for p in space if not any(o for _, o in _strategies(p))])[0]
    assert recomputing < offloading


def test_roomy_workloads_search_no_offload() -> None:
    """Where the plan without recomputation fits, offloaded variants cannot win
    and are not costed (the search stays as it was)."""
    workload = _workload("H100", 2, 80)
    cost = CostModel(workload)
    candidates = list(UniformPlanner().candidates(workload, cost))
    assert not any(s.offload for p in candidates for st in p.stages for s in st.strategies)
    assert len(candidates) == len(list(UniformPlanner(offload_choices=(False,)).candidates(workload)))


def test_offload_never_and_nothing_fits_is_an_error() -> None:
    """With offloading off, a workload that fits only by offloading says so."""
    tight = _workload(SLOW_H100, 1, 7.7)
    best = UniformPlanner().plan(tight, 1)[0]
    assert any(offload for _, offload in _strategies(best.plan))
    with pytest.raises(HetplanError):
        UniformPlanner().plan(replace(tight, search_offload=False), 1)


# --- host memory limits offloading (issue 12, item 5) ------------------------------------------
def _long_llama_workload(cluster: ClusterSpec) -> Workload:
    """Llama-3-8B at 64k tokens (tests/test_cp_ep_cost.py's ``_long_llama``), 64 samples."""
    from hetplan.model.presets import llama_decoder

    return Workload(llama_decoder("llama3-8b-64k", 32, 4096, 32, 8, 14336, 128256, 65536), cluster, 64)


def _dp64_offload(workload: Workload) -> Plan:
    return uniform_plan(workload, 64, 1, 1, 1, 3, "none", offload=True)


def _host_bytes_by_hand(cost: CostModel, plan: Plan) -> float:
    """One sample's saved activations over every layer (1 micro-batch of 1 sample in flight)."""
    stage = plan.stages[0]
    return float(sum(cost.kernel.activation_bytes(stage.tp, "none", False)[i] for i in stage.layers))


def test_host_memory_defaults_follow_the_reference_servers() -> None:
    """DGX datasheets: A100 40GB 1 TB, A100 80GB / H100 / H200 2 TB per 8 GPUs;
    a type no server lists gets its own memory; a CPU "device" has no limit."""
    from hetplan.cost.memory import host_offload_capacity_bytes, node_host_memory_bytes

    assert node_host_memory_bytes(NodeSpec("A100-40GB", 8, 600.0)) == 1024 * GIB
    for gpu in ("A100-80GB", "H100", "H200"):
        assert node_host_memory_bytes(NodeSpec(gpu, 8, 600.0)) == 2048 * GIB
    assert node_host_memory_bytes(NodeSpec("H100", 4, 600.0)) == 1024 * GIB  # half a server's GPUs, half its RAM
    assert node_host_memory_bytes(NodeSpec("T4", 4, 50.0)) == 4 * GPU_CATALOG["T4"].memory_bytes
    assert node_host_memory_bytes(NodeSpec("H100", 8, 600.0, host_memory_bytes=4096 * GIB)) == 4096 * GIB
    assert host_offload_capacity_bytes(NodeSpec("H100", 8, 600.0)) == 2048 * GIB / 8 * 0.75
    assert host_offload_capacity_bytes(NodeSpec("CPU", 4, 10.0)) == float("inf")
    with pytest.raises(HetplanError, match="host_memory_gb"):
        NodeSpec("H100", 8, 600.0, host_memory_bytes=-1)


def test_dp64_offload_of_llama3_8b_at_64k_exceeds_a_dgx_h100s_host_memory() -> None:
    """~305 GiB of offloaded activations per GPU, 2.4 TB per node: more than a
    DGX H100's 2 TB. The estimate says it does not fit and the planners never
    offer it, nor any offloading plan beyond the host share."""
    from hetplan.cluster.presets import get_cluster
    from hetplan.report.text import memory_table

    workload = _long_llama_workload(get_cluster("64xH100"))
    cost = CostModel(workload)
    plan = _dp64_offload(workload)
    estimate = cost.estimate(plan)
    share = int(2048 * GIB / 8 * 0.75)
    assert set(estimate.host_offload_bytes) == set(range(64))
    assert estimate.host_capacity_bytes == {d: share for d in range(64)}
    by_hand = _host_bytes_by_hand(cost, plan)
    assert by_hand > 300 * GIB and 8 * by_hand > 2048 * GIB
    assert all(abs(b - by_hand) <= 1 for b in estimate.host_offload_bytes.values())
    assert max(estimate.peak_memory_bytes.values()) <= 80 * GIB  # the GPUs alone would hold it
    assert not estimate.fits and not cost.quick(plan)[1] and not cost.stage_fits(plan, 0)
    assert Estimate.from_dict(json.loads(json.dumps(estimate.to_dict()))) == estimate  # a plan file keeps them
    assert "over host memory" in memory_table(plan, estimate, workload, cost.memory_breakdown(plan))
    assert plan not in list(UniformPlanner().candidates(workload, cost))
    for planner in (UniformPlanner(), AutoPlanner()):
        for ranked in planner.plan(workload, 3, cost):
            e = ranked.estimate
            assert e.fits, (planner.name, ranked.plan.describe())
            assert all(e.host_offload_bytes[d] <= e.host_capacity_bytes[d] for d in e.host_offload_bytes)
            assert not (ranked.plan.stages[0].dp == 64 and _strategies(ranked.plan) & {("none", True)})


def test_a_cluster_file_with_more_host_memory_allows_the_dp64_offload(tmp_path) -> None:
    """The same 64 H100 with 4 TB of host RAM per node (``host_memory_gb``):
    384 GiB per GPU after the reserve holds the ~305 GiB."""
    import yaml

    from hetplan.cluster.io import cluster_to_dict, load_cluster_yaml
    from hetplan.cluster.presets import get_cluster

    data = cluster_to_dict(get_cluster("64xH100"))
    data["name"] = "dgx-h100-4tb"
    for node in data["nodes"]:
        node["host_memory_gb"] = 4096
    path = tmp_path / "dgx-h100-4tb.yaml"
    path.write_text(yaml.safe_dump(data))
    cluster = load_cluster_yaml(path)
    assert all(n.host_memory_bytes == 4096 * GIB for n in cluster.nodes)
    assert cluster_to_dict(cluster)["nodes"][0]["host_memory_gb"] == 4096  # written back
    workload = _long_llama_workload(cluster)
    cost = CostModel(workload)
    plan = _dp64_offload(workload)
    estimate = cost.estimate(plan)
    assert estimate.fits and cost.quick(plan)[1]
    assert estimate.host_capacity_bytes[0] == int(4096 * GIB / 8 * 0.75) >= estimate.host_offload_bytes[0]
    assert plan in list(UniformPlanner().candidates(workload, cost))


def test_host_bytes_of_a_mixed_stage_equal_the_uniform_stage_tables() -> None:
    """The layer-by-layer sum (mixed stages) and the stage tables charge the
    same host bytes, and the fits check of the tables matches the estimate."""
    from hetplan.cost.mixed import stage_host_bytes

    workload = _workload("H100", 4, 8)
    cost = CostModel(workload)
    for dp, tp, pp in ((4, 1, 1), (2, 2, 1), (2, 1, 2)):
        plan = uniform_plan(workload, dp, tp, pp, 1, 0, "selective", offload=True)
        estimate = cost.estimate(plan)
        for j, stage in enumerate(plan.stages):
            in_flight = float(min(plan.pp - j, plan.num_micro_batches))
            mixed = stage_host_bytes(cost.kernel, stage, plan.micro_batch_size, in_flight)
            tables = [estimate.host_offload_bytes[d] for d in stage.devices]
            assert mixed == pytest.approx(tables, rel=1e-12) and min(tables) > 0


@pytest.mark.parametrize("gpus", [1, 2])
def test_planners_match_brute_force_when_host_memory_binds(gpus: int) -> None:
    """A host share just under what the best offloading plan keeps there: that
    plan no longer fits, and uniform and auto's exact solve still find the
    brute-force optimum of what does (the host check is in their tables)."""
    roomy = _workload(SLOW_H100, gpus, 8)
    cost = CostModel(roomy)
    _, free_best = _best(cost, _auto_space(roomy))
    needed = max(cost.estimate(free_best).host_offload_bytes.values(), default=0)
    assert needed > 0, "the unlimited optimum offloads"
    node = replace(roomy.cluster.nodes[0], host_memory_bytes=int(needed * 0.99 / 0.75 * gpus))
    tight = replace(roomy, cluster=replace(roomy.cluster, nodes=(node,)))
    tight_cost = CostModel(tight)
    assert not tight_cost.quick(free_best)[1]
    for planner, space in ((UniformPlanner(), _uniform_space(tight)),
                           (AutoPlanner(sources=(), contained=()), _auto_space(tight))):
        best_s, best = _best(tight_cost, space)
        got = planner.plan(tight, 1, tight_cost)[0]
        assert got.estimate.fits
        assert got.estimate.iteration_time_s == pytest.approx(best_s, rel=1e-9), (got.plan.describe(),
                                                                                  best.describe())


def test_stage_tables_apply_the_host_limit_like_the_scalar_check() -> None:
    """Every layer range of an offloading stage: the exact solver's fit table
    equals ``StageCosts.fits`` and the plan's estimate, and the host limit
    (not device memory) is what rules the longer ranges out."""
    roomy = _workload(SLOW_H100, 2, 80)
    # 2 GiB per GPU after the reserve; the whole model keeps ~3.6 GiB per sample
    node = replace(roomy.cluster.nodes[0], host_memory_bytes=int(2 * 2 * GIB / 0.75))
    workload = replace(roomy, cluster=replace(roomy.cluster, nodes=(node,)))
    cost = CostModel(workload)
    option = StageOption((0, 1), 2, 1, (1, 1), 0, "none", False, True)
    costs = cost.kernel.stage(option)
    n = cost.kernel.num_layers
    share = cost.kernel.host_capacity_bytes(0)
    assert share == pytest.approx(2 * GIB, abs=1)
    for in_flight in (1.0, 2.0):
        table = costs.tables(in_flight).fits
        by_host = []
        for a in range(n):
            for b in range(a + 1, n + 1):
                assert bool(table[a, b]) == costs.fits(a, b, in_flight), (a, b, in_flight)
                by_host.append(costs.host_bytes(a, b, 1, in_flight) > share)
                assert costs.fits(a, b, in_flight) == (not by_host[-1])  # device memory is roomy
        assert any(by_host) and not all(by_host)
    plan = option.stage(range(n))
    whole = Plan(workload.model.name, workload.cluster.name, 8, 2, 4, "1f1b", (plan,), planner="test")
    assert cost.estimate(whole).fits == costs.fits(0, n, 1.0) is False
