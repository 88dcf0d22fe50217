"""The shortcuts that make planning on thousands of GPUs fast give the numbers
of the plain per-GPU and per-replica computations they replace.

The kernel costs a collective once per group *shape* (``cost/groups.py``),
reads a stage's replicas and memory classes off numpy arrays, shares one
``StageCosts`` between stages that differ only by which identical nodes they
use, and Metis caches what it works out for a device group under the group's
class. Each test here computes the same thing the slow, obvious way, on
clusters where the shortcuts have something to get wrong: mixed GPU types,
uneven nodes, groups that straddle nodes, and a device-to-device matrix.
"""

from __future__ import annotations

import random
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from hetplan.cluster.io import load_cluster
from hetplan.cluster.spec import ClusterSpec, NodeSpec
from hetplan.cost.model import CostModel
from hetplan.plan.workload import Workload
from hetplan.cost.comm import (
    allgather_time,
    allreduce_time,
    collective_latency,
    flat_ring_allreduce_time,
    p2p_time,
    reduce_scatter_time,
)
from hetplan.cost.constants import MEMORY_BANDWIDTH_EFFICIENCY, OPTIMIZER_STEP_BYTES_PER_PARAM
from hetplan.cost.stage import StageOption
from hetplan.model.presets import get_model
from hetplan.search.base import rank_key, sorted_by_rank
from hetplan.search.common.placement import canonical_placements, count_canonical_placements, heuristic_placement
from hetplan.search.metis.groups import make_group
from hetplan.search.metis.stage_costs import Intra, MetisCosts, proportional_bounds

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from mixed_clusters import mixed_cluster


def _matrix_cluster() -> ClusterSpec:
    base = load_cluster("metis-p100-v100-8")
    n = base.num_devices
    rows = tuple(tuple(0.0 if i == j else (300.0 if base.devices[i].node == base.devices[j].node
                                           else 25.0 + (i + j) % 3 * 10) for j in range(n)) for i in range(n))
    return ClusterSpec("matrix-8", base.nodes, base.inter_bandwidth_gbps, bandwidth_matrix_gbps=rows)


def _uneven_cluster() -> ClusterSpec:
    """Nodes of 8, 4 and 2 GPUs of three types, two network speeds."""
    return ClusterSpec("uneven", (NodeSpec("H100", 8, 3600.0, 400.0), NodeSpec("A100-80GB", 4, 2400.0),
                                  NodeSpec("H100", 8, 3600.0, 400.0), NodeSpec("V100-16GB", 2, 1200.0),
                                  NodeSpec("A100-80GB", 4, 2400.0)), 200.0)


def _zoned_cluster() -> ClusterSpec:
    """The uneven cluster with its nodes in zones a, b, a, b, a and 50 Gbps between
    zones: alike nodes in two zones must not share a group shape."""
    base = _uneven_cluster()
    nodes = tuple(replace(node, zone="ab"[i % 2]) for i, node in enumerate(base.nodes))
    return replace(base, name="zoned", nodes=nodes, inter_zone_bandwidth_gbps=50.0)


CLUSTERS = {"mixed-64": lambda: mixed_cluster(64), "metis-mixed-64": lambda: load_cluster("metis-mixed-64"),
            "uneven": _uneven_cluster, "matrix": _matrix_cluster, "128xH100": lambda: load_cluster("128xH100"),
            "zoned": _zoned_cluster}


def _random_groups(n: int, rng: random.Random, count: int) -> list[tuple[int, ...]]:
    out = []
    for _ in range(count):
        size = rng.randint(1, n)
        if rng.random() < 0.5:
            start = rng.randint(0, n - size)
            out.append(tuple(range(start, start + size)))
        else:
            out.append(tuple(rng.sample(range(n), size)))
    return out


