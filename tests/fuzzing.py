"""Generators and the checker for the input fuzz tests (tests/test_fuzz_inputs.py).

Every input surface (cluster YAML, ModelSpec JSON, HF config.json, plan JSON,
command-line values) is fuzzed by *mutating a valid input once*: one value
replaced by an awkward one (NaN, a bool, a string, null, a huge or negative
number, ...), one key removed or added, the text truncated or given bytes
that are not UTF-8. Each input runs through ``hetplan.cli.main`` in this
process, and must end in one of two ways:

* exit 0 (the input is valid), or
* exit 2 with exactly one line ``hetplan: error: ...`` on stderr;

never an exception, never longer than ``TIME_LIMIT_S``, never more than
``MEMORY_LIMIT_BYTES`` of new memory. Mutations that can only make an input
wrong (a number replaced by a non-number, an unknown key) must end in exit 2:
accepting them would be silently wrong.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import math
import os
import resource
import signal
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import yaml
from hypothesis import strategies as st

TIME_LIMIT_S = 10.0
MEMORY_LIMIT_BYTES = 1 << 30

# Values that have broken parsers before: non-finite and out-of-range numbers,
# the wrong JSON type for every type, strings Python would call true.
AWKWARD_VALUES: tuple[Any, ...] = (
    math.nan, math.inf, -math.inf, -1, 0, -0.0, 0.5, 1e308, 10**30, 2**63, True, False,
    1e30, 1e19, 2.0**62, 1e-10,  # finite but past int64 once scaled to bytes, or rounding to 0 bytes
    "false", "true", "", "8", "x" * 300, "\u0000", None, [], {}, [1], {"a": 1},
)

# Names a plan's ``model`` / ``cluster`` may be edited to while the file embeds
# the specs: another preset, an unknown name, empty; each must be refused.
EDITED_NAMES: tuple[str, ...] = ("gpt2-amp", "8xH100", "no-such-name", "", " ")
# Plan-file model sources that must never be imported by merely reading the
# file (issue 32: the trust model for plan files). Commands that never build
# the model (estimate, export) are fuzzed with them today (test_fuzz_inputs.py);
# the commands that build it join once plan files carry a typed, trusted source.
HOSTILE_MODULE_SOURCES: tuple[str, ...] = ("os:abort", "os:fork", "subprocess:call", "builtins:exit")


# --- running one input ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Outcome:
    code: int
    stdout: str
    stderr: str
    seconds: float
    new_memory_bytes: int


class _TooSlow(BaseException):
    pass


def _max_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


@contextlib.contextmanager
def _time_limit(seconds: float) -> Iterator[None]:
    def alarm(signum: int, frame: Any) -> None:
        raise _TooSlow()

    previous = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def run_cli(argv: Sequence[str]) -> Outcome:
    """``hetplan ARGV`` in this process; an exception escaping it fails the caller."""
    from hetplan.cli import main

    out, err = io.StringIO(), io.StringIO()
    rss, start = _max_rss_bytes(), time.perf_counter()
    try:
        with _time_limit(TIME_LIMIT_S), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(list(argv))
            except SystemExit as exc:  # argparse's errors and --help
                code = exc.code if isinstance(exc.code, int) else 2
    except _TooSlow:
        raise AssertionError(f"hetplan {' '.join(argv)} ran past {TIME_LIMIT_S} s") from None
    return Outcome(int(code or 0), out.getvalue(), err.getvalue(), time.perf_counter() - start,
                   _max_rss_bytes() - rss)


def check_outcome(argv: Sequence[str], outcome: Outcome, must_fail: bool, what: str) -> None:
    """The promise of the module docstring, for one input."""
    label = f"{what}\nhetplan {' '.join(argv)}\nstderr: {outcome.stderr[-2000:]}"
    assert "Traceback" not in outcome.stderr, label
    assert outcome.new_memory_bytes < MEMORY_LIMIT_BYTES, label
    if outcome.code == 0:
        assert not must_fail, f"accepted an input that cannot be valid: {label}"
        return
    lines = outcome.stderr.strip().splitlines()
    assert outcome.code == 2, label
    assert len(lines) == 1 and lines[0].startswith("hetplan: error: "), label


# --- mutating a document -------------------------------------------------------------------------
Path = tuple[Any, ...]


def paths(doc: Any, prefix: Path = ()) -> list[Path]:
    """Every value's path in a JSON-like document (the root excluded)."""
    found: list[Path] = []
    items = doc.items() if isinstance(doc, dict) else enumerate(doc) if isinstance(doc, list) else ()
    for key, value in items:
        found.append((*prefix, key))
        found += paths(value, (*prefix, key))
    return found


