"""argparse ``type=`` functions shared by the hetplan command lines.

This module imports nothing from hetplan, so ``hetplan.cli`` and
``hetplan.runtime.cli`` can both use it without importing each other.
"""

from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    """A whole number > 0; anything else is an argparse error naming the bad value."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {value}")
    return value
