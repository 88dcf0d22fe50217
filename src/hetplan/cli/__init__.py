"""The ``hetplan`` command line.

    hetplan plan      best plans for a model on a cluster (default: AMP's GPT-2 on
                      its heterogeneous cluster), with time, throughput, memory and why
    hetplan compare   several planners side by side on the same inputs
    hetplan estimate  cost one plan file, or one uniform dp/tp/pp setting
    hetplan export    a plan as torchtitan / Megatron / DeepSpeed settings
    hetplan models    list model presets
    hetplan clusters  list cluster presets and GPU types
    hetplan train/run train with a plan (runtime; needs torch)
    hetplan profile   measure layer times and collectives on your hardware (needs torch)
    hetplan tune      train the top plans for a few steps, re-rank them by measurement (needs torch)
    hetplan calibrate fit the cost model's rates to measured step times
    hetplan report    one self-contained HTML page for a plan file
    hetplan replan    re-plan a plan file for the GPUs left when some fail or are taken away
    hetplan choose    from a pool of GPU offers (types, zones, prices), the allocation and plan
                      that trains cheapest by a deadline, fastest within a budget, or the frontier

A user mistake prints one line ``hetplan: error: ...`` and exits with status 2.

This package parses and dispatches: one module per command group registers
its commands (``planning``, ``listing``, ``calibrate``, ``report``, ``replan``, ``choose``, ``tune``;
the runtime's and the profiler's in ``hetplan.runtime.cli`` and
``hetplan.runtime.profiling.cli``); the work is ``hetplan.app``'s, the text and pages
``hetplan.report``'s.
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from hetplan import __version__
from hetplan.io.argtypes import EXIT_USAGE, OneLineParser
from hetplan.cli import calibrate as calibrate_cli
from hetplan.cli import choose as choose_cli
from hetplan.cli import listing as listing_cli
from hetplan.cli import planning as planning_cli
from hetplan.cli import replan as replan_cli
from hetplan.cli import report as report_cli
from hetplan.cli import tune as tune_cli
from hetplan.cli.options import load_workload
from hetplan.errors import HetplanError
from hetplan.io.userfiles import check_writable_file
from hetplan.runtime import cli as runtime_cli
from hetplan.runtime.profiling import cli as profile_cli

__all__ = ["build_parser", "load_workload", "main"]

# Ctrl-C: the shell's convention, 128 + SIGINT (2).
EXIT_INTERRUPTED = 130


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="hetplan", description="Plan and run parallel training on heterogeneous GPU clusters.")
    parser.add_argument("--version", action="version", version=f"hetplan {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    planning_cli.register(sub)
    listing_cli.register(sub)
    calibrate_cli.register(sub)
    runtime_cli.register(sub)
    report_cli.register(sub)
    replan_cli.register(sub)
    choose_cli.register(sub)
    tune_cli.register(sub)
    profile_cli.register(sub)
    return parser


# Output files of the planning commands, checked before the search starts (a
# wrong --json found after minutes of search loses them). tune, profile and
# train check their own outputs; train's --out is a directory.
_OUTPUT_FILES = (("json_path", "--json"), ("timeline", "--timeline"), ("memory_chart", "--memory-chart"),
                 ("chart", "--chart"))
_COMMANDS_WITH_OUT_FILE = ("report", "calibrate", "export")


def _check_output_files(args: argparse.Namespace) -> None:
    """Every file the command will write can be written."""
    flags = list(_OUTPUT_FILES)
    if args.command in _COMMANDS_WITH_OUT_FILE:
        flags.append(("out", "--out"))
    for attr, flag in flags:
        path = getattr(args, attr, None)
        if isinstance(path, str) and path:
            check_writable_file(flag, path)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "command", None):
        args = parser.parse_args(["plan", *(argv or [])])
    try:
        _check_output_files(args)
        return int(args.func(args) or 0)
    except HetplanError as exc:
        print(f"hetplan: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("hetplan: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # output piped into `head` and closed early
        sys.stderr.close()
        return 0
