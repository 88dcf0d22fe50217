"""Built-in PyTorch models for the runtime: a GPT/Llama-style decoder.

The module names match the ModelSpec layer names of hetplan's decoder presets
(``embed``, ``layers.0`` .. ``layers.N-1``, ``head``), so a Plan's pipeline
split is a list of module names of this model. Every layer takes one tensor and
returns one tensor, so a pipeline stage is just its layers run in order.

One class covers the decoder families of the papers:

* GPT-2/GPT-3: learned positions, LayerNorm, GELU MLP, biases, LM head tied to
  the token embedding (``GPTConfig()`` defaults);
* Llama-style: RMSNorm, SwiGLU MLP, rotary positions, no biases, grouped-query
  attention (``norm="rms", mlp="swiglu", positions="rope", bias=False, kv_heads=...``);
* GShard-style mixture of experts (``num_experts``, ``top_k``, ``moe_layers``):
  the MLP of the listed blocks is a router and ``num_experts`` expert MLPs
  (:class:`MoE`), dropless.

Context parallelism (hetplan.runtime.cp) and expert parallelism are switched
on by the runtime through :meth:`GPT.set_context_parallel` and the MoE
modules' ``ep_group``; without them the model is the plain single-process one.

Query, key and value are separate linears (not one fused QKV matrix) so that
column-wise tensor parallelism splits each of them by heads. Attention reshapes
with ``-1`` heads, so the same code runs the local heads of a TP shard.
Dropout (``GPTConfig.dropout``, default 0) sits where GPT-2 has it -- the
embedding output, the attention probabilities, the attention and MLP outputs --
and draws plan-independent masks (hetplan.runtime.dropout), so a run under any
plan still matches the single-process one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hetplan.errors import HetplanError
from hetplan.model.spec import ModelSpec
from hetplan.runtime.cp import context_parallel_attention
from hetplan.runtime.dropout import Dropout
from hetplan.runtime.ep import expert_tp_input, expert_tp_output, local_tensor, moe_dispatch_combine
from hetplan.plan.support import moe_sequence_parallel
from hetplan.runtime.tp import TPSettings, register_selective_recompute, register_tp_plan


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256
    seq_len: int = 32
    hidden: int = 64
    heads: int = 4
    num_layers: int = 4
    ffn: int = 0  # 0 = 4 * hidden
    kv_heads: int = 0  # 0 = heads
    norm: str = "layer"  # "layer" or "rms"
    mlp: str = "gelu"  # "gelu", "relu" or "swiglu"
    positions: str = "learned"  # "learned", "rope" or "none"
    bias: bool = True
    tied_embeddings: bool = True
    norm_eps: float = 1e-5
    dropout: float = 0.0  # GPT-2's four sites (hetplan.runtime.dropout: plan-independent masks)
    num_experts: int = 0  # > 0: the blocks in moe_layers have a mixture-of-experts MLP
    top_k: int = 2
    expert_ffn: int = 0  # 0 = ffn_size
    moe_layers: tuple[int, ...] = ()

    @property
    def ffn_size(self) -> int:
        return self.ffn or 4 * self.hidden

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads or self.heads

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def check(self) -> None:
        if self.hidden % self.heads:
            raise HetplanError(f"hidden size {self.hidden} is not a multiple of {self.heads} heads")
        if self.heads % self.num_kv_heads:
            raise HetplanError(f"{self.heads} heads are not a multiple of {self.num_kv_heads} key/value heads")
        if self.positions == "rope" and self.head_dim % 2:
            raise HetplanError("rotary positions need an even head dimension")
        if not 0.0 <= self.dropout < 1.0:
            raise HetplanError(f"dropout {self.dropout} must be at least 0 and below 1")
        if self.moe_layers and not 1 <= self.top_k <= self.num_experts:
            raise HetplanError(f"top_k={self.top_k} must be between 1 and num_experts={self.num_experts}")


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.size(-1),), self.weight, self.eps)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


def _norm(cfg: GPTConfig) -> nn.Module:
    return RMSNorm(cfg.hidden, cfg.norm_eps) if cfg.norm == "rms" else nn.LayerNorm(cfg.hidden, eps=cfg.norm_eps)


class Embed(nn.Module):
    """Token embedding (+ learned positions)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab_size, cfg.hidden)
        self.pos = nn.Embedding(cfg.seq_len, cfg.hidden) if cfg.positions == "learned" else None
        self.context_shard: Any = None  # set by GPT.set_context_parallel: this rank's sequence positions
        self.drop = Dropout(cfg.dropout)  # whole sequence and width on every TP rank

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx)
        if self.pos is not None:
            x = x + self.pos(_positions(self.context_shard, idx.size(1), idx.device))
        return self.drop(x)


