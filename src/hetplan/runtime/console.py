"""hetplan's own one-line messages on the terminal, also from a rank whose stderr goes to a log.

``hetplan train`` sends each rank's stderr (tracebacks, warnings, gloo's C++
messages) to ``rank<R>.log`` (:func:`log_stderr`), so that the tracebacks of
ranks that lost a peer do not bury what ended the run; :func:`console` still
reaches the terminal. The launcher (hetplan.runtime.launch) and the heartbeat
(hetplan.runtime.heartbeat) both write through it, which is why it is a module
of its own below both. Torch-free.
"""

from __future__ import annotations

import os
import sys
from typing import Any

_console_fd = 2  # the terminal's stderr, also after log_stderr
_context: Any = None  # this process's RuntimeContext (remember_context), for the out-of-memory line


def remember_context(ctx: Any) -> None:
    """Keep the process's RuntimeContext (``hr.init`` calls this), so an error
    caught outside the user's code can say where the rank sits in the plan and
    at which step it was."""
    global _context
    _context = ctx


def current_context() -> Any:
    """The RuntimeContext ``remember_context`` kept, or None before ``hr.init``."""
    return _context


def console(line: str) -> None:
    """Write one of hetplan's own messages (an error line) to the terminal's
    stderr, also from a rank whose stderr goes to its log. ``os.write``, not
    ``sys.stderr``: the heartbeat calls it while the main thread may hold that lock."""
    os.write(_console_fd, (line.rstrip("\n") + "\n").encode(errors="replace"))


def rank_log(directory: str, rank: int) -> str:
    """The file a rank's stderr goes to under ``hetplan train``."""
    return os.path.join(directory, f"rank{rank}.log")


def log_stderr(directory: str, rank: int) -> None:
    """Send this process's stderr (file descriptor 2: Python tracebacks,
    warnings, gloo's C++ messages) to ``rank_log(directory, rank)``;
    :func:`console` still reaches the terminal."""
    global _console_fd
    sys.stderr.flush()
    os.makedirs(directory, exist_ok=True)
    fd = os.open(rank_log(directory, rank), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    _console_fd = os.dup(2)
    os.dup2(fd, 2)
    os.close(fd)
