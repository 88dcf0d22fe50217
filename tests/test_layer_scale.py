"""Planning cost that grows gently with the layers (issue 32 item 2).

Range tables answer every range as the dense matrices did; Megatron's balanced
split grows as k·L, not k·L²; the searching planners see a model above
``MAX_SEARCH_LAYERS`` layers in layer groups, whose plans are plans of the real
model costed by the real model. The 1,000 and 10,000-layer measurements are
``benchmarks/bench_layer_scale.py``.
"""

from __future__ import annotations

import time
from dataclasses import replace

import numpy as np
import pytest

from hetplan.cluster.presets import get_cluster
from hetplan.cost.model import CostModel
from hetplan.cost import ranges
from hetplan.cost.ranges import RangeMax, RangeSum
from hetplan.errors import HetplanError
from hetplan.model.presets import gpt_decoder
from hetplan.plan.workload import Workload
from hetplan.profile.db import ProfileDB
from hetplan.search.common.layer_groups import (MAX_SEARCH_LAYERS, MAX_UNGROUPED_LAYERS, SEARCH_GROUPS,
                                                 grouped_model, layer_groups)
from hetplan.search.baselines.uniform import uniform_plan
from hetplan.search.common.partition import balanced_partition
from hetplan.search.registry import get_planner


def _dense_max(values: np.ndarray) -> np.ndarray:
    """``[a, b]``: max(values[a:b]), 0 where a >= b — the matrix the kernel used to hold."""
    n = len(values)
    out = np.zeros((n + 1, n + 1))
    for a in range(n):
        for b in range(a + 1, n + 1):
            out[a, b] = values[a:b].max()
    return out


def test_range_tables_equal_the_dense_matrices() -> None:
    rng = np.random.default_rng(11)
    for _ in range(40):
        n = int(rng.integers(1, 30))
        values = rng.random(n) * (rng.random(n) > 0.3)
        prefix = np.concatenate([[0.0], np.cumsum(rng.random(n))])
        dense = _dense_max(values)
        peak = np.triu(np.maximum(_dense_max(prefix[1:] + values) - prefix[None, :], 0.0), 1)
        table, peaks = RangeMax(values), RangeMax(prefix[1:] + values, prefix)
        every = slice(0, n + 1)
        assert np.array_equal(table[every, every], dense) and np.array_equal(peaks[every, every], peak)
        assert np.array_equal((3 * table)[every, every], 3 * dense)
        rows, cols = np.sort(rng.choice(n + 1, 4)), np.sort(rng.choice(n + 1, 5))
        assert np.array_equal(peaks[rows, cols], peak[np.ix_(rows, cols)])
        a, b = sorted(int(x) for x in rng.choice(n + 1, 2))
        assert table[a, b] == dense[a, b] and peaks[a, b] == peak[a, b]
        tied = [(n - 1, 0, 0.5)] if n > 1 else []
        held = RangeSum(prefix, tied)
        expected = prefix[None, :] - prefix[:, None] - np.where(
            (np.arange(n + 1)[:, None] <= 0) & (np.arange(n + 1)[None, :] > n - 1), 0.5, 0.0) * bool(tied)
        assert np.array_equal(held[every, every], expected) and held[a, b] == expected[a, b]


def test_small_tables_answer_from_the_whole_matrix_as_the_sparse_table_does(monkeypatch: pytest.MonkeyPatch) -> None:
    """Up to ``DENSE_LAYERS`` a RangeMax answers blocks from its whole matrix: the
    same values as the sparse table, empty ranges included wherever their ends lie
    (``cost/zero3.py`` asks for ``[rows + 1, cols - 1]``, which reaches -1 and L + 1)."""
    rng = np.random.default_rng(5)
    for _ in range(20):
        n = int(rng.integers(1, 30))
        values, prefix = rng.random(n) * 10, np.concatenate([[0.0], np.cumsum(rng.random(n))])
        rows, cols = np.arange(n + 1) + 1, np.arange(n + 1) - 1
        whole = [RangeMax(values)[rows, cols], RangeMax(prefix[1:] + values, prefix, 2.0)[rows, cols]]
        monkeypatch.setattr(ranges, "DENSE_LAYERS", -1)
        sparse = [RangeMax(values)[rows, cols], RangeMax(prefix[1:] + values, prefix, 2.0)[rows, cols]]
        monkeypatch.setattr(ranges, "DENSE_LAYERS", n)
        assert all(np.array_equal(a, b) for a, b in zip(whole, sparse))


def _cpu(call: object) -> float:
    start = time.process_time()
    call()
    return time.process_time() - start


def test_balanced_partition_grows_linearly_with_layers() -> None:
    """Ten times the layers, well under a hundred times the work (the segment table grew as L²)."""
    rng = np.random.default_rng(5)
    small, large = rng.random(200), rng.random(2000)
    small_s = min(_cpu(lambda: balanced_partition(small, 8)) for _ in range(3))
    large_s = min(_cpu(lambda: balanced_partition(large, 8)) for _ in range(3))
    assert large_s < 30 * max(small_s, 1e-3)


