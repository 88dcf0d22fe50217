"""argparse ``type=`` functions shared by the hetplan command lines.

This module imports nothing from hetplan, so ``hetplan.cli`` and
``hetplan.runtime.cli`` can both use it without importing each other.
"""

from __future__ import annotations

import argparse
from typing import Callable, NoReturn

EXIT_USAGE = 2


class OneLineParser(argparse.ArgumentParser):
    """argparse's parser, but a usage error is the promised one line
    ``hetplan: error: ...`` (exit 2) naming the command's --help; the usage
    text is printed only by --help. Sub-commands' parsers inherit the class."""

    def error(self, message: str) -> NoReturn:
        command = self.prog.split(" ", 1)[1] + " " if " " in self.prog else ""
        self.exit(EXIT_USAGE, f"hetplan: error: {message} (see 'hetplan {command}--help')\n")
import math


# No count on a command line is near 2**31; past it a number is a slip (and
# Python refuses to parse integers of more than 4,300 digits).
MAX_COUNT = 2**31 - 1
# Tokens to train: the largest published runs are a few tens of trillions
# (Qwen3: 36T tokens, Qwen3 technical report 2025; Llama 4: ~40T, Meta 2025);
# 1e18 is 25,000x that.
MAX_TOKENS = 1e18
# Price of one GPU-hour, dollars: an H100 rents for $2.5-3.5 (Mercatus cloud GPU
# guide, May 2026, app/training.py); $1,000,000 is 300,000x that. With
# MAX_TOKENS and at most 131,072 GPUs, every cost hetplan prints or writes stays
# a finite number (far below a float's 1.8e308), which its JSON reader accepts.
MAX_PRICE_PER_GPU_HOUR = 1e6


def positive_int(text: str, maximum: int = MAX_COUNT) -> int:
    """A whole number in [1, maximum]; anything else is an argparse error naming the bad value."""
    text = text.strip()
    if not text.lstrip("+-").isdigit():
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}")
    if len(text.lstrip("+-")) > len(str(maximum)) or int(text) > maximum:
        raise argparse.ArgumentTypeError(f"{text[:20]}{'...' if len(text) > 20 else ''} is above hetplan's "
                                         f"limit of {maximum:,}; is the number right?")
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {value}")
    return value


def at_most(maximum: int) -> Callable[[str], int]:
    """``positive_int`` with a lower ``maximum`` (hetplan.limits), for argparse ``type=``."""
    def parse(text: str) -> int:
        return positive_int(text, maximum)
    parse.__name__ = f"positive_int_at_most_{maximum}"
    return parse


def zero_or_at_most(maximum: int) -> Callable[[str], int]:
    """A whole number in [0, ``maximum``] (warm-up steps, repeats), for argparse ``type=``."""
    def parse(text: str) -> int:
        if text.strip() in ("0", "+0", "-0"):
            return 0
        if text.strip().startswith("-"):
            raise argparse.ArgumentTypeError(f"must be 0 or more, got {text.strip()}")
        return positive_int(text, maximum)
    parse.__name__ = "non-negative whole number"
    return parse


def name_or_path(text: str) -> str:
    """A preset name, file path or ``pkg.mod:function`` (``--model``, ``--cluster``):
    not empty, since an empty value would silently mean the default."""
    if not text.strip():
        raise argparse.ArgumentTypeError("is empty; give a name or a path, or leave the flag out for the default")
    return text


def _finite_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return value


def finite_positive_float(text: str) -> float:
    """A finite number > 0 (not nan, inf or negative)."""
    value = _finite_float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text!r}")
    return value


def finite_nonneg_float(text: str) -> float:
    """A finite number >= 0 (not nan, inf or negative)."""
    value = _finite_float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text!r}")
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
    if value > MAX_TOKENS:
        raise argparse.ArgumentTypeError(f"{text} is above hetplan's limit of {MAX_TOKENS:.0e} tokens; "
                                         "is the number right?")
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
        if not price > 0 or price == float("inf"):  # the cluster file's price_per_gpu_hour has the same rule
            raise argparse.ArgumentTypeError(f"a price must be a finite number > 0 (leave the price out for no "
                                             f"cost), got {value!r}")
        if price > MAX_PRICE_PER_GPU_HOUR:
            raise argparse.ArgumentTypeError(f"a price of {value} per GPU-hour is above hetplan's limit of "
                                             f"{MAX_PRICE_PER_GPU_HOUR:,.0f}; is the number right?")
        prices[name.strip() or "*"] = price
    return prices
