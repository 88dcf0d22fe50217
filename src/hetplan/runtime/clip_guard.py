"""Stop PyTorch's own gradient clipping where it would be wrong.

``torch.nn.utils.clip_grad_norm_`` takes the norm of the gradients it is
given. Under pipeline parallelism each rank holds one stage, so every stage is
clipped by its own norm: a different update than one device makes, and no
error. Under tensor parallelism it mixes DTensors of several meshes and
raises. ``RuntimeContext.clip_grad_norm_`` takes the norm over the whole model
(all stages, shards and replicas; a tied weight once), which is right.

So while a context holds such a model, ``torch.nn.utils.clip_grad_norm_`` is
wrapped: given a parameter of that model it raises ``HetplanError`` naming the
right call; given anything else it is PyTorch's function unchanged. Under plain
data parallelism and ZeRO (one stage, no TP) FSDP2's DTensors make PyTorch's
function right, so those models are not guarded.
"""

from __future__ import annotations

import functools
from typing import Any, Iterable

import torch

from hetplan.errors import HetplanError

_guarded: dict[int, str] = {}  # id(parameter) -> why torch's clipping is wrong for it


def guard(parameters: Iterable[torch.nn.Parameter], why: str) -> None:
    """Make torch's clipping refuse these parameters (installs the wrapper once)."""
    _install()
    for p in parameters:
        _guarded[id(p)] = why


def release(parameters: Iterable[torch.nn.Parameter]) -> None:
    for p in parameters:
        _guarded.pop(id(p), None)


def _install() -> None:
    import torch.nn.utils as utils
    import torch.nn.utils.clip_grad as clip_grad

    if getattr(utils.clip_grad_norm_, "_hetplan_guard", False):
        return
    original = clip_grad.clip_grad_norm_

    @functools.wraps(original)
    def clip_grad_norm_(parameters: Any, max_norm: float, *args: Any, **kwargs: Any) -> torch.Tensor:
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        for p in params:
            why = _guarded.get(id(p))
            if why is not None:
                raise HetplanError(
                    f"torch.nn.utils.clip_grad_norm_ is wrong for this model ({why}); use "
                    "ctx.clip_grad_norm_(model, max_norm), which takes the norm over the whole model"
                )
        return original(params, max_norm, *args, **kwargs)

    clip_grad_norm_._hetplan_guard = True  # type: ignore[attr-defined]  # a marker torch does not declare
    utils.clip_grad_norm_ = clip_grad_norm_
    clip_grad.clip_grad_norm_ = clip_grad_norm_
