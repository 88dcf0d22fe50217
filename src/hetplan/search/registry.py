"""Every planner, by name — registered here explicitly, not discovered by import side effects."""

from __future__ import annotations

from functools import partial
from typing import Callable

from hetplan.errors import HetplanError, did_you_mean
from hetplan.search.amp import AMPPlanner
from hetplan.search.auto import AutoPlanner
from hetplan.search.base import Planner
from hetplan.search.baselines.fixed import BASELINES, BaselinePlanner
from hetplan.search.baselines.hetero_avg import HeteroAvgPlanner
from hetplan.search.baselines.megatron import MegatronPlanner
from hetplan.search.baselines.random_search import DEFAULT_SAMPLES, RandomPlanner
from hetplan.search.baselines.uniform import UniformPlanner
from hetplan.search.common.layer_groups import GroupedPlanner
from hetplan.search.exhaustive import ExhaustivePlanner
from hetplan.search.galvatron import VARIANTS, GalvatronPlanner
from hetplan.search.metis import MetisPlanner
from hetplan.search.smp import SMPPlanner

PlannerFactory = Callable[[], Planner]

PLANNERS: dict[str, tuple[PlannerFactory, str]] = {
    "auto": (AutoPlanner, "hetplan's own: the papers' planners' best plans, refined and searched exactly under "
                          "the shared cost model (layer split x per-stage ZeRO/recompute), with a lower bound"),
    "uniform": (UniformPlanner, "every uniform dp x tp x pp, micro-batch, ZeRO and recompute choice "
                                "(even layer split)"),
    "megatron": (MegatronPlanner, "Megatron-LM heuristics (AMP §4.1): smallest tp x pp that fits, TP in node, "
                                  "then DP; layers split evenly by count or parameters"),
    "amp": (AMPPlanner, "AMP (NeurIPS'22) Algorithm 1: degrees x micro-batch, Megatron placement, optimal "
                        "layer assignment, ranked by AMP's own cost (ignores memory; OOM shown)"),
    "random": (RandomPlanner, f"AMP's RS baseline: {DEFAULT_SAMPLES} uniformly random valid strategies (degrees, "
                              "micro-batch, placement, layer split), best by the cost model"),
    "exhaustive": (ExhaustivePlanner, "every plan of AMP's space (degrees, micro-batch, placements up to "
                                      "symmetry, layer splits) ranked by the cost model; small instances only"),
    "metis": (MetisPlanner, "Metis (ATC'24): device groups, pruned stage mapping, DP-first intra-stage search, "
                            "capacity-aware layer and data balancing"),
    "smp": (SMPPlanner, "SageMaker model parallelism (Karakus et al. 2021, §4.5): tree partition of the module hierarchy, "
                        "cost alpha*memory + (1-alpha)*compute, balanced segments, D'Hondt device allocation; "
                        "dp over the rest, tp=1"),
    "hetero-avg": (HeteroAvgPlanner, "AMP/Alpa homogeneous abstraction: uniform 3D plans chosen as if every GPU "
                                     "were the cluster's average GPU (Metis §3 baseline)"),
}
for _name, (_config, _description) in VARIANTS.items():
    PLANNERS[_name] = (partial(GalvatronPlanner, _config), _description)
for _name, (_baseline, _description) in BASELINES.items():
    PLANNERS[_name] = (partial(BaselinePlanner, _baseline), _description)


def planner_names() -> list[str]:
    return sorted(PLANNERS)


def planner_descriptions() -> dict[str, str]:
    return {name: PLANNERS[name][1] for name in planner_names()}


# Planners whose work grows gently with the layers (even or parameter-balanced
# splits from prefix sums, one pass over the layers per candidate): they plan
# every layer of a 10,000-layer model (benchmarks/bench_layer_scale.py). The
# others search models above ``layer_groups.MAX_SEARCH_LAYERS`` layers in layer groups.
LAYER_BY_LAYER = frozenset({"uniform", "megatron", "hetero-avg", *BASELINES})


def get_planner(name: str) -> Planner:
    if name not in PLANNERS:
        raise HetplanError(f"unknown planner {name!r}{did_you_mean(name, PLANNERS)}; choose one of {', '.join(planner_names())}")
    planner = PLANNERS[name][0]()
    if name in LAYER_BY_LAYER:
        return planner
    # auto's space holds uniform's and Megatron's plans: searched in groups, it plans every layer with them too
    return GroupedPlanner(planner, companions=(UniformPlanner, MegatronPlanner) if name == "auto" else ())
