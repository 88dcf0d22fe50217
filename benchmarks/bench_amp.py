"""AMP benchmark: fast partition vs AMP's DP, search time, and the paper's results.

    python benchmarks/bench_amp.py [--quick]

Prints three tables and exits with status 1 when a target is missed:

1. pipeline layer assignment, L ∈ {24, 48, 96} layers × k ∈ {4, 8, 16} stages
   (random layer times and boundary costs, 8 micro-batches): the fast solver
   and AMP's DP (§3.5) must return the same cost, and the fast one must be
   ≥ 100× faster at L = 96, k = 16;
2. the whole ``amp`` search for GPT-2 (gbs 32) on n×n V100 clusters as in
   AMP Table 2; 16×16 must take under 2 s (the paper: 1,627 s);
3. AMP §4.5 reproduced (shared cost model's predictions next to the paper's
   measurements), with the tests' inequalities re-checked.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from hetplan.cluster.presets import get_cluster
from hetplan.cluster.spec import ClusterSpec, NodeSpec
from hetplan.cost.model import CostModel
from hetplan.plan.workload import Workload
from hetplan.model.presets import get_model
from hetplan.report.text import table
from hetplan.search import get_planner
from hetplan.search.amp import AMPPlanner, AmpCostModel
from hetplan.search.baselines.megatron import layer_split
from hetplan.search.common.partition import PartitionProblem, fast_partition, reference_partition
from hetplan.search.baselines.uniform import uniform_plan

SPEEDUP_TARGET = 100.0
SEARCH_TARGET_S = 2.0
failures: list[str] = []


def check(ok: bool, what: str) -> str:
    if not ok:
        failures.append(what)
    return "ok" if ok else "MISSED"


def best_of(fn, repeats: int) -> tuple[float, object]:
    times, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return min(times), result


# --- 1. partition ------------------------------------------------------------------------------
def bench_partition(quick: bool) -> None:
    rows = []
    sizes = [(24, 4), (48, 8), (96, 16)] if quick else [(n, k) for n in (24, 48, 96) for k in (4, 8, 16)]
    rng = np.random.default_rng(2022)
    for n, k in sizes:
        layer = rng.uniform(0.5, 1.5, size=n)  # heterogeneous layers
        links = rng.uniform(0.0, 0.3, size=(k - 1, n - 1))  # per cut, per link
        problem = PartitionProblem(layer, 8, links, num_stages=k)
        fast_s, fast = best_of(lambda: fast_partition(problem), 5)
        ref_s, ref = best_of(lambda: reference_partition(problem), 1)
        same = math.isclose(fast.cost_s, ref.cost_s, rel_tol=1e-9)
        speedup = ref_s / fast_s
        target = speedup >= SPEEDUP_TARGET if (n, k) == (96, 16) else True
        status = check(same, f"partition L={n} k={k}: costs differ") if not same else \
            check(target, f"partition L={n} k={k}: {speedup:.0f}x < {SPEEDUP_TARGET:.0f}x")
        rows.append([n, k, f"{fast.cost_s:.4f}", f"{ref.cost_s:.4f}", "yes" if same else "NO",
                     f"{fast_s * 1e3:.2f} ms", f"{ref_s * 1e3:.0f} ms", f"{speedup:.0f}x", status])
    print("1. pipeline layer assignment: fast solver vs AMP's DP (eq. 6-8), 8 micro-batches")
    print(table(["L", "k", "fast cost", "AMP DP cost", "same", "fast", "AMP DP", "speed-up", "target"], rows))
    print()


# --- 2. search time ------------------------------------------------------------------------------
def square_cluster(n: int) -> ClusterSpec:
    """n nodes of n V100 (NVLink inside, 100 Gb/s between): AMP Table 2's n×n."""
    nodes = tuple(NodeSpec("V100-16GB", n, 1200.0, name=f"node-{i}") for i in range(n))
    return ClusterSpec(f"{n}x{n}-V100", nodes, 100.0)


