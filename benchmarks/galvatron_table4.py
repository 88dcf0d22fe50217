"""Galvatron-BMW Table IV on hetplan's shared cost model: the bi-objective
pipeline partition vs the memory-balanced and time-balanced partitions
(Galvatron without CKPT, 16 A100 in 2 nodes, 8 GB and 16 GB budgets), each
with its own batch-size search.

    python benchmarks/galvatron_table4.py [--json out.json]

Exits non-zero if the bi-objective partition is slower than either balanced
partition in any cell (issue 4's Table IV property).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from galvatron_paper import MODELS_IV, TABLE_IV

from hetplan.cluster.io import load_cluster
from hetplan.plan.workload import Workload
from hetplan.model.presets import get_model
from hetplan.search.galvatron import get_variant

LABELS = {"memory": "1F1B+Mem", "time": "1F1B+Time", "bi-objective": "1F1B+Bi-obj"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", dest="json_path", default="")
    args = parser.parse_args(argv)
    cluster = load_cluster("galvatron-16x-a100")
    rows = []
    ok = True
    print("| budget | partition | " + " | ".join(MODELS_IV) + " |")
    print("|---|---|" + "---|" * len(MODELS_IV))
    for budget in (8, 16):
        results: dict[str, dict[str, tuple[float, int, tuple[int, ...]]]] = {}
        for mode in ("memory", "time", "bi-objective"):
            results[mode] = {}
            for model_name in MODELS_IV:
                workload = Workload(get_model(model_name), cluster, 1, memory_limit_bytes=budget << 30)
                planner = get_variant("galvatron-bmw", partition=mode, ckpt=False, name=f"galvatron-{mode}")
                start = time.process_time()
                best = planner.plan_auto_batch(workload, 1)[0]
                sizes = tuple(s.num_layers for s in best.plan.stages)
                results[mode][model_name] = (best.estimate.samples_per_s, best.plan.global_batch_size, sizes)
                rows.append({"budget_gb": budget, "partition": mode, "model": model_name,
                             "paper": TABLE_IV[budget][mode][model_name], "hetplan": results[mode][model_name],
                             "search_cpu_s": time.process_time() - start})
        for mode in ("memory", "time", "bi-objective"):
            cells = []
            for model_name in MODELS_IV:
                p = TABLE_IV[budget][mode][model_name]
                o = results[mode][model_name]
                cells.append(f"{p[0]:.2f} ({p[1]}) {list(p[2])} / {o[0]:.2f} ({o[1]}) {list(o[2])}")
            print(f"| {budget}G | {LABELS[mode]} | " + " | ".join(cells) + " |")
        for model_name in MODELS_IV:
            bi = results["bi-objective"][model_name][0]
            if bi < max(results["memory"][model_name][0], results["time"][model_name][0]) * (1 - 1e-9):
                ok = False
                print(f"MISSED: {model_name} {budget}G: bi-objective slower than a balanced partition")
    print("\nCells are paper samples/s (batch) [partition] / hetplan predicted samples/s (batch) [layers per stage, "
          "embedding and heads included].")
    print("bi-objective >= both balanced partitions in every cell" if ok else "TARGET MISSED")
    if args.json_path:
        with open(args.json_path, "w", encoding="utf-8") as f:
            json.dump(rows, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
