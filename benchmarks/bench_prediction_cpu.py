"""Predicted vs measured step time on this machine: the loop a user runs on
their own cluster (issue 11), end to end through the CLI.

1. ``hetplan profile`` measures a small GPT's layers and the gloo collectives
   on ``local-cpu-2`` and ``local-cpu-4``;
2. for plans of different kinds (DP, ZeRO-1/2/3, TP, PP with 1F1B and GPipe,
   PP x DP, TP x DP, an uneven layer split, recomputation) the cost model
   predicts the step time with that profile, and ``hetplan train`` measures
   it (the median of the steps after the first, warm-up, one);
3. ``hetplan tune`` runs its own trials and must write the plan it measured
   fastest.

The CPU is a machine the cost model did not know in advance: its layer times
come only from the profile, its collectives from the profile's measured curves.
Prints the table and exits non-zero if the median |error| is above 15%, any
plan is off by more than 35%, or tune's written plan is not its measured best.

Run alone on a quiet machine (other processes on the 2 cores skew both the
profile and the trials): ``python benchmarks/bench_prediction_cpu.py``. It
takes about 15 minutes. ``--quick`` runs the local-cpu-2 plans only.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from hetplan.cluster.io import load_cluster
from hetplan.cost.calibration import effective_calibration
from hetplan.cost.model import CostModel
from hetplan.plan.workload import Workload
from hetplan.model.presets import gpt_decoder
from hetplan.plan.file import workload_record
from hetplan.profile import load_profile
from hetplan.search.baselines.uniform import uniform_plan

MEDIAN_TARGET = 0.15
MAX_TARGET = 0.35
STEPS = 8  # measured steps: the first is warm-up, the median of the rest is the step time
PROFILE_REPEATS = 11  # timed runs per layer measurement (median): this machine is noisy
# Each plan is measured this many times, in rounds over all plans, and its
# fastest round counts: interference from other work on a shared 2-core
# machine only ever slows a step down (seen: the same plan 0.40-0.69 s/step).
ROUNDS = 2
GLOBAL_BATCH = 16
HETPLAN = [sys.executable, "-m", "hetplan"]

# name: (dp, tp, pp, micro-batch per replica, zero, recompute, schedule, layer split or None)
PLANS_2 = {
    "DP": (2, 1, 1, 4, 0, "none", "1f1b", None),
    "ZeRO-1": (2, 1, 1, 4, 1, "none", "1f1b", None),
    "ZeRO-2": (2, 1, 1, 4, 2, "none", "1f1b", None),
    "ZeRO-3": (2, 1, 1, 4, 3, "none", "1f1b", None),
    "DP + full recompute": (2, 1, 1, 4, 0, "full", "1f1b", None),
    "TP": (1, 2, 1, 4, 0, "none", "1f1b", None),
    "PP 1F1B": (1, 1, 2, 4, 0, "none", "1f1b", None),
    "PP GPipe": (1, 1, 2, 4, 0, "none", "gpipe", None),
    "PP uneven split": (1, 1, 2, 4, 0, "none", "1f1b", (2, 4)),
}
PLANS_4 = {
    "DP": (4, 1, 1, 4, 0, "none", "1f1b", None),
    "PP x DP": (2, 1, 2, 4, 0, "none", "1f1b", None),
    "TP x DP": (2, 2, 1, 4, 0, "none", "1f1b", None),
    "PP 1F1B": (1, 1, 4, 4, 0, "none", "1f1b", None),
}


def bench_model() -> object:
    """Big enough that compute dominates a step (hidden 256, 4 blocks, 128 tokens), fp32 for the CPU."""
    return gpt_decoder("bench-gpt", 4, 256, 4, 128, vocab=1024, dtype_bytes=4)


def run(args: list[str], timeout: float = 900) -> subprocess.CompletedProcess[str]:
    result = subprocess.run([*HETPLAN, *args], capture_output=True, text=True, timeout=timeout)
    if result.returncode != 0:
        raise SystemExit(f"hetplan {' '.join(args)} failed:\n{result.stderr[-3000:]}")
    return result


def write_plan(path: Path, workload: Workload, plan: object) -> None:
    path.write_text(json.dumps({"plans": [{"plan": plan.to_dict()}], **workload_record(workload)}))


def make_plan(workload: Workload, setting: tuple) -> object:
    dp, tp, pp, mbs, zero, recompute, schedule, split = setting
    layer_split = None
    if split is not None:  # layer counts per stage
        bounds = [0]
        for count in split:
            bounds.append(bounds[-1] + count)
        layer_split = [range(a, b) for a, b in zip(bounds, bounds[1:])]
    return uniform_plan(workload, dp, tp, pp, mbs, zero, recompute, schedule, layer_split=layer_split)


def measure(plan_path: Path, out: Path) -> float:
    run(["train", "--plan", str(plan_path), "--steps", str(STEPS), "--optimizer", "adamw", "--out", str(out)])
    times = json.loads((out / "summary.json").read_text())["step_times_s"]
    return statistics.median(times[1:])


def bench_cluster(cluster_name: str, plans: dict, work: Path, model_path: Path) -> list[list[str]]:
    profile_path = work / f"profile-{cluster_name}.json"
    print(f"profiling on {cluster_name} ...", file=sys.stderr, flush=True)
    run(["profile", "--model", str(model_path), "--cluster", cluster_name, "--repeats", str(PROFILE_REPEATS),
         "-o", str(profile_path)])
    model, cluster, profile = bench_model(), load_cluster(cluster_name), load_profile(str(profile_path))
    workload = Workload(model, cluster, GLOBAL_BATCH, profile=profile,
                        calibration=effective_calibration(profile, cluster, None))  # as 'hetplan --profile' does
    predicted, paths = {}, {}
    for k, (name, setting) in enumerate(plans.items()):
        plan = make_plan(workload, setting)
        paths[name] = work / f"{cluster_name}-{k}.json"
        write_plan(paths[name], workload, plan)
        predicted[name] = CostModel(workload).estimate(plan).iteration_time_s
    measured: dict[str, float] = {}
    for r in range(ROUNDS):
        for k, name in enumerate(plans):
            print(f"{cluster_name}: round {r + 1}/{ROUNDS}, measuring {name} ({k + 1}/{len(plans)}) ...",
                  file=sys.stderr, flush=True)
            step = measure(paths[name], work / f"{cluster_name}-{k}-{r}")
            measured[name] = min(step, measured.get(name, step))
    return [[cluster_name, name, f"{predicted[name]:.3f}", f"{measured[name]:.3f}",
             f"{predicted[name] / measured[name] - 1:+.1%}"] for name in plans]


def check_tune(work: Path, model_path: Path) -> tuple[bool, str]:
    """tune must write the plan it measured fastest."""
    out = work / "tuned.json"
    run(["tune", "--model", str(model_path), "--cluster", "local-cpu-2", "--global-batch", str(GLOBAL_BATCH),
         "--top-k", "3", "--steps", "3", "--warmup", "1", "-o", str(out), "--measurements",
         str(work / "tuned.measurements.json")])
    trials = json.loads((work / "tuned.measurements.json").read_text())["trials"]
    ok = [t for t in trials if t["status"] == "ok"]
    fastest = min(ok, key=lambda t: t["measured_step_s"])
    written = json.loads(out.read_text())["plans"][0]["plan"]
    same = written == fastest["plan_file"]["plans"][0]["plan"]
    return same, f"tune: {len(ok)} of {len(trials)} trials ok; wrote the measured fastest: {'yes' if same else 'NO'}"


def table(rows: list[list[str]]) -> str:
    head = ["cluster", "plan", "predicted s", "measured s", "error"]
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    lines = ["  ".join(h.ljust(w) for h, w in zip(head, widths)), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="local-cpu-2 only, no tune check")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="hetplan-bench-") as tmp:
        work = Path(tmp)
        model_path = work / "model.json"
        model_path.write_text(json.dumps(bench_model().to_dict()))
        rows = bench_cluster("local-cpu-2", PLANS_2, work, model_path)
        if not args.quick:
            rows += bench_cluster("local-cpu-4", PLANS_4, work, model_path)
        tune_ok, tune_line = (True, "tune: skipped (--quick)") if args.quick else check_tune(work, model_path)
    errors = [abs(float(r[4].rstrip("%")) / 100) for r in rows]
    print(table(rows))
    median, worst = statistics.median(errors), max(errors)
    print(f"\n{len(rows)} plans: median |error| {median:.1%} (target <= {MEDIAN_TARGET:.0%}), "
          f"max {worst:.1%} (target <= {MAX_TARGET:.0%})")
    print(tune_line)
    failed = median > MEDIAN_TARGET or worst > MAX_TARGET or not tune_ok
    print("TARGET MISSED" if failed else "all targets met")
    return 1 if failed else 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    sys.exit(main())
