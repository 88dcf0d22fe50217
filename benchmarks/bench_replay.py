"""The replay check's cost (issue 28): CPU seconds to replay a plan's ranks on
fake tensors (``hetplan.runtime.replay``), per plan, against the issue's
target of seconds per plan for a 70B-class model on 2 cores.

Rows: a 1B-parameter plan measured on one H100 (``benchmarks/data/h100``), and
the best plan ``hetplan plan`` gives for Llama-3-70B on 64 H100 that the replay
runs (the planner's first plans offload activations or are heterogeneous
pipelines, which it does not replay: docs/cost-model.md). Prints one row per
plan (ranks replayed, CPU and wall seconds, replayed and analytic peak of the
fullest rank) and exits non-zero if a plan's replay takes more CPU seconds than
``TARGET_CPU_S``. ``--quick`` runs the 1B row only. The 70B row takes several
CPU minutes today (docs/cost-model.md, "The replay check").
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass

from hetplan.app import plan as plan_api
from hetplan.plan.file import read_plan_file, resolve_model
from hetplan.plan.spec import Plan
from hetplan.runtime.replay import replay_plan

# The "seconds per plan for a 70B-class model on 2 cores", as CPU seconds of this process.
TARGET_CPU_S = 30.0
H100 = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "h100")
GIB = 1 << 30
LARGE = ("llama3-70b", "64xH100", 256)  # model preset, cluster, global batch


@dataclass(frozen=True)
class Row:
    name: str
    plan: str
    ranks: int
    cpu_s: float
    wall_s: float
    replayed_gib: float
    analytic_gib: float


def timed(name: str, plan: Plan, spec: object, analytic: float) -> Row:
    """Replay ``plan`` and time it."""
    cpu, wall = time.process_time(), time.perf_counter()
    replay = replay_plan(plan, spec)
    return Row(name, plan.describe(), len(replay.stages), time.process_time() - cpu, time.perf_counter() - wall,
               replay.peak_bytes / GIB, analytic / GIB)


def small_row() -> Row:
    """gpt3-1.3b, 8 x 2 on one H100 (the measured plan file)."""
    pf = read_plan_file(os.path.join(H100, "A_g13_mb8.json"))
    plan = pf.plan()
    return timed("gpt3-1.3b 1xH100", plan, resolve_model(pf, None), 0.0)


def large_row() -> Row:
    """The best plan for Llama-3-70B on 64 H100 (the replay runs every plan kind)."""
    model, cluster, batch = LARGE
    result = plan_api(model, cluster, batch, top=1, replay=0)
    analytic = max(result.best.estimate.peak_memory_bytes.values())
    return timed(f"{model} {cluster}", result.best.plan, result.workload.model, analytic)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the 1B row only")
    args = parser.parse_args()
    rows = [small_row()] + ([] if args.quick else [large_row()])
    print(f"{'plan':<20} {'ranks':>5} {'CPU s':>7} {'wall s':>7} {'replayed GiB':>12} {'analytic GiB':>12}  plan")
    for r in rows:
        analytic = f"{r.analytic_gib:12.2f}" if r.analytic_gib else f"{'-':>12}"
        print(f"{r.name:<20} {r.ranks:5d} {r.cpu_s:7.1f} {r.wall_s:7.1f} {r.replayed_gib:12.2f} {analytic}  {r.plan}")
    slow = [r.name for r in rows if r.cpu_s > TARGET_CPU_S]
    if slow:
        print(f"over the target of {TARGET_CPU_S:.0f} CPU s per plan: {', '.join(slow)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
