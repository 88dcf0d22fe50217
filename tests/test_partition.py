"""Pipeline layer assignment: the fast solver, AMP's DP (§3.5) and brute force agree."""

from __future__ import annotations

import itertools
import math
import random

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hetplan.cluster.presets import get_cluster
from hetplan.cluster.spec import ClusterSpec, NodeSpec
from hetplan.cost.model import CostModel
from hetplan.cost.pipeline import one_f_one_b_period
from hetplan.plan.workload import Workload
from hetplan.errors import HetplanError
from hetplan.model.presets import get_model, gpt_decoder
from hetplan.cost.stage import StageOption
from hetplan.plan.spec import Plan
from hetplan.search.common.partition import (
    PartitionProblem,
    balanced_partition,
    brute_force_partition,
    fast_partition,
    reference_partition,
)
from hetplan.search.common import stage_partition
from hetplan.search.common.stage_partition import PipelinePartitioner
from hetplan.search.baselines.uniform import uniform_plan


def same(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)


@st.composite
def instances(draw: st.DrawFn, memory: bool = False) -> PartitionProblem:
    """L ≤ 12 layers, k ≤ 4 stages; random layer costs (sometimes integers, so
    ties happen), stage speeds, link bandwidths and activation sizes."""
    num_layers = draw(st.integers(1, 12))
    k = draw(st.integers(1, min(4, num_layers)))
    integral = draw(st.booleans())
    cost = st.integers(0, 6).map(float) if integral else st.floats(0.0, 10.0, allow_nan=False)
    layer_cost = np.array(draw(st.lists(cost, min_size=num_layers, max_size=num_layers)))
    speeds = np.array(draw(st.lists(st.sampled_from([0.5, 1.0, 1.0, 2.0, 3.0]) if integral
                                    else st.floats(0.2, 5.0), min_size=k, max_size=k)))
    times = layer_cost[None, :] / speeds[:, None]
    links = None
    if k > 1 and draw(st.booleans()):
        volume = np.array(draw(st.lists(st.floats(0.0, 4.0), min_size=num_layers - 1, max_size=num_layers - 1)))
        bandwidth = np.array(draw(st.lists(st.floats(0.25, 8.0), min_size=k - 1, max_size=k - 1)))
        links = volume[None, :] / bandwidth[:, None]
    micro_batches = draw(st.integers(1, 32))
    if not memory:
        return PartitionProblem(times, micro_batches, links)
    layer_memory = np.array(draw(st.lists(st.floats(0.0, 3.0), min_size=num_layers, max_size=num_layers)))
    in_flight = np.array([min(k - j, micro_batches) for j in range(k)], dtype=float)  # 1F1B
    per_stage = layer_memory[None, :] * (0.5 + 0.5 * in_flight[:, None])
    capacity = np.array(draw(st.lists(st.floats(0.5, 12.0), min_size=k, max_size=k)))
    return PartitionProblem(times, micro_batches, links, per_stage, capacity)


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(instances())
def test_fast_equals_reference_equals_brute_force(problem: PartitionProblem) -> None:
    brute = brute_force_partition(problem)
    fast = fast_partition(problem)
    reference = reference_partition(problem)
    assert brute is not None and fast is not None and reference is not None
    assert same(fast.cost_s, brute.cost_s), (fast, brute)
    assert same(reference.cost_s, brute.cost_s), (reference, brute)
    # the splits they return really cost what they say
    assert same(problem.cost(fast.boundaries), fast.cost_s)
    assert same(problem.cost(reference.boundaries), reference.cost_s)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(instances(memory=True))
def test_fast_with_memory_limits_equals_brute_force(problem: PartitionProblem) -> None:
    brute = brute_force_partition(problem)
    fast = fast_partition(problem)
    if brute is None:
        assert fast is None
        return
    assert fast is not None and problem.fits(fast.boundaries)
    assert same(fast.cost_s, brute.cost_s)


