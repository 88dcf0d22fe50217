"""AMP §4.5 reproduced on hetplan's presets, as inequalities (not hard-coded plans).

"Predicted" times are the shared cost model's; AMP's own cost ranks AMP's list.
``benchmarks/bench_amp.py`` prints the numbers next to the paper's.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from hetplan.cluster.presets import get_cluster
from hetplan.cost.model import CostModel
from hetplan.plan.workload import Workload
from hetplan.model.presets import get_model
from hetplan.model.spec import ModelSpec
from hetplan.plan.spec import RankedPlan
from hetplan.search import get_planner
from hetplan.search.amp import AMPPlanner, AmpCandidate, AmpCostModel
from hetplan.search.baselines.megatron import layer_split
from hetplan.search.common.partition import fast_partition
from hetplan.search.common.placement import heuristic_placement
from hetplan.search.baselines.uniform import uniform_plan
from hetplan.simulate.events import makespan
from hetplan.simulate.plan import simulate_plan


def megatron_plan(workload: Workload) -> RankedPlan:
    return get_planner("megatron").plan(workload, 1)[0]


def rank_in_amp_list(candidates: list[AmpCandidate], plan_key: tuple[int, int, int, int]) -> int:
    return 1 + next(i for i, c in enumerate(candidates) if (c.pp, c.dp, c.tp, c.micro_batch) == plan_key)


def test_homogeneous_gpt2() -> None:
    """AMP §4.5, Table 3: Megatron is near-optimal and AMP finds at least as
    good; a pipelined plan (paper: dp=4, pp=4, mbs=1) beats Megatron's dp=16."""
    workload = Workload(get_model("gpt2-amp"), get_cluster("amp-homogeneous"), 32)
    megatron = megatron_plan(workload)
    assert megatron.plan.pp == 1 and megatron.plan.stages[0].dp == 16
    amp = get_planner("amp").plan(workload, 10)
    assert amp[0].estimate.iteration_time_s <= megatron.estimate.iteration_time_s
    assert amp[0].plan.pp > 1 and amp[0].estimate.fits
    assert amp[0].plan.micro_batch_size // amp[0].plan.stages[0].dp == 1  # the smallest micro-batch
    # Megatron is "near-optimal" in this setting: within 2x of AMP, unlike the heterogeneous cluster
    assert megatron.estimate.iteration_time_s < 2.0 * amp[0].estimate.iteration_time_s


def test_heterogeneous_cluster_gpt2() -> None:
    """AMP §4.5, Table 4: Megatron picks dp=16; AMP's best is ≥ 1.4x faster
    (paper 1.54x) and AMP's own cost ranks Megatron's plan far down (paper: 21st)."""
    workload = Workload(get_model("gpt2-amp"), get_cluster("amp-heterogeneous"), 32)
    megatron = megatron_plan(workload)
    assert megatron.plan.pp == 1 and megatron.plan.stages[0].dp == 16 and megatron.plan.stages[0].tp == 1
    cost_model = CostModel(workload)
    candidates = AMPPlanner().search(workload, AmpCostModel(cost_model))
    best = cost_model.estimate(candidates[0].to_plan(workload))
    assert best.fits
    assert megatron.estimate.iteration_time_s >= 1.4 * best.iteration_time_s
    # better than every one of Megatron's proposals, not just its pick
    for proposal in get_planner("megatron").plan(workload, 50):
        assert proposal.estimate.iteration_time_s >= 1.4 * best.iteration_time_s
    u = megatron.plan.micro_batch_size // 16
    rank = rank_in_amp_list(candidates, (1, 16, 1, u))
    assert rank > 10  # outside AMP's 10 real trials: AMP never runs it
    assert rank > len(candidates) // 2  # in the bottom half of AMP's list
    # AMP's cost penalises it for the 10 Gbps links in its DP group (eq. 3 over the slowest link)
    megatron_cost = candidates[rank - 1].cost
    assert megatron_cost.dp_sync_s > megatron_cost.pipeline_s


