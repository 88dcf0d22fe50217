"""Pipelines whose stages differ in (dp, tp) or in how they split a micro-batch (Metis).

torch.distributed.pipelining connects stage k to stage k+1 one-to-one inside a
pipeline group, which needs every stage to have the same (dp, tp) and the same
samples per replica. A Metis plan breaks that: stage 0 may run 2 replicas
that take 3 and 1 samples of each micro-batch while stage 1 runs one replica
with tp=2. This executor does the re-splitting itself with point-to-point
messages on the world group:

* every micro-batch is a row range; replica ``r`` of stage ``j`` owns rows
  ``[o_r, o_r + b_r)`` of it (from the plan's ``dp_split``);
* forward: each sender replica sends every overlapping row range to the
  receiver replica that owns it. Inside a replica all TP ranks hold the same
  activation, so TP rank ``t'`` of the receiver gets it from TP rank
  ``t' mod tp_j`` of the sender (``tp_j``: the sender replica's degree, which
  may differ between replicas of a stage: ``Stage.replica_tp``);
* backward: the gradient of each row range goes back the same way; TP rank
  ``t`` of the sender gets it from TP rank ``t mod tp_{j+1}`` of the receiver
  (gradients of a TP-replicated input are equal on every TP rank);
* scaling: the last stage scales each micro-batch's mean loss by
  ``b_r * dp_L / B``; data parallelism then averages over ``dp`` of each
  stage, so the gradient a stage receives is scaled by ``dp_j / dp_{j+1}``:
  every stage's averaged gradient is then the gradient of the global-batch mean.

Schedules: GPipe (all forwards, then all backwards) and 1F1B (warm-up of
``pp - j - 1`` forwards, then one forward / one backward, then the remaining
backwards). Sends are asynchronous and receives blocking, in the schedule's
order, which cannot deadlock. Shapes are exchanged once (the first micro-batch
of the first step) and must then stay fixed, as with torch pipelining.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from hetplan.runtime import microbatch
from hetplan.runtime.parallelize import set_accumulating

_HEADER = 8  # ndim, dtype code, up to 6 dims
_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32]
_HEADER_TAG = 1 << 20


@dataclass(frozen=True)
class _Link:
    peer: int  # global rank
    lo: int  # rows of *my* replica's share (0-based within it)
    hi: int


def _overlap(a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int] | None:
    lo, hi = max(a[0], b[0]), min(a[1], b[1])
    return (lo, hi) if lo < hi else None


class HeteroPipeline:
    """Runs one rank's stage of a heterogeneous pipeline (see module doc)."""

    def __init__(self, layout: Any, position: Any, part: nn.Module, device: torch.device,
                 sync_modules: list[tuple[nn.Module, bool]]) -> None:
        self.layout = layout
        self.part = part
        self.device = device
        self.sync_modules = sync_modules
        j = self.stage = position.pp_index
        self.pp = layout.pp
        self.first, self.last = j == 0, j == layout.pp - 1
        mine = layout.sample_range(j, position.dp_index)
        self.rows = mine
        t = position.tp_index
        tp_mine = layout.replica_tp(j, position.dp_index)  # replicas of one stage may differ (runtime.mixed)
        self.recv_fwd: list[_Link] = []
        self.send_fwd: list[_Link] = []
        self.recv_bwd: list[_Link] = []
        self.send_bwd: list[_Link] = []
        if not self.first:
            prev = j - 1
            for r in range(layout.stage_dp(prev)):
                ov = _overlap(mine, layout.sample_range(prev, r))
                tp_prev = layout.replica_tp(prev, r)
                if ov:
                    ranks = layout.stage_mesh_ranks(prev)[r]
                    lo, hi = ov[0] - mine[0], ov[1] - mine[0]
                    self.recv_fwd.append(_Link(ranks[t % tp_prev], lo, hi))
                    for tt in range(tp_prev):  # input gradients to every TP rank of that replica fed by me
                        if tt % tp_mine == t:
                            self.send_bwd.append(_Link(ranks[tt], lo, hi))
        if not self.last:
            nxt = j + 1
            for r in range(layout.stage_dp(nxt)):
                ov = _overlap(mine, layout.sample_range(nxt, r))
                tp_next = layout.replica_tp(nxt, r)
                if ov:
                    ranks = layout.stage_mesh_ranks(nxt)[r]
                    lo, hi = ov[0] - mine[0], ov[1] - mine[0]
                    for tt in range(tp_next):
                        if tt % tp_mine == t:
                            self.send_fwd.append(_Link(ranks[tt], lo, hi))
                    self.recv_bwd.append(_Link(ranks[t % tp_next], lo, hi))
        self.grad_scale = 1.0 if self.last else layout.stage_dp(j) / layout.stage_dp(j + 1)
        self._in_meta: dict[int, tuple[tuple[int, ...], torch.dtype]] = {}
        self._headers_sent: set[int] = set()
        self._pending: list[Any] = []

    # --- messages ------------------------------------------------------------------------
    def _send(self, tensor: torch.Tensor, peer: int, tag: int) -> None:
        tensor = tensor.contiguous()
        self._pending.append((dist.isend(tensor, peer, tag=tag), tensor))

    def _send_header(self, tensor: torch.Tensor, peer: int) -> None:
        h = torch.zeros(_HEADER, dtype=torch.int64)
        h[0], h[1] = tensor.dim(), _DTYPES.index(tensor.dtype)
        h[2:2 + tensor.dim()] = torch.tensor(tensor.shape[:], dtype=torch.int64)
        self._send(h.to(self.device) if self.device.type != "cpu" else h, peer, _HEADER_TAG)

    def _recv_header(self, peer: int) -> tuple[tuple[int, ...], torch.dtype]:
        h = torch.zeros(_HEADER, dtype=torch.int64, device=self.device)
        dist.recv(h, peer, tag=_HEADER_TAG)
        h = h.cpu()
        ndim = int(h[0])
        return tuple(int(x) for x in h[2:2 + ndim]), _DTYPES[int(h[1])]

    def _recv(self, shape: tuple[int, ...], dtype: torch.dtype, peer: int, tag: int) -> torch.Tensor:
        buf = torch.empty(shape, dtype=dtype, device=self.device)
        dist.recv(buf, peer, tag=tag)
        return buf

    def _finish_sends(self) -> None:
        for work, _ in self._pending:
            work.wait()
        self._pending.clear()

    # --- one step ---------------------------------------------------------------------------
    def step(self, inputs: torch.Tensor | None, targets: torch.Tensor | None,
             loss_fn: Callable[[Any, torch.Tensor], torch.Tensor], scale: float, num_micro: int,
             schedule: str, model_inputs: dict[str, torch.Tensor] | None = None, keep_outputs: bool = True
             ) -> tuple[list[torch.Tensor], list[Any]]:
        """``model_inputs``: the model's keyword inputs, this replica's rows of
        each micro-batch after micro-batch (as ``inputs``), given to every stage.
        ``keep_outputs``: the last stage returns each micro-batch's output; off,
        none is held past its backward (a detached output keeps its storage: the
        logits of every micro-batch until the step ends)."""
        b = self.rows[1] - self.rows[0]
        saved: dict[int, tuple[torch.Tensor | None, Any]] = {}
        losses: list[torch.Tensor] = []
        outputs: list[Any] = []

        def forward(k: int) -> None:
            if self.first:
                assert inputs is not None
                x: torch.Tensor | None = inputs[k * b:(k + 1) * b]
                args = x
            else:
                pieces = []
                for link in self.recv_fwd:
                    if link.peer not in self._in_meta:
                        self._in_meta[link.peer] = self._recv_header(link.peer)
                    shape, dtype = self._in_meta[link.peer]
                    pieces.append(self._recv(shape, dtype, link.peer, 2 * k))
                x = torch.cat(pieces, 0) if len(pieces) > 1 else pieces[0]
                x.requires_grad_(x.is_floating_point())
                args = x
            with microbatch.forward(k):  # its own autocast region; dropout draws for its samples
                out = self.part(args, **{n: v[k * b:(k + 1) * b] for n, v in (model_inputs or {}).items()})
            if self.last:
                assert targets is not None
                with microbatch.autocast():
                    loss = loss_fn(out, targets[k * b:(k + 1) * b])
                if scale != 1.0:
                    loss = loss * scale
                losses.append(loss.detach())
                if keep_outputs:
                    outputs.append(out.detach() if isinstance(out, torch.Tensor) else out)
                saved[k] = (x if not self.first else None, loss)
            else:
                for link in self.send_fwd:
                    piece = out[link.lo:link.hi].detach()
                    if link.peer not in self._headers_sent:  # shapes travel once, then stay fixed
                        self._send_header(piece, link.peer)
                        self._headers_sent.add(link.peer)
                    self._send(piece, link.peer, 2 * k)
                saved[k] = (x if not self.first else None, out)

        def backward(k: int, last_backward: bool) -> None:
            x, out = saved.pop(k)
            set_accumulating(self.sync_modules, last_backward)
            if self.last:
                out.backward()
            else:
                grads = []
                for link in self.recv_bwd:
                    shape = (link.hi - link.lo, *out.shape[1:])
                    grads.append(self._recv(shape, out.dtype, link.peer, 2 * k + 1))
                grad = torch.cat(grads, 0) if len(grads) > 1 else grads[0]
                if self.grad_scale != 1.0:
                    grad = grad * self.grad_scale
                torch.autograd.backward(out, grad)
            if not self.first and x is not None:
                gx = x.grad if x.grad is not None else torch.zeros_like(x)
                for link in self.send_bwd:
                    self._send(gx[link.lo:link.hi], link.peer, 2 * k + 1)

        m = num_micro
        if schedule == "1f1b":
            warmup = min(self.pp - self.stage - 1, m)
            for k in range(warmup):
                forward(k)
            for k in range(m - warmup):
                forward(warmup + k)
                backward(k, k == m - 1)
            for k in range(m - warmup, m):
                backward(k, k == m - 1)
        else:
            for k in range(m):
                forward(k)
            for k in range(m):
                backward(k, k == m - 1)
        self._finish_sends()
        return losses, outputs
