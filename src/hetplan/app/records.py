"""What the commands write: a ranked plan as the plan-file record (``--json``,
``-o``), and the files themselves, each said with one ``wrote PATH`` line.

A plan-file entry is ``RankedPlan.to_dict`` plus each GPU's peak memory by
category and the time (and cost) to train, so a plan file read back
(``hetplan.plan.file``) carries what the tables showed."""

from __future__ import annotations

import json
from typing import Any

from hetplan.app.training import training_numbers
from hetplan.cost.model import CostModel
from hetplan.errors import HetplanError
from hetplan.io.userfiles import write_target
from hetplan.plan.spec import RankedPlan


def ranked_record(ranked: RankedPlan, cost_model: CostModel, tokens: float | None,
                  prices: dict[str, float] | None) -> dict[str, Any]:
    """A ranked plan as JSON, with each GPU's peak memory by category
    (``memory_breakdown_bytes``: params, grads, optimizer, activations, buffers)
    and the time (and cost) to train ``tokens`` (``training``: app/training.py)."""
    data = ranked.to_dict()
    data["estimate"]["memory_breakdown_bytes"] = {str(d): parts for d, parts in
                                                  sorted(cost_model.memory_breakdown(ranked.plan).items())}
    w = cost_model.workload
    data["training"] = training_numbers(ranked.plan, ranked.estimate, w.cluster, w.model.seq_len, tokens, prices)
    return data


def write_json(path: str | None, data: Any) -> None:
    """``data`` as indented JSON at ``path`` (nothing without a path)."""
    if not path:
        return
    write_text(path, json.dumps(data, indent=2))


def write_text(path: str, text: str) -> None:
    """``text`` at ``path``; a file that cannot be written is one HetplanError line."""
    shown = write_target(path)
    try:
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
    except OSError as exc:
        raise HetplanError(f"cannot write {path}: {exc.strerror}") from None
    print(f"wrote {shown}")
