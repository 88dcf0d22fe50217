"""Metis reproduction and search-speed benchmark.

    PYTHONPATH=src python benchmarks/bench_metis.py [--quick] [--json out.json]

Prints, next to the paper's numbers:

* search time and search-space size per cluster size (Table 4's setting: GPT-3
  on T4+V100 at Table 2's sizes) and on ``metis-mixed-64``;
* profiling runs, Metis's scheme vs the Oracle (Table 4, "Profiling");
* how much the default pruning loses against the unpruned search on the
  16-GPU setups (Table 4's Oracle comparison), and the paper's own var 0.5;
* speed-ups over ``amp`` and ``hetero-avg`` on every Fig. 4 setup;
* Fig. 5 (uneven nodes), Fig. 6 (load balancing), §5.2.1 (GPT-3 layers on
  T4; Wide-ResNet's rear layers).

Exits with status 1 when ``metis`` on ``metis-mixed-64`` (GPT-3 6.7B, global
batch 128) takes more than 2 s with default pruning (best of three runs, wall
clock; the machine may be shared, so CPU time is printed too).
``--quick`` skips the unpruned searches.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

from hetplan.cluster.io import load_cluster
from hetplan.cluster.spec import ClusterSpec, NodeSpec
from hetplan.cost.model import CostModel
from hetplan.plan.workload import Workload
from hetplan.errors import HetplanError
from hetplan.model.presets import get_model, gpt_decoder
from hetplan.profile.metis import metis_profile_runs, oracle_profile_runs
from hetplan.report.text import table
from hetplan.search import get_planner
from hetplan.search.metis import MetisOptions, MetisPlanner
from hetplan.search.baselines.uniform import UniformPlanner

GATE_S = 2.0
GATE_MODEL, GATE_CLUSTER, GATE_GBS = "gpt3-6.7b", "metis-mixed-64", 128
GBS = 128
TABLE2 = {4: ("gpt3-1.3b", "moe-1.3b", "wresnet-1b"), 8: ("gpt3-2.6b", "moe-2.4b", "wresnet-2b"),
          16: ("gpt3-6.7b", "moe-10b", "wresnet-4b"), 32: ("gpt3-15b", "moe-27b", "wresnet-6.8b")}
PAIRS = ("p100-t4", "t4-v100", "p100-v100")
UNPRUNED = MetisOptions(var=1.0, max_permute_len=16, max_evaluations=0)
PAPER_VAR = MetisOptions(var=0.5)
# Metis §5.4: search seconds at 4/8/16/32/64 GPUs, Oracle/Metis search cost ratio
PAPER_SEARCH_S = {4: 0.1, 8: 0.5, 16: 1.7, 32: 58.9, 64: 600.0}
PAPER_ORACLE_SEARCH = {4: "17", 8: "108", 16: "480", 32: ">29K", 64: ">5M"}
PAPER_ORACLE_PROFILE = {4: "96", 8: "228", 16: "270", 32: ">3171", 64: ">3294"}


def _gpt350m():
    return gpt_decoder("gpt3-350m", num_layers=24, hidden=1024, heads=16, seq=1024, vocab=51200)


def timed(planner, workload: Workload, top_k: int = 1):
    wall, cpu = time.perf_counter(), time.process_time()
    try:
        ranked = planner.plan(workload, top_k)
    except HetplanError as exc:
        ranked, error = [], str(exc)
    else:
        error = ""
    return ranked, time.perf_counter() - wall, time.process_time() - cpu, error


def best_fitting(name: str, workload: Workload, top_k: int) -> float:
    try:
        ranked = get_planner(name).plan(workload, top_k)
    except HetplanError:
        return math.inf
    times = [r.estimate.iteration_time_s for r in ranked if r.estimate.fits]
    return min(times) if times else math.inf


def fmt(x: float, digits: int = 3) -> str:
    return "OOM" if not math.isfinite(x) else f"{x:.{digits}f}"


def section(title: str) -> None:
    print()
    print(title)
    print("=" * len(title))


# --- sections -------------------------------------------------------------------------------------
def search_speed(quick: bool, out: dict) -> None:
    section("Search time and space (Table 4 setting: GPT-3 on T4+V100, Table 2 sizes; gbs 128)")
    rows = []
    for n, models in TABLE2.items():
        workload = Workload(get_model(models[0]), load_cluster(f"metis-t4-v100-{n}"), GBS)
        planner = MetisPlanner()
        ranked, wall, cpu, _ = timed(planner, workload)
        st = planner.stats
        row = {"gpus": n, "model": models[0], "metis_s": wall, "mappings": st.mappings,
               "evaluations": st.evaluations, "plans": st.complete_plans}
        unpruned = "-"
        if not quick and n <= 16:
            up = MetisPlanner(UNPRUNED)
            _, up_wall, _, _ = timed(up, workload)
            row.update(unpruned_s=up_wall, unpruned_mappings=up.stats.mappings, unpruned_plans=up.stats.complete_plans)
            unpruned = f"{up_wall:.2f} s, {up.stats.mappings} mappings"
        profile = metis_profile_runs(workload.model, 2)
        oracle = oracle_profile_runs(workload.model, 2)
        row.update(profile_runs=profile, oracle_profile_runs=oracle)
        rows.append(row)
        out.setdefault("search", []).append(row)
        print_row = [n, models[0], f"{wall:.2f} s", f"{st.mappings}", f"{st.evaluations}", unpruned,
                     f"{PAPER_SEARCH_S[n]} s", PAPER_ORACLE_SEARCH[n], f"{oracle / profile:.0f}x",
                     PAPER_ORACLE_PROFILE[n]]
        rows[-1]["print"] = print_row
    print(table(["GPUs", "model", "metis", "mappings", "searched", "unpruned (var 1, perm 16)", "paper metis",
                 "paper oracle/metis", "profiling oracle/metis", "paper"],
                [r["print"] for r in rows]))
    for r in rows:
        r.pop("print")


def mixed_64(out: dict) -> bool:
    section(f"metis-mixed-64 (64 GPUs: 16 V100, 24 T4, 24 P100 in 16 nodes of 1-8 GPUs), gbs {GATE_GBS}")
    rows = []
    gate_ok = True
    for model in (GATE_MODEL, "gpt3-2.6b", "wresnet-6.8b", "gpt3-15b"):
        workload = Workload(get_model(model), load_cluster(GATE_CLUSTER), GATE_GBS)
        runs = [timed(MetisPlanner(), workload) for _ in range(3 if model == GATE_MODEL else 1)]
        walls = [r[1] for r in runs]
        cpus = [r[2] for r in runs]
        ranked = runs[0][0]
        best = ranked[0].estimate.iteration_time_s if ranked else math.inf
        gate = model == GATE_MODEL
        if gate:
            gate_ok = min(walls) <= GATE_S
        rows.append([model + (" (gate)" if gate else ""), f"{min(walls):.2f} s", f"{min(cpus):.2f} s", fmt(best),
                     ranked[0].plan.describe()[:60] if ranked else runs[0][3][:60],
                     ("PASS" if gate_ok else "MISS") if gate else ""])
        out.setdefault("mixed64", []).append({"model": model, "wall_s": min(walls), "cpu_s": min(cpus),
                                              "iteration_s": best})
    print(table(["model", "search (wall)", "(cpu)", "iter s", "best plan", f"<= {GATE_S:.0f} s"], rows,
                [False, True, True, True, False, False]))
    print("paper: 600 s at 64 GPUs (var 0.5, permutation length 10); the authors' code 0.2-1.5 s for a "
          "10-layer GPT with equal-size groups only")
    return gate_ok


def pruning_loss(quick: bool, out: dict) -> None:
    section("Pruning loss vs the unpruned search at 4, 8 and 16 GPUs (Table 4's Oracle comparison)")
    if quick:
        print("skipped (--quick)")
        return
    for n in (4, 8, 16):
        rows = []
        losses = []
        same = 0
        for pair in PAIRS:
            for model in TABLE2[n]:
                workload = Workload(get_model(model), load_cluster(f"metis-{pair}-{n}"), GBS)
                default, d_wall, _, _ = timed(MetisPlanner(), workload)
                paper, p_wall, _, _ = timed(MetisPlanner(PAPER_VAR), workload)
                full, f_wall, _, _ = timed(MetisPlanner(UNPRUNED), workload)
                t = [r[0].estimate.iteration_time_s if r else math.inf for r in (default, paper, full)]
                loss = t[0] / t[2] - 1 if all(map(math.isfinite, t)) else math.nan
                identical = bool(default and full and default[0].plan.stages == full[0].plan.stages
                                 and default[0].plan.num_micro_batches == full[0].plan.num_micro_batches)
                same += identical
                losses.append(loss)
                rows.append([f"{pair}-{n}", model, fmt(t[0]), f"{d_wall:.2f} s", fmt(t[1]), f"{p_wall:.2f} s",
                             fmt(t[2]), f"{f_wall:.1f} s", f"{100 * loss:+.1f}%", "yes" if identical else "no"])
                out.setdefault("pruning", []).append({"setup": f"{pair}-{n}", "model": model, "default_s": t[0],
                                                      "var05_s": t[1], "unpruned_s": t[2], "loss": loss,
                                                      "same_plan": identical})
        print(table(["setup", "model", "default", "search", "var 0.5", "search", "unpruned", "search", "loss",
                     "same plan"], rows))
        finite = [x for x in losses if math.isfinite(x)]
        if finite:
            print(f"{n} GPUs: same plan on {same} of {len(rows)}; mean loss {100 * statistics.mean(finite):+.2f}%, "
                  f"worst {100 * max(finite):+.2f}%")
        print()
    print("paper: the same plan as the Oracle at 4 and 8 GPUs, a marginal gap at 16")


def fig4(out: dict) -> None:
    section("Fig. 4: speed-up of metis over amp and hetero-avg (best fitting plan, shared cost model)")
    rows = []
    over_amp: list[float] = []
    over_avg: list[float] = []
    for pair in PAIRS:
        for n, models in TABLE2.items():
            for model in models:
                workload = Workload(get_model(model), load_cluster(f"metis-{pair}-{n}"), GBS)
                metis = best_fitting("metis", workload, 3)
                amp = best_fitting("amp", workload, 50)
                avg = best_fitting("hetero-avg", workload, 8)
                s_amp = amp / metis
                s_avg = avg / metis
                if math.isfinite(s_amp):
                    over_amp.append(s_amp)
                over_avg.append(s_avg)
                rows.append([f"{pair}-{n}", model, fmt(metis), fmt(amp), fmt(avg),
                             "OOM" if not math.isfinite(s_amp) else f"{s_amp:.2f}x", f"{s_avg:.2f}x"])
                out.setdefault("fig4", []).append({"setup": f"{pair}-{n}", "model": model, "metis_s": metis,
                                                   "amp_s": amp, "hetero_avg_s": avg})
    print(table(["setup", "model", "metis s", "amp s", "hetero-avg s", "vs amp", "vs avg"], rows))
    for name, values in (("amp", over_amp), ("hetero-avg", over_avg)):
        print(f"over {name}: {min(values):.2f}x - {max(values):.2f}x, mean {statistics.mean(values):.2f}x, "
              f"geomean {math.exp(statistics.mean(map(math.log, values))):.2f}x")
    amp_oom = sum(1 for r in out["fig4"] if not math.isfinite(r["amp_s"]))
    print(f"amp has no fitting plan on {amp_oom} setups (counted as OOM, as in Fig. 4)")
    print("paper: 1.05x - 8.43x, mean 2.65x over AMP and 2.02x over Alpa")


def fig5(out: dict) -> None:
    section("Fig. 5: uneven nodes (GPT-3 350M, gbs 128)")
    rows = []
    for name in ("metis-uneven-a", "metis-uneven-b", "metis-uneven-c", "metis-uneven-d"):
        workload = Workload(_gpt350m(), load_cluster(name), GBS)
        ranked = MetisPlanner().plan(workload, 1)
        best = ranked[0]
        spec = workload.cluster
        aligned = all(len({spec.devices[d].node for d in s.devices}) == 1 for s in best.plan.stages)
        amp = best_fitting("amp", workload, 20)
        avg = best_fitting("hetero-avg", workload, 8)
        amp_pp = get_planner("amp").plan(workload, 1)[0].plan.pp
        rows.append([name, fmt(best.estimate.iteration_time_s), best.plan.pp, amp_pp, "yes" if aligned else "no",
                     f"{amp / best.estimate.iteration_time_s:.2f}x", f"{avg / best.estimate.iteration_time_s:.2f}x"])
        out.setdefault("fig5", []).append({"cluster": name, "metis_s": best.estimate.iteration_time_s,
                                           "amp_s": amp, "hetero_avg_s": avg})
    print(table(["cluster", "metis s", "stages", "amp stages", "node-aligned", "vs amp", "vs avg"], rows))
    print("paper: 9.1x over AMP, 2.7x over Alpa on average; Metis uses 3 (a, b) or 4 (c, d) nodes' shapes")


def fig6(out: dict) -> None:
    section("Fig. 6: load balancing (stage 1 = V100 + T4, stage 2 = T4 + P100, GPT-3 350M, gbs 16)")
    cluster = ClusterSpec("fig6", (NodeSpec("V100", 1, 126), NodeSpec("T4", 1, 126), NodeSpec("T4", 1, 126),
                                   NodeSpec("P100", 1, 126)), 16)
    workload = Workload(_gpt350m(), cluster, 16)
    results = {}
    for label, data, layer in (("hetero-unaware (Alpa)", False, False), ("data only (Whale)", True, False),
                               ("layers only", False, True), ("data + layers (Metis)", True, True)):
        planner = MetisPlanner(MetisOptions(data_balance=data, layer_balance=layer, exact_layers=False))
        best = None
        for b in (1, 2, 4, 8, 16):
            try:
                r = planner.plan_mapping(workload, [(0, 1), (2, 3)], b)[0]
            except HetplanError:
                continue
            if best is None or r.estimate.iteration_time_s < best.estimate.iteration_time_s:
                best = r
        assert best is not None
        results[label] = best
    metis = results["data + layers (Metis)"].estimate.iteration_time_s
    rows = [[k, fmt(v.estimate.iteration_time_s), f"{v.estimate.iteration_time_s / metis - 1:+.0%}", v.plan.describe()]
            for k, v in results.items()]
    print(table(["balancing", "iter s", "vs Metis", "plan"], rows, [False, True, True, False]))
    out["fig6"] = {k: v.estimate.iteration_time_s for k, v in results.items()}
    print("paper: Metis 19% faster than Whale's data-only, 22% faster than Alpa's hetero-unaware balancing")


def section_521(out: dict) -> None:
    section("§5.2.1 details")
    workload = Workload(get_model("gpt3-6.7b"), load_cluster("metis-t4-v100-16"), GBS)
    best = MetisPlanner().plan(workload, 1)[0].plan
    spec = workload.cluster
    t4 = sum(s.num_layers for s in best.stages if {spec.devices[d].gpu.name for d in s.devices} == {"T4"})
    share = t4 / workload.model.num_layers
    print(f"GPT-3 6.7B on 16 T4+V100: {100 * share:.0f}% of layers on T4 stages ({best.describe()}); paper: 36%")
    out["gpt3_t4_share"] = share
    # Wide-ResNet with costlier rear layers (the paper's profile); our preset's rear layers carry parameters,
    # not extra compute, so the paper's setting is reproduced by scaling the last residual stage's compute x4
    model = get_model("wresnet-2b")
    jumps = [i for i in range(1, model.num_layers) if model.layers[i].params > 3 * model.layers[i - 1].params]
    import dataclasses

    layers = [dataclasses.replace(layer, fwd_flops=layer.fwd_flops * 4, fwd_mem_bytes=layer.fwd_mem_bytes * 4,
                                  profile_key=layer.profile_key + ":rear")
              if i >= jumps[-1] and layer.kind != "head" else layer for i, layer in enumerate(model.layers)]
    workload = Workload(model.with_layers(layers, name="wresnet-2b-rear"), load_cluster("metis-t4-v100-8"), GBS)
    two = MetisPlanner(MetisOptions(max_stages=2)).plan(workload, 1)[0]
    cm = CostModel(workload)
    dp_only = [p for p in UniformPlanner(zero_choices=(0,), recompute_choices=("none",)).candidates(workload)
               if p.pp == 1 and p.stages[0].tp == 1]
    best_dp = min((cm.estimate(p) for p in dp_only), key=lambda e: e.iteration_time_s)
    rear = two.plan.stages[-1]
    print(f"Wide-ResNet 2B (rear x4 compute) on 8 T4+V100: two stages {two.plan.describe()} "
          f"{two.estimate.iteration_time_s:.3f} s, rear layers on "
          f"{sorted({spec.name for spec in [workload.cluster.devices[d].gpu for d in rear.devices]})}; "
          f"best DP-only {best_dp.iteration_time_s:.3f} s ({'fits' if best_dp.fits else 'OOM'}): "
          f"{best_dp.iteration_time_s / two.estimate.iteration_time_s:.2f}x; paper: 3.66x over AMP's DP-only plan")
    out["wresnet_two_stage_speedup"] = best_dp.iteration_time_s / two.estimate.iteration_time_s


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="skip the unpruned (Oracle-like) searches")
    parser.add_argument("--json", default=None, help="write the numbers as JSON here")
    args = parser.parse_args()
    out: dict = {}
    gate_ok = mixed_64(out)
    search_speed(args.quick, out)
    pruning_loss(args.quick, out)
    fig4(out)
    fig5(out)
    fig6(out)
    section_521(out)
    print()
    print(f"gate: metis on {GATE_CLUSTER} ({GATE_MODEL}, gbs {GATE_GBS}) "
          f"{'<=' if gate_ok else '>'} {GATE_S:.0f} s: {'PASS' if gate_ok else 'MISS'}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(out, f, indent=2, default=str)
    return 0 if gate_ok else 1


if __name__ == "__main__":
    sys.exit(main())
