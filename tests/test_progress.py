"""Progress output: shown on demand, rate-limited, erased at the end."""

import io

from hetplan.progress import Progress


def test_progress_prints_when_enabled_and_clears() -> None:
    out = io.StringIO()
    with Progress("search", total=4, stream=out, min_interval_s=0.0, enabled=True) as p:
        for _ in range(4):
            p.advance(note="pp=2")
    text = out.getvalue()
    assert "search: 4/4 (100%)" in text and "[pp=2]" in text
    assert text.endswith("\r")


def test_progress_silent_when_not_a_terminal() -> None:
    out = io.StringIO()
    with Progress("search", total=3, stream=out, min_interval_s=0.0) as p:
        p.advance(3)
    assert out.getvalue() == ""
