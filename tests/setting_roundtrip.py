"""One check several CLI settings share: ``hetplan estimate`` with a setting
writes it to the plan file, and estimating that file again gives the same
step time (the setting is read back, not defaulted)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from hetplan.cli import main


def estimate_keeps_setting(args: list[str], option: str, value: str, key: str, tmp_path: Path,
                           capsys: pytest.CaptureFixture[str]) -> tuple[Any, float, str]:
    """Run ``args`` with ``option value``; return (the plan file's ``settings[key]``,
    its step time, what estimate printed), after checking the file's own estimate
    gives the same step time."""
    path = tmp_path / f"{key}-{value}.json"
    assert main([*args, option, value, "--json", str(path)]) == 0
    out = capsys.readouterr().out
    data = json.loads(path.read_text())
    time_s = data["plans"][0]["estimate"]["iteration_time_s"]
    again_path = tmp_path / "again.json"
    assert main(["estimate", str(path), "--json", str(again_path)]) == 0
    capsys.readouterr()
    assert json.loads(again_path.read_text())["plans"][0]["estimate"]["iteration_time_s"] == time_s
    return data["settings"][key], time_s, out
