"""One cost kernel: what every planner's internals say a plan costs is what
CostModel.estimate says, on random workloads (models, mixed clusters, degrees,
ZeRO, recomputation, schedules)."""

from __future__ import annotations

import math
import random
from dataclasses import replace

import pytest

from hetplan.cluster.spec import ClusterSpec, NodeSpec
from hetplan.cost.model import CostModel
from hetplan.plan.workload import Workload
from hetplan.cost.stage import StageOption
from hetplan.cost.mixed import mixed_stage_memory, mixed_stage_timing
from hetplan.errors import HetplanError
from hetplan.model.presets import gpt_decoder
from hetplan.plan.spec import LayerStrategy, Plan, Stage
from hetplan.search import get_planner
from hetplan.search.common.stage_partition import PipelinePartitioner
from hetplan.search.exhaustive import ExhaustivePlanner
from hetplan.search.galvatron import get_variant

GPUS = ("V100-16GB", "T4", "A100-40GB", "A100-80GB", "H100", "P100")
# Planners whose own number for a plan is a private objective, not the shared
# model's (AMP eq. 3-5; the average-GPU abstraction of hetero-avg).
PRIVATE_OBJECTIVES = ("amp", "hetero-avg")
COARSE = dict(memory_bins=32, batch_growth=1.5, batch_linear_steps=2, micro_batch_multipliers=(4,))


def _random_workload(rng: random.Random) -> Workload:
    heads = rng.choice((4, 8, 16))
    hidden = heads * rng.choice((32, 64, 128))
    model = gpt_decoder(f"m{rng.randrange(10**6)}", rng.randint(2, 8), hidden, heads, rng.choice((128, 256, 512)),
                        vocab=rng.choice((1000, 8000, 32000)), dtype_bytes=rng.choice((2, 4)),
                        tied_embeddings=rng.random() < 0.7)
    nodes = []
    for i in range(rng.randint(1, 3)):
        gpu = rng.choice(GPUS)
        nodes.append(NodeSpec(gpu, rng.choice((1, 2, 4)), rng.choice((100.0, 600.0, 2400.0)),
                              rng.choice((0.0, 25.0, 100.0)), name=f"n{i}"))
    cluster = ClusterSpec(f"c{rng.randrange(10**6)}", tuple(nodes), rng.choice((10.0, 50.0, 200.0)))
    limit = rng.choice((0, 0, 2, 6)) << 30
    return Workload(model, cluster, rng.choice((8, 16, 32)), memory_limit_bytes=limit,
                    overlap_grad_sync=rng.random() < 0.8)


WORKLOADS = [_random_workload(random.Random(seed)) for seed in range(8)]


def _in_zones(workload: Workload, zones: tuple[str, ...], gbps: float) -> Workload:
    """``workload`` with its nodes in ``zones`` (one per node) and ``gbps`` between zones."""
    cluster = workload.cluster
    nodes = tuple(replace(node, zone=zone) for node, zone in zip(cluster.nodes, zones, strict=True))
    return replace(workload, cluster=replace(cluster, name=f"{cluster.name}-zoned", nodes=nodes,
                                             inter_zone_bandwidth_gbps=gbps))


# the 3-node workload with its outer nodes in one zone and the middle one in
# another (5 Gbps, slower than every NIC): no node order keeps zones together
ZONED = _in_zones(WORKLOADS[6], ("a", "b", "a"), 5.0)


@pytest.mark.parametrize("workload", [*WORKLOADS, ZONED], ids=lambda w: f"{w.model.name}-{w.cluster.name}")
def test_every_planners_own_cost_is_the_estimate(workload: Workload) -> None:
    cost = CostModel(workload)
    checked = 0
    planners = [("uniform", get_planner("uniform")), ("megatron", get_planner("megatron")),
                ("random", get_planner("random")), ("metis", get_planner("metis")),
                ("galvatron-bmw", get_variant("galvatron-bmw", **COARSE)), ("auto", get_planner("auto"))]
    if ExhaustivePlanner().count(workload) <= 3000:
        planners.append(("exhaustive", ExhaustivePlanner()))
    for name, planner in planners:
        try:
            ranked = planner.plan(workload, 3, cost)
        except HetplanError:
            continue
        for r in ranked:
            estimate = cost.estimate(r.plan)
            assert estimate.iteration_time_s == pytest.approx(r.estimate.iteration_time_s, rel=1e-12)
            if r.planner_cost_s is not None and name not in PRIVATE_OBJECTIVES:
                assert r.planner_cost_s == pytest.approx(estimate.iteration_time_s, rel=1e-9), name
                checked += 1
    assert checked > 0


