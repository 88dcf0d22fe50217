"""hetplan.runtime: train a model the way a Plan says, on PyTorch's own pieces.

DeviceMesh, DTensor tensor parallelism, FSDP2 (``fully_shard``/``replicate``),
``torch.distributed.pipelining`` schedules, activation checkpointing and
torch.distributed.checkpoint; launched by torchrun (gloo on CPU, NCCL on GPUs).
See docs/runtime.md. Importing this package does not import torch; the names
below load on first use::

    import hetplan.runtime as hr
    ctx = hr.init("plan.json")
    model = ctx.parallelize(build_model)
    loss = ctx.train_step(model, (inputs, targets), loss_fn)
"""

from __future__ import annotations

from typing import Any

from hetplan.errors import HetplanError

_LAZY = {
    "init": ("hetplan.runtime.context", "init"),
    "RuntimeContext": ("hetplan.runtime.context", "RuntimeContext"),
    "register_tp_plan": ("hetplan.runtime.tp", "register_tp_plan"),
    "unregister_tp_plan": ("hetplan.runtime.tp", "unregister_tp_plan"),
    "register_selective_recompute": ("hetplan.runtime.tp", "register_selective_recompute"),
    "TPSettings": ("hetplan.runtime.tp", "TPSettings"),
    "hf_tp_plan": ("hetplan.runtime.tp", "hf_tp_plan"),
    "PlanLayout": ("hetplan.plan.layout", "PlanLayout"),
    "PlanNotSupportedError": ("hetplan.plan.layout", "PlanNotSupportedError"),
    "PipelinePart": ("hetplan.runtime.parallelize", "PipelinePart"),
    "GPT": ("hetplan.runtime.models", "GPT"),
    "GPTConfig": ("hetplan.runtime.models", "GPTConfig"),
    "Dropout": ("hetplan.runtime.dropout", "Dropout"),
    "build_preset_model": ("hetplan.runtime.models", "build_preset_model"),
    "cross_entropy_loss": ("hetplan.runtime.models", "cross_entropy_loss"),
    "build_reference": ("hetplan.runtime.reference", "build_reference"),
    "train_reference": ("hetplan.runtime.reference", "train_reference"),
    "synthetic_batch": ("hetplan.runtime.reference", "synthetic_batch"),
    "latest_checkpoint": ("hetplan.runtime.checkpoint_dirs", "latest_checkpoint"),
    "checkpoint_dir": ("hetplan.runtime.checkpoint_dirs", "checkpoint_dir"),
    "run_local": ("hetplan.runtime.launch", "run_local"),
}

__all__ = ["HetplanError", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        value = getattr(importlib.import_module(module), attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'hetplan.runtime' has no attribute {name!r}")