def _with_split(workload: Workload, candidate: AmpCandidate, ranges: list[range]):
    return uniform_plan(workload, candidate.dp, candidate.tp, candidate.pp, candidate.micro_batch,
                        layer_split=list(ranges), planner="amp")


def test_heterogeneous_model_transgan() -> None:
    """AMP §4.5, Table 5: AMP's best strategy with its DP layer assignment beats
    the same degrees and micro-batch with Megatron's uniform-layer and
    uniform-parameter assignments (paper: 1.17x and 2.05x)."""
    workload = Workload(get_model("transgan-het"), get_cluster("amp-hetero-model"), 64)
    cost_model = CostModel(workload)
    amp = AmpCostModel(cost_model)
    best = AMPPlanner().search(workload, amp)[0]
    assert best.pp > 1
    ours = best.to_plan(workload)
    ours_time = cost_model.estimate(ours).iteration_time_s
    for rule in ("layers", "parameters"):
        other = _with_split(workload, best, layer_split(workload, best.pp, rule))
        assert amp.plan_cost(other).total_s > 1.1 * amp.plan_cost(ours).total_s, rule
        assert cost_model.estimate(other).iteration_time_s > 1.1 * ours_time, rule
    # and AMP beats Megatron's pick (paper: 1.77x)
    assert megatron_plan(workload).estimate.iteration_time_s > 1.5 * ours_time


def with_heterogeneity(model: ModelSpec, workload_cluster: str, target: float) -> tuple[ModelSpec, float]:
    """The TransGAN generator with its dim-16 blocks' work scaled so that
    (dim-16 block time) / (dim-1024 block time) = ``target`` (AMP eq. 9),
    measured by the shared compute model on one V100 at micro-batch 1."""
    cluster = get_cluster(workload_cluster)
    gpu = cluster.devices[0].gpu
    low = next(i for i, layer in enumerate(model.layers) if layer.kind.startswith("transgan") and
               layer.kind != model.layers[1].kind)

    def scaled(s: float) -> ModelSpec:
        layers = [replace(layer, fwd_flops=layer.fwd_flops * s, fwd_mem_bytes=layer.fwd_mem_bytes * s,
                          attention_flops=layer.attention_flops * s)
                  if layer.kind == model.layers[low].kind else layer for layer in model.layers]
        return model.with_layers(layers)

    def ratio(m: ModelSpec) -> float:
        kernel = CostModel(Workload(m, cluster, 64)).kernel
        a, b = kernel.layer_time(low, gpu, 1), kernel.layer_time(1, gpu, 1)
        return (a[0] + a[1]) / (b[0] + b[1])

    lo, hi = 0.0, 1.0
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if ratio(scaled(mid)) < target else (lo, mid)
    result = scaled(hi)
    return result, ratio(result)


def fig3_speedups(gbs: int, target: float) -> dict[str, float]:
    """Fig. 3: with mp=1, pp=4, dp=4 and micro-batch 1, the DP layer assignment's
    speed-up over the uniform-layer and uniform-parameter assignments, by AMP's
    pipeline objective (eq. 5, what the assignment optimises), AMP's full cost
    (eq. 4), the shared cost model and the event simulator's pipeline (links
    carrying one transfer at a time each way)."""
    model, het = with_heterogeneity(get_model("transgan-het"), "amp-hetero-model", target)
    workload = Workload(model, get_cluster("amp-hetero-model"), gbs)
    cost_model = CostModel(workload)
    amp = AmpCostModel(cost_model)
    pp, dp, tp, u = 4, 4, 1, 1
    gas = gbs // (dp * u)
    terms = amp.terms(heuristic_placement(16, pp, dp, tp), dp, tp, u)
    best = fast_partition(amp.partition_problem(terms, gas))
    assert best is not None
    splits = {"dp": best.ranges(), "layers": layer_split(workload, pp, "layers"),
              "parameters": layer_split(workload, pp, "parameters")}
    values = {}
    for name, ranges in splits.items():
        bounds = [0] + [r.stop for r in ranges]
        cost = amp.cost(terms, gas, bounds)
        plan = uniform_plan(workload, dp, tp, pp, u, layer_split=list(ranges))
        estimate = cost_model.estimate(plan)
        simulated = makespan(simulate_plan(cost_model, plan, estimate))
        values[name] = (cost.pipeline_s, cost.total_s, estimate.iteration_time_s, simulated)
    out = {"heterogeneity": het}
    for rule in ("layers", "parameters"):
        for i, what in enumerate(("eq5", "amp", "shared", "simulated")):
            out[f"{what}_vs_{rule}"] = values[rule][i] / values["dp"][i]
    return out


