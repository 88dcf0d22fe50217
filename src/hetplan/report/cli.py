"""``hetplan report PLAN_FILE -o OUT.html``: one self-contained HTML page about
a plan file (``report/html.py``; docs/report.md).

Registered by ``hetplan.cli.build_parser``; imports only argtypes at module
level, so the command line starts as fast as before.
"""

from __future__ import annotations

import argparse
from typing import Any

from hetplan.argtypes import gpu_prices, positive_int, token_count


def register(subparsers: Any) -> None:
    """Add ``report`` to the hetplan CLI's subparsers."""
    p = subparsers.add_parser("report", help="write one self-contained HTML page about a plan file "
                                             "(plan, why, alternatives, timeline, memory, cost)")
    p.add_argument("plan_file", help="plan JSON from 'hetplan plan/estimate --json'")
    p.add_argument("-o", "--out", required=True, help="write the page here (.html)")
    p.add_argument("--index", type=positive_int, default=1, help="which plan of the file to describe (1 = best)")
    p.add_argument("--tokens", type=token_count, default=None,
                   help="tokens to train (e.g. 300B): days and GPU-hours (and cost with prices)")
    p.add_argument("--price-per-gpu-hour", dest="prices", type=gpu_prices, default=None,
                   help="price per GPU-hour: one number, or GPU=PRICE,... per type (e.g. H100=4.9,A100-80GB=1.8)")
    p.add_argument("--vary", default=None, metavar="WHAT=V1,V2,...",
                   help="add a what-if table: gpus=64,128 | gpu=H100,A100-80GB (homogeneous clusters) | "
                   "global-batch=256,512")
    p.add_argument("--planner", default="auto", help="planner for the what-if variants (default auto)")
    p.set_defaults(func=cmd_report)


def cmd_report(args: argparse.Namespace) -> int:
    from hetplan.cli import _runnable_best, _write_text
    from hetplan.planfile import read_plan_file
    from hetplan.report.html import report_html
    from hetplan.report.whatif import check_varies, parse_vary, run_whatif

    plan_file = read_plan_file(args.plan_file)
    plan_file.plan(args.index)  # a bad --index fails here, before any work
    base = plan_file.workload(args.index)
    results, planner_name = None, ""
    if args.vary is not None:
        from hetplan.search import get_planner

        what, items = parse_vary(args.vary)
        check_varies(base, what)
        planner = get_planner(args.planner)
        planner_name = planner.name
        results = run_whatif(base, what, items, planner, args.tokens, args.prices,
                             best_of=_runnable_best)
    page = report_html(plan_file, args.index, args.tokens, args.prices, results, planner_name)
    _write_text(args.out, page)
    return 0
