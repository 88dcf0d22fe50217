"""Galvatron-BMW Table II on hetplan's shared cost model: paper vs hetplan.

For every model x memory budget x strategy of Table II (8x RTX TITAN 24 GB,
PCIe 3.0, fp32 Adam — see docs/models.md for why fp32), this runs the
corresponding hetplan planner with the batch-size search and reports

* the memory-model agreement for the fixed strategies (DP, TP, PP, SDP,
  DeepSpeed-3D): does the strategy fit at all (the paper's OOM cells), and
  the largest batch that fits (multiples of 8, as in the paper) next to the
  paper's batch (the batch of the best throughput, which for these
  strategies is the largest that runs);
* for every strategy including the searched ones, the best throughput and its
  batch next to the paper's, and whether the paper's ordering holds
  (Galvatron-BMW >= Galvatron-Base >= Galvatron >= max(DP+TP, DP+PP) >=
  best pure strategy).

    python benchmarks/galvatron_table2.py            # everything, markdown to stdout
    python benchmarks/galvatron_table2.py --fixed    # memory agreement only (fast)
    python benchmarks/galvatron_table2.py --json out.json

Nothing here is fitted to the paper; the numbers come from the shared cost
model (src/hetplan/cost) and the model presets (src/hetplan/model/presets.py).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import replace

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from galvatron_paper import MODELS_II, STRATEGIES_II, TABLE_II

from hetplan.cluster.io import load_cluster
from hetplan.plan.workload import Workload
from hetplan.errors import HetplanError
from hetplan.model.presets import get_model
from hetplan.search.baselines.fixed import BASELINES, BaselinePlanner
from hetplan.search.galvatron import get_variant

BUDGETS = (8, 12, 16, 20)
FIXED = ("pure-dp", "pure-tp", "pure-pp", "pure-sdp", "deepspeed-3d")
CLUSTER = "galvatron-8x-titan"


def planner_for(name: str):
    if name in BASELINES:
        return BaselinePlanner(BASELINES[name][0])
    if name == "galvatron-1f1b-bi-obj":
        return get_variant("galvatron-bmw", ckpt=False, name=name)
    return get_variant(name)


def max_fitting_batch(planner: BaselinePlanner, workload: Workload, step: int = 8, limit: int = 4096) -> int:
    """Largest multiple of ``step`` at which the fixed strategy fits (0: none)."""
    best = 0
    batch = step
    while batch <= limit:
        try:
            planner.plan(replace(workload, global_batch_size=batch), 1)
        except HetplanError:
            break
        best = batch
        batch += step
    return best


def run(planners: list[str], models: list[str], budgets: list[int]) -> list[dict]:
    cluster = load_cluster(CLUSTER)
    rows = []
    for budget in budgets:
        for model_name in models:
            model = get_model(model_name)
            workload = Workload(model, cluster, 1, memory_limit_bytes=budget << 30)
            for name in planners:
                paper = TABLE_II[budget][name][model_name]
                planner = planner_for(name)
                start = time.process_time()
                try:
                    best = planner.plan_auto_batch(workload, 1)[0]
                    ours = (best.estimate.samples_per_s, best.plan.global_batch_size)
                    describe = best.plan.describe()
                except HetplanError:
                    ours, describe = None, "OOM"
                elapsed = time.process_time() - start
                row = {"budget_gb": budget, "model": model_name, "planner": name, "paper": paper, "hetplan": ours,
                       "plan": describe, "search_cpu_s": elapsed}
                if name in FIXED:
                    row["max_batch"] = max_fitting_batch(planner, workload)
                rows.append(row)
                print(f"  {budget:2d}G {model_name:13s} {name:22s} paper {fmt(paper):>14s}  hetplan {fmt(ours):>14s}"
                      f"  {elapsed:5.1f}s", file=sys.stderr)
    return rows


def fmt(cell) -> str:
    return "OOM" if cell is None else f"{cell[0]:.2f} ({cell[1]})"


def fixed_table(rows: list[dict]) -> list[str]:
    """Markdown: OOM/fit and largest batch, paper vs hetplan, per model x budget x strategy."""
    lines = ["| budget | strategy | " + " | ".join(MODELS_II) + " |", "|---|---|" + "---|" * len(MODELS_II)]
    by = {(r["budget_gb"], r["planner"], r["model"]): r for r in rows}
    agree = total = exact = near = 0
    ratios = []
    for budget in BUDGETS:
        for name in FIXED:
            cells = []
            for model in MODELS_II:
                r = by.get((budget, name, model))
                if r is None:
                    cells.append("-")
                    continue
                paper = r["paper"]
                ours = r["max_batch"]
                p_text = "OOM" if paper is None else str(paper[1])
                o_text = "OOM" if not ours else str(ours)
                same = (paper is None) == (not ours)
                agree += same
                total += 1
                if paper is not None and ours:
                    ratios.append(ours / paper[1])
                    exact += ours == paper[1]
                    near += abs(ours - paper[1]) <= 8
                cells.append(f"{p_text} / {o_text}" + ("" if same else " ✗"))
            lines.append(f"| {budget}G | {name} | " + " | ".join(cells) + " |")
    lines.append("")
    lines.append(f"Cells are paper batch / hetplan largest fitting batch (multiples of 8); ✗ marks an OOM/fit "
                 f"disagreement. OOM/fit agreement: {agree}/{total} cells.")
    if ratios:
        ratios.sort()
        mid = ratios[len(ratios) // 2]
        within = sum(1 for x in ratios if 0.5 <= x <= 2.0)
        lines.append(f"Where both fit ({len(ratios)} cells), hetplan's largest batch equals the paper's in {exact}, "
                     f"is within one step (8) in {near}, within 2x in {within}; ratio median {mid:.2f}, "
                     f"range {ratios[0]:.2f}-{ratios[-1]:.2f}.")
    return lines


def throughput_table(rows: list[dict]) -> list[str]:
    lines = ["| budget | strategy | " + " | ".join(MODELS_II) + " |", "|---|---|" + "---|" * len(MODELS_II)]
    by = {(r["budget_gb"], r["planner"], r["model"]): r for r in rows}
    names = [n for n in STRATEGIES_II.values() if any(k[1] == n for k in by)]
    for budget in BUDGETS:
        for name in names:
            cells = []
            for model in MODELS_II:
                r = by.get((budget, name, model))
                cells.append("-" if r is None else f"{fmt(r['paper'])} / {fmt(r['hetplan'])}")
            if any(c != "-" for c in cells):
                lines.append(f"| {budget}G | {name} | " + " | ".join(cells) + " |")
    lines.append("")
    lines.append("Cells are paper samples/s (batch) / hetplan predicted samples/s (batch).")
    return lines


PURE = ("pure-dp", "pure-tp", "pure-pp")


def ordering(rows: list[dict]) -> list[str]:
    """Per cell: BMW >= Base >= Galvatron >= max(DP+TP, DP+PP) >= best of pure
    DP/TP/PP, and Galvatron >= pure SDP — for hetplan, and for the paper's own
    numbers (OOM counts as 0)."""
    by = {(r["budget_gb"], r["planner"], r["model"]): r for r in rows}

    def tput(budget: int, name: str, model: str, key: str) -> float:
        r = by.get((budget, name, model))
        return 0.0 if r is None or r[key] is None else r[key][0]

    lines = []
    for key, who in (("hetplan", "hetplan"), ("paper", "the paper")):
        held = total = sdp_wins = 0
        broken = []
        for budget in BUDGETS:
            for model in MODELS_II:
                if (budget, "galvatron-bmw", model) not in by:
                    continue
                chain = [tput(budget, n, model, key) for n in ("galvatron-bmw", "galvatron-base", "galvatron")]
                chain.append(max(tput(budget, "galvatron-dp-tp", model, key),
                                 tput(budget, "galvatron-dp-pp", model, key)))
                chain.append(max(tput(budget, n, model, key) for n in PURE))
                sdp = tput(budget, "pure-sdp", model, key)
                ok = all(a >= b * (1 - 1e-9) for a, b in zip(chain, chain[1:])) and chain[2] >= sdp * (1 - 1e-9)
                sdp_wins += sdp > chain[3]
                held += ok
                total += 1
                if not ok:
                    broken.append(f"{model} {budget}G: " + " >= ".join(f"{x:.2f}" for x in chain)
                                  + f"; Galvatron {chain[2]:.2f} vs SDP {sdp:.2f}")
        lines.append(f"{who}: BMW >= Base >= Galvatron >= max(DP+TP, DP+PP) >= best of pure DP/TP/PP, and "
                     f"Galvatron >= pure SDP, holds in {held}/{total} cells; pure SDP beats both DP+TP and DP+PP "
                     f"in {sdp_wins}/{total}.")
        lines += [f"  - not in {b}" for b in broken]
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fixed", action="store_true", help="only the fixed strategies (memory agreement)")
    parser.add_argument("--models", default=",".join(MODELS_II))
    parser.add_argument("--budgets", default=",".join(map(str, BUDGETS)))
    parser.add_argument("--planners", default="", help="comma-separated planner names (default: all of Table II)")
    parser.add_argument("--json", dest="json_path", default="", help="also write the rows as JSON")
    parser.add_argument("--from-json", dest="from_json", default="", help="re-render rows written by --json")
    args = parser.parse_args(argv)
    planners = args.planners.split(",") if args.planners else (list(FIXED) if args.fixed
                                                              else list(STRATEGIES_II.values()))
    if args.from_json:
        with open(args.from_json, encoding="utf-8") as f:
            rows = json.load(f)
        for r in rows:
            for k in ("paper", "hetplan"):
                r[k] = None if r[k] is None else tuple(r[k])
    else:
        rows = run(planners, args.models.split(","), [int(b) for b in args.budgets.split(",")])
    print("## Memory-model agreement (fixed strategies)\n")
    print("\n".join(fixed_table(rows)))
    print("\n## Throughput (predicted) and batch, paper vs hetplan\n")
    print("\n".join(throughput_table(rows)))
    if not args.fixed:
        print("\n## Orderings\n")
        print("\n".join(ordering(rows)))
    if args.json_path:
        with open(args.json_path, "w", encoding="utf-8") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
