"""Progress lines for long work (searches, model traces), on stderr.

Two forms, by where stderr goes:

* a terminal: one line rewritten in place (``\\r``) at most every half second,
  erased at the end;
* anything else (a pipe, ``tee``, CI's log, a notebook): a whole line every
  ``LINE_INTERVAL_S`` seconds, the first only after that long, so a log shows
  that a long search is alive and how far it is, while work that ends sooner
  prints nothing (and commands piped into other tools stay clean).

``HETPLAN_PROGRESS`` overrides the choice: ``0`` none, ``1`` the terminal
form, ``lines`` the line form; ``HETPLAN_PROGRESS_EVERY_S`` the seconds
between lines of the line form. The counts say what is done of what is known
(``expect`` adds work found on the way, so ``done`` never passes ``total``),
and the time left is estimated only while work remains. A hand-written
helper rather than tqdm or rich: both write ``\\r`` updates into a log file
too, which is what a pipe must not get; this one is forty lines with the two
forms above. Progress output never changes a result: it only reads the clock
to decide when to print.
"""

from __future__ import annotations

import os
import sys
import time
from typing import TextIO

LINE_INTERVAL_S = 10.0  # a log line every 10 s: often enough to see life, rare enough not to flood a CI log
TERMINAL_INTERVAL_S = 0.5
WIDTH = 118  # the terminal form's line, padded so a shorter one erases the longer before it
MODES = ("0", "1", "lines")


def _mode(stream: TextIO, enabled: bool | None) -> str:
    """"terminal", "lines" or "off" for ``stream`` (``enabled``: force the terminal form or none)."""
    if enabled is not None:
        return "terminal" if enabled else "off"
    forced = os.environ.get("HETPLAN_PROGRESS", "")
    if forced in MODES:
        return {"0": "off", "1": "terminal", "lines": "lines"}[forced]
    return "terminal" if getattr(stream, "isatty", lambda: False)() else "lines"


def _line_interval() -> float:
    """``HETPLAN_PROGRESS_EVERY_S`` if it is a number >= 0, else ``LINE_INTERVAL_S``."""
    try:
        value = float(os.environ.get("HETPLAN_PROGRESS_EVERY_S", ""))
    except ValueError:
        return LINE_INTERVAL_S
    return value if value >= 0 else LINE_INTERVAL_S


class Progress:
    """``with Progress("amp: degrees", total=n) as p: ... p.advance()``."""

    def __init__(self, label: str, total: int | None = None, stream: TextIO | None = None,
                 min_interval_s: float | None = None, enabled: bool | None = None) -> None:
        self.label = label
        self.total = total
        self.stream = stream or sys.stderr
        self.mode = _mode(self.stream, enabled)
        if min_interval_s is None:
            min_interval_s = _line_interval() if self.mode == "lines" else TERMINAL_INTERVAL_S
        self.min_interval_s = min_interval_s
        self.done = 0
        self.note = ""
        self._start = time.perf_counter()
        self._last = self._start
        self._shown = False

    @property
    def enabled(self) -> bool:
        return self.mode != "off"

    def expect(self, more: int) -> None:
        """More work than first known (shapes found by a first pass, a fallback's planners)."""
        self.total = (self.total or 0) + more

    def advance(self, steps: int = 1, note: str = "") -> None:
        self.done += steps
        if self.total is not None and self.done > self.total:
            self.total = self.done
        if note:
            self.note = note
        if self.mode == "off":
            return
        now = time.perf_counter()
        if now - self._last >= self.min_interval_s:
            self._last = now
            self._print(self.text(now - self._start))

    def text(self, elapsed: float) -> str:
        """The progress line after ``elapsed`` seconds."""
        if self.total:
            frac = self.done / self.total
            text = f"{self.label}: {self.done}/{self.total} ({100 * frac:.0f}%), {elapsed:.1f} s"
            if 0 < frac < 1:
                text += f", ~{elapsed / frac - elapsed:.0f} s left"
        else:
            text = f"{self.label}: {self.done} done, {elapsed:.1f} s"
        return text + (f" [{self.note}]" if self.note else "")

    def _print(self, text: str) -> None:
        if self.mode == "lines":
            self.stream.write(text + "\n")
        else:
            self.stream.write("\r" + text[:WIDTH].ljust(WIDTH))
        self.stream.flush()
        self._shown = True

    def close(self) -> None:
        if not self._shown:
            return
        if self.mode == "lines":
            self.stream.write(f"{self.label}: done in {time.perf_counter() - self._start:.1f} s\n")
        else:
            self.stream.write("\r" + " " * WIDTH + "\r")
        self.stream.flush()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
