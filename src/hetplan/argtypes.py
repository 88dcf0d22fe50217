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


def token_count(text: str) -> float:
    """A number of tokens: 3e11, 300B, 1.5T, 20M (positive)."""
    scale = {"K": 1e3, "M": 1e6, "B": 1e9, "T": 1e12}
    body, unit = (text[:-1], scale[text[-1].upper()]) if text and text[-1].upper() in scale else (text, 1.0)
    try:
        value = float(body) * unit
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a token count such as 300B or 3e11, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be positive, got {text!r}")
    return value


def gpu_prices(text: str) -> dict[str, float]:
    """Price per GPU-hour: one number for every GPU (``2.5``, key ``*``) or
    per GPU type (``H100=4.9,A100-80GB=1.8``)."""
    prices: dict[str, float] = {}
    for item in text.split(","):
        name, _, value = item.rpartition("=")
        try:
            price = float(value)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected PRICE or GPU=PRICE[,GPU=PRICE...] (price per GPU-hour), got {item!r}") from None
        if not price >= 0 or price == float("inf"):
            raise argparse.ArgumentTypeError(f"a price must be a number >= 0, got {value!r}")
        prices[name.strip() or "*"] = price
    return prices
