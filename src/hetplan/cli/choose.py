"""``hetplan choose``: which GPUs of a pool to take, and the plan for them
(``hetplan.app.choose``; text and chart by ``hetplan.report.choose``)."""

from __future__ import annotations

import argparse
from typing import Any

from hetplan.app.choose import DEFAULT_MAX_PLANS, choose, summary, write_points
from hetplan.app.planning import replica_tp_best, runnable_best
from hetplan.app.records import write_json, write_text
from hetplan.app.workload import DEFAULT_PLANNER, WorkloadOptions, load_workload
from hetplan.cli.options import batch_size
from hetplan.cluster.pool import load_pool
from hetplan.io.argtypes import finite_positive_float, gpu_prices, name_or_path, positive_int, token_count
from hetplan.report.choose import choose_text, frontier_svg
from hetplan.search import get_planner

# --deadline's units, in hours.
DURATION_UNITS = {"s": 1 / 3600, "m": 1 / 60, "h": 1.0, "d": 24.0}


def duration_hours(text: str) -> float:
    """A deadline such as 36h, 5d, 90m or 3600s (a bare number: hours), in hours."""
    unit = text[-1:].lower()
    body, scale = (text[:-1], DURATION_UNITS[unit]) if unit in DURATION_UNITS else (text, 1.0)
    try:
        value = finite_positive_float(body)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected a time such as 36h, 5d, 90m or 3600s, got {text!r}") from None
    return value * scale


def register(sub: Any) -> None:
    """Add ``choose`` to the hetplan CLI."""
    p = sub.add_parser("choose", help="choose the GPUs too: from a pool of offers, the allocation and plan that "
                                      "trains cheapest by a deadline, fastest within a budget, or the frontier")
    p.add_argument("--pool", type=name_or_path, required=True, help="pool YAML: zones, offers, prices (docs/choose.md)")
    p.add_argument("--model", type=name_or_path, default=None, help="preset name, HF config.json, ModelSpec .json "
                                                                    "or pkg.mod:function (default gpt2-amp)")
    p.add_argument("--global-batch", type=batch_size, required=True, help="samples per step")
    p.add_argument("--seq-len", type=positive_int, default=None, help="sequence length (default: the model's)")
    p.add_argument("--tokens", type=token_count, required=True, help="tokens to train (e.g. 10B)")
    goal = p.add_mutually_exclusive_group()
    goal.add_argument("--deadline", type=duration_hours, default=None,
                      help="the cheapest allocation that trains within this time (36h, 5d, ...)")
    goal.add_argument("--budget", type=finite_positive_float, default=None,
                      help="the fastest allocation that trains within this many dollars")
    p.add_argument("--price", dest="prices", type=gpu_prices, default=None,
                   help="what-if on prices: GPU=PRICE,... per GPU-hour (or one PRICE for every offer) "
                        "in place of the pool's")
    p.add_argument("--planner", default=DEFAULT_PLANNER, help=f"planner (default {DEFAULT_PLANNER})")
    p.add_argument("--max-plans", type=positive_int, default=DEFAULT_MAX_PLANS,
                   help=f"planner calls the search may make (default {DEFAULT_MAX_PLANS}); past it the answer "
                        "is the best found, and the output says it is not proven")
    p.add_argument("--jobs", type=positive_int, default=1,
                   help="allocations planned at once, each in its own process (default 1; the answer is the same, "
                        "the counts of planned and pruned allocations may differ)")
    p.add_argument("--mixed-tp", action="store_true",
                   help="also give the replicas of stages that hold several GPU types their own TP degree "
                        "(Sailor's mixed replicas; hetplan's runtime trains them at ZeRO 0 and refuses them with ZeRO > 0, "
                        "runtime/mixed.py)")
    p.add_argument("--json", dest="json_path", default=None, help="write the result as JSON here")
    p.add_argument("--chart", default=None, help="write the points as a chart of days vs $ here (.svg)")
    p.add_argument("--out-dir", default=None,
                   help="write each point's cluster file and plan file here (point-N.cluster.yaml, point-N.plan.json)")
    p.set_defaults(func=cmd_choose)


def cmd_choose(args: argparse.Namespace) -> int:
    pool = load_pool(args.pool)
    if args.prices:
        pool = pool.with_prices(args.prices)
    base = load_workload(WorkloadOptions(model=args.model, global_batch=args.global_batch, seq_len=args.seq_len))
    objective, limit = ("deadline", args.deadline) if args.deadline is not None else \
        ("budget", args.budget) if args.budget is not None else ("frontier", None)
    planner = get_planner(args.planner)
    result = choose(pool, base, planner, args.tokens, objective, limit, args.max_plans,
                    replica_tp_best if args.mixed_tp else runnable_best, args.jobs)
    print(choose_text(result))
    write_json(args.json_path, result.record())
    if args.chart and result.points:
        write_text(args.chart, frontier_svg(summary(result)))
    if args.out_dir:
        write_points(result, args.out_dir, planner.name)
    return 0