def _positions(shard: Any, length: int, device: torch.device) -> torch.Tensor:
    """Global sequence positions of the ``length`` local tokens (all of them without CP)."""
    if shard is None:
        return torch.arange(length, device=device)
    return shard.positions(length, device)


def _rope(x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
    """Rotary position embedding on (batch, heads, seq, head_dim), computed on the fly
    (``positions``: the tokens' global positions, under context parallelism)."""
    s, d = x.size(-2), x.size(-1)
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d))
    pos = torch.arange(s, device=x.device) if positions is None else positions
    ang = pos.to(torch.float32)[:, None] * inv[None, :]
    cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


def _attention_with_dropout(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, drop: Dropout) -> torch.Tensor:
    """Causal softmax(QK^T/sqrt(d)) V with dropout on the probabilities, written
    out (SDPA's own dropout draws from torch's generator): the probabilities
    (batch, heads, query, key) are what GPT-2 drops and the cost model counts."""
    scores = (q @ k.transpose(-2, -1)) * (q.size(-1) ** -0.5)
    s = q.size(-2)
    causal = torch.ones(s, k.size(-2), dtype=torch.bool, device=q.device).tril()
    probs = F.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)
    return drop(probs) @ v


@register_selective_recompute  # what recompute="selective" checkpoints, as a user model marks its own
class AttentionCore(nn.Module):
    """softmax(QK^T)V, causal: what selective recomputation recomputes (no parameters).
    Under context parallelism (``context_shard`` set) the local queries attend to
    the keys and values all-gathered over the CP group (hetplan.runtime.cp)."""

    def __init__(self, rope: bool, dropout: float = 0.0) -> None:
        super().__init__()
        self.rope = rope
        self.drop = Dropout(dropout, tp_dim=1)  # on the probabilities; TP shards the heads (dim 1)
        self.context_shard: Any = None  # set by GPT.set_context_parallel

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.context_shard is not None and not q.is_meta:
            return context_parallel_attention(q, k, v, self.context_shard, _rope if self.rope else None)
        if self.rope:
            q, k = _rope(q), _rope(k)
        if k.size(1) != q.size(1):  # grouped-query attention
            rep = q.size(1) // k.size(1)
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        if self.drop.active:
            return _attention_with_dropout(q, k, v, self.drop)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        hd = cfg.head_dim
        self.heads, self.kv_heads, self.head_dim = cfg.heads, cfg.num_kv_heads, hd
        self.q = nn.Linear(cfg.hidden, cfg.heads * hd, bias=cfg.bias)
        self.k = nn.Linear(cfg.hidden, cfg.num_kv_heads * hd, bias=cfg.bias)
        self.v = nn.Linear(cfg.hidden, cfg.num_kv_heads * hd, bias=cfg.bias)
        self.core = AttentionCore(cfg.positions == "rope", cfg.dropout)
        self.proj = nn.Linear(cfg.heads * hd, cfg.hidden, bias=cfg.bias)
        self.drop = Dropout(cfg.dropout, sp_dim=1)  # sequence-sharded under sequence parallelism

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        k = self.k(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        v = self.v(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        o = self.core(q, k, v)
        return self.drop(self.proj(o.transpose(1, 2).reshape(b, s, -1)))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.kind = cfg.mlp
        self.fc = nn.Linear(cfg.hidden, cfg.ffn_size, bias=cfg.bias)
        self.gate = nn.Linear(cfg.hidden, cfg.ffn_size, bias=cfg.bias) if cfg.mlp == "swiglu" else None
        self.proj = nn.Linear(cfg.ffn_size, cfg.hidden, bias=cfg.bias)
        self.drop = Dropout(cfg.dropout, sp_dim=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate is not None:
            h = F.silu(self.gate(x)) * self.fc(x)
        elif self.kind == "relu":
            h = F.relu(self.fc(x))
        else:
            h = F.gelu(self.fc(x))
        return self.drop(self.proj(h))


class Experts(nn.Module):
    """``num_experts`` GELU/ReLU/SwiGLU MLPs, their weights stacked along dim 0 so
    that expert parallelism shards them as one DTensor (``Shard(0)`` over the EP
    ranks); ``forward`` takes the token copies sorted by expert and the count per
    expert of the experts this rank holds.

    Expert tensor parallelism (``tp_group`` set by the runtime when the stage
    has tp > 1): each TP rank holds a ``1/tp`` slice of every expert's inner
    width -- the dim named in ``tp_shard_dims`` (first matmul split by columns,
    second by rows, as Megatron splits a dense MLP) -- and the partial outputs
    are summed over the TP group before the (whole) output bias."""

    # the inner-width dim of each stacked weight; absent: replicated on the TP ranks
    tp_shard_dims = {"fc_weight": 2, "gate_weight": 2, "fc_bias": 1, "proj_weight": 1}

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        e, h, f = cfg.num_experts, cfg.hidden, cfg.expert_ffn or cfg.ffn_size
        self.kind = cfg.mlp
        self.tp_group: Any = None
        self.fc_weight = nn.Parameter(torch.empty(e, h, f))
        self.gate_weight = nn.Parameter(torch.empty(e, h, f)) if cfg.mlp == "swiglu" else None
        self.proj_weight = nn.Parameter(torch.empty(e, f, h))
        self.fc_bias = nn.Parameter(torch.zeros(e, f)) if cfg.bias else None
        self.proj_bias = nn.Parameter(torch.zeros(e, h)) if cfg.bias else None

    def forward(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """The experts' MLPs over their rows. The stacked weights are split by one
        ``unbind`` each: its backward stacks the experts' gradients once, where indexing
        per expert made a whole-stack gradient per expert (``select_backward``) that
        autograd summed, holding a stacked weight's gradient twice (docs/cost-model.md)."""
        weights = {n: local_tensor(p).unbind(0) for n, p in self.named_parameters() if n != "proj_bias"}
        rows = expert_tp_input(rows, self.tp_group)
        outs, start = [], 0
        for e, n in enumerate(counts):
            r = rows[start:start + n]
            start += n
            a = r @ weights["fc_weight"][e]
            if "fc_bias" in weights:
                a = a + weights["fc_bias"][e]
            if "gate_weight" in weights:
                a = F.silu(r @ weights["gate_weight"][e]) * a
            else:
                a = F.relu(a) if self.kind == "relu" else F.gelu(a)
            outs.append(a @ weights["proj_weight"][e])
        out = expert_tp_output(torch.cat(outs) if outs else rows[:0], self.tp_group)
        if self.proj_bias is not None:
            out = out + local_tensor(self.proj_bias).repeat_interleave(torch.tensor(counts, device=out.device), dim=0)
        return out


class MoE(nn.Module):
    """Mixture-of-experts MLP (GShard §2.2; the routing as Mixtral's): a router
    linear, softmax over the experts, the ``top_k`` largest renormalised to sum
    to 1, and each token's output the weighted sum of its experts' outputs.
    Dropless (no capacity limit), so every plan computes exactly what one
    process does. With ``ep_group`` set (expert parallelism, by the runtime) this
    rank holds ``num_experts / ep`` experts and token copies travel to and from
    their expert's rank by ``all_to_all_single`` (hetplan.runtime.ep)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.num_experts, self.top_k = cfg.num_experts, cfg.top_k
        self.router = nn.Linear(cfg.hidden, cfg.num_experts, bias=False)
        self.experts = Experts(cfg)
        self.ep_group: Any = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_meta:  # shape inference (pipeline, chain check): the output has the input's shape
            return torch.empty_like(x)
        b, s, h = x.shape
        tokens = x.reshape(-1, h)
        probs = F.softmax(self.router(tokens).float(), dim=-1)
        weights, experts = probs.topk(self.top_k, dim=-1)
        weights = (weights / weights.sum(dim=-1, keepdim=True)).to(x.dtype)
        out = moe_dispatch_combine(tokens, experts, weights, self.experts, self.num_experts, self.ep_group)
        return out.view(b, s, h)


class Block(nn.Module):
    """Pre-norm transformer decoder block (its MLP a mixture of experts when ``moe``)."""

    def __init__(self, cfg: GPTConfig, moe: bool = False) -> None:
        super().__init__()
        self.ln1 = _norm(cfg)
        self.attn = Attention(cfg)
        self.ln2 = _norm(cfg)
        self.mlp: nn.Module = MoE(cfg) if moe else MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Head(nn.Module):
    """Final norm + vocabulary projection (weight tied to the embedding when asked)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.norm = _norm(cfg)
        self.proj = nn.Linear(cfg.hidden, cfg.vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.norm(x))


class GPT(nn.Module):
    """Decoder-only transformer whose top-level modules are the ModelSpec layers."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        cfg.check()
        self.config = cfg
        self.embed = Embed(cfg)
        self.layers = nn.ModuleDict({str(i): Block(cfg, i in cfg.moe_layers) for i in range(cfg.num_layers)})
        self.head = Head(cfg)
        if cfg.tied_embeddings:
            self.head.proj.weight = self.embed.tok.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for block in self.layers.values():
            x = block(x)
        return self.head(x)

    def set_context_parallel(self, shard: Any) -> None:
        """Run on this rank's chunk of every sequence (hetplan.runtime.cp.ContextShard):
        positions from the chunk's global positions, attention over the keys and
        values of the whole sequence. Declares that this model supports CP."""
        for module in self.modules():
            if isinstance(module, (Embed, AttentionCore)):
                module.context_shard = shard

    @staticmethod
    def init_parameter(fqn: str, tensor: torch.Tensor, generator: torch.Generator) -> None:
        """GPT-2 initialisation of one full (unsharded) parameter, given its name:
        norms 1, biases 0, everything else N(0, 0.02), and the residual output
        projections N(0, 0.02/sqrt(2L)) (GPT-2 paper, §2.3) -- here scaled by a
        fixed 1/sqrt(8) so the value does not depend on the layer count."""
        with torch.no_grad():
            if fqn.endswith("bias"):
                tensor.zero_()
            elif tensor.dim() == 1:
                tensor.fill_(1.0)
            else:
                residual_out = ("attn.proj.weight", "mlp.proj.weight", "experts.proj_weight")
                std = 0.02 / math.sqrt(8.0) if fqn.endswith(residual_out) else 0.02
                tensor.normal_(0.0, std, generator=generator)


def cross_entropy_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over every token of the batch."""
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1))


# --- tensor-parallel plans -------------------------------------------------------------
# Registered as a user model registers its own (hetplan.runtime.register_tp_plan): Megatron's
# layout (Shoeybi et al. 2019 §3) -- Q/K/V and the first MLP linears column-parallel, the output
# projections row-parallel, the token embedding vocabulary-parallel, the LM head column-parallel
# with its logits gathered; with sequence parallelism the norms run on sequence shards and the
# row-parallel outputs are reduce-scattered along the sequence (Korthikanti et al. 2022, as
# torchtitan does). torch.distributed.tensor is imported in the plan functions (lazy: the model
# itself runs in one process without it).
@register_tp_plan(Embed)
def embed_tp_plan(module: Embed, s: TPSettings) -> dict[str, Any]:
    """The token embedding split by vocabulary rows, its output all-reduced (and
    sequence-sharded under sequence parallelism)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import PrepareModuleOutput, RowwiseParallel

    if module.tok.num_embeddings % s.tp:
        raise HetplanError(
            f"tp={s.tp} does not divide the vocabulary of {module.tok.num_embeddings} in layer {s.name!r}"
        )
    plan: dict[str, Any] = {"tok": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())}
    if s.sequence_parallel:
        plan[""] = PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(1),
                                       use_local_output=True)
    return plan


@register_tp_plan(Block)
def block_tp_plan(module: Block, s: TPSettings) -> dict[str, Any]:
    """Attention split by heads, the dense MLP by width; a MoE block's router
    stays whole on every TP rank (its experts are split by ``parallelize.apply_ep``)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    _check_heads(s.name, module.attn.heads, module.attn.kv_heads, s.tp)
    moe = isinstance(module.mlp, MoE)
    if moe and s.sequence_parallel:
        raise HetplanError(moe_sequence_parallel(s.name))
    ffn = 0 if moe else module.mlp.fc.out_features
    if ffn % s.tp:
        raise HetplanError(f"tp={s.tp} does not divide the MLP width {ffn} of layer {s.name!r}")
    sp = s.sequence_parallel
    out = Shard(1) if sp else Replicate()
    plan: dict[str, Any] = {
        "attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(), "attn.v": ColwiseParallel(),
        "attn.proj": RowwiseParallel(output_layouts=out),
    }
    if not moe:
        plan.update({"mlp.fc": ColwiseParallel(), "mlp.proj": RowwiseParallel(output_layouts=out)})
    if not moe and module.mlp.gate is not None:
        plan["mlp.gate"] = ColwiseParallel()
    if sp:
        plan.update({
            "ln1": SequenceParallel(), "ln2": SequenceParallel(),
            "attn": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        })
    return plan


@register_tp_plan(Head)
def head_tp_plan(module: Head, s: TPSettings) -> dict[str, Any]:
    """The vocabulary projection split by columns, its logits gathered."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, SequenceParallel

    if module.proj.out_features % s.tp:
        raise HetplanError(
            f"tp={s.tp} does not divide the vocabulary of {module.proj.out_features} in layer {s.name!r}"
        )
    plan: dict[str, Any] = {
        "proj": ColwiseParallel(input_layouts=Shard(1) if s.sequence_parallel else Replicate(),
                                output_layouts=Replicate(), use_local_output=True),
    }
    if s.sequence_parallel:
        plan["norm"] = SequenceParallel()
    return plan


def _check_heads(name: str, heads: int, kv_heads: int, tp: int) -> None:
    if heads % tp:
        raise HetplanError(
            f"tp={tp} does not divide the {heads} attention heads of layer {name!r}; use a tp that divides {heads}"
        )
    if kv_heads % tp:
        raise HetplanError(
            f"tp={tp} does not divide the {kv_heads} key/value heads of layer {name!r}; "
            f"use a tp that divides {kv_heads}"
        )


# --- presets ------------------------------------------------------------------------
def config_from_spec(spec: ModelSpec) -> GPTConfig:
    """A GPTConfig whose modules match a ModelSpec of hetplan's decoder presets.

    Names must be ``embed``, ``layers.0..N-1``, ``head``; sizes come from the
    spec (hidden, heads, vocabulary, sequence; the MLP width and key/value
    heads from the block's parameter count and TP limit). The built model's
    parameter counts are checked layer by layer against the spec.
    """
    names = [layer.name for layer in spec.layers]
    n = len(names) - 2
    expected = ["embed"] + [f"layers.{i}" for i in range(n)] + ["head"]
    if names != expected or n < 1:
        raise HetplanError(
            f"model {spec.name!r} has layers {names[:3]}...; the built-in runtime model needs "
            "'embed', 'layers.0'..'layers.N-1', 'head' -- pass your own build function to "
            "hetplan.runtime (ctx.parallelize(build_model)) for other models"
        )
    if spec.family not in ("gpt", "llama", "moe"):
        raise HetplanError(
            f"the built-in runtime model covers GPT- and Llama-style decoders and GShard-style MoE decoders, "
            f"not family {spec.family!r}; pass your own build function to hetplan.runtime"
        )
    h, heads, vocab, seq = spec.hidden_size, spec.num_heads, spec.vocab_size, spec.seq_len
    if not (h and heads and vocab):
        raise HetplanError(f"model {spec.name!r} lacks hidden size, heads or vocabulary")
    llama = spec.family == "llama"
    moe = moe_layer_indices(spec)
    dense = [i for i in range(n) if i not in moe]
    if not dense:
        raise HetplanError(f"model {spec.name!r} has no dense block; the built-in runtime model needs one to infer "
                           "its sizes -- pass your own build function to hetplan.runtime")
    block = spec.layers[1 + dense[0]]
    kv = block.tp_max or heads
    tied = bool(spec.layers[0].tied_group) and spec.layers[0].tied_group == spec.layers[-1].tied_group
    hd = h // heads
    base = dict(vocab_size=vocab, seq_len=seq, hidden=h, heads=heads, num_layers=n,
                kv_heads=kv if kv != heads else 0, tied_embeddings=tied)
    if llama:
        base.update(norm="rms", mlp="swiglu", positions="rope", bias=False)
        attn = h * heads * hd + 2 * h * kv * hd + heads * hd * h
        norms = 2 * h
        ffn, rem = divmod(block.params - attn - norms, 3 * h)
    else:
        attn = h * heads * hd + 2 * h * kv * hd + heads * hd * h + heads * hd + 2 * kv * hd + h
        norms = 4 * h
        ffn, rem = divmod(block.params - attn - norms - h, 2 * h + 1)
    if rem or ffn <= 0:
        raise HetplanError(f"cannot infer the MLP width of model {spec.name!r} from its parameter count")
    if moe:
        base.update(_moe_config(spec, moe, attn + norms, llama))
    cfg = GPTConfig(ffn=ffn, **base)
    _check_params(spec, cfg)
    return cfg


def moe_layer_indices(spec: ModelSpec) -> tuple[int, ...]:
    """Block indices (0 = ``layers.0``) of a decoder preset's mixture-of-experts layers."""
    return tuple(i - 1 for i, layer in enumerate(spec.layers)
                 if getattr(layer, "num_experts", 0) or layer.kind == "moe")


def _moe_config(spec: ModelSpec, moe: tuple[int, ...], rest: int, llama: bool) -> dict[str, Any]:
    """Experts, top-k and expert width of the MoE blocks: the counts from the
    layer (or the spec's meta), the width from the block's parameter count
    (``rest``: its attention and norms; then a bias-free router of ``h x e`` and
    ``e`` experts of ``3hf`` (SwiGLU) or ``2hf + f + h`` (GELU, biases))."""
    layer = spec.layers[1 + moe[0]]
    e = getattr(layer, "num_experts", 0) or int(spec.meta.get("num_experts", 0))
    k = getattr(layer, "top_k", 0) or int(spec.meta.get("top_k", 2))
    h = spec.hidden_size
    if not e:
        raise HetplanError(f"model {spec.name!r} does not say how many experts its MoE layers have")
    experts = layer.params - rest - h * e
    f, rem = divmod(experts, 3 * h * e) if llama else divmod(experts - e * h, e * (2 * h + 1))
    if rem or f <= 0 or any(spec.layers[1 + i].params != layer.params for i in moe):
        raise HetplanError(f"cannot infer the expert width of model {spec.name!r} from its parameter count; "
                           "pass your own build function to hetplan.runtime")
    return dict(num_experts=e, top_k=k, expert_ffn=f, moe_layers=moe)


def _check_params(spec: ModelSpec, cfg: GPTConfig) -> None:
    with torch.device("meta"):
        model = GPT(cfg)
    for layer in spec.layers:
        module = model.get_submodule(layer.name)
        count = sum(p.numel() for p in module.parameters())
        if layer.kind == "head" and cfg.tied_embeddings:
            count = sum(p.numel() for p in module.parameters())  # includes the tied matrix, as the spec does
        if count != layer.params:
            raise HetplanError(
                f"the built-in runtime model's {layer.name!r} has {count} parameters but model "
                f"{spec.name!r} says {layer.params}; pass your own build function to hetplan.runtime"
            )


def build_preset_model(spec: ModelSpec) -> GPT:
    """The built-in runtime model for a decoder preset (on the current default device)."""
    return GPT(config_from_spec(spec))
