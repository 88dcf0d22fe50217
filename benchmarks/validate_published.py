"""The cost model against published training runs.

    python benchmarks/validate_published.py [RUNS.json] [--verbose]

Every run of ``shared/calibration/published_runs.json`` (or of the file
given) that hetplan can express is estimated with the run's own settings
(``published_runs.py``) and its predicted throughput compared with the
measured one. Prints, per source group and overall: the median and 90th
percentile of |error|, the median signed error (positive = hetplan too
optimistic), Spearman's rank correlation within every sweep of one model on
one cluster, Megatron 3D vs ZeRO-3 at equal GPU counts, memory error and
out-of-memory labels where a run measured them, and every run it cannot
express with the reason.

Targets (exit status 1 when one is missed): median |error| <= 8%, 90th
percentile <= 20%, |median signed error| <= 4%, every group's median
|error| <= 12%, Spearman >= 0.9 within every sweep of at least three runs,
Megatron 3D vs ZeRO-3 ordered as measured, peak memory within 10% and every
out-of-memory label right where measured.
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from published_runs import DEFAULT_RUNS, Case, derived_oom_cases, load_cases

from hetplan.cost.model import CostModel
from hetplan.report.text import table
from hetplan.units import GIB

TARGET_MEDIAN = 0.08
TARGET_P90 = 0.20
TARGET_BIAS = 0.04
TARGET_GROUP_MEDIAN = 0.12
TARGET_SPEARMAN = 0.90
TARGET_MEMORY = 0.10
MIN_SWEEP = 3


def spearman(x: list[float], y: list[float]) -> float:
    """Spearman's rho (average ranks for ties)."""
    def ranks(v: list[float]) -> np.ndarray:
        order = np.argsort(v, kind="stable")
        r = np.empty(len(v))
        r[order] = np.arange(len(v), dtype=float)
        values = np.asarray(v)
        for value in set(v):  # average the ranks of ties
            tie = values == value
            r[tie] = r[tie].mean()
        return r
    rx, ry = ranks(x), ranks(y)
    if rx.std() == 0 or ry.std() == 0:
        return float("nan")
    return round(float(np.corrcoef(rx, ry)[0, 1]), 9)  # rank correlations are ratios: 0.9, not 0.8999...


def predict(case: Case) -> tuple[float, float]:
    """Predicted tokens/s and the peak memory (bytes) of the busiest GPU."""
    assert case.workload is not None and case.plan is not None
    estimate = CostModel(case.workload).estimate(case.plan)
    tokens = case.workload.global_batch_size * case.workload.model.seq_len
    return tokens / estimate.iteration_time_s, max(estimate.peak_memory_bytes.values())


def summary(errors: list[float]) -> list[str]:
    a = np.abs(errors)
    return [str(len(errors)), f"{100 * np.median(a):.1f}%", f"{100 * np.percentile(a, 90):.1f}%",
            f"{100 * np.median(errors):+.1f}%", f"{100 * a.max():.1f}%"]


def memory_checks(cases: list[Case], peaks: dict[str, float]) -> tuple[list[list[str]], bool]:
    """Rows for runs that measured peak memory or an out-of-memory outcome. A
    run that trained is a label too (it fitted): listed only when hetplan
    predicts otherwise."""
    rows, ok = [], True
    for case in cases:
        meas = case.run.get("measured") or {}
        peak = peaks.get(case.id)
        if peak is None:
            continue
        measured_gb = meas.get("peak_memory_gb") or meas.get("memory_gb_per_gpu")
        if measured_gb:
            err = peak / (float(measured_gb) * GIB) - 1
            ok &= abs(err) <= TARGET_MEMORY
            rows.append([case.id, f"{float(measured_gb):.1f} GiB", f"{peak / GIB:.1f} GiB", f"{100 * err:+.1f}%"])
        capacity = case.workload.cluster.devices[0].memory_bytes if case.workload else 0
        oom, predicted_oom = bool(meas.get("oom", False)), peak > capacity
        ok &= predicted_oom == oom
        if "oom" in meas or predicted_oom != oom:
            rows.append([case.id[:60], "OOM" if oom else "fits (trained)",
                         f"{'OOM' if predicted_oom else 'fits'} ({peak / GIB:.1f} of {capacity / GIB:.0f} GiB)",
                         "" if predicted_oom == oom else "WRONG"])
    return rows, ok


