"""Metis Fig. 4 as inequalities: on every GPU pair and size of Table 3, with
Table 2's model sizes, ``metis`` is at least as fast as ``amp`` and as the
homogeneous-abstraction baseline ``hetero-avg``, by the shared cost model.

A planner whose plans do not fit in memory (AMP's objective ignores memory)
counts as infinitely slow there, like the OOM marks of Fig. 4.
"""

from __future__ import annotations

import math

import pytest

from hetplan.cluster.io import load_cluster
from hetplan.plan.workload import Workload
from hetplan.errors import HetplanError
from hetplan.model.presets import get_model
from hetplan.search import get_planner

GLOBAL_BATCH = 128
TABLE2 = {4: ("gpt3-1.3b", "moe-1.3b", "wresnet-1b"), 8: ("gpt3-2.6b", "moe-2.4b", "wresnet-2b"),
          16: ("gpt3-6.7b", "moe-10b", "wresnet-4b"), 32: ("gpt3-15b", "moe-27b", "wresnet-6.8b")}
PAIRS = ("p100-t4", "t4-v100", "p100-v100")
SETUPS = [(f"metis-{pair}-{n}", model) for pair in PAIRS for n, models in TABLE2.items() for model in models]


def best_fitting_time(planner: str, workload: Workload, top_k: int) -> float:
    """The fastest plan among the planner's top ``top_k`` that fits (inf if none)."""
    try:
        ranked = get_planner(planner).plan(workload, top_k)
    except HetplanError:
        return math.inf
    times = [r.estimate.iteration_time_s for r in ranked if r.estimate.fits]
    return min(times) if times else math.inf


@pytest.mark.parametrize("cluster,model", SETUPS)
def test_metis_at_least_as_fast_as_amp_and_average_gpu(cluster: str, model: str) -> None:
    workload = Workload(get_model(model), load_cluster(cluster), GLOBAL_BATCH)
    metis = best_fitting_time("metis", workload, 3)
    assert math.isfinite(metis), "metis found no fitting plan"
    assert metis <= best_fitting_time("hetero-avg", workload, 8) * (1 + 1e-9)
    assert metis <= best_fitting_time("amp", workload, 50) * (1 + 1e-9)


# --- the average-GPU baseline itself ----------------------------------------------------------------
def test_balanced_split_is_the_minmax_optimum() -> None:
    import itertools

    from hetplan.search.baselines.hetero_avg import balanced_split

    cases = [([1, 1, 1, 1, 5, 1, 1], 3), ([3, 1, 4, 1, 5, 9, 2, 6], 4), ([1] * 7, 7), ([2, 2, 2, 2], 1),
             ([0.5, 7, 0.5, 0.5, 7, 0.5], 2)]
    for times, parts in cases:
        ranges = balanced_split(times, parts)
        assert len(ranges) == parts and all(len(r) for r in ranges)
        assert [i for r in ranges for i in r] == list(range(len(times)))
        best = min(max(sum(times[a:b]) for a, b in zip((0,) + cuts, cuts + (len(times),)))
                   for cuts in itertools.combinations(range(1, len(times)), parts - 1))
        assert max(sum(times[i] for i in r) for r in ranges) == pytest.approx(best)


def test_hetero_avg_plans_are_uniform_grids_with_even_splits() -> None:
    workload = Workload(get_model("gpt3-2.6b"), load_cluster("metis-p100-v100-8"), GLOBAL_BATCH)
    ranked = get_planner("hetero-avg").plan(workload, 3)
    for r in ranked:
        first = r.plan.stages[0]
        assert all((s.dp, s.tp) == (first.dp, first.tp) for s in r.plan.stages)
        assert all(len(set(s.dp_split)) == 1 for s in r.plan.stages)
        devices = [d for s in r.plan.stages for d in s.devices]
        assert devices == sorted(devices)  # the M x N grid in device-id order
        assert r.planner_cost_s is not None
