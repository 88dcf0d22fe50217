"""Reading a JSON file the user gave, with any problem as one HetplanError line."""

from __future__ import annotations

import json
import os
from typing import Any

from hetplan.errors import HetplanError


def read_json(path: str | os.PathLike[str], what: str, fix: str = "") -> Any:
    """Parsed JSON of ``path``; ``what`` names the file in messages ("plan file"),
    ``fix`` is appended to the invalid-JSON message ("fix the syntax")."""
    path = os.fspath(path)
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except OSError as exc:
        raise HetplanError(f"cannot read {what} {path}: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise HetplanError(f"{what} {path} is not valid JSON (line {exc.lineno}){': ' + fix if fix else ''}") from None
