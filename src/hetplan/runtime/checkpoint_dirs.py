"""Checkpoint directories without torch: where step N's checkpoint goes, and the newest complete one.

A checkpoint (``hetplan.runtime.checkpoint``) is the directory ``ROOT/step_N``; it is complete when it
holds its manifest, which the save writes last. The ``--elastic`` supervisor (``hetplan.app.elastic``,
torch-free) reads the same directories to say where a re-planned run continues from.
"""

from __future__ import annotations

import os
import re
import sys
from typing import Callable

from hetplan.errors import HetplanError

MANIFEST = "hetplan-manifest.json"
# Where ``hetplan run --checkpoint-dir`` tells the user's script to keep its checkpoints (and to resume from).
CHECKPOINT_DIR_ENV = "HETPLAN_CHECKPOINT_DIR"
_STEP_DIR = re.compile(r"^step_(\d+)$")


def checkpoint_dir(root: str, step: int) -> str:
    return os.path.join(root, f"step_{step:08d}")


def latest_checkpoint(root: str, note: Callable[[str], None] | None = None) -> tuple[str, int] | None:
    """The newest complete ``root/step_N`` checkpoint (one with a manifest) and its step, or None.

    Newer directories without a manifest (saves that did not finish) are
    skipped, each with a note: ``note(text)``, by default printed on stderr.
    Only the manifest's presence is checked here; :func:`load` verifies the files.
    """
    if not os.path.isdir(root):
        return None
    note = note or _note_on_stderr
    steps = []
    for entry in os.listdir(root):
        m = _STEP_DIR.match(entry)
        if m and os.path.isdir(os.path.join(root, entry)):
            steps.append((int(m.group(1)), os.path.join(root, entry)))
    for step, path in sorted(steps, reverse=True):
        if os.path.isfile(os.path.join(path, MANIFEST)):
            return path, step
        note(f"skipping checkpoint {path}: it is incomplete (no {MANIFEST}: its save did not finish)")
    return None


def _note_on_stderr(text: str) -> None:
    print(f"note: {text}", file=sys.stderr, flush=True)


def resume_checkpoint(root: str, or_start: bool = False, note: Callable[[str], None] | None = None
                      ) -> tuple[str, int] | None:
    """The checkpoint ``--resume`` continues from: the newest complete one in
    ``root`` (:func:`latest_checkpoint`; the newer incomplete ones it skips are
    noted). When there is none, a HetplanError saying what to do: starting from
    step 0 instead would retrain from scratch, and a job-scheduler restart would
    never notice a wrong ``--checkpoint-dir``. ``or_start``
    (``--resume-or-start``): None instead, the run starts from step 0."""
    skipped: list[str] = []
    found = latest_checkpoint(root, note=skipped.append)
    if found is not None or or_start:
        for text in skipped:
            (note or _note_on_stderr)(text)
        return found
    if not os.path.isdir(root):
        why = "it does not exist"
    elif skipped:
        why = (f"{len(skipped)} incomplete: no {MANIFEST}, {'its save' if len(skipped) == 1 else 'their saves'} "
               "did not finish")
    else:
        why = "it holds no step_N checkpoint"
    raise HetplanError(f"--resume: no complete checkpoint in {root} ({why}); drop --resume to start from step 0, "
                       "or use --resume-or-start, which starts from step 0 when there is none")