def zero3_vs_3d(cases: list[Case], predicted: dict[str, float]) -> tuple[list[list[str]], bool]:
    """Megatron 3D vs ZeRO-3 per model at equal GPU counts (SC21 Table 2)."""
    by_key: dict[tuple[str, int], dict[str, Case]] = defaultdict(dict)
    for case in cases:
        if case.id.startswith("megatron_sc21_t2") and case.id in predicted:
            kind = "zero3" if case.plan and case.plan.stages[0].strategies[0].zero == 3 else "3d"
            by_key[(case.sweep[0], case.workload.cluster.num_devices if case.workload else 0)][kind] = case
    rows, ok = [], True
    for (model, gpus), pair in sorted(by_key.items()):
        if len(pair) < 2:
            continue
        z, d = pair["zero3"], pair["3d"]
        measured_3d_faster = d.measured_tokens_per_s > z.measured_tokens_per_s
        predicted_3d_faster = predicted[d.id] > predicted[z.id]
        ok &= measured_3d_faster == predicted_3d_faster
        rows.append([model, str(gpus), f"{d.measured_tokens_per_s / z.measured_tokens_per_s:.2f}",
                     f"{predicted[d.id] / predicted[z.id]:.2f}", "yes" if measured_3d_faster == predicted_3d_faster
                     else "NO"])
    return rows, ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="?", default=str(DEFAULT_RUNS), help="published runs JSON")
    parser.add_argument("--verbose", action="store_true", help="one row per run")
    args = parser.parse_args()
    cases = load_cases(Path(args.runs))
    expressed = [c for c in cases if not c.skip]
    predicted, peaks, errors = {}, {}, {}
    for case in expressed:
        predicted[case.id], peaks[case.id] = predict(case)
        errors[case.id] = predicted[case.id] / case.measured_tokens_per_s - 1

    if args.verbose:
        rows = [[c.id[:62], c.plan.describe()[:44] if c.plan else "", f"{c.measured_tokens_per_s:,.0f}",
                 f"{predicted[c.id]:,.0f}", f"{100 * errors[c.id]:+.1f}%"] for c in expressed]
        print(table(["run", "plan", "measured tok/s", "hetplan tok/s", "error"], rows,
                    [False, False, True, True, True]))
        print()

    ok = True
    groups: dict[str, list[float]] = defaultdict(list)
    for case in expressed:
        groups[case.group].append(errors[case.id])
        gpu = case.workload.cluster.devices[0].gpu.name if case.workload else "?"
        groups[f"  {gpu}"].append(errors[case.id])
    rows = []
    for name, errs in sorted(groups.items(), key=lambda kv: (kv[0].startswith(" "), kv[0])):
        rows.append([name, *summary(errs)])
        if not name.startswith(" "):
            ok &= float(np.median(np.abs(errs))) <= TARGET_GROUP_MEDIAN
    everything = list(errors.values())
    rows.append(["all", *summary(everything)])
    print("Throughput, predicted vs measured (error > 0: hetplan too optimistic)")
    print(table(["group / GPU", "runs", "median |err|", "p90 |err|", "median signed", "max |err|"], rows,
                [False, True, True, True, True, True]))
    a = np.abs(everything)
    ok &= np.median(a) <= TARGET_MEDIAN and np.percentile(a, 90) <= TARGET_P90
    ok &= abs(np.median(everything)) <= TARGET_BIAS

    sweeps: dict[tuple[str, str, int], list[Case]] = defaultdict(list)
    for case in expressed:
        sweeps[case.sweep].append(case)
    srows = []
    for key, members in sorted(sweeps.items()):
        if len(members) < MIN_SWEEP:
            continue
        rho = spearman([c.measured_tokens_per_s for c in members], [predicted[c.id] for c in members])
        ok &= not rho < TARGET_SPEARMAN
        srows.append([key[0], key[1], str(key[2]), str(len(members)), f"{rho:.2f}"])
    print()
    print("Ranking within sweeps (one model on one cluster)")
    print(table(["model", "GPU", "GPUs", "runs", "Spearman"], srows, [False, False, True, True, True]))

    zrows, zok = zero3_vs_3d(expressed, predicted)
    ok &= zok
    print()
    print("Megatron 3D vs ZeRO-3 (SC21 Table 2): throughput ratio 3D / ZeRO-3")
    print(table(["model", "GPUs", "measured", "hetplan", "same order"], zrows, [False, True, True, True, False]))

    labelled = derived_oom_cases(cases)
    for case in labelled:
        peaks[case.id] = predict(case)[1]
    mrows, mok = memory_checks(expressed + labelled, peaks)
    ok &= mok
    print()
    print(f"Memory: {len(expressed)} runs trained (each fitted), {len(labelled)} out-of-memory outcome(s) "
          "stated in the runs' notes, no peak printed")
    if mrows:
        print(table(["run", "measured", "hetplan", ""], mrows, [False, False, False, False]))

    skipped = [c for c in cases if c.skip]
    print()
    print(f"{len(expressed)} runs expressed, {len(skipped)} not:")
    reasons: dict[str, list[str]] = defaultdict(list)
    for case in skipped:
        reasons[case.skip].append(case.id)
    for reason, ids in sorted(reasons.items()):
        print(f"  {len(ids):3d}  {reason}: {', '.join(ids[:3])}{', ...' if len(ids) > 3 else ''}")
    print()
    print("all targets met" if ok else "TARGET MISSED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