def test_objective_is_amp_eq5() -> None:
    # 4 layers, 2 stages; stage 1 twice as slow; cut after layer 1 or 2 or 3
    problem = PartitionProblem([[1, 2, 3, 4], [2, 4, 6, 8]], 5, [[0.5, 0.25, 0.125]])
    # cut after 2 layers: t = (3, 14), e = 0.25 → 4·14 + 17 + 0.25
    assert problem.cost((0, 2, 4)) == pytest.approx(4 * 14 + 17 + 0.25)
    best = fast_partition(problem)
    assert best is not None and best.boundaries == (0, 3, 4)  # t = (6, 8): 4·8 + 14 + 0.125
    assert best.cost_s == pytest.approx(46.125)


def test_memory_limit_forces_a_worse_split() -> None:
    times = [1.0] * 6
    free = fast_partition(PartitionProblem(times, 8, num_stages=2))
    assert free is not None and free.sizes == (3, 3)
    # stage 0 keeps 2 micro-batches of activations, stage 1 one (1F1B): stage 0 can hold 2 layers
    limited = PartitionProblem(times, 8, stage_layer_memory=[[2.0] * 6, [1.0] * 6], stage_memory_capacity=4.5,
                               num_stages=2)
    best = fast_partition(limited)
    assert best is not None and best.sizes == (2, 4)
    assert fast_partition(PartitionProblem(times, 8, stage_layer_memory=[5.0] * 6, stage_memory_capacity=4.0,
                                           num_stages=2)) is None


def test_large_instance_matches_reference() -> None:
    rng = np.random.default_rng(7)
    problem = PartitionProblem(rng.uniform(0.5, 1.5, size=32), 8, rng.uniform(0, 0.3, size=(5, 31)), num_stages=6)
    fast, reference = fast_partition(problem), reference_partition(problem)
    assert fast is not None and reference is not None and same(fast.cost_s, reference.cost_s)


def test_balanced_partition_minimises_the_heaviest_stage() -> None:
    rng = np.random.default_rng(3)
    for _ in range(50):
        n = int(rng.integers(1, 9))
        k = int(rng.integers(1, n + 1))
        weights = rng.integers(0, 5, size=n).astype(float)
        bounds = balanced_partition(weights, k)
        assert bounds[0] == 0 and bounds[-1] == n and all(a < b for a, b in zip(bounds, bounds[1:]))
        heaviest = max(weights[a:b].sum() for a, b in zip(bounds, bounds[1:]))
        best = min(max(weights[a:b].sum() for a, b in zip((0, *c), (*c, n)))
                   for c in itertools.combinations(range(1, n), k - 1))
        assert heaviest == best


def test_bad_inputs_say_what_to_change() -> None:
    with pytest.raises(HetplanError, match="at least one layer"):
        PartitionProblem([1.0, 2.0], 1, num_stages=3)
    with pytest.raises(HetplanError, match="num_stages"):
        PartitionProblem([1.0, 2.0], 1)
    with pytest.raises(HetplanError, match=">= 0"):
        PartitionProblem([1.0, -2.0], 1, num_stages=1)
    with pytest.raises(HetplanError, match="micro-batches"):
        PartitionProblem([1.0, 2.0], 0, num_stages=1)
    with pytest.raises(HetplanError, match="shape"):
        PartitionProblem([[1.0, 2.0]] * 2, 1, boundary_times=[[1.0, 2.0]])
    with pytest.raises(HetplanError, match="memory limit"):
        reference_partition(PartitionProblem([1.0, 2.0], 2, stage_layer_memory=[1, 1], stage_memory_capacity=5,
                                             num_stages=2))


def segment_tables(rng: np.random.Generator, k: int, q: int, n: int, layer_s: float,
                   fit_share: float) -> tuple[np.ndarray, np.ndarray]:
    """Random per-layer times summed into ``(k, q, n + 1, n + 1)`` segment
    times, and a memory verdict per segment (``fit_share`` of them fit)."""
    layer = rng.uniform(0.0, layer_s, size=(k, q, n))
    prefix = np.concatenate([np.zeros((k, q, 1)), np.cumsum(layer, axis=2)], axis=2)
    times = np.maximum(prefix[:, :, None, :] - prefix[:, :, :, None], 0.0)
    return times, rng.uniform(size=times.shape) < fit_share


