"""Search speed of the Galvatron planners (issue 4's performance targets).

1. ``galvatron-bmw`` on a 48-layer model (BERT-Huge-48) on 16 GPUs
   (``galvatron-16x-titan``), each memory budget of Table II (8/12/16/20 GB),
   with the whole batch-size search (one Table II cell per budget): each must
   take <= 5 s. Galvatron's own search took 179-330 CPU seconds for 8-16 GPUs.
2. Search time grows linearly with the number of layers (the paper's Fig. 6):
   a fixed-batch search on BERT models of 24..192 layers must cost at most
   ``LINEAR_SLACK`` times more per layer at the largest size than at the smallest.

The machine may be shared, so the targets are checked on the process's CPU
time (``time.process_time``); wall-clock time is printed next to it.
Exits non-zero when a target is missed.

    python benchmarks/bench_galvatron.py
"""

from __future__ import annotations

import sys
import time

from hetplan.cluster.io import load_cluster
from hetplan.plan.workload import Workload
from hetplan.model.presets import get_model
from hetplan.model.families import bert_model
from hetplan.search.galvatron import get_variant

TARGET_S = 5.0
LINEAR_SLACK = 1.5
BUDGETS_GB = (8, 12, 16, 20)


def timed(fn):
    cpu, wall = time.process_time(), time.perf_counter()
    out = fn()
    return out, time.process_time() - cpu, time.perf_counter() - wall


def table_ii_cells() -> bool:
    model = get_model("bert-huge-48")
    cluster = load_cluster("galvatron-16x-titan")
    print(f"galvatron-bmw, {model.name} ({model.num_layers} layers incl. embedding/heads) on {cluster.name} "
          f"({cluster.num_devices} GPUs), batch-size search, target <= {TARGET_S:.0f} s CPU per budget")
    print(f"{'budget':>6}  {'cpu s':>6}  {'wall s':>6}  {'batches':>7}  {'stage DPs':>9}  {'samples/s':>9}  "
          f"{'batch':>5}  plan")
    ok = True
    for budget in BUDGETS_GB:
        workload = Workload(model, cluster, 1, memory_limit_bytes=budget << 30)
        planner = get_variant("galvatron-bmw")
        ranked, cpu, wall = timed(lambda: planner.plan_auto_batch(workload, 1))
        best = ranked[0]
        miss = cpu > TARGET_S
        ok &= not miss
        print(f"{budget:>4}GB  {cpu:6.2f}  {wall:6.2f}  {len(planner.stats.batch_sizes):7d}  "
              f"{planner.stats.stage_dps:9d}  {best.estimate.samples_per_s:9.2f}  {best.plan.global_batch_size:5d}  "
              f"{best.plan.describe()}" + ("  <-- MISSED" if miss else ""))
    return ok


def linear_in_layers() -> bool:
    cluster = load_cluster("galvatron-8x-titan")
    sizes = (24, 48, 96, 192)
    print(f"\ngalvatron-bmw at a fixed batch (64) on {cluster.name}, 12 GB, BERT hidden 1280: search time vs layers")
    print(f"{'layers':>6}  {'cpu s':>6}  {'wall s':>6}  {'ms/layer':>8}  {'stage DPs':>9}")
    per_layer = []
    for layers in sizes:
        model = bert_model(f"bert-{layers}", layers, 1280, 16, dtype_bytes=4, softmax_saves_input=True)
        workload = Workload(model, cluster, 64, memory_limit_bytes=12 << 30)
        planner = get_variant("galvatron-bmw")
        planner.plan(workload, 1)  # warm-up (imports, caches of the first run)
        planner = get_variant("galvatron-bmw")
        _, cpu, wall = timed(lambda: planner.plan(workload, 1))
        per_layer.append(cpu / layers)
        print(f"{layers:6d}  {cpu:6.2f}  {wall:6.2f}  {1e3 * cpu / layers:8.2f}  {planner.stats.stage_dps:9d}")
    growth = per_layer[-1] / per_layer[0]
    ok = growth <= LINEAR_SLACK
    print(f"time per layer at {sizes[-1]} layers / at {sizes[0]} layers = {growth:.2f} (target <= {LINEAR_SLACK})"
          + ("" if ok else "  <-- MISSED"))
    return ok


def main() -> int:
    ok = table_ii_cells()
    ok &= linear_in_layers()
    print("\nall targets met" if ok else "\nTARGET MISSED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
