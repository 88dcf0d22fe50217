"""How long each planner takes on big homogeneous clusters: GPT-3 175B on H100s.

    python benchmarks/bench_plan_scale.py [--quick]

The workload of the planning-time issue: ``hetplan plan --model gpt3-175b
--cluster NxH100 --global-batch N/2`` with every planner on 1,024 and 4,096
GPUs, and ``auto`` (the default planner, which runs most of the others as
seeds) also on 16,384. Each cell runs in its own process and reports the
search's CPU seconds (``time.process_time``: its own work, whatever else the
machine runs) and its wall seconds (for information: on a loaded machine they
are larger).

Targets (exit status 1 when one is missed):

* every planner, ``auto`` included, plans 4,096 GPUs in at most 10 CPU s;
* ``auto`` plans 16,384 GPUs in at most 20 CPU s;
* going from 1,024 to 4,096 GPUs (4x) costs every planner at most 3x the
  time, and ``auto`` from 4,096 to 16,384 at most 3x: planning must not grow
  with the number of GPUs the way it did (per-GPU loops made 4,096 GPUs take
  minutes). Cells under 0.5 s are exempt from the ratios (too short to time).

``--quick`` leaves out the 16,384-GPU cell.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from hetplan.cluster.io import load_cluster
from hetplan.plan.workload import Workload
from hetplan.model.load import load_model
from hetplan.report.text import table
from hetplan.search import get_planner
from cells import run_cell  # benchmarks/cells.py, beside this script

MODEL = "gpt3-175b"
PLANNERS = ("uniform", "megatron", "amp", "galvatron", "metis", "auto")
SIZES = (1024, 4096)
AUTO_LARGE = 16384
CAP_S = {4096: 10.0, AUTO_LARGE: 20.0}  # CPU seconds
GROWTH = 3.0  # most time ratio for 4x the GPUs
MIN_TIMED_S = 0.5  # shorter cells are exempt from the growth ratio


def global_batch(num_gpus: int) -> int:
    return num_gpus // 2


def run_one(planner: str, num_gpus: int) -> dict[str, object]:
    """One cell, in this process (called in a child process by ``cell``)."""
    workload = Workload(load_model(MODEL), load_cluster(f"{num_gpus}xH100"), global_batch(num_gpus))
    cpu, wall = time.process_time(), time.perf_counter()
    try:
        best = get_planner(planner).plan(workload, 1)[0]
        result: dict[str, object] = {"plan": best.plan.describe(), "time_s": best.estimate.iteration_time_s}
    except Exception as exc:  # noqa: BLE001 - reported in the table
        result = {"error": str(exc)[:80]}
    result["cpu_s"] = time.process_time() - cpu
    result["wall_s"] = time.perf_counter() - wall
    return result


def cell(planner: str, num_gpus: int) -> dict[str, object]:
    return run_cell(__file__, [planner, str(num_gpus)], ("cpu_s", "wall_s"))


def cells(quick: bool) -> list[tuple[str, int]]:
    out = [(planner, n) for planner in PLANNERS for n in SIZES]
    if not quick:
        out.append(("auto", AUTO_LARGE))
    return out


def missed_targets(results: dict[tuple[str, int], dict[str, object]]) -> list[str]:
    missed = []
    for (planner, n), r in results.items():
        cpu = float(r["cpu_s"])
        if "error" in r:
            missed.append(f"{planner} on {n} GPUs: {r['error']}")
        elif n in CAP_S and not cpu <= CAP_S[n]:
            missed.append(f"{planner} on {n} GPUs: {cpu:.1f} CPU s > {CAP_S[n]:.0f} s")
        smaller = results.get((planner, n // 4))
        if smaller is not None and "error" not in smaller and cpu >= MIN_TIMED_S:
            ratio = cpu / max(float(smaller["cpu_s"]), MIN_TIMED_S)
            if ratio > GROWTH:
                missed.append(f"{planner}: {n // 4} -> {n} GPUs costs {ratio:.1f}x the time (target <= {GROWTH}x)")
    return missed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=f"leave out the {AUTO_LARGE:,}-GPU cell")
    parser.add_argument("--one", nargs=2, metavar=("PLANNER", "GPUS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(run_one(args.one[0], int(args.one[1]))))
        return 0
    results: dict[tuple[str, int], dict[str, object]] = {}
    rows = []
    for planner, n in cells(args.quick):
        r = results[(planner, n)] = cell(planner, n)
        iteration = f"{r['time_s']:.3f}" if "time_s" in r else "-"
        rows.append([planner, n, global_batch(n), f"{float(r['cpu_s']):.2f}",
                     f"{float(r['wall_s']):.2f}", iteration,
                     str(r.get("plan", r.get("error", "")))[:80]])
        print("  ".join(str(x) for x in rows[-1]), file=sys.stderr, flush=True)
    print(table(["planner", "GPUs", "batch", "CPU s", "wall s", "iter s", "best plan"], rows,
                [False, True, True, True, True, True, False]))
    missed = missed_targets(results)
    for line in missed:
        print(f"MISSED: {line}")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
