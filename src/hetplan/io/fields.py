"""Typed reading of fields from parsed JSON/YAML, each problem one HetplanError line.

JSON and YAML give bools where numbers go (``true`` is 1 to Python), strings
where bools go (``"false"`` is truthy), NaN and floats where whole numbers go.
These readers take exactly the type asked for and name the field otherwise,
so no input is ever converted into something the user did not write.
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Mapping

from hetplan.errors import HetplanError


def number(where: str, value: Any, minimum: float | None = 0.0, strict: bool = True) -> float:
    """A finite number (not a bool); above ``minimum`` (``strict``) or at least it."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise HetplanError(f"{where} must be a number, got {value!r}")
    if not math.isfinite(value):
        raise HetplanError(f"{where} must be a finite number, got {value}")
    if minimum is not None and (value <= minimum if strict else value < minimum):
        bound = ("positive" if strict else "zero or positive") if minimum == 0 else \
            f"{'>' if strict else '>='} {minimum:g}"
        raise HetplanError(f"{where} must be {bound}, got {value:g}")
    return float(value)


def whole(where: str, value: Any, minimum: int = 1, maximum: int | None = None) -> int:
    """A whole number (an int, or a float with no fraction; not a bool) in [minimum, maximum]."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise HetplanError(f"{where} must be a whole number, got {value!r}")
    if isinstance(value, float) and not (math.isfinite(value) and value.is_integer()):
        raise HetplanError(f"{where} must be a whole number, got {value}")
    value = int(value)
    if value < minimum:
        raise HetplanError(f"{where} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise HetplanError(f"{where} = {value:,} is above hetplan's limit of {maximum:,}")
    return value


def flag(where: str, value: Any) -> bool:
    """true or false, never a string or number that Python would call truthy."""
    if not isinstance(value, bool):
        raise HetplanError(f"{where} must be true or false, got {value!r}")
    return value


def text(where: str, value: Any, choices: Iterable[str] | None = None) -> str:
    """A string; one of ``choices`` when given."""
    if not isinstance(value, str):
        raise HetplanError(f"{where} must be text, got {value!r}")
    if choices is not None:
        allowed = tuple(choices)
        if value not in allowed:
            raise HetplanError(f"{where} must be one of {', '.join(allowed)}; got {value!r}")
    return value


def listing(where: str, value: Any, maximum: int | None = None) -> list[Any] | tuple[Any, ...]:
    """A JSON list (of at most ``maximum`` items); a tuple too, as dataclasses' asdict gives."""
    if not isinstance(value, (list, tuple)):
        raise HetplanError(f"{where} must be a list, got {type(value).__name__}")
    if maximum is not None and len(value) > maximum:
        raise HetplanError(f"{where} has {len(value):,} items, above hetplan's limit of {maximum:,}")
    return value


def mapping(where: str, value: Any, allowed: Iterable[str], required: Iterable[str] = ()) -> Mapping[str, Any]:
    """A JSON object with only ``allowed`` keys and all ``required`` ones."""
    if not isinstance(value, dict):
        raise HetplanError(f"{where} must be an object, got {type(value).__name__}")
    allowed = set(allowed)
    unknown = sorted(str(k) for k in value if k not in allowed)
    if unknown:
        raise HetplanError(f"{where}: unknown key(s) {unknown}; allowed: {sorted(allowed)}")
    missing = [k for k in required if k not in value]
    if missing:
        raise HetplanError(f"{where}: missing {', '.join(repr(k) for k in missing)}")
    return value
