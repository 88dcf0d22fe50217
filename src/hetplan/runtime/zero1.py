"""ZeRO-1: optimizer states sharded over the data-parallel group, weights and
gradients whole (Rajbhandari et al. 2020, §5.1 "P_os").

FSDP2 has no ZeRO-1 (``fully_shard`` always shards gradients and, between
steps, weights), so a ZeRO-1 layer runs under ``replicate`` (whole weights,
gradients all-reduced) and this optimizer shards what remains: each dp rank
keeps the optimizer states of one contiguous 1/dp slice of every ZeRO-1
parameter (flattened, its TP-local tensor), updates only that slice (in place, in
the buffer the all-gather sends), and the updated slices are all-gathered
back into the whole parameter, each element copied once -- the
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
        self.numel = _local(param).numel()
        self.chunk = math.ceil(self.numel / size)
        self.start, self.stop = min(rank * self.chunk, self.numel), min((rank + 1) * self.chunk, self.numel)
        self.shard = torch.empty(0)  # what the inner optimizer updates: a view into its bucket's send buffer
        self.offset = 0  # where its chunk starts in that buffer (and in each rank's row of the gathered one)

    def take_grad(self) -> None:
        grad = self.param.grad
        self.shard.grad = None if grad is None else _local(grad).reshape(-1)[self.start:self.stop]

    def pieces(self, per_rank: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(parts of the flat local parameter, every rank's updated slice of it
        in the gathered ``per_rank`` rows): the copies that put it back together."""
        flat = _local(self.param).detach().view(-1)
        into, out = [], []
        for r in range(self.size):
            lo, hi = min(r * self.chunk, self.numel), min((r + 1) * self.chunk, self.numel)
            if hi > lo:
                into.append(flat[lo:hi])
                out.append(per_rank[r, self.offset:self.offset + hi - lo])
        return into, out


class _Bucket:
    """The ZeRO-1 parameters of one (group, dtype, device): their slices laid
    end to end, each zero-padded to its chunk length, in one send buffer the
    inner optimizer updates in place (its shards are views into it), so the
    all-gather sends it as it is, with no copy into a staging buffer."""

    def __init__(self, slices: list[_Slice]) -> None:
        self.slices, self.group, self.size = slices, slices[0].group, slices[0].size
        first = _local(slices[0].param)
        self.send = torch.zeros(sum(s.chunk for s in slices), dtype=first.dtype, device=first.device)
        offset = 0
        for s in slices:
            s.offset = offset
            s.shard = self.send[offset:offset + s.stop - s.start]
            s.shard.copy_(_local(s.param).detach().reshape(-1)[s.start:s.stop])
            offset += s.chunk

    def gather(self) -> None:
        """Every rank's updated slices back into the whole parameters: one
        all-gather, then each parameter element copied once (a grouped copy)."""
        gathered = torch.empty(self.size * self.send.numel(), dtype=self.send.dtype, device=self.send.device)
        dist.all_gather_into_tensor(gathered, self.send, group=self.group)
        per_rank = gathered.view(self.size, self.send.numel())
        into, out = [], []
        for s in self.slices:
            a, b = s.pieces(per_rank)
            into += a
            out += b
        with torch.no_grad():
            torch._foreach_copy_(into, out)


def buckets_of(slices: list[_Slice]) -> list[_Bucket]:
    """The slices bucketed by (group, dtype, device): one all-gather each, as
    the cost model charges one all-gather of the stage's bytes (a collective
    per parameter pays the group's latency once per tensor, which on gloo
    costs more than the bytes)."""
    groups: dict[tuple[int, torch.dtype, torch.device], list[_Slice]] = {}
    for s in slices:
        p = _local(s.param)
        groups.setdefault((id(s.group), p.dtype, p.device), []).append(s)
    return [_Bucket(group) for group in groups.values()]


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
        self.buckets = buckets_of(self.slices)  # sets each slice's shard
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
        for bucket in self.buckets:
            bucket.gather()
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
