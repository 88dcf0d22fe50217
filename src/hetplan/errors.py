"""User-facing errors.

Every mistake a user can make (a malformed file, an unknown preset, a batch no
plan can divide) raises a :class:`HetplanError`: a ``ValueError`` whose message
is one line saying what is wrong and what to change. The CLI prints it and
exits with status 2; it never shows a traceback for bad input.
"""

from __future__ import annotations

from difflib import get_close_matches
from typing import Iterable


class HetplanError(ValueError):
    """A user's input cannot be honoured; the message says what to change."""


class OutOfMemoryError(HetplanError):
    """No plan fits in the memory of the GPUs it was given."""


def did_you_mean(name: str, known: Iterable[str]) -> str:
    """' (did you mean 'H100'?)' for the known name closest to a mistyped
    ``name`` (``difflib``'s ratio, case ignored, its default cutoff 0.6), or ''
    where none is close: the error then says what to type, not only what exists."""
    names = list(known)
    by_key = {n.lower(): n for n in names}
    close = get_close_matches(name.lower(), list(by_key), n=1)
    return f" (did you mean {by_key[close[0]]!r}?)" if close else ""
