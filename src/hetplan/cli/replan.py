"""``hetplan replan``: a plan file re-planned for the GPUs that are left (``hetplan.app.replan``)."""

from __future__ import annotations

import argparse
from typing import Any

from hetplan.app.planning import DEFAULT_TOP
from hetplan.app.records import write_json
from hetplan.app.replan import replan_file
from hetplan.cli.options import add_training_args
from hetplan.io.argtypes import positive_int
from hetplan.report.replan import replan_text


def register(sub: Any) -> None:
    """Add ``replan`` to the hetplan CLI."""
    p = sub.add_parser("replan", help="re-plan a plan file for the GPUs left after some fail or are taken away")
    p.add_argument("plan_file", help="a plan file written by 'hetplan plan/estimate --json'")
    p.add_argument("--without", nargs="+", required=True, metavar="GPU_OR_NODE",
                   help="GPUs to leave out: ids as the plan numbers them (5 or gpu:5) or whole nodes (node:1)")
    p.add_argument("--index", type=positive_int, default=1, help="which plan of the file (default 1, the best)")
    p.add_argument("--planner", default=None,
                   help="planner for the new plan (default: the one the file was made by); see 'hetplan planners'")
    p.add_argument("--top", type=positive_int, default=DEFAULT_TOP, help="how many new plans to show")
    p.add_argument("--quiet", action="store_true", help="only the tables")
    p.add_argument("--json", dest="json_path", default=None,
                   help="write the new plans as a plan file here (for 'hetplan train --plan ... --load CHECKPOINT')")
    add_training_args(p)
    p.set_defaults(func=cmd_replan)


def cmd_replan(args: argparse.Namespace) -> int:
    replan = replan_file(args.plan_file, args.without, args.index, args.planner, args.top, args.tokens, args.prices)
    print(replan_text(replan, args.quiet))
    if args.json_path:
        write_json(args.json_path, replan.result.record())
    return 0