def _random_plan(workload: Workload, rng: random.Random, mixed: bool) -> Plan | None:
    """A random valid plan: uniform degrees on the first GPUs, any split, any
    ZeRO/recompute per stage (per layer with ``mixed``), any schedule."""
    n, layers = workload.cluster.num_devices, workload.model.num_layers
    choices = [(pp, dp, tp) for pp in (1, 2, 3, 4) for dp in (1, 2, 4) for tp in (1, 2, 4)
               if pp * dp * tp <= n and pp <= layers and all(node.num_gpus % tp == 0 for node in workload.cluster.nodes)
               and all(layer.supports_tp(tp) for layer in workload.model.layers)]
    pp, dp, tp = rng.choice(choices)
    mbs = dp * rng.choice([u for u in (1, 2, 4) if workload.global_batch_size % (dp * u) == 0] or [0])
    if not mbs:
        return None
    cuts = sorted(rng.sample(range(1, layers), pp - 1))
    bounds = (0, *cuts, layers)
    stages = []
    for j in range(pp):
        count = bounds[j + 1] - bounds[j]
        zero, recompute = rng.choice((0, 1, 2, 3)), rng.choice(("none", "selective", "full"))
        strategies = tuple(LayerStrategy(rng.choice((0, 2, 3)) if mixed else zero,
                                         rng.choice(("none", "full")) if mixed else recompute) for _ in range(count))
        devices = tuple(range(j * dp * tp, (j + 1) * dp * tp))
        stages.append(Stage(tuple(range(bounds[j], bounds[j + 1])), devices, dp, tp, (mbs // dp,) * dp, strategies,
                            tp > 1 and rng.random() < 0.5))
    schedule = rng.choice(("1f1b", "gpipe"))
    return Plan(workload.model.name, workload.cluster.name, workload.global_batch_size, mbs,
                workload.global_batch_size // mbs, schedule, tuple(stages))


@pytest.mark.parametrize("seed", range(6))
def test_uniform_and_mixed_stage_paths_agree(seed: int) -> None:
    """The kernel's prefix-sum StageCosts and the per-layer path for mixed
    stages give the same numbers for a stage that runs every layer one way."""
    rng = random.Random(seed)
    workload = WORKLOADS[seed % len(WORKLOADS)]
    cost = CostModel(workload)
    for _ in range(20):
        plan = _random_plan(workload, rng, mixed=False)
        if plan is None:
            continue
        for j, stage in enumerate(plan.stages):
            fast = cost.stage_timing(stage, plan.micro_batch_size)
            slow = mixed_stage_timing(cost.kernel, stage, plan.micro_batch_size)
            for name in ("fwd_s", "bwd_s", "recompute_s", "tp_comm_s", "zero3_exposed_s", "grad_sync_s",
                         "post_step_s", "optimizer_s"):
                assert getattr(fast, name) == pytest.approx(getattr(slow, name), rel=1e-9, abs=1e-15), name
            if cost.kernel.memory_profile is None:
                assert cost.stage_memory(plan, j) == mixed_stage_memory(cost.kernel, stage, plan.micro_batch_size,
                                                                         _in_flight(plan, j))


def _in_flight(plan: Plan, j: int) -> float:
    from hetplan.cost.memory import in_flight_micro_batches

    return in_flight_micro_batches(plan.schedule, j, plan.pp, plan.num_micro_batches)


@pytest.mark.parametrize("seed", range(6))
def test_exact_partition_tables_are_the_estimate(seed: int) -> None:
    """For random layouts, options and schedules, the partition solver's own
    value of the plan it returns is that plan's estimate."""
    rng = random.Random(100 + seed)
    workload = WORKLOADS[seed % len(WORKLOADS)]
    cost = CostModel(workload)
    solved = 0
    for _ in range(6):
        base = _random_plan(workload, rng, mixed=False)
        if base is None:
            continue
        options = [[StageOption(s.devices, s.dp, s.tp, s.dp_split, zero, recompute, s.sequence_parallel)
                    for zero in ((0, 1, 2, 3) if s.dp > 1 else (0,)) for recompute in ("none", "selective", "full")]
                   for s in base.stages]
        solution, plan, estimate = _solve_and_check(cost, base, options)
        if solution is None:
            continue
        assert solution.lower_bound_s <= solution.iteration_s * (1 + 1e-12)
        assert estimate.lower_bound_s <= estimate.iteration_time_s
        solved += 1
    assert solved > 0


def test_cpu_processes_do_not_overlap_communication() -> None:
    """gloo runs collectives on the cores that compute: an 'overlapped'
    collective is exposed whole on CPU, 1.3x-slowed on GPUs (Galvatron-BMW §V)."""
    from hetplan.cluster.io import load_cluster
    from hetplan.cost.constants import OVERLAP_SLOWDOWN
    from hetplan.cost.pipeline import overlapped_exposure

    model = gpt_decoder("cpu-gpt", 2, 256, 4, 128, vocab=1024, dtype_bytes=4)
    cpu = CostModel(Workload(model, load_cluster("local-cpu-2"), 8)).kernel
    gpu = CostModel(Workload(model, load_cluster("8xA100-80GB"), 8)).kernel
    assert cpu.overlap_slowdown == 2.0 and gpu.overlap_slowdown == OVERLAP_SLOWDOWN
    for comm, compute in ((1.0, 3.0), (3.0, 1.0)):
        assert overlapped_exposure(comm, compute, cpu.overlap_slowdown) == pytest.approx(comm)
    assert overlapped_exposure(1.0, 3.0, gpu.overlap_slowdown) == pytest.approx(0.3)


def test_uniform_planners_own_cost_of_cp_ep_plans_is_the_estimate() -> None:
    """Context and expert parallelism go through the same kernel: the uniform
    and auto planners' own numbers for MoE plans with ep > 1 (and the exact
    solver's tables behind auto's) are their estimates."""
    from hetplan.model.presets import get_model

    model = get_model("moe-1.3b")
    nodes = tuple(NodeSpec("H100", 8, 3600.0, 400.0, name=f"n{i}") for i in range(2))
    workload = Workload(model, ClusterSpec("c", nodes, 400.0), 32)
    cost = CostModel(workload)
    seen = 0
    for name in ("uniform", "auto"):
        for r in get_planner(name).plan(workload, 5, cost):
            estimate = cost.estimate(r.plan)
            assert estimate.iteration_time_s == pytest.approx(r.estimate.iteration_time_s, rel=1e-12)
            if r.planner_cost_s is not None:
                assert r.planner_cost_s == pytest.approx(estimate.iteration_time_s, rel=1e-9)
            seen += any(s.ep > 1 for s in r.plan.stages)
    assert seen > 0


def _memory_short_workload(gpus: int, limit_gib: float) -> Workload:
    """Long sequences on a slow-compute H100 (fast host link) with little
    memory: the planners' best plans offload activations."""
    from dataclasses import replace

    from hetplan.cluster.catalog import GPU_CATALOG

    slow = replace(GPU_CATALOG["H100"], name="H100-slow", peak_flops=10e12, derived_from="H100")
    model = gpt_decoder("long-seq", 8, 2048, 16, 2048, vocab=8000)
    cluster = ClusterSpec(f"{gpus}x", (NodeSpec(slow, gpus, 600.0, 0.0, name="n0"),), 100.0)
    return Workload(model, cluster, 8, memory_limit_bytes=int(limit_gib * (1 << 30)))


@pytest.mark.parametrize("gpus, limit_gib", [(1, 8.5), (2, 8), (4, 6)])
def test_planners_own_cost_of_offload_plans_is_the_estimate(gpus: int, limit_gib: float) -> None:
    """Offloading goes through the same kernel: what the uniform, auto and
    exact-partition planners charge for plans that offload activations is
    their estimate, and offloading plans are among those checked."""
    workload = _memory_short_workload(gpus, limit_gib)
    cost = CostModel(workload)
    offloading = 0
    for name in ("uniform", "auto", "megatron", "metis"):
        try:
            ranked = get_planner(name).plan(workload, 5, cost)
        except HetplanError:
            continue
        for r in ranked:
            estimate = cost.estimate(r.plan)
            assert estimate.iteration_time_s == pytest.approx(r.estimate.iteration_time_s, rel=1e-12)
            if r.planner_cost_s is not None:
                assert r.planner_cost_s == pytest.approx(estimate.iteration_time_s, rel=1e-9), name
            offloading += any(s.offload for st in r.plan.stages for s in st.strategies)
    assert offloading > 0


@pytest.mark.parametrize("seed", range(3))
def test_exact_partition_tables_with_offload_are_the_estimate(seed: int) -> None:
    """The partition solver's own value of a plan whose stages choose among
    recomputation x offloading is that plan's estimate."""
    rng = random.Random(300 + seed)
    workload = _memory_short_workload(4, rng.choice((5, 6, 8)))
    cost = CostModel(workload)
    solved = offloaded = 0
    for _ in range(6):
        base = _random_plan(workload, rng, mixed=False)
        if base is None:
            continue
        options = [[StageOption(s.devices, s.dp, s.tp, s.dp_split, zero, recompute, s.sequence_parallel, offload)
                    for zero in ((0, 2, 3) if s.dp > 1 else (0,)) for offload in (False, True)
                    for recompute in ("none", "selective", "full")] for s in base.stages]
        solution, plan, estimate = _solve_and_check(cost, base, options)
        if solution is None:
            continue
        solved += 1
        offloaded += any(s.offload for st in plan.stages for s in st.strategies)
    assert solved > 0 and offloaded > 0


def _solve_and_check(cost, base, options):
    """The exact partitioner's solution over ``options`` for ``base``'s stages,
    its plan and estimate (Nones when nothing fits); the plan fits and its time
    equals CostModel.estimate's."""
    solution = PipelinePartitioner(cost.kernel, base.micro_batch_size, base.num_micro_batches,
                                   base.schedule).solve(options)
    if solution is None:
        return None, None, None
    plan = base.with_changes(stages=solution.stages)
    estimate = cost.estimate(plan)
    assert estimate.fits
    assert math.isclose(estimate.iteration_time_s, solution.iteration_s, rel_tol=1e-9)
    return solution, plan, estimate
