"""Progress lines for long searches, on stderr.

Shown only when stderr is a terminal (or HETPLAN_PROGRESS=1), at most every
half second, so piped output and tests stay clean and fast searches print nothing.
"""

from __future__ import annotations

import os
import sys
import time
from typing import TextIO


class Progress:
    """``with Progress("amp: degrees", total=n) as p: ... p.advance()``."""

    def __init__(self, label: str, total: int | None = None, stream: TextIO | None = None,
                 min_interval_s: float = 0.5, enabled: bool | None = None) -> None:
        self.label = label
        self.total = total
        self.stream = stream or sys.stderr
        self.min_interval_s = min_interval_s
        if enabled is None:
            enabled = os.environ.get("HETPLAN_PROGRESS") == "1" or getattr(self.stream, "isatty", lambda: False)()
        self.enabled = enabled
        self.done = 0
        self.note = ""
        self._start = time.perf_counter()
        self._last = self._start
        self._shown = False

    def advance(self, steps: int = 1, note: str = "") -> None:
        self.done += steps
        if note:
            self.note = note
        if not self.enabled:
            return
        now = time.perf_counter()
        if now - self._last >= self.min_interval_s:
            self._last = now
            self._print(now)

    def _print(self, now: float) -> None:
        elapsed = now - self._start
        if self.total:
            frac = min(1.0, self.done / self.total)
            eta = elapsed / frac - elapsed if frac > 0 else 0.0
            text = f"{self.label}: {self.done}/{self.total} ({100 * frac:.0f}%), {elapsed:.1f} s, ~{eta:.0f} s left"
        else:
            text = f"{self.label}: {self.done} done, {elapsed:.1f} s"
        if self.note:
            text += f" [{self.note}]"
        self.stream.write("\r" + text[:118].ljust(118))
        self.stream.flush()
        self._shown = True

    def close(self) -> None:
        if self._shown:
            self.stream.write("\r" + " " * 118 + "\r")
            self.stream.flush()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
