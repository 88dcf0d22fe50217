"""Counting what a training step asks of the device, on any device (CPU here).

A ``TorchDispatchMode`` sees every aten op the step runs (DTensor-level ops
included, FSDP2's own ops too), so two counts need no GPU: host syncs (ops
whose result the host must wait for) and the optimizer's kernel launches.
Workers for ``run_local`` live here as module-level functions.
"""

from __future__ import annotations

import collections
import json
import math
import os
from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode

# aten ops that copy a device value to the host (the host waits for the device there): ``.item()``,
# ``float(t)``, ``bool(t)`` and ``int(t)`` run ``_local_scalar_dense``; ``if t:`` runs ``is_nonzero``;
# ``torch.equal`` returns a Python bool (torch/_refs/__init__.py lists the same as data-dependent).
SYNC_OPS = frozenset({"aten._local_scalar_dense", "aten.item", "aten.is_nonzero", "aten.equal"})
# ops that launch no device kernel: the profiler's markers, and the optimizers' reads of their step
# counters, which torch keeps on the host unless capturable (torch/optim/adam.py, ``_get_value``).
NOT_LAUNCHES = frozenset({"profiler._record_function_enter_new", "profiler._record_function_exit",
                          "aten._local_scalar_dense", "aten.lift_fresh"})


class OpCounter(TorchDispatchMode):
    """Counts the aten ops run inside it, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))

    def syncs(self) -> dict[str, int]:
        return {op: n for op, n in self.ops.items() if op in SYNC_OPS}

    def launches(self) -> int:
        return sum(n for op, n in self.ops.items() if op not in NOT_LAUNCHES)


def write_plan(directory: str, plan: Any, precision: str) -> str:
    path = os.path.join(directory, f"plan-{precision}.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump({"plans": [{"plan": plan.to_dict()}], "settings": {"precision": precision}}, f)
    return path


def sync_count_worker(plan_path: str, calls_per_step: int) -> list[dict[str, int]]:
    """Three optimizer steps of the plan's built-in model, each of
    ``calls_per_step`` ``train_step`` calls (accumulation) and then clipping on
    the second step, off on the third; the host syncs of each step's
    ``train_step`` calls and clipping (the first step's chain check aside), and
    under the key ``"blocking all_reduce"`` the ``dist.all_reduce`` calls there
    that the host waits for (not ``async_op``)."""
    import torch.distributed as dist

    from hetplan.runtime.context import init
    from hetplan.runtime.models import build_preset_model, cross_entropy_loss
    from hetplan.runtime.reference import make_optimizer, synthetic_batch

    blocking = [0]
    all_reduce = dist.all_reduce

    def counting(*args: Any, **kwargs: Any) -> Any:
        blocking[0] += not kwargs.get("async_op", False)
        return all_reduce(*args, **kwargs)

    ctx = init(plan_path)
    spec = ctx.spec
    model = ctx.parallelize(lambda: build_preset_model(spec))
    opt = ctx.optimizer(model, make_optimizer, name="adamw")
    counts, losses = [], []
    dist.all_reduce = counting
    try:
        for step, clip in enumerate((True, True, False)):
            x, y = synthetic_batch(spec.vocab_size, spec.seq_len, ctx.plan.global_batch_size, step)
            blocking[0] = 0
            with OpCounter() as counter:
                for _ in range(calls_per_step):
                    losses.append(ctx.train_step(model, (x, y), cross_entropy_loss, return_outputs=False))
                if clip:
                    ctx.clip_grad_norm_(model, 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            counts.append({**counter.syncs(), "blocking all_reduce": blocking[0]})
    finally:
        dist.all_reduce = all_reduce
    assert all(math.isfinite(float(v)) for v in losses)  # read after counting
    ctx.close()
    return counts


def tied_sync_worker(plan_path: str, pair_counts: tuple[int, ...]) -> dict[int, dict[str, Any]]:
    """``sync_tied_grads`` on a pp2 plan's ranks, for stand-in models whose two
    tied layers (the plan's embedding and head) hold ``pairs`` weights tied
    across the stages, gradients ``rank + 1 + i``: per ``pairs``, the
    all-reduce calls and this rank's gradients after the sync."""
    from types import SimpleNamespace

    import torch
    import torch.distributed as dist
    from torch import nn

    from hetplan.plan.layout import tied_layer_groups
    from hetplan.runtime.context import init
    from hetplan.runtime.step import sync_tied_grads

    ctx = init(plan_path)
    first, last = tied_layer_groups(ctx.spec)[0]
    mine = first if ctx.layout.pp_index_of_layer(first) == ctx.position.pp_index else last
    calls = [0]
    all_reduce = dist.all_reduce

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return all_reduce(*args, **kwargs)

    out = {}
    for pairs in pair_counts:
        model = nn.Module()
        for layer in (first, last):
            holder = nn.Module()
            for i in range(pairs):
                holder.register_parameter(f"w{i}", nn.Parameter(torch.zeros(3, 2)))
                holder.get_parameter(f"w{i}").grad = torch.full((3, 2), float(ctx.rank + 1 + i))
            model.add_module(layer, holder)
        info = SimpleNamespace(tied_pairs=[(f"{first}.w{i}", f"{last}.w{i}") for i in range(pairs)])
        calls[0] = 0
        dist.all_reduce = counting
        try:
            sync_tied_grads(ctx, model, info)
        finally:
            dist.all_reduce = all_reduce
        out[pairs] = {"calls": calls[0],
                      "grads": [model.get_parameter(f"{mine}.w{i}").grad.tolist() for i in range(pairs)]}
    ctx.close()
    return out
