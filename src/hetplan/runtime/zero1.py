"""ZeRO-1: optimizer states sharded over the data-parallel group, weights and
gradients whole (Rajbhandari et al. 2020, §5.1 "P_os").

FSDP2 has no ZeRO-1 (``fully_shard`` always shards gradients and, between
steps, weights), so a ZeRO-1 layer runs under ``replicate`` (whole weights,
gradients all-reduced) and this optimizer shards what remains: each dp rank
keeps the optimizer states of one contiguous 1/dp slice of every ZeRO-1
parameter (flattened, its TP-local tensor), updates only that slice, and the
updated slices are all-gathered back into the whole parameter -- the
all-reduce + all-gather of ZeRO-1 that the cost model charges
(``cost.stage.zero12_gradient_collective``). Parameters of other layers go to
the wrapped optimizer unchanged. Get one with ``ctx.optimizer(cls, **kwargs)``.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn


def _local(p: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return p.to_local() if isinstance(p, DTensor) else p


class _Slice:
    """One ZeRO-1 parameter: this rank's slice ``[start, stop)`` of its flat local tensor."""

    def __init__(self, param: nn.Parameter, group: Any) -> None:
        self.param, self.group = param, group
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        self.size = size
        flat = _local(param).detach().reshape(-1)
        self.numel = flat.numel()
        self.chunk = math.ceil(self.numel / size)
        self.start, self.stop = min(rank * self.chunk, self.numel), min((rank + 1) * self.chunk, self.numel)
        self.shard = flat[self.start:self.stop].clone()  # what the inner optimizer updates

    def take_grad(self) -> None:
        grad = self.param.grad
        self.shard.grad = None if grad is None else _local(grad).reshape(-1)[self.start:self.stop]

    def padded(self) -> torch.Tensor:
        """This rank's updated slice, zero-padded to the common chunk length."""
        padded = torch.zeros(self.chunk, dtype=self.shard.dtype, device=self.shard.device)
        padded[:self.stop - self.start] = self.shard.detach()
        return padded

    def assign(self, parts: list[torch.Tensor]) -> None:
        """The whole (local) parameter from every rank's padded slice, in rank order."""
        with torch.no_grad():
            _local(self.param).view(-1).copy_(torch.cat(parts)[:self.numel])


def gather_slices(slices: list[_Slice]) -> None:
    """Every rank's updated slices back into the whole parameters: one
    all-gather per (group, dtype, device) of all its slices laid end to end,
    as the cost model charges one all-gather of the stage's bytes (a
    collective per parameter pays the group's latency once per tensor, which
    on gloo costs more than the bytes)."""
    buckets: dict[tuple[int, torch.dtype, torch.device], list[_Slice]] = {}
    for s in slices:
        buckets.setdefault((id(s.group), s.shard.dtype, s.shard.device), []).append(s)
    for bucket in buckets.values():
        group, size = bucket[0].group, bucket[0].size
        mine = torch.cat([s.padded() for s in bucket])
        gathered = torch.empty(size * mine.numel(), dtype=mine.dtype, device=mine.device)
        dist.all_gather_into_tensor(gathered, mine, group=group)
        per_rank = gathered.view(size, mine.numel())
        offset = 0
        for s in bucket:
            s.assign([per_rank[r, offset:offset + s.chunk] for r in range(size)])
            offset += s.chunk


class Zero1Optimizer(torch.optim.Optimizer):
    """``cls`` over this rank's slices of the ZeRO-1 parameters and the whole
    other parameters; ``param_groups`` and ``state`` are the inner optimizer's
    (so learning-rate schedulers work). The super constructor is not called:
    the inner optimizer owns the groups."""

    def __init__(self, params: Iterable[nn.Parameter], zero1: set[int], group: Any,
                 cls: Callable[..., torch.optim.Optimizer], groups: dict[int, Any] | None = None,
                 **kwargs: Any) -> None:
        """``groups``: parameter id -> the group its states are sharded over, where
        not ``group`` (expert-parallel experts: the ranks holding the same experts)."""
        params = list(dict.fromkeys(params))
        self.group = group
        self.slices = [_Slice(p, (groups or {}).get(id(p), group)) for p in params if id(p) in zero1]
        others = [p for p in params if id(p) not in zero1]
        self.inner = cls([s.shard for s in self.slices] + others, **kwargs)
        self.param_groups = self.inner.param_groups
        self.defaults = self.inner.defaults
        self.state = self.inner.state
        self._model_params = params
        self._optimizer_step_pre_hooks: dict[int, Any] = {}
        self._optimizer_step_post_hooks: dict[int, Any] = {}

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]  # Optimizer.step, narrowed
        for s in self.slices:
            s.take_grad()
        loss = self.inner.step(closure)
        gather_slices(self.slices)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self._model_params:
            if p.grad is not None:
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.zero_()
        for s in self.slices:
            s.shard.grad = None

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.inner.load_state_dict(state_dict)
