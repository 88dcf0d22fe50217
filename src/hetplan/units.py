"""Unit helpers: one place that converts between the units users write and SI."""

from __future__ import annotations

import re

from hetplan.errors import HetplanError

GIB = 1024**3
MIB = 1024**2
GB = 10**9

_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmgt]i?b?)?\s*$", re.IGNORECASE)
_FACTORS = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "ki": 2**10, "kib": 2**10,
    "m": 10**6, "mb": 10**6, "mi": 2**20, "mib": 2**20,
    "g": 2**30, "gb": 2**30, "gi": 2**30, "gib": 2**30,
    "t": 2**40, "tb": 2**40, "ti": 2**40, "tib": 2**40,
}


def gbps_to_bytes_per_s(gbps: float) -> float:
    """Gigabits per second (how links are sold) to bytes per second."""
    return gbps * 1e9 / 8.0


# Smaller than any accelerator's memory by 16x (the smallest in the catalog
# hold 16 GiB; a CPU process in the runtime tests a few); a limit below it is a
# slip such as "0.5" meant as GB.
MIN_MEMORY_LIMIT_BYTES = 2**20


def parse_memory_size(text: str | int | float) -> int:
    """Parse '8GB', '12 GiB', '16g' or a byte count into bytes.

    GPU memory is quoted in binary units ("24 GB" cards hold 24 GiB), so GB and
    GiB both mean 2**30 here, as in the papers' memory budgets. Text needs its
    unit: "0.5" could mean bytes or GB, and read as bytes it is no limit at all.
    """
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        if not text > 0 or text == float("inf"):
            raise HetplanError(f"memory size must be positive, got {text}")
        return int(text)
    match = _SIZE.match(str(text))
    if not match:
        raise HetplanError(f"cannot read memory size {text!r}: write e.g. '8GB' or '16GiB'")
    value, unit = float(match.group(1)), (match.group(2) or "").lower()
    if not unit:
        shown = str(text).strip()
        raise HetplanError(f"memory size {text!r} has no unit: write e.g. '{shown}GB' or '{shown}MB'")
    size = int(value * _FACTORS[unit])
    if size < MIN_MEMORY_LIMIT_BYTES:
        raise HetplanError(f"memory size {text!r} is {size:,} bytes, below 1 MiB: is the unit right?")
    return size


def parse_byte_size(text: str) -> int:
    """A byte count such as '64MiB', '1 GiB', '4096' (no unit: bytes) or '0',
    for sizes that are not memory limits (message sizes): any size >= 0."""
    match = _SIZE.match(str(text))
    if not match:
        raise HetplanError(f"cannot read size {text!r}: write e.g. '64MiB' or '1GiB'")
    return int(float(match.group(1)) * _FACTORS[(match.group(2) or "").lower()])


def format_bytes(num_bytes: float) -> str:
    """Human-readable binary size, e.g. '12.3 GiB'."""
    for unit, factor in (("TiB", 2**40), ("GiB", GIB), ("MiB", MIB), ("KiB", 1024)):
        if abs(num_bytes) >= factor:
            return f"{num_bytes / factor:.1f} {unit}"
    return f"{num_bytes:.0f} B"


def format_time(seconds: float) -> str:
    """Seconds with a unit that keeps 3 significant figures readable."""
    if seconds >= 1:
        return f"{seconds:.3f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds * 1e6:.1f} us"


def format_count(count: float) -> str:
    """Parameter counts as people say them: '355M', '1.32B', '52.5K'."""
    for unit, factor in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(count) >= factor:
            value = count / factor
            return f"{value:.3g}{unit}" if value < 100 else f"{value:.0f}{unit}"
    return f"{count:.0f}"
