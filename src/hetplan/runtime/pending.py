"""The step's global loss while its all-reduce is still running.

``train_step`` returns the global-batch mean loss on every rank. Summing it
over the replicas is a collective; issued blocking, it stops each rank's host
at the end of every step until the slowest rank has got there (on gloo the
host itself runs the all-reduce), which a plain DDP loop -- whose printed loss
is the rank's own -- never does. So the all-reduce is issued with
``async_op=True`` and the loss handed back as a :class:`PendingLoss`: a 0-dim
tensor that waits for the collective (and divides by the replica count) on its
first use -- ``float(loss)``, ``f"{loss:.4f}"``, ``loss.item()``,
``torch.stack(losses)``, any torch op -- and is a plain tensor to every such
use. The host runs on through clipping and the optimizer step meanwhile.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_map_only


class PendingLoss(torch.Tensor):
    """A 0-dim loss whose all-reduce is in flight: any use waits for it first
    (``settle``), and sees the plain tensor with the final value."""

    _value: torch.Tensor
    _work: Any
    _divisor: int

    @staticmethod
    def __new__(cls, value: torch.Tensor, work: Any, divisor: int) -> PendingLoss:
        loss = torch.Tensor._make_subclass(cls, value)
        loss._value, loss._work, loss._divisor = value, work, divisor
        return loss

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        args, kwargs = tree_map_only(PendingLoss, PendingLoss.settle, (args, kwargs or {}))
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    def settle(self) -> torch.Tensor:
        """Wait for the all-reduce (once), divide the sum into the mean; the plain tensor."""
        if self._work is not None:
            work, self._work = self._work, None
            work.wait()
            self._value.div_(self._divisor)
        return self._value


def mean_over(total: torch.Tensor, divisor: int) -> torch.Tensor:
    """``total`` summed over the default process group, divided by ``divisor``:
    a :class:`PendingLoss` where ``total`` is a plain tensor, else (a fake
    tensor of the memory replay, another subclass) waited for here."""
    work = dist.all_reduce(total, async_op=True)
    if type(total) is torch.Tensor:
        return PendingLoss(total, work, divisor)
    work.wait()
    return total / divisor