def _random_stage(n: int, rng: random.Random) -> tuple[tuple[int, ...], int, int, tuple[int, ...]]:
    """Devices, dp, tp and an uneven split of a random stage."""
    tp = rng.choice([1, 1, 2, 4])
    dp = rng.randint(1, max(1, min(16, n // tp)))
    devices = tuple(rng.sample(range(n), dp * tp)) if rng.random() < 0.5 else \
        tuple(range(rng.randint(0, n - dp * tp), 0)) or tuple(range(dp * tp))
    split = tuple(rng.choice([1, 2, 3]) for _ in range(dp))
    return devices, dp, tp, split


@pytest.mark.parametrize("name", sorted(CLUSTERS))
def test_collectives_by_shape_are_the_formulas(name: str) -> None:
    """A collective cached under its group's shape costs what ``cost/comm.py`` says for that very group."""
    cluster = CLUSTERS[name]()
    kernel = CostModel(Workload(get_model("gpt2-amp"), cluster, 8)).kernel
    rng = random.Random(1)
    for group in _random_groups(cluster.num_devices, rng, 150):
        for kind, formula in (("allreduce", allreduce_time), ("allgather", allgather_time),
                              ("reduce_scatter", reduce_scatter_time)):
            concurrent = rng.choice([1, 2, 8])
            assert kernel.collective_rate(kind, group, concurrent) == formula(cluster, group, 1.0, concurrent)
    for a, b in zip(_random_groups(cluster.num_devices, rng, 100), _random_groups(cluster.num_devices, rng, 100)):
        assert kernel.p2p_rate(a, b) == p2p_time(cluster, a, b, 1.0)


@pytest.mark.parametrize("name", sorted(CLUSTERS))
def test_stage_layout_is_the_per_replica_one(name: str) -> None:
    """A stage's replica classes, memory classes, data-parallel rates and
    optimizer rate, read off numpy arrays, are those of a loop over its replicas."""
    cluster = CLUSTERS[name]()
    kernel = CostModel(Workload(get_model("gpt2-amp"), cluster, 8)).kernel
    rng = random.Random(2)
    for _ in range(60):
        devices, dp, tp, split = _random_stage(cluster.num_devices, rng)
        layout = kernel.layout(devices, dp, tp, split)
        times: dict[tuple[object, ...], tuple[object, ...]] = {}
        memory: dict[tuple[int, int, int, float], list[int]] = {}
        for r in range(dp):
            group = devices[r * tp:(r + 1) * tp]
            gpu = kernel.slowest_gpu(group)
            link = (allreduce_time(cluster, group, 1.0), collective_latency(cluster, group, "allreduce")) \
                if tp > 1 else (0.0, 0.0)
            times.setdefault((gpu.name, split[r], link), (gpu, split[r], link, (1.0, 1.0)))  # no EP: own tokens
            for position in range(r * tp, (r + 1) * tp):
                key = (split[r], kernel.capacity_bytes(devices[position]), kernel.overhead_bytes(devices[position]),
                       kernel.host_capacity_bytes(devices[position]))
                memory.setdefault(key, []).append(position)
        assert layout.time_classes == tuple(times.values())
        assert [(c.batch, c.capacity, c.overhead, c.host_capacity) for c in layout.memory_classes] == list(memory)
        for index, positions in enumerate(memory.values()):
            assert all(layout.device_class[p] == index for p in positions)
        bandwidth = min(cluster.devices[d].gpu.memory_bandwidth_bytes_per_s for d in devices)
        assert layout.optimizer_rate == OPTIMIZER_STEP_BYTES_PER_PARAM / (bandwidth * MEMORY_BANDWIDTH_EFFICIENCY)
        for kind in ("allreduce", "allgather", "reduce_scatter"):
            assert kernel.dp_collective_rate(kind, devices, tp) == _dp_rate_by_group(kernel, kind, devices, tp)


def _dp_rate_by_group(kernel: object, kind: str, devices: tuple[int, ...], tp: int) -> float:
    """``CostKernel.dp_collective_rate`` over every data-parallel group, one by one."""
    dp = len(devices) // tp
    if dp < 2:
        return 0.0
    cluster = kernel.cluster
    groups = [tuple(devices[r * tp + t] for r in range(dp)) for t in range(tp)]
    latency = max(collective_latency(cluster, g, kind) for g in groups)
    share = tp * kernel._nic_sharers(kind, groups[0])
    rates = [{"allreduce": allreduce_time, "allgather": allgather_time,
              "reduce_scatter": reduce_scatter_time}[kind](cluster, g, 1.0, share) for g in groups]
    return max(rates) + latency / kernel.message_bytes(kind, tp)


def test_symmetric_stages_share_their_costs_and_keep_their_numbers() -> None:
    """The stages of a uniform plan on identical nodes share one StageCosts;
    a kernel that saw only one of them costs it the same."""
    workload = Workload(get_model("gpt3-1.3b"), load_cluster("64xH100"), 64)
    cost = CostModel(workload)
    options = [StageOption(devices, 4, 2, (2,) * 4, 2, "selective") for devices in heuristic_placement(64, 8, 4, 2)]
    shared = {id(cost.kernel.stage(o)) for o in options}
    assert len(shared) == 1
    for option in options:
        alone = CostModel(workload).kernel.stage(option)
        ours = cost.kernel.stage(option)
        assert ours.timing(3, 9) == alone.timing(3, 9)
        assert ours.device_memory(3, 9, 2.0) == alone.device_memory(3, 9, 2.0)


def test_metis_group_classes_cost_alike() -> None:
    """Groups of one Metis class have the same intra-stage plans and stage costs."""
    cluster = mixed_cluster(64)
    costs = MetisCosts(CostModel(Workload(get_model("gpt3-1.3b"), cluster, 64)))
    groups = [make_group(cluster, range(start, start + size)) for size in (2, 4, 8, 16)
              for start in range(0, cluster.num_devices - size + 1, 2)]
    by_class: dict[int, list[object]] = {}
    for g in groups:
        by_class.setdefault(costs.group_class(g), []).append(g)
    assert any(len(members) > 1 for members in by_class.values())
    assert len(by_class) > 1
    for members in by_class.values():
        reference = members[0]
        for g in members[1:]:
            for tp in (1, 2):
                if g.size % tp:
                    continue
                dp = g.size // tp
                intra = Intra(dp, tp, (1,) * dp)
                assert costs.stage(g, intra).timing(0, 5) == costs.stage(reference, intra).timing(0, 5)
                assert costs.stage(g, intra).fits(0, 5, 2.0) == costs.stage(reference, intra).fits(0, 5, 2.0)
                assert [(r.gpu.name, r.capacity_bytes, r.overhead_bytes) for r in costs.replicas(g, tp)] == \
                    [(r.gpu.name, r.capacity_bytes, r.overhead_bytes) for r in costs.replicas(reference, tp)]


def test_flat_ring_by_shape() -> None:
    """AMP's eq. 3 cached per data-parallel group shape is eq. 3 of the group."""
    from hetplan.search.amp import AmpCostModel

    cluster = mixed_cluster(64)
    amp = AmpCostModel(CostModel(Workload(get_model("gpt2-amp"), cluster, 64)))
    rng = random.Random(3)
    for _ in range(40):
        devices, dp, tp, _ = _random_stage(cluster.num_devices, rng)
        expected = max(flat_ring_allreduce_time(cluster, [devices[r * tp + t] for r in range(dp)], 1.0)
                       for t in range(tp))
        assert amp._sync_per_byte(devices, tp) == expected


def test_placements_on_thousands_of_identical_nodes() -> None:
    """One placement up to symmetry when every node is one TP group — found
    without scanning every node per slot, and without recursion: 2,048 slots."""
    cluster = load_cluster("16384xH100")
    assert count_canonical_placements(cluster, 1, 2048, 8) == 1
    assert list(canonical_placements(cluster, 1, 2048, 8)) == [heuristic_placement(16384, 1, 2048, 8)]
    assert list(canonical_placements(cluster, 16, 128, 8)) == [heuristic_placement(16384, 16, 128, 8)]


def test_rank_order_reads_plan_text_only_on_ties() -> None:
    """``sorted_by_rank`` orders as ``rank_key`` does."""

    class FakePlan:
        def __init__(self, text: str) -> None:
            self.text = text

        def describe(self) -> str:
            return self.text

    rng = random.Random(4)
    scored = [((rng.randint(0, 1), rng.choice([1.0, 2.0, 2.5])), FakePlan(rng.choice("abcdef")))
              for _ in range(300)]
    expected = sorted(scored, key=lambda item: (*item[0], item[1].describe()))
    assert [id(p) for _, p in sorted_by_rank(scored)] == [id(p) for _, p in expected]
    assert rank_key  # the order it reproduces


def test_proportional_bounds_by_bisection() -> None:
    """The cut points on ascending prefix sums, as the paper's search finds them."""
    rng = random.Random(5)
    for _ in range(3000):
        layers = rng.randint(1, 60)
        prefix = [0.0]
        for _ in range(layers):
            prefix.append(prefix[-1] + rng.choice([0.0, rng.random(), 1.0]))
        stages = rng.randint(1, layers)
        weights = [rng.random() + 1e-3 for _ in range(stages)]
        fractions = [w / sum(weights) for w in weights]
        assert proportional_bounds(prefix, fractions) == _proportional_bounds_by_hand(prefix, fractions)


def _proportional_bounds_by_hand(prefix: list[float], fractions: list[float]) -> list[int]:
    """For each cut, the prefix closest to its target (the first on ties)
    among those leaving every stage a layer."""
    layers, stages = len(prefix) - 1, len(fractions)
    total = prefix[-1] or 1.0
    bounds, cumulative = [0], 0.0
    for j in range(stages - 1):
        cumulative += fractions[j]
        target = cumulative * total
        lo, hi = bounds[-1] + 1, layers - (stages - 1 - j)
        above = next((i for i in range(lo, hi + 1) if prefix[i] >= target), hi + 1)
        best, gap = lo, abs(prefix[lo] - target)
        for cand in (above - 1, above):
            if lo <= cand <= hi and abs(prefix[cand] - target) < gap - 1e-15:
                best, gap = cand, abs(prefix[cand] - target)
        bounds.append(best)
    return bounds + [layers]


def test_first_appearance_numbers_as_a_dict_does() -> None:
    """Classes numbered in order of first appearance, for short and long arrays and rows."""
    import numpy as np

    from hetplan.cost.groups import first_appearance

    rng = random.Random(6)
    for _ in range(2000):
        values = [rng.randint(0, 4) for _ in range(rng.randint(1, 60))]
        rows = rng.random() < 0.3
        codes = np.array([[v, v % 2] for v in values]) if rows else np.array(values)
        numbering: dict[object, int] = {}
        classes = [numbering.setdefault(tuple(c) if rows else c, len(numbering)) for c in codes.tolist()]
        firsts, found = first_appearance(codes)
        assert found.tolist() == classes
        assert firsts.tolist() == [classes.index(k) for k in range(len(numbering))]
