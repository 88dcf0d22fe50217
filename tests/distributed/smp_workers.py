"""Workers for tests/distributed/test_smp_train.py: train a tests/smp_models.py model under a plan.

Module-level functions of an importable module (hetplan.runtime.launch.run_local forks them).
"""

from __future__ import annotations

import os
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

STEPS = 3
GBS = 8
LR = 0.05


def _model(name: str) -> Any:
    import smp_models

    builder = smp_models.encdec_two_inputs if name == "encdec_two_inputs" else smp_models.BUILDERS[name]
    return builder()[0]


def _data(name: str, step: int) -> tuple[Any, Any, dict[str, Any]]:
    """(inputs, targets, keyword inputs): the two-input model takes the target tokens as ``tgt``."""
    import smp_models

    if name != "encdec_two_inputs":
        return (*smp_models.batch(name, GBS, step), {})
    x, y = smp_models.batch("encdec", GBS, step)
    return x[:, :smp_models.SRC], y, {"tgt": x[:, smp_models.SRC:]}


def _loss(name: str) -> Any:
    import smp_models

    return smp_models.LOSSES["encdec" if name == "encdec_two_inputs" else name]


def train_worker(plan: Any, spec: Any, name: str) -> dict[str, Any]:
    """Train ``name`` under ``plan`` through the Python API; rank 0 returns losses and the full state."""
    import torch

    from hetplan.runtime.context import init

    ctx = init(plan, spec)
    model = ctx.parallelize(lambda: _model(name), seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9, foreach=False)
    losses = []
    for step in range(STEPS):
        opt.zero_grad()
        x, y, kw = _data(name, step)
        losses.append(float(ctx.train_step(model, (x, y), _loss(name), inputs=kw or None)))
        opt.step()
    state = ctx.full_state_dict(model)
    ctx.close()
    return {"losses": losses, "state": state}


def reference(name: str) -> tuple[list[float], dict[str, Any]]:
    """Plain single-process PyTorch on the whole batches, from the runtime's initial values."""
    import torch

    from hetplan.runtime.reference import build_reference

    model = build_reference(lambda: _model(name), 0)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9, foreach=False)
    losses = []
    for step in range(STEPS):
        x, y, kw = _data(name, step)
        opt.zero_grad()
        loss = _loss(name)(model(x, **kw), y)
        loss.backward()
        opt.step()
        losses.append(float(loss))
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}
