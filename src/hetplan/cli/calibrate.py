"""``hetplan calibrate``: its flags and what it prints and writes; the fit is
``hetplan.app.calibrate``."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from hetplan.app.calibrate import fit, fit_record, load_observations
from hetplan.app.records import write_json, write_text
from hetplan.profile import load_profile
from hetplan.report.measured import fit_report


def register(sub: Any) -> None:
    """Add ``calibrate`` to the hetplan CLI."""
    p = sub.add_parser("calibrate", help="fit the cost model's rates to measured step times")
    p.add_argument("measurements", nargs="+", metavar="FILE",
                   help="'hetplan tune' measurements JSON, 'hetplan train --out' summary.json, or a CSV "
                   "with columns plan,measured_step_s[,measured_peak_memory_bytes]")
    p.add_argument("-o", "--out", required=True, help="write the calibration here (JSON; use with --calibration)")
    p.add_argument("--profile", default=None, help="the measured layer times the plans were costed with")
    p.add_argument("--json", dest="json_path", default=None, help="also write the fit report as JSON here")
    p.set_defaults(func=cmd_calibrate)


def cmd_calibrate(args: argparse.Namespace) -> int:
    """Fit a Calibration to measured plans, print the fit, write it."""
    profile = load_profile(args.profile) if args.profile else None
    observations = load_observations(args.measurements, profile)
    print(f"calibrate: {len(observations)} measured plan(s)", file=sys.stderr, flush=True)
    result = fit(observations, progress=lambda line: print(line, file=sys.stderr, flush=True))
    print("\n".join(fit_report(result, observations)))
    print()
    write_text(args.out, json.dumps(result.calibration.to_dict(), indent=1) + "\n")
    print(f"use it with --calibration {args.out} (or 'calibration: {args.out}' in the cluster file)")
    write_json(args.json_path, fit_record(result, observations))
    return 0
