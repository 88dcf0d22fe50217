"""Dropout whose masks do not depend on how a plan lays out the work.

A dropout mask drawn from a random generator depends on which process draws
it, in which order and on which shard: DP replicas seeded alike draw the same
mask for different samples, TP ranks draw for different slices, a pipeline
stage draws in schedule order, and none of it matches one process running
the whole batch. DTensor's RNG tracker (``OffsetBasedRNGTracker``) keeps TP
ranks consistent only for random ops on DTensors, refuses CPU devices on
torch 2.13, and cannot reproduce a plain single-process run.

So the keep decision of an element is a hash of its identity: (seed, step,
dropout site, global sample index in the step's global batch, then its global
index along every other dimension). Every rank computes the mask of its local
shard from the shard's global indices, so the same element gets the same
decision on one process and on any rank of any DP/TP/SP/PP plan, and ranks
holding a replicated activation draw identical masks, by construction. The
hash is lowbias32 (Chris Wellons' hash-prospector) on 32-bit values held in
int64 tensors, with every product kept below 2**63 (no overflow).

Who knows what: the runtime opens a *step scope* (seed, step, this replica's
global sample indices, rows per micro-batch) in ``train_step``, and each
micro-batch's forward selects its rows (:func:`micro_batch`); the reference
run opens a scope over the whole global batch. A :class:`Dropout` module knows
its site name (set by :func:`prepare` from the module path, the same in every
plan) and which of its dimensions tensor parallelism shards (``tp_dim``: e.g.
attention heads) or sequence parallelism shards (``sp_dim``); the runtime
tells it its TP rank (:func:`set_tp`). Activation checkpointing recomputes
under the scope captured at the forward (:func:`checkpoint_context`).

Outside any scope (evaluation in train mode, shape inference on meta
tensors) dropout falls back to ``torch.nn.functional.dropout``.
"""

from __future__ import annotations

import contextlib
import zlib
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from hetplan.errors import HetplanError

_M32 = 0xFFFFFFFF


# --- the hash ---------------------------------------------------------------------------------
def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for x < 2**32 in int64, without overflow: c is split
    into 16-bit halves, so no product exceeds 2**48."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _M32


def mix32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32: a bijective 32-bit integer hash with low bias (values in [0, 2**32))."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def site_key(seed: int, step: int, site: str) -> int:
    """32 bits naming one dropout call of one step (crc32: stable across processes and hash seeds)."""
    return zlib.crc32(f"{seed}:{step}:{site}".encode())


def keep_mask(p: float, key: int, indices: Sequence[torch.Tensor]) -> torch.Tensor:
    """Bool mask of shape (len(indices[0]), len(indices[1]), ...): element
    (i0, i1, ...) is kept unless the hash of (key, indices[0][i0],
    indices[1][i1], ...) falls below ``p * 2**32``. Indices are global ones
    (any non-negative int64 below 2**32), so a shard's mask is the slice of
    the full mask at its indices."""
    threshold = round(p * 2.0 ** 32)
    h = torch.tensor(key & _M32, dtype=torch.int64, device=indices[0].device)
    for idx in indices:
        h = mix32(h.unsqueeze(-1) ^ (idx.to(torch.int64) & _M32))
    return h >= threshold


# --- scopes: which samples the running forward holds ---------------------------------------------
@dataclass(frozen=True)
class Scope:
    """What a dropout call needs to know beyond its input: the seed, the
    training step, and the global index of each row of its input."""

    seed: int
    step: int
    samples: torch.Tensor  # int64, one global sample index per row


@dataclass(frozen=True)
class _StepScope:
    seed: int
    step: int
    samples: torch.Tensor  # this replica's samples of the step, micro-batch after micro-batch
    rows: int  # rows per micro-batch


_active: Scope | None = None
_step: _StepScope | None = None


def current() -> Scope | None:
    return _active


@contextlib.contextmanager
def _set(value: Scope | None) -> Iterator[None]:
    global _active
    saved, _active = _active, value
    try:
        yield
    finally:
        _active = saved


def scope(seed: int, step: int, samples: torch.Tensor | Sequence[int]) -> contextlib.AbstractContextManager[None]:
    """Dropout inside draws for rows that are these global samples (the reference: all of them)."""
    return _set(Scope(int(seed), int(step), torch.as_tensor(samples, dtype=torch.int64).cpu()))


