"""What each micro-batch's forward runs under: its own autocast region and its dropout scope.

State that lives across the micro-batches of a step must not outlive what it
was made from. The one that did is autocast's cache of low-precision weight
copies: ``torch.autocast`` keeps the bf16/fp16 copy of every weight it casts
until the outermost autocast region exits (PyTorch 2.13,
``torch/amp/autocast_mode.py``, ``__exit__`` clears the cache only at nesting
level 0). One region around all micro-batches of a step therefore reuses the
first micro-batch's copies -- and their autograd edges -- after FSDP2 has
resharded and regathered the weights in between: with data parallelism and two
or more micro-batches, mixed precision trained wrong gradients (1e-2 off after
two steps on a tiny Llama). So every micro-batch's forward (and its loss) runs
in a region of its own, opened here, with the cache off (``cache_enabled=False``)
so that a region a user opened around ``train_step`` cannot keep copies alive
either. Each forward casts each weight once either way, so nothing is lost.

Everything else a forward keeps across micro-batches was audited: dropout
masks are drawn per micro-batch (:mod:`hetplan.runtime.dropout`, opened
here too); FSDP's gradient-sync and reshard flags are set before each
micro-batch's backward (``parallelize.set_accumulating``); HF models train
with their KV cache off (``parallelize.apply_recompute``); the fp16 loss scale
changes only between steps.

The three places that run a micro-batch's forward use this module: the
one-stage loop (``step.forward_backward``), torch pipelining's
stages (:func:`wrap_stage`) and the heterogeneous executor
(:mod:`hetplan.runtime.hetero`).
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterator

import torch

from hetplan.runtime import dropout
from hetplan.runtime.precision import DTYPES

_autocast: tuple[str, torch.dtype] | None = None  # (device type, dtype) of the open step; None: fp32


@contextlib.contextmanager
def step(device: torch.device, precision: str) -> Iterator[None]:
    """One ``train_step`` in ``precision``: forwards opened by :func:`forward` autocast to it."""
    global _autocast
    dtype = DTYPES[precision]
    saved, _autocast = _autocast, (device.type, dtype) if dtype is not None else None
    try:
        yield
    finally:
        _autocast = saved


def autocast() -> contextlib.AbstractContextManager[Any]:
    """A fresh autocast region of the open step's precision, its weight cache off (module doc)."""
    if _autocast is None:
        return contextlib.nullcontext()
    device_type, dtype = _autocast
    return torch.autocast(device_type=device_type, dtype=dtype, cache_enabled=False)


@contextlib.contextmanager
def forward(k: int) -> Iterator[None]:
    """The forward of micro-batch ``k``: its own autocast region and its dropout rows."""
    with autocast(), dropout.micro_batch(k):
        yield


def loss(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``fn`` run in an autocast region of its own (a loss computed outside the forward's)."""
    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> torch.Tensor:
        with autocast():
            return fn(*args, **kwargs)

    return run


def wrap_stage(stage: Any) -> None:
    """A ``torch.distributed.pipelining`` stage runs each micro-batch's forward under :func:`forward`."""
    inner = stage.forward_one_chunk

    @functools.wraps(inner)
    def forward_one_chunk(fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        with forward(fwd_chunk_id):
            return inner(fwd_chunk_id, *args, **kwargs)

    stage.forward_one_chunk = forward_one_chunk
