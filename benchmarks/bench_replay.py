"""The replay check's cost (issue 28): CPU seconds to replay a plan's ranks on
fake tensors (``hetplan.runtime.replay``), per plan, against the issue's
target of seconds per plan for a 70B-class model on 2 cores.

Rows: a 1B-parameter plan measured on one H100 (``benchmarks/data/h100``), and
for Llama-3-70B on 64 H100 (gbs 256) the best plan ``hetplan plan`` gives (one
stage) and its best pipelined plan. Each plan is replayed as the planner's check
replays it and by a reference replay it must equal to the byte: the one-stage
plans as the check does (one step after the optimizer's states are made,
``replay_plan(states_first=True)``) against two steps, the peak the second's
(``states_first=False``); the pipelined plan as the check does
(``replay_micro.fast_replay``: its first micro-batch sample from the plan, the
growth per micro-batch from a copy with fewer blocks) against both samples from
the plan itself (``extrapolated(plan, spec, None)``; the two-step replay of all 8
micro-batches would take minutes more: tiny plans hold that equality in
``tests/test_replay_micro.py``). Prints one row per plan (ranks replayed, CPU and
wall seconds of the check's replay, CPU seconds of the reference, both peaks and
the analytic peak of the fullest rank) and exits non-zero if a check takes more
CPU seconds than its target or its peak of any rank is not the reference's to
the byte. ``--quick`` runs the 1B row only; the 70B rows take about 4 CPU minutes
(docs/cost-model.md, "The replay check").
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from hetplan.app import plan as plan_api
from hetplan.plan.file import read_plan_file, resolve_model
from hetplan.plan.spec import Plan
from hetplan.runtime.replay import StageReplay, replay_plan
from hetplan.runtime.replay_micro import extrapolated, fast_replay

# The "seconds per plan for a 70B-class model on 2 cores", as CPU seconds of this process: a plan of
# one stage, and a pipelined one (two ranks of 40 blocks, each replayed at 3 micro-batches besides a copy).
TARGET_CPU_S = 30.0
PIPELINED_TARGET_CPU_S = 60.0
H100 = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "h100")
GIB = 1 << 30
LARGE = ("llama3-70b", "64xH100", 256)  # model preset, cluster, global batch
Replay = Callable[[Plan, Any], Sequence[StageReplay]]


@dataclass(frozen=True)
class Row:
    name: str
    plan: str
    ranks: int
    cpu_s: float
    wall_s: float
    target_cpu_s: float
    reference_cpu_s: float
    replayed_gib: float
    reference_gib: float
    analytic_gib: float
    same_peaks: bool  # every rank's device and host peaks equal to the reference replay's


def one_step(plan: Plan, spec: Any) -> Sequence[StageReplay]:
    return replay_plan(plan, spec, states_first=True).stages


def two_steps(plan: Plan, spec: Any) -> Sequence[StageReplay]:
    return replay_plan(plan, spec, states_first=False).stages


def pipelined_check(plan: Plan, spec: Any) -> Sequence[StageReplay]:
    return fast_replay(plan, spec).stages


def from_the_plan(plan: Plan, spec: Any) -> Sequence[StageReplay]:
    return extrapolated(plan, spec, None)


def timed(name: str, plan: Plan, spec: object, analytic: float, check: Replay = one_step,
          reference: Replay = two_steps, target: float = TARGET_CPU_S) -> Row:
    """Replay ``plan`` as the check does and as its reference, and time both."""
    cpu, wall = time.process_time(), time.perf_counter()
    replay = check(plan, spec)
    cpu_s, wall_s = time.process_time() - cpu, time.perf_counter() - wall
    cpu = time.process_time()
    other = reference(plan, spec)
    reference_cpu_s = time.process_time() - cpu
    same = [(s.peak_bytes, s.host_peak_bytes) for s in replay] == [(s.peak_bytes, s.host_peak_bytes) for s in other]
    return Row(name, plan.describe(), len(replay), cpu_s, wall_s, target, reference_cpu_s,
               max(s.peak_bytes for s in replay) / GIB, max(s.peak_bytes for s in other) / GIB, analytic / GIB, same)


def small_row() -> Row:
    """gpt3-1.3b, 8 x 2 on one H100 (the measured plan file)."""
    pf = read_plan_file(os.path.join(H100, "A_g13_mb8.json"))
    plan = pf.plan()
    return timed("gpt3-1.3b 1xH100", plan, resolve_model(pf, None), 0.0)


def large_rows() -> list[Row]:
    """The best plan for Llama-3-70B on 64 H100 and its best pipelined plan."""
    model, cluster, batch = LARGE
    result = plan_api(model, cluster, batch, top=4, replay=0)
    best = result.best
    pipelined = next(r for r in result.plans if len(r.plan.stages) > 1)
    rows = []
    for name, ranked, check, reference, target in (
            (f"{model} {cluster}", best, one_step, two_steps, TARGET_CPU_S),
            (f"{model} pipelined", pipelined, pipelined_check, from_the_plan, PIPELINED_TARGET_CPU_S)):
        analytic = max(ranked.estimate.peak_memory_bytes.values())
        rows.append(timed(name, ranked.plan, result.workload.model, analytic, check, reference, target))
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the 1B row only")
    args = parser.parse_args()
    rows = [small_row()] + ([] if args.quick else large_rows())
    print(f"{'plan':<22} {'ranks':>5} {'CPU s':>7} {'target':>6} {'wall s':>7} {'ref CPU s':>9} "
          f"{'replayed GiB':>12} {'ref GiB':>8} {'analytic GiB':>12}  plan")
    for r in rows:
        analytic = f"{r.analytic_gib:12.2f}" if r.analytic_gib else f"{'-':>12}"
        print(f"{r.name:<22} {r.ranks:5d} {r.cpu_s:7.1f} {r.target_cpu_s:6.0f} {r.wall_s:7.1f} "
              f"{r.reference_cpu_s:9.1f} {r.replayed_gib:12.4f} {r.reference_gib:8.4f} {analytic}  {r.plan}")
    failed = 0
    slow = [r.name for r in rows if r.cpu_s > r.target_cpu_s]
    if slow:
        print(f"over its target of CPU s per plan: {', '.join(slow)}")
        failed = 1
    differ = [r.name for r in rows if not r.same_peaks]
    if differ:
        print(f"a rank's peak differs from the reference replay's: {', '.join(differ)}")
        failed = 1
    return failed


if __name__ == "__main__":
    sys.exit(main())
