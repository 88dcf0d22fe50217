"""Context parallelism: each rank holds a chunk of every sequence (Llama 3 §3.3.2).

The all-gather form of Llama 3 (Dubey et al. 2024, §3.3.2): every CP rank
keeps a chunk of each sample's tokens, all-gathers the keys and values of the
whole sequence over its CP group and computes attention of its own queries
against all of them, masked by the queries' and keys' *global* positions.
Causal attention makes the late tokens costlier, so the sequence is cut into
``2 * cp`` chunks and rank ``c`` takes chunks ``c`` and ``2 * cp - 1 - c``
(load-balanced "zigzag" split, as Llama 3 and Megatron-Core do).

PyTorch's own API (``torch.distributed.tensor.experimental.context_parallel``)
does not run on CPU with torch 2.13: the CPU SDPA kernel
(``aten._scaled_dot_product_flash_attention_for_cpu``) has no sharding
strategy (torch raises for it; probed on gloo, see docs/runtime.md), so the
runtime uses this form on every device: plain ``torch.distributed``
collectives, the same code on gloo and NCCL.

The all-gather is autograd-aware (``_GatherSequence``): its backward sums the
key/value gradients of all CP ranks into each rank's chunk (a reduce-scatter). Each rank's loss is the
mean over its own tokens; chunks are equal, so the mean over the CP group is
the sequence mean, and dense gradients are averaged over ``dp * cp``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from hetplan.errors import HetplanError


def zigzag_positions(seq_len: int, cp: int, rank: int) -> torch.Tensor:
    """Global positions of CP rank ``rank``'s tokens: chunks ``rank`` and
    ``2*cp - 1 - rank`` of ``2*cp`` equal chunks, in order."""
    check_sequence(seq_len, cp)
    size = seq_len // (2 * cp)
    first = torch.arange(rank * size, (rank + 1) * size)
    second = torch.arange((2 * cp - 1 - rank) * size, (2 * cp - rank) * size)
    return torch.cat([first, second])


def check_sequence(seq_len: int, cp: int) -> None:
    if seq_len % (2 * cp):
        raise HetplanError(f"context parallelism cuts the sequence of {seq_len} tokens into 2 x cp = {2 * cp} "
                           f"equal chunks; use a cp with 2 x cp dividing {seq_len}")


def causal_mask(q_positions: torch.Tensor, k_positions: torch.Tensor) -> torch.Tensor:
    """True where a query may attend to a key: the key is not later than the query."""
    return q_positions[:, None] >= k_positions[None, :]


@dataclass
class ContextShard:
    """This rank's place in its CP group (what a model with CP support is given)."""

    group: Any  # the CP process group (ranks sharing one sample's sequence, same TP rank)
    rank: int
    size: int

    def positions(self, local_len: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """Global positions of this rank's ``local_len`` tokens."""
        return zigzag_positions(local_len * self.size, self.size, self.rank).to(device)

    def all_positions(self, local_len: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """Global positions of the gathered keys (rank 0's chunk, then rank 1's, ...)."""
        seq = local_len * self.size
        return torch.cat([zigzag_positions(seq, self.size, r) for r in range(self.size)]).to(device)

    def gather(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        """All CP ranks' chunks of ``t`` concatenated along ``dim`` (autograd-aware)."""
        return _GatherSequence.apply(t, self.group, dim)

    def split(self, t: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's tokens of a whole-sequence tensor (token ids, targets)."""
        index = zigzag_positions(t.size(dim), self.size, self.rank).to(t.device)
        return t.index_select(dim, index)


class _GatherSequence(torch.autograd.Function):
    """All-gather along ``dim`` over a CP group; the backward sums every rank's
    gradient of the whole tensor and keeps this rank's chunk (a reduce-scatter:
    ``reduce_scatter_tensor`` on NCCL; on gloo, which has none, an all-reduce
    and a slice). torch 2.13's ``torch.distributed.nn.functional.all_gather``
    is not used: on gloo its backward scatters from *group* ranks taken as
    global ranks (fails for a CP group such as {0, 2} under TP) and fills
    strided buffers in the wrong order (wrong gradients, no error); measured,
    see docs/runtime.md."""

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, group: Any, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        t = t.contiguous()
        parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, t, group=group)
        return torch.cat(parts, dim=dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        size, rank = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        chunks = [c.contiguous() for c in grad.chunk(size, dim=ctx.dim)]
        if dist.get_backend(ctx.group) == dist.Backend.NCCL:
            out = torch.empty_like(chunks[rank])
            dist.reduce_scatter(out, chunks, group=ctx.group)
            return out, None, None
        whole = torch.stack(chunks)
        dist.all_reduce(whole, group=ctx.group)
        return whole[rank], None, None


def context_parallel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shard: ContextShard,
                               rope: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
                               ) -> torch.Tensor:
    """Causal attention of this rank's queries against the whole sequence's keys
    and values; (batch, heads, local seq, head_dim) each, rotary positions from
    the global positions. Grouped-query K/V are gathered before being repeated."""
    s = q.size(2)
    pos = shard.positions(s, q.device)
    if rope is not None:
        q, k = rope(q, pos), rope(k, pos)
    k, v = shard.gather(k, 2), shard.gather(v, 2)
    if k.size(1) != q.size(1):
        rep = q.size(1) // k.size(1)
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    mask = causal_mask(pos, shard.all_positions(s, q.device))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