@st.composite
def option_instances(draw: st.DrawFn) -> PartitionProblem:
    """Stages with up to 3 options each (own times, memory verdicts) and a
    sum-only extra cost: the generalisation the exact planners use."""
    n = draw(st.integers(1, 7))
    k = draw(st.integers(1, min(3, n)))
    q = draw(st.integers(1, 3))
    rng = np.random.default_rng(draw(st.integers(0, 2**31)))
    times, fits = segment_tables(rng, k, q, n, 4.0, 0.8)
    extra = rng.uniform(0.0, 3.0, size=times.shape) if draw(st.booleans()) else None
    links = rng.uniform(0.0, 1.0, size=(k - 1, n - 1)) if k > 1 else None
    return PartitionProblem.from_segments(times, draw(st.integers(1, 16)), links, fits, extra)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(option_instances())
def test_fast_with_options_and_extras_equals_brute_force(problem: PartitionProblem) -> None:
    brute = brute_force_partition(problem)
    fast = fast_partition(problem)
    if brute is None:
        assert fast is None
        return
    assert fast is not None and problem.fits(fast.boundaries, fast.options)
    assert same(fast.cost_s, brute.cost_s), (fast, brute)
    assert same(problem.cost(fast.boundaries, fast.options), fast.cost_s)


@st.composite
def paced_instances(draw: st.DrawFn) -> tuple[PartitionProblem, dict[str, np.ndarray | int | None]]:
    """``option_instances`` whose links are sometimes slower than every stage
    (``link_pace``), paced by the slowest stage or link or by 1F1B's round
    trips (``one_f_one_b``), with the arrays they were built from."""
    one_f_one_b = draw(st.booleans())
    n = draw(st.integers(2, 8 if one_f_one_b else 7))
    k = draw(st.integers(2, min(4 if one_f_one_b else 3, n)))
    q = draw(st.integers(1, 2))
    rng = np.random.default_rng(draw(st.integers(0, 2**31)))
    times, fits = segment_tables(rng, k, q, n, 2.0, 0.85)
    extra = rng.uniform(-1.0, 1.0, size=times.shape) if draw(st.booleans()) else None
    pace = np.zeros((k - 1, n + 1))
    pace[:, 1:n] = rng.uniform(0.0, draw(st.sampled_from([0.5, 4.0, 20.0])), size=(k - 1, n - 1))
    m = draw(st.integers(1, 16))
    passes = draw(st.sampled_from([2.0, 1.3]))  # the dual's relaxation charges a link other than twice (stage_partition)
    problem = PartitionProblem.from_segments(times, m, passes * pace[:, 1:n], fits, extra, link_pace=pace,
                                             one_f_one_b=one_f_one_b)
    return problem, {"times": times, "fits": fits, "extra": extra, "pace": pace, "m": m, "passes": passes,
                     "one_f_one_b": one_f_one_b}


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(paced_instances())
def test_a_link_slower_than_every_stage_paces_the_optimum(instance: tuple[PartitionProblem, dict]) -> None:
    """With ``link_pace`` the solver minimises ``(m − 1)·P + Σ t + Σ extra +
    passes·Σ c`` where the pace ``P`` is ``max(max t, max c)`` or, with
    ``one_f_one_b``, 1F1B's round trips (``cost.pipeline.pipeline_time``):
    equal to every split and option choice so written out by hand."""
    problem, raw = instance
    times, fits, extra, pace, m = raw["times"], raw["fits"], raw["extra"], raw["pace"], raw["m"]
    passes, one_f_one_b = raw["passes"], raw["one_f_one_b"]
    k, q, n = times.shape[0], times.shape[1], times.shape[2] - 1
    best = math.inf
    for cuts in itertools.combinations(range(1, n), k - 1):
        b = (0, *cuts, n)
        for choice in itertools.product(range(q), repeat=k):
            cells = [(j, o, b[j], b[j + 1]) for j, o in enumerate(choice)]
            if not all(fits[c] for c in cells):
                continue
            stage = [times[c] for c in cells]
            links = [pace[j, b[j + 1]] for j in range(k - 1)]
            added = sum(extra[c] for c in cells) if extra is not None else 0.0
            paced = one_f_one_b_period(stage, links) if one_f_one_b else max(max(stage), max(links))
            best = min(best, (m - 1) * paced + sum(stage) + added + passes * sum(links))
    fast = fast_partition(problem)
    if not math.isfinite(best):
        assert fast is None
        return
    assert fast is not None and math.isclose(fast.cost_s, best, rel_tol=1e-9, abs_tol=1e-9), (fast, best)