def get(doc: Any, path: Path) -> Any:
    for key in path:
        doc = doc[key]
    return doc


@dataclass(frozen=True)
class Mutation:
    kind: str  # replace | delete | add-key | none
    path: Path
    value: Any = None

    def apply(self, doc: Any) -> Any:
        doc = copy.deepcopy(doc)
        if self.kind == "add-key":
            get(doc, self.path)["fuzz_unknown_key"] = self.value
        elif self.kind in ("replace", "delete"):
            parent, key = get(doc, self.path[:-1]), self.path[-1]
            if self.kind == "replace":
                parent[key] = self.value
            else:
                del parent[key]
        return doc

    def must_fail(self, doc: Any, free_form: Callable[[Path], bool]) -> bool:
        """Only a mistake can come of it: an unknown key, or a number or
        true/false replaced by a value of another type or a non-finite one."""
        if self.kind == "none" or free_form(self.path):
            return False
        if self.kind == "add-key":
            return True
        if self.kind != "replace":
            return False
        old, new = get(doc, self.path), self.value
        if isinstance(old, bool):
            return not isinstance(new, bool)
        if isinstance(old, (int, float)):
            return isinstance(new, (bool, str, list, dict, type(None))) or (
                isinstance(new, float) and not math.isfinite(new))
        return False

    def __str__(self) -> str:
        return f"{self.kind} {'/'.join(map(str, self.path))} {self.value!r}"[:300]


def mutations(doc: Any) -> st.SearchStrategy[Mutation]:
    """One mutation of ``doc`` (or none: the valid input must pass)."""
    every = paths(doc)
    dicts = [p for p in every if isinstance(get(doc, p), dict)] or [()]
    awkward = st.sampled_from(AWKWARD_VALUES) | st.integers(-2**40, 2**40) | st.floats(allow_nan=True)
    return st.one_of(
        st.just(Mutation("none", ())),
        st.builds(Mutation, st.just("replace"), st.sampled_from(every), awkward),
        st.builds(Mutation, st.just("delete"), st.sampled_from(every)),
        st.builds(Mutation, st.just("add-key"), st.sampled_from(dicts), awkward),
    )


# --- damaging the text ---------------------------------------------------------------------------
def to_json(doc: Any) -> str:
    return json.dumps(doc, allow_nan=True)  # NaN/Infinity written as Python does: the reader must refuse them


def to_yaml(doc: Any) -> str:
    return yaml.safe_dump(doc, sort_keys=False, allow_unicode=True)


def damages() -> st.SearchStrategy[tuple[str, int, bytes]]:
    """(kind, position as a fraction x 1000, bytes) of a text-level damage."""
    return st.tuples(st.sampled_from(("truncate", "insert")), st.integers(0, 1000),
                     st.sampled_from((b"\xff\xfe", b"\x00", b"{", b"]", b": :", b"&a x", b"*a", b"\n  - ", b"\t")))


def damaged(text: str, damage: tuple[str, int, bytes]) -> bytes:
    kind, where, payload = damage
    data = text.encode("utf-8")
    cut = len(data) * where // 1000
    return data[:cut] if kind == "truncate" else data[:cut] + payload + data[cut:]


def write(directory: str, name: str, data: str | bytes) -> str:
    path = os.path.join(directory, name)
    with open(path, "wb") as f:
        f.write(data.encode("utf-8") if isinstance(data, str) else data)
    return path
