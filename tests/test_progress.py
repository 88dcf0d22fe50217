"""Progress output: rewritten in place on a terminal, whole lines now and then on a pipe, never on fast work."""

import io

import pytest

from hetplan.progress import Progress


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_prints_when_enabled_and_clears() -> None:
    out = io.StringIO()
    with Progress("search", total=4, stream=out, min_interval_s=0.0, enabled=True) as p:
        for _ in range(4):
            p.advance(note="pp=2")
    text = out.getvalue()
    assert "search: 4/4 (100%)" in text and "[pp=2]" in text
    assert text.endswith("\r")


def test_progress_on_a_pipe_prints_whole_lines_and_a_last_one(monkeypatch) -> None:
    """A pipe (CI, tee, a notebook) gets lines ending in a newline, never a carriage return."""
    monkeypatch.delenv("HETPLAN_PROGRESS", raising=False)
    out = io.StringIO()
    with Progress("search", total=3, stream=out, min_interval_s=0.0) as p:
        p.advance()
        p.advance(note="exact layouts")
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue()
    assert lines[0].startswith("search: 1/3 (33%)") and "s left" in lines[0]
    assert lines[1].startswith("search: 2/3 (67%)") and lines[1].endswith("[exact layouts]")
    assert lines[-1].startswith("search: done in ")


def test_fast_work_on_a_pipe_prints_nothing(monkeypatch) -> None:
    monkeypatch.delenv("HETPLAN_PROGRESS", raising=False)
    out = io.StringIO()
    with Progress("search", total=3, stream=out) as p:  # the first line only after LINE_INTERVAL_S
        p.advance(3)
    assert out.getvalue() == ""


@pytest.mark.parametrize("value, mode", [("0", "off"), ("1", "terminal"), ("lines", "lines")])
def test_hetplan_progress_overrides_the_choice(monkeypatch, value: str, mode: str) -> None:
    monkeypatch.setenv("HETPLAN_PROGRESS", value)
    assert Progress("x", stream=_Terminal()).mode == mode
    assert Progress("x", stream=io.StringIO()).mode == mode


def test_counts_never_pass_the_total_and_no_time_left_when_done() -> None:
    """Work found on the way is expected, not counted past the end (auto's 5/4 before)."""
    p = Progress("auto", total=2, stream=io.StringIO(), enabled=False)
    p.advance(2)
    p.expect(3)
    p.advance(4)
    assert (p.done, p.total) == (6, 6)
    assert "left" not in p.text(28.0) and p.text(28.0).startswith("auto: 6/6 (100%)")


def test_plan_piped_into_a_file_shows_progress_lines(tmp_path) -> None:
    """``hetplan plan 2> log``: the search's progress arrives as lines (here one every 0 s)."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "HETPLAN_PROGRESS": "", "HETPLAN_PROGRESS_EVERY_S": "0"}
    proc = subprocess.run([sys.executable, "-m", "hetplan.cli", "plan", "--model", "gpt3-1.3b", "--cluster",
                           "metis-t4-v100-16", "--global-batch", "64", "--quiet"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stderr.splitlines()
    assert "\r" not in proc.stderr
    assert any(line.startswith("auto planner: ") and "%)" in line for line in lines), proc.stderr
    assert lines[-1].startswith("auto planner: done in ") or any("done in" in line for line in lines)