def _workload(layers: int, gpus: int = 8) -> Workload:
    return Workload(gpt_decoder(f"tiny-{layers}", layers - 2, 64, 4, 128, vocab=512), get_cluster(f"{gpus}xH100"), 16)


def test_groups_keep_runs_apart_and_sum_the_model() -> None:
    model = _workload(1000).model
    groups = layer_groups(model)
    assert groups is not None and len(groups) <= max(SEARCH_GROUPS, 3)
    assert groups[0] == range(0, 1) and groups[-1] == range(999, 1000)  # embedding and head stay alone
    assert [i for g in groups for i in g] == list(range(1000))
    grouped = grouped_model(model, groups)
    assert grouped.total_params == model.total_params
    assert grouped.fwd_flops_per_sample == pytest.approx(model.fwd_flops_per_sample, rel=1e-12)
    assert layer_groups(_workload(MAX_SEARCH_LAYERS).model) is None  # small models: layer by layer


@pytest.mark.parametrize("planner", ["auto", "galvatron-bmw"])
def test_grouped_plans_are_real_plans_costed_by_the_real_model(planner: str) -> None:
    workload = _workload(2000)
    start = time.process_time()
    ranked = get_planner(planner).plan(workload, 2)
    assert time.process_time() - start < 60  # seconds, not the minutes the layer-by-layer search took
    real = CostModel(workload)
    for r in ranked:
        layers = [i for stage in r.plan.stages for i in stage.layers]
        assert layers == list(range(2000))
        assert all(len(s.strategies) == len(s.layers) for s in r.plan.stages)
        assert r.estimate.iteration_time_s == real.estimate(r.plan).iteration_time_s
        assert any("groups" in note for note in r.plan.notes)  # searched in groups, or a companion's plan


def test_grouped_auto_is_never_worse_than_uniform() -> None:
    """A group over-states memory (full recomputation rebuilds the whole group):
    with memory for every layer's full recomputation and little more, the
    grouped search alone found a plan twice as slow; auto plans every layer with
    uniform and Megatron too, as its space holds their plans."""
    base = Workload(gpt_decoder("tiny-2000", 1998, 256, 4, 2048, vocab=512), get_cluster("8xH100"), 16,
                    search_offload=False)
    full = CostModel(base).estimate(uniform_plan(base, 8, 1, 1, 2, 3, "full"))  # dp8, ZeRO-3, full recomputation
    tight = replace(base, memory_limit_bytes=int(max(full.peak_memory_bytes.values()) * 1.02))
    best_uniform = get_planner("uniform").plan(tight, 1)[0].estimate.iteration_time_s
    assert get_planner("auto").plan(tight, 1)[0].estimate.iteration_time_s <= best_uniform


def test_small_models_plan_as_before() -> None:
    workload = _workload(40)
    grouped, inner = get_planner("amp"), get_planner("amp").inner
    assert [r.plan for r in grouped.plan(workload, 3)] == [r.plan for r in inner.plan(workload, 3)]


def test_too_many_distinct_layers_or_a_profile_are_refused_in_one_line() -> None:
    base = _workload(MAX_SEARCH_LAYERS + 2)
    layers = [layer if i % 2 else type(layer)(**{**layer.__dict__, "fwd_flops": layer.fwd_flops * 1.5,
                                                 "profile_key": ""})
              for i, layer in enumerate(base.model.layers)]
    mixed = Workload(base.model.with_layers(layers), base.cluster, 16)
    with pytest.raises(HetplanError, match="use --planner megatron or uniform") as error:
        get_planner("amp").plan(mixed, 1)
    assert "\n" not in str(error.value)
    long = _workload(MAX_UNGROUPED_LAYERS + 2)
    profiled = Workload(long.model, long.cluster, 16, profile=ProfileDB())
    with pytest.raises(HetplanError, match="plan without --profile"):
        get_planner("metis").plan(profiled, 1)
    runtime = Workload(long.model, long.cluster, 16, target="hetplan")
    with pytest.raises(HetplanError, match="plan for a tool"):
        get_planner("auto").plan(runtime, 1)
    assert get_planner("megatron").plan(runtime, 1)  # the planners that plan every layer still do


def test_a_workload_that_cannot_be_grouped_is_searched_layer_by_layer_up_to_its_limit() -> None:
    """hetplan's runtime target (and a profile) cannot be grouped; up to MAX_UNGROUPED_LAYERS the
    search runs on every layer, as before layer groups, instead of refusing."""
    base = _workload(MAX_SEARCH_LAYERS + 2)
    runtime = Workload(base.model, base.cluster, 16, target="hetplan")
    grouped, inner = get_planner("amp"), get_planner("amp").inner
    assert [r.plan for r in grouped.plan(runtime, 2)] == [r.plan for r in inner.plan(runtime, 2)]
