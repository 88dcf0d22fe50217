"""Running one benchmark cell in its own process (a fresh interpreter: its CPU
time and peak memory are its own), read back from the JSON line it prints last."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Sequence


def run_cell(script: str, args: Sequence[str], missing: Sequence[str]) -> dict[str, object]:
    """``python script --one ARGS``'s last stdout line as JSON; a crash gives
    ``error`` (its last stderr line) and NaN for each ``missing`` number."""
    done = subprocess.run([sys.executable, script, "--one", *args], capture_output=True, text=True, check=False)
    try:
        return json.loads(done.stdout.strip().splitlines()[-1])
    except (json.JSONDecodeError, IndexError):
        error = (done.stderr.strip().splitlines() or ["crashed"])[-1][:80]
        return {"error": error, **{key: float("nan") for key in missing}}