def bench_search(quick: bool) -> None:
    paper = {2: 58.0, 4: 325.6, 8: 890.3, 16: 1627.4}
    rows = []
    model = get_model("gpt2-amp")
    for n in ((16,) if quick else (2, 4, 8, 16)):
        workload = Workload(model, square_cluster(n), 32)
        planner = get_planner("amp")
        elapsed, ranked = best_of(lambda: planner.plan(workload, 5), 3)
        strategies = len(AMPPlanner().search(workload))
        status = check(elapsed < SEARCH_TARGET_S, f"amp search {n}x{n}: {elapsed:.2f} s") if n == 16 else ""
        rows.append([f"{n}x{n}", n * n, strategies, f"{elapsed:.3f} s", f"{paper[n]:.1f} s",
                     ranked[0].plan.describe(), status])
    print("2. whole amp search, GPT-2 (26 layers) gbs 32 on n nodes of n V100 (AMP Table 2)")
    print(table(["cluster", "GPUs", "strategies", "hetplan", "paper", "AMP's best", "target <2 s"], rows,
                [False, True, True, True, True, False, False]))
    print()


# --- 3. reproduction -----------------------------------------------------------------------------
def bench_reproduction() -> None:
    rows = []
    # homogeneous
    w = Workload(get_model("gpt2-amp"), get_cluster("amp-homogeneous"), 32)
    meg = get_planner("megatron").plan(w, 50)
    amp = get_planner("amp").plan(w, 10)
    best_trial = min((r for r in amp if r.estimate.fits), key=lambda r: r.estimate.iteration_time_s)
    ok = amp[0].estimate.iteration_time_s <= meg[0].estimate.iteration_time_s and amp[0].plan.pp > 1
    rows.append(["homogeneous: Megatron's pick", meg[0].plan.describe(), f"{meg[0].estimate.iteration_time_s:.3f} s",
                 "1.32 s (best of 10)", ""])
    rows.append(["homogeneous: AMP #1", amp[0].plan.describe(), f"{amp[0].estimate.iteration_time_s:.3f} s",
                 "1.20 s (dp4 pp4 mbs1)", check(ok, "homogeneous: AMP #1 not >= Megatron or not pipelined")])
    rows.append(["homogeneous: best of AMP top 10", best_trial.plan.describe(),
                 f"{best_trial.estimate.iteration_time_s:.3f} s", "", ""])
    # heterogeneous cluster
    w = Workload(get_model("gpt2-amp"), get_cluster("amp-heterogeneous"), 32)
    cm = CostModel(w)
    meg = get_planner("megatron").plan(w, 50)
    candidates = AMPPlanner().search(w, AmpCostModel(cm))
    top = cm.estimate(candidates[0].to_plan(w))
    u = meg[0].plan.micro_batch_size // meg[0].plan.stages[0].dp
    rank = 1 + next(i for i, c in enumerate(candidates) if (c.pp, c.dp, c.tp, c.micro_batch) == (1, 16, 1, u))
    speedup = meg[0].estimate.iteration_time_s / top.iteration_time_s
    best_meg = min(r.estimate.iteration_time_s for r in meg)
    rows.append(["het. cluster: Megatron's pick", meg[0].plan.describe(), f"{meg[0].estimate.iteration_time_s:.3f} s",
                 "2.72 s (dp16)", check(meg[0].plan.stages[0].dp == 16, "het cluster: Megatron not dp=16")])
    rows.append(["het. cluster: best Megatron proposal", min(meg, key=lambda r: r.estimate.iteration_time_s)
                 .plan.describe(), f"{best_meg:.3f} s", "1.97 s (best of 10)", ""])
    rows.append(["het. cluster: AMP #1", candidates[0].to_plan(w).describe(), f"{top.iteration_time_s:.3f} s",
                 "1.28 s (dp2 pp8 mbs1)", ""])
    rows.append(["het. cluster: AMP speed-up vs Megatron's pick", "", f"{speedup:.2f}x", "2.13x (2.72/1.28)",
                 check(speedup >= 1.4, "het cluster: speed-up < 1.4")])
    rows.append(["het. cluster: AMP speed-up vs best proposal", "", f"{best_meg / top.iteration_time_s:.2f}x",
                 "1.54x", check(best_meg / top.iteration_time_s >= 1.4, "het cluster: < 1.4x best proposal")])
    rows.append(["het. cluster: dp16's rank in AMP's list", "", f"{rank} of {len(candidates)}", "21st",
                 check(rank > 10 and rank > len(candidates) // 2, "het cluster: dp16 ranked too high")])
    # heterogeneous model
    w = Workload(get_model("transgan-het"), get_cluster("amp-hetero-model"), 64)
    cm = CostModel(w)
    ac = AmpCostModel(cm)
    best = AMPPlanner().search(w, ac)[0]
    ours = best.to_plan(w)
    ours_t = cm.estimate(ours).iteration_time_s
    meg = get_planner("megatron").plan(w, 1)[0]
    rows.append(["TransGAN: Megatron's pick", meg.plan.describe(), f"{meg.estimate.iteration_time_s:.3f} s",
                 "1.89 s", ""])
    rows.append(["TransGAN: AMP #1", ours.describe(), f"{ours_t:.3f} s", "1.07 s",
                 check(meg.estimate.iteration_time_s > 1.5 * ours_t, "TransGAN: AMP < 1.5x Megatron")])
    paper = {"layers": "1.25 s (1.17x)", "parameters": "2.19 s (2.05x)"}
    for rule in ("layers", "parameters"):
        other = uniform_plan(w, best.dp, best.tp, best.pp, best.micro_batch, layer_split=layer_split(w, best.pp, rule))
        t = cm.estimate(other).iteration_time_s
        rows.append([f"TransGAN: AMP #1 with uniform-{rule} split", other.describe(), f"{t:.3f} s ({t / ours_t:.2f}x)",
                     paper[rule], check(t > 1.1 * ours_t, f"TransGAN: DP split not > 1.1x {rule} split")])
    print("3. AMP §4.5 reproduced: hetplan's shared-cost-model prediction vs the paper's measurement")
    print(table(["setting", "plan", "hetplan", "paper", "check"], rows, [False, False, True, True, False]))
    print()

    # Fig. 3
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from test_amp_reproduction import GRID, fig3_speedups

    fig_rows = []
    for gbs in (64, 16):
        for h in GRID:
            r = fig3_speedups(gbs, h)
            fig_rows.append([gbs, f"{r['heterogeneity']:.2f}"] + [f"{r[f'{what}_vs_{rule}']:.3f}"
                                                                  for rule in ("layers", "parameters")
                                                                  for what in ("eq5", "amp", "shared")])
    print("   Fig. 3: DP assignment's speed-up over uniform-layer / uniform-parameter splits, mp1 pp4 dp4 mbs1,")
    print("   TransGAN with its dim-16 blocks scaled to each heterogeneity (eq. 9); by AMP's eq. 5, AMP's eq. 4,")
    print("   and the shared cost model. Paper (measured, gbs 64 and 16): all four curves rise with heterogeneity")
    print("   over 1.0-2.5, between 1.0x and 2.0x.")
    print(table(["gbs", "heterogeneity", "eq5 vs layers", "eq4 vs layers", "shared vs layers", "eq5 vs params",
                 "eq4 vs params", "shared vs params"], fig_rows))
    print()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer partition sizes and clusters")
    args = parser.parse_args()
    bench_partition(args.quick)
    bench_search(args.quick)
    bench_reproduction()
    if failures:
        print("MISSED: " + "; ".join(failures))
        return 1
    print("all targets met")
    return 0


if __name__ == "__main__":
    sys.exit(main())
