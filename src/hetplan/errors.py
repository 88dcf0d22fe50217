"""User-facing errors.

Every mistake a user can make (a malformed file, an unknown preset, a batch no
plan can divide) raises a :class:`HetplanError`: a ``ValueError`` whose message
is one line saying what is wrong and what to change. The CLI prints it and
exits with status 2; it never shows a traceback for bad input.
"""


class HetplanError(ValueError):
    """A user's input cannot be honoured; the message says what to change."""


class OutOfMemoryError(HetplanError):
    """No plan fits in the memory of the GPUs it was given."""