GRID = (1.0, 1.25, 1.5, 1.75, 2.0, 2.25, 2.5)  # Fig. 3's x-axis


def slope(xs: list[float], ys: list[float]) -> float:
    return float(np.polyfit(xs, ys, 1)[0])


@pytest.mark.parametrize("gbs", [64, 16])
def test_fig3_speedup_grows_with_heterogeneity(gbs: int) -> None:
    """Fig. 3's trend. On eq. 5 — the objective the layer assignment optimises —
    the DP never loses, and its gain over the parameter split grows with
    heterogeneity at both batch sizes; at gbs 64 so does its gain over the
    uniform-layer split (up to the wiggles of splitting 25 blocks into 4
    stages), and on AMP's whole cost the DP never loses to either split and its
    gain over the parameter split grows.

    Not asserted, printed by the benchmark: at gbs 16 the gain over the
    uniform-layer split is largest at heterogeneity 1.0, because Megatron's
    split cuts right after the upsampling layer, whose output is 16x larger
    than a dim-1024 block's, and with only 4 micro-batches that p2p weighs
    more than the bottleneck; and on AMP's whole cost at gbs 16 the DP can
    lose, as eq. 4's DP-sync term — ignored by the assignment — weighs more.

    On the shared cost model at gbs 64 the DP's split loses to the parameter
    split: it cuts after the upsampling layer, whose 8.5 ms send per
    micro-batch outlasts every 2-4 ms stage, and a link slower than the stages
    paces the pipeline (cost/pipeline.py), which eq. 5 does not charge. The
    event simulator's replay of both schedules agrees (at heterogeneity 1.0:
    186 ms against 95 ms), so the shared model ranks the two splits as the
    replay does at every heterogeneity (before the link's pace was charged it
    ranked the DP first, the replay's slower one). Against the uniform-layer
    split both are within a few percent of a tie, not asserted."""
    rows = [fig3_speedups(gbs, h) for h in GRID]
    xs = [r["heterogeneity"] for r in rows]
    assert xs == pytest.approx(list(GRID), rel=1e-3)
    for rule in ("layers", "parameters"):
        eq5 = [r[f"eq5_vs_{rule}"] for r in rows]
        assert min(eq5) >= 1.0 - 1e-12  # the DP is optimal for eq. 5
        if rule == "parameters" or gbs == 64:
            assert eq5[-1] > eq5[0] and slope(xs, eq5) > 0
    if gbs == 64:
        for rule in ("layers", "parameters"):
            assert min(r[f"amp_vs_{rule}"] for r in rows) > 1.0
        by_params = [r["amp_vs_parameters"] for r in rows]
        assert min(by_params) > 1.0 and by_params[-1] > by_params[0] and slope(xs, by_params) > 0
        for what in ("shared", "simulated"):  # the DP's split slower, by less as heterogeneity grows
            by_params = [r[f"{what}_vs_parameters"] for r in rows]
            assert max(by_params) < 1.0 and slope(xs, by_params) > 0