def _layout_options(workload: Workload, dp: int, tp: int, pp: int, u: int) -> list[list[StageOption]]:
    base = uniform_plan(workload, dp, tp, pp, u)
    return [[StageOption(s.devices, dp, tp, s.dp_split, zero, recompute, tp > 1)
             for zero in ((0, 2, 3) if dp > 1 else (0,)) for recompute in ("none", "full")] for s in base.stages]


@pytest.mark.parametrize("model, cluster, limit_gib, degrees", [
    ("tiny-gpt", "metis-uneven-c", 0, (2, 1, 2, 2)),
    ("gpt2-amp", "amp-heterogeneous", 5, (4, 2, 2, 2)),
    ("gpt2-amp", "amp-heterogeneous", 3, (8, 1, 2, 1)),
])
def test_exact_partition_is_the_estimates_optimum(model: str, cluster: str, limit_gib: int,
                                                  degrees: tuple[int, int, int, int]) -> None:
    """The exact partition of a layout (split x per-stage ZeRO/recompute) costs
    what CostModel.estimate says, and no split or option choice of the layout
    has a smaller estimate (brute force over all of them, through estimate)."""
    workload = Workload(get_model(model), get_cluster(cluster), 16, memory_limit_bytes=limit_gib << 30)
    cost = CostModel(workload)
    dp, tp, pp, u = degrees
    options = _layout_options(workload, dp, tp, pp, u)
    mbs = dp * u
    solution = PipelinePartitioner(cost.kernel, mbs, 16 // mbs).solve(options)
    best = math.inf
    n = workload.model.num_layers
    for cuts in itertools.combinations(range(1, n), pp - 1):
        bounds = (0, *cuts, n)
        for choice in itertools.product(*(range(len(o)) for o in options)):
            stages = tuple(options[j][c].stage(range(bounds[j], bounds[j + 1])) for j, c in enumerate(choice))
            plan = Plan(model, cluster, 16, mbs, 16 // mbs, "1f1b", stages)
            time_s, fits = cost.quick(plan)
            if fits:
                best = min(best, time_s)
    if not math.isfinite(best):
        assert solution is None
        return
    assert solution is not None
    plan = Plan(model, cluster, 16, mbs, 16 // mbs, "1f1b", solution.stages)
    estimate = cost.estimate(plan)
    assert estimate.fits
    assert same(estimate.iteration_time_s, solution.iteration_s)
    assert same(solution.iteration_s, best)
    assert solution.lower_bound_s <= solution.iteration_s * (1 + 1e-12)


def _tail_workload(rng: random.Random) -> Workload:
    """Small GPTs on one-GPU nodes with slow links: every data-parallel pair
    syncs over the network, so a later stage's sync often ends last."""
    heads = rng.choice((8, 16))
    model = gpt_decoder(f"t{rng.randrange(10**6)}", rng.randint(3, 6), heads * 128, heads, 512,
                        vocab=rng.choice((8000, 50000)), tied_embeddings=rng.random() < 0.5)
    nodes = tuple(NodeSpec(rng.choice(("V100-16GB", "T4", "A100-40GB")), 1, 300.0, 0.0, name=f"n{i}")
                  for i in range(rng.choice((4, 6))))
    return Workload(model, ClusterSpec(f"c{rng.randrange(10**6)}", nodes, rng.choice((1.0, 5.0, 25.0))),
                    rng.choice((8, 16)))


def test_dual_bounds_are_valid_and_tighter(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without enumeration, the solver's bound (F' and the Lagrangian steps) is
    at most the layout's optimum found by brute force, its answer at least
    that optimum and equal to it when certified; more dual steps never lower
    the bound, and on some layouts they raise it (a later stage's sync ends last)."""
    monkeypatch.setattr(stage_partition, "BRUTE_FORCE_LIMIT", 0)
    raised = 0
    for seed in range(12):
        rng = random.Random(seed)
        workload = _tail_workload(rng)
        cost = CostModel(workload)
        dp, pp = 2, workload.cluster.num_devices // 2
        u = rng.choice([u for u in (1, 2) if workload.global_batch_size % (dp * u) == 0])
        base = uniform_plan(workload, dp, 1, pp, u)
        options = [[StageOption(s.devices, dp, 1, s.dp_split, zero, recompute)
                    for zero in (0, 3) for recompute in ("none", "full")] for s in base.stages]
        partitioner = PipelinePartitioner(cost.kernel, base.micro_batch_size, base.num_micro_batches)
        optimum = partitioner._brute_force(partitioner.tables(options))[2]
        plain = partitioner.solve(options, dual_steps=0)
        dual = partitioner.solve(options, dual_steps=6, stairs=None, dual_gap=0.0)
        capped = partitioner.solve(options, dual_steps=3, stairs=1, dual_gap=0.0)
        for solution in (plain, dual, capped):
            assert solution is not None
            assert solution.lower_bound_s <= optimum * (1 + 1e-9), seed
            assert solution.iteration_s >= optimum * (1 - 1e-9), seed
            if solution.certified:
                assert same(solution.iteration_s, optimum), seed
        assert dual.lower_bound_s >= plain.lower_bound_s * (1 - 1e-12), seed
        assert dual.iteration_s <= plain.iteration_s * (1 + 1e-12), seed
        raised += dual.lower_bound_s > plain.lower_bound_s * (1 + 1e-9)
    
    assert raised >= 1


def test_the_exact_partition_certifies_a_pipeline_paced_by_its_link(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two zones joined by 0.2 Gbps: the round trips over the best split's
    middle link pace the pipeline (1F1B's pace is above every stage's time).
    The staircase alone (no enumeration) finds the estimate's optimum over
    every split and option and certifies it: its objective carries 1F1B's pace
    (``one_f_one_b``), so auto need not fall back to the planners it contains."""
    monkeypatch.setattr(stage_partition, "BRUTE_FORCE_LIMIT", 0)
    cluster = ClusterSpec("two-zones", (NodeSpec("V100-16GB", 2, 100.0, 25.0, name="a", zone="a"),
                                        NodeSpec("A100-40GB", 2, 100.0, 25.0, name="b", zone="b")), 25.0,
                          inter_zone_bandwidth_gbps=0.2)
    workload = Workload(get_model("tiny-gpt"), cluster, 16)
    cost = CostModel(workload)
    options = _layout_options(workload, 1, 1, 4, 1)
    partitioner = PipelinePartitioner(cost.kernel, 1, 16)
    solution = partitioner.solve(options)
    assert solution is not None and solution.certified
    assert same(solution.iteration_s, partitioner._brute_force(partitioner.tables(options))[2])
    plan = Plan("tiny-gpt", cluster.name, 16, 1, 16, "1f1b", solution.stages)
    assert same(cost.estimate(plan).iteration_time_s, solution.iteration_s)
    times = [cost.stage_timing(s, 1).per_micro_batch_s for s in plan.stages]
    assert one_f_one_b_period(times, cost.p2p_times(plan)) > 1.01 * max(times)  # the round trips pace it