@contextlib.contextmanager
def step_scope(seed: int, step: int, samples: Sequence[int], rows: int) -> Iterator[None]:
    """One ``train_step``: this replica's sample indices; :func:`micro_batch` picks each forward's rows."""
    global _step
    saved, _step = _step, _StepScope(int(seed), int(step), torch.as_tensor(list(samples), dtype=torch.int64), rows)
    try:
        yield
    finally:
        _step = saved


def micro_batch(k: int) -> contextlib.AbstractContextManager[None]:
    """The forward of micro-batch ``k`` of the open step (no step open: nothing changes)."""
    s = _step
    if s is None:
        return contextlib.nullcontext()
    return _set(Scope(s.seed, s.step, s.samples[k * s.rows:(k + 1) * s.rows]))


def checkpoint_context() -> tuple[contextlib.AbstractContextManager[None], contextlib.AbstractContextManager[None]]:
    """``context_fn`` for ``torch.utils.checkpoint``: the recomputation in
    backward runs under the scope of its forward (another micro-batch's may be
    open by then, or none), so it draws the same masks."""
    return contextlib.nullcontext(), _set(_active)


# --- dropout -------------------------------------------------------------------------------------
@torch.compiler.disable  # reads the scope (Python state): runs eagerly inside compiled layers
def dropout(x: torch.Tensor, p: float, site: str, offsets: Sequence[int] | None = None) -> torch.Tensor:
    """Layout-invariant dropout of ``x`` (training). Dim 0 holds the scope's
    samples; ``offsets[d]`` is where dim ``d + 1`` of this shard starts in the
    full activation (default 0: the dimension is whole). The mask is kept as
    bool (1 byte per element, as the cost model counts it)."""
    s = _active
    if s is None or x.device.type == "meta":
        return F.dropout(x, p, True)
    if p >= 1.0:
        return x.masked_fill(torch.ones((), dtype=torch.bool, device=x.device), 0.0)
    if x.size(0) != s.samples.numel():
        raise HetplanError(
            f"dropout {site!r} got a tensor of shape {tuple(x.shape)} whose first dimension is not the "
            f"{s.samples.numel()} samples of the micro-batch; layout-invariant dropout needs batch-first activations"
        )
    offsets = list(offsets or [])
    idx = [s.samples.to(x.device)]
    for d in range(1, x.dim()):
        start = offsets[d - 1] if d - 1 < len(offsets) else 0
        idx.append(torch.arange(start, start + x.size(d), device=x.device))
    keep = keep_mask(p, site_key(s.seed, s.step, site), idx)
    return x.masked_fill(~keep, 0.0) * (1.0 / (1.0 - p))


class Dropout(nn.Module):
    """Dropout with plan-independent masks (see the module doc).

    ``tp_dim``: the dimension tensor parallelism shards evenly at this site
    (attention probabilities: 1, the heads); ``sp_dim``: the one sequence
    parallelism shards (a block's output under SP: 1). Other dimensions must
    be whole on every rank (replicated activations). ``site`` is set by
    :func:`prepare`; ``tp_rank`` and ``sequence_parallel`` by :func:`set_tp`.
    """

    def __init__(self, p: float = 0.0, *, tp_dim: int | None = None, sp_dim: int | None = None) -> None:
        super().__init__()
        if not 0.0 <= p < 1.0:
            raise HetplanError(f"dropout probability {p} must be in [0, 1)")
        self.p = float(p)
        self.tp_dim, self.sp_dim = tp_dim, sp_dim
        self.site: str | None = None
        self.tp_rank: tuple[int, int] = (0, 1)  # (index, size) of this rank's TP group
        self.sequence_parallel = False

    @property
    def active(self) -> bool:
        return self.training and self.p > 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.active:
            return x
        return dropout(x, self.p, self._site(), self._offsets(x))

    def _site(self) -> str:
        if self.site is None and _active is not None:
            raise HetplanError("a hetplan Dropout has no site name: call hetplan.runtime.dropout.prepare(model) "
                               "on the whole model first (ctx.parallelize and train_reference do)")
        return self.site or ""

    def _offsets(self, x: torch.Tensor) -> list[int]:
        index, _size = self.tp_rank
        offsets = [0] * (x.dim() - 1)
        for dim in (self.tp_dim, self.sp_dim if self.sequence_parallel else None):
            if dim is not None and index:
                offsets[dim - 1] = index * x.size(dim)  # even shards (the TP checks ensure it)
        return offsets

    def extra_repr(self) -> str:
        return f"p={self.p}, tp_dim={self.tp_dim}, sp_dim={self.sp_dim}"


