"""Every ``# noqa`` and ``# type: ignore`` in the tree says why (issue 31):
a suppression without a reason hides a bug as easily as a false alarm.

Form: the codes, then the reason (``# noqa: BLE001 -- user code``,
``# type: ignore[attr-defined]  # a marker torch does not declare``).
mypy's ``warn_unused_ignores`` (pyproject) removes the ones that no longer
suppress anything on the checked planner side."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TREES = ("src", "tests", "benchmarks", "examples")
# the suppression and its codes; what follows on the line is the reason
SUPPRESSION = re.compile(r"#\s*(noqa(?::\s*[A-Z0-9]+(?:\s*,\s*[A-Z0-9]+)*)?|type:\s*ignore(?:\[[a-z0-9, -]+\])?)(.*)$")
REASON = re.compile(r"^\s*(--|-|#)\s*\S")


def _unexplained(path: Path, root: Path = ROOT) -> list[str]:
    out = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        match = SUPPRESSION.search(line)
        if match and not REASON.match(match.group(2)):
            out.append(f"{path.relative_to(root)}:{number}: {line.strip()}")
    return out


def test_every_suppression_says_why() -> None:
    found = [hit for tree in TREES for path in sorted((ROOT / tree).rglob("*.py")) if ".venv" not in path.parts
             and path.name != "test_suppressions.py" for hit in _unexplained(path)]
    assert not found, "suppressions without a reason:\n" + "\n".join(found)


def test_the_check_sees_a_bare_suppression(tmp_path: Path) -> None:
    sample = tmp_path / "probe.py"
    sample.write_text("import os  # noqa: F401\nx = 1  # type: ignore[misc]\ny = 2  # noqa: F841 -- kept\n")
    assert [hit.split(":")[1] for hit in _unexplained(sample, tmp_path)] == ["1", "2"]
