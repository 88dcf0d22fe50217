"""``hetplan report PLAN_FILE -o OUT.html``: one self-contained HTML page about
a plan file (``hetplan.report.html``; docs/report.md)."""

from __future__ import annotations

import argparse
from typing import Any

from hetplan.app.choose import read_choose_json
from hetplan.app.planning import runnable_best
from hetplan.app.records import write_text
from hetplan.app.whatif import WhatIfResult, check_varies, parse_vary, run_whatif
from hetplan.app.workload import DEFAULT_PLANNER
from hetplan.io.argtypes import positive_int
from hetplan.cli.options import add_training_args
from hetplan.plan.file import read_plan_file
from hetplan.report.html import report_html
from hetplan.search import get_planner


def register(sub: Any) -> None:
    """Add ``report`` to the hetplan CLI."""
    p = sub.add_parser("report", help="write one self-contained HTML page about a plan file "
                                      "(plan, why, alternatives, timeline, memory, cost)")
    p.add_argument("plan_file", help="plan JSON from 'hetplan plan/estimate --json'")
    p.add_argument("-o", "--out", required=True, help="write the page here (.html)")
    p.add_argument("--index", type=positive_int, default=1, help="which plan of the file to describe (1 = best)")
    add_training_args(p)
    p.add_argument("--vary", default=None, metavar="WHAT=V1,V2,...",
                   help="add a what-if table: gpus=64,128 | gpu=H100,A100-80GB (homogeneous clusters) | "
                   "global-batch=256,512")
    p.add_argument("--planner", default=DEFAULT_PLANNER,
                   help=f"planner for the what-if variants (default {DEFAULT_PLANNER})")
    p.add_argument("--choose", default=None, metavar="CHOOSE.json",
                   help="add the frontier (or answer) of 'hetplan choose --json' as a chart and table")
    p.set_defaults(func=cmd_report)


def cmd_report(args: argparse.Namespace) -> int:
    plan_file = read_plan_file(args.plan_file)
    plan_file.plan(args.index)  # a bad --index fails here, before any work
    chosen = read_choose_json(args.choose) if args.choose is not None else None
    base = plan_file.workload(args.index)
    results: list[WhatIfResult] | None = None
    planner_name = ""
    if args.vary is not None:
        what, items = parse_vary(args.vary)
        check_varies(base, what)
        planner = get_planner(args.planner)
        planner_name = planner.name
        results = run_whatif(base, what, items, planner, args.tokens, args.prices, best_of=runnable_best)
    write_text(args.out, report_html(plan_file, args.index, args.tokens, args.prices, results, planner_name, chosen))
    return 0
