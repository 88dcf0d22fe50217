"""The replay check's cost (issue 28): CPU seconds to replay a plan's ranks on
fake tensors (``hetplan.runtime.replay``), per plan, against the issue's
target of seconds per plan for a 70B-class model on 2 cores.

Rows: a 1B-parameter plan measured on one H100 (``benchmarks/data/h100``), and
the best plan ``hetplan plan`` gives for Llama-3-70B on 64 H100 that the replay
runs (the planner's first plans offload activations or are heterogeneous
pipelines, which it does not replay: docs/cost-model.md). Each plan is replayed
as the planner's check replays it (one step after the optimizer's states are
made, ``replay_plan(states_first=True)``) and as two steps, the peak the
second's (``states_first=False``). Prints one row per plan (ranks replayed, CPU
and wall seconds of the check's replay, CPU seconds of the two-step one, both
replayed peaks and the analytic peak of the fullest rank) and exits non-zero if
the check's replay takes more CPU seconds than ``TARGET_CPU_S`` or its peak of
any rank is not the two-step replay's to the byte. ``--quick`` runs the 1B row
only. The 70B row takes about 2 CPU minutes (docs/cost-model.md, "The replay check").
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
    two_step_cpu_s: float
    replayed_gib: float
    two_step_gib: float
    analytic_gib: float
    same_peaks: bool  # every rank's device and host peaks equal to the two-step replay's


def timed(name: str, plan: Plan, spec: object, analytic: float) -> Row:
    """Replay ``plan`` as the check does and in two steps, and time both."""
    cpu, wall = time.process_time(), time.perf_counter()
    replay = replay_plan(plan, spec, states_first=True)
    cpu_s, wall_s = time.process_time() - cpu, time.perf_counter() - wall
    cpu = time.process_time()
    two = replay_plan(plan, spec, states_first=False)
    two_cpu_s = time.process_time() - cpu
    same = [(s.peak_bytes, s.host_peak_bytes) for s in replay.stages] == \
        [(s.peak_bytes, s.host_peak_bytes) for s in two.stages]
    return Row(name, plan.describe(), len(replay.stages), cpu_s, wall_s, two_cpu_s, replay.peak_bytes / GIB,
               two.peak_bytes / GIB, analytic / GIB, same)


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
    print(f"{'plan':<20} {'ranks':>5} {'CPU s':>7} {'wall s':>7} {'2-step CPU s':>12} {'replayed GiB':>12} "
          f"{'2-step GiB':>10} {'analytic GiB':>12}  plan")
    for r in rows:
        analytic = f"{r.analytic_gib:12.2f}" if r.analytic_gib else f"{'-':>12}"
        print(f"{r.name:<20} {r.ranks:5d} {r.cpu_s:7.1f} {r.wall_s:7.1f} {r.two_step_cpu_s:12.1f} "
              f"{r.replayed_gib:12.4f} {r.two_step_gib:10.4f} {analytic}  {r.plan}")
    failed = 0
    slow = [r.name for r in rows if r.cpu_s > TARGET_CPU_S]
    if slow:
        print(f"over the target of {TARGET_CPU_S:.0f} CPU s per plan: {', '.join(slow)}")
        failed = 1
    differ = [r.name for r in rows if not r.same_peaks]
    if differ:
        print(f"a rank's peak differs from the two-step replay's: {', '.join(differ)}")
        failed = 1
    return failed


if __name__ == "__main__":
    sys.exit(main())
