"""``hetplan tune``: its flags and what it prints and writes; the trials are
``hetplan.app.tune`` (docs/tuning.md)."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from hetplan.app.records import ranked_record, write_json
from hetplan.app.tune import (
    DEFAULT_STEPS, DEFAULT_TOP_K, DEFAULT_TRIAL_TIMEOUT_S, DEFAULT_WARMUP, MAX_STEPS, MAX_TOP_K, MAX_WARMUP,
    TrialRunner, measurements_dict, measurements_path, result_json, select_plans, trial_device, tune,
    tune_candidates, tuned_plan_file,
)
from hetplan.app.workload import DEFAULT_PLANNER
from hetplan.io.argtypes import at_most, finite_positive_float, zero_or_at_most
from hetplan.cli.options import add_workload_args, load_workload
from hetplan.cost.model import CostModel
from hetplan.errors import HetplanError
from hetplan.report.measured import result_table, verdict
from hetplan.report.text import workload_header
from hetplan.runtime import cli as runtime_cli
from hetplan.search import get_planner
from hetplan.io.userfiles import check_writable_file


def register(sub: Any) -> None:
    """Add ``tune`` to the hetplan CLI (its workload options are ``hetplan plan``'s)."""
    p = sub.add_parser("tune", help="train the top plans for a few steps here and keep the fastest measured")
    add_workload_args(p, batch_auto=False)
    p.add_argument("--planner", default=DEFAULT_PLANNER, help=f"planner (default {DEFAULT_PLANNER})")
    p.add_argument("--top-k", type=at_most(MAX_TOP_K), default=DEFAULT_TOP_K,
                   help=f"plans to try, of different kinds where possible (default {DEFAULT_TOP_K}, "
                   f"at most {MAX_TOP_K})")
    p.add_argument("--steps", type=at_most(MAX_STEPS), default=DEFAULT_STEPS,
                   help=f"measured steps per plan (default {DEFAULT_STEPS}; the median counts)")
    p.add_argument("--warmup", type=zero_or_at_most(MAX_WARMUP), default=DEFAULT_WARMUP,
                   help=f"steps before them, not measured (default {DEFAULT_WARMUP})")
    p.add_argument("--trial-timeout", type=finite_positive_float, default=DEFAULT_TRIAL_TIMEOUT_S, metavar="SECONDS",
                   help=f"seconds before a trial is killed and marked failed (default {DEFAULT_TRIAL_TIMEOUT_S:g})")
    p.add_argument("-o", "--out", required=True,
                   help="write the plans that ran, fastest measured first, here (a plan file: estimate/export/train)")
    p.add_argument("--measurements", default=None,
                   help="write every trial here (default: next to --out, <stem>.measurements.json)")
    p.set_defaults(func=cmd_tune)


def cmd_tune(args: argparse.Namespace, runner: TrialRunner | None = None) -> int:
    """Plan, try the top plans, print and write the measured ranking; ``runner``:
    how a trial runs (default: ``hetplan.app.tune.run_trial_subprocess``)."""
    measurements = measurements_path(args.out, args.measurements)
    if os.path.abspath(measurements) == os.path.abspath(args.out):
        raise HetplanError("--measurements and -o/--out name the same file; give two")
    check_writable_file("-o/--out", args.out)
    check_writable_file("--measurements", measurements)
    workload = load_workload(args)
    device = trial_device(workload.cluster)
    if runner is None:
        runtime_cli.require_torch()
    planner = get_planner(args.planner)
    ranked, search_s = tune_candidates(workload, planner, args.top_k)
    cost_model = CostModel(workload)
    n = len(select_plans(ranked, args.top_k))
    extra = (f"planner  {planner.name}: searched in {search_s:.2f} s; trying {n} plan(s) on {device}, "
             f"{args.warmup} warm-up + {args.steps} measured step(s) each")
    print(workload_header(workload, extra), flush=True)
    result = tune(workload, ranked, runner, top_k=args.top_k, steps=args.steps, warmup=args.warmup,
                  timeout_s=args.trial_timeout, device=device, planner=planner.name, search_time_s=search_s,
                  entry=lambda r: ranked_record(r, cost_model, args.tokens, args.prices))
    print()
    print(result_table(result))
    print(verdict(result))
    write_json(measurements, measurements_dict(result.trials))
    write_json(args.json_path, result_json(result))
    if result.best is None:
        print(f"hetplan: error: every trial failed (see the status column); nothing written to {args.out}",
              file=sys.stderr)
        return 1
    write_json(args.out, tuned_plan_file(result))
    return 0