# --- preparing a model -----------------------------------------------------------------------------
class _PlanIndependentDropout(nn.Dropout):
    """What :func:`prepare` turns a plain ``nn.Dropout`` into (same state, same
    ``p``): rows are samples, every other dimension whole (flattened)."""

    _hetplan_site = ""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        if _active is None:
            return F.dropout(x, self.p, True, self.inplace)
        return dropout(x, self.p, self._hetplan_site)


def prepare(model: nn.Module) -> list[str]:
    """Name every dropout site by its module path (the same in every plan and
    the reference) and make plain ``nn.Dropout`` modules layout-invariant
    (their inputs must be batch-first with whole samples on every rank; under
    TP :func:`check_tensor_parallel` refuses them). Idempotent. Returns notes
    on the dropout hetplan leaves to torch's generator (other dropout classes,
    HF attention dropout): its masks depend on the plan."""
    notes = []
    for name, module in model.named_modules():
        if isinstance(module, Dropout):
            module.site = name
        elif type(module) in (nn.Dropout, _PlanIndependentDropout):
            module.__class__ = _PlanIndependentDropout  # a class swap survives deepcopy and pickling
            module._hetplan_site = name  # type: ignore[attr-defined]  # a marker torch does not declare
        elif isinstance(module, nn.modules.dropout._DropoutNd) and module.p > 0:
            notes.append(f"{name!r} ({type(module).__name__}, p={module.p}) draws from torch's generator: its masks "
                         "depend on the plan and --verify will differ; use nn.Dropout or hetplan.runtime.Dropout")
    attention = unmanaged_attention_dropout(model)
    return notes + ([attention] if attention else [])


def set_tp(model: nn.Module, index: int, size: int, sequence_parallel: bool) -> None:
    """Tell the Dropout modules of a tensor-parallel part where their shard lies."""
    for module in model.modules():
        if isinstance(module, Dropout):
            module.tp_rank = (index, size)
            module.sequence_parallel = sequence_parallel


def has_dropout(model: nn.Module) -> bool:
    """Whether ``model`` holds a dropout module that drops something."""
    return any(isinstance(m, (Dropout, nn.Dropout)) and m.p > 0 for m in model.modules())


def unsupported_under_tp(model: nn.Module, layer_tp: dict[str, int]) -> str:
    """The first dropout module hetplan cannot keep consistent under tensor
    parallelism, as one line ('' if none): a torch dropout module with p > 0
    in a stage with tp > 1 (its input may be a rank's slice, which hetplan
    cannot know). ``layer_tp``: layer name -> tp of its stage; a module outside
    every layer belongs to the one stage of a pp=1 plan."""
    if not layer_tp or max(layer_tp.values()) <= 1:
        return ""
    for name, module in model.named_modules():
        if not isinstance(module, nn.modules.dropout._DropoutNd) or module.p == 0:
            continue
        owner = [t for layer, t in layer_tp.items() if name == layer or name.startswith(layer + ".")]
        if (owner[0] if owner else max(layer_tp.values())) > 1:
            kind = "Dropout" if isinstance(module, _PlanIndependentDropout) else type(module).__name__
            return (f"{name!r} is a torch {kind}(p={module.p}) in a tensor-parallel stage: hetplan "
                    "cannot tell which slice of its input each TP rank holds, so its masks would differ from the "
                    "reference; set its p to 0, use hetplan.runtime.Dropout (declaring tp_dim/sp_dim), or use tp=1")
    return ""


def check_tensor_parallel(model: nn.Module, layer_tp: dict[str, int]) -> None:
    why = unsupported_under_tp(model, layer_tp)
    if why:
        raise HetplanError(why)


def unmanaged_attention_dropout(model: nn.Module) -> str:
    """A note for HF models whose attention dropout is a probability handed to
    the attention function (torch's generator, not reproducible here)."""
    config = getattr(model, "config", None)
    for key in ("attn_pdrop", "attention_dropout", "attention_probs_dropout_prob"):
        value = getattr(config, key, 0) or 0
        if isinstance(value, (int, float)) and value > 0:
            return (f"the model's attention dropout ({key}={value}) draws from torch's generator inside its attention "
                    "function: its masks depend on the plan and --verify will differ; set it to 0 for an exact run")
    return ""
