"""Built-in PyTorch models for the runtime: a GPT/Llama-style decoder.

The module names match the ModelSpec layer names of hetplan's decoder presets
(``embed``, ``layers.0`` .. ``layers.N-1``, ``head``), so a Plan's pipeline
split is a list of module names of this model. Every layer takes one tensor and
returns one tensor, so a pipeline stage is just its layers run in order.

One class covers the decoder families of the papers:

* GPT-2/GPT-3: learned positions, LayerNorm, GELU MLP, biases, LM head tied to
  the token embedding (``GPTConfig()`` defaults);
* Llama-style: RMSNorm, SwiGLU MLP, rotary positions, no biases, grouped-query
  attention (``norm="rms", mlp="swiglu", positions="rope", bias=False, kv_heads=...``).

Query, key and value are separate linears (not one fused QKV matrix) so that
column-wise tensor parallelism splits each of them by heads. Attention reshapes
with ``-1`` heads, so the same code runs the local heads of a TP shard.
There is no dropout: the runtime's tests compare fp32 numbers bit-for-bit-ish.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from hetplan.errors import HetplanError


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

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx)
        if self.pos is not None:
            x = x + self.pos(torch.arange(idx.size(1), device=idx.device))
        return x


def _rope(x: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding on (batch, heads, seq, head_dim), computed on the fly."""
    s, d = x.size(-2), x.size(-1)
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d))
    ang = torch.arange(s, device=x.device, dtype=torch.float32)[:, None] * inv[None, :]
    cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


class AttentionCore(nn.Module):
    """softmax(QK^T)V, causal: what selective recomputation recomputes (no parameters)."""

    def __init__(self, rope: bool) -> None:
        super().__init__()
        self.rope = rope

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.rope:
            q, k = _rope(q), _rope(k)
        if k.size(1) != q.size(1):  # grouped-query attention
            rep = q.size(1) // k.size(1)
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        hd = cfg.head_dim
        self.heads, self.kv_heads, self.head_dim = cfg.heads, cfg.num_kv_heads, hd
        self.q = nn.Linear(cfg.hidden, cfg.heads * hd, bias=cfg.bias)
        self.k = nn.Linear(cfg.hidden, cfg.num_kv_heads * hd, bias=cfg.bias)
        self.v = nn.Linear(cfg.hidden, cfg.num_kv_heads * hd, bias=cfg.bias)
        self.core = AttentionCore(cfg.positions == "rope")
        self.proj = nn.Linear(cfg.heads * hd, cfg.hidden, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        k = self.k(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        v = self.v(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        o = self.core(q, k, v)
        return self.proj(o.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.kind = cfg.mlp
        self.fc = nn.Linear(cfg.hidden, cfg.ffn_size, bias=cfg.bias)
        self.gate = nn.Linear(cfg.hidden, cfg.ffn_size, bias=cfg.bias) if cfg.mlp == "swiglu" else None
        self.proj = nn.Linear(cfg.ffn_size, cfg.hidden, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate is not None:
            h = F.silu(self.gate(x)) * self.fc(x)
        elif self.kind == "relu":
            h = F.relu(self.fc(x))
        else:
            h = F.gelu(self.fc(x))
        return self.proj(h)


class Block(nn.Module):
    """Pre-norm transformer decoder block."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = _norm(cfg)
        self.attn = Attention(cfg)
        self.ln2 = _norm(cfg)
        self.mlp = MLP(cfg)

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
        self.layers = nn.ModuleDict({str(i): Block(cfg) for i in range(cfg.num_layers)})
        self.head = Head(cfg)
        if cfg.tied_embeddings:
            self.head.proj.weight = self.embed.tok.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for block in self.layers.values():
            x = block(x)
        return self.head(x)

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
                std = 0.02 / math.sqrt(8.0) if fqn.endswith(("attn.proj.weight", "mlp.proj.weight")) else 0.02
                tensor.normal_(0.0, std, generator=generator)


def cross_entropy_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over every token of the batch."""
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1))


# --- presets ------------------------------------------------------------------------
def config_from_spec(spec) -> GPTConfig:  # noqa: ANN001 - ModelSpec, kept torch-free at import
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
    if spec.family not in ("gpt", "llama"):
        raise HetplanError(
            f"the built-in runtime model covers GPT- and Llama-style decoders, not family {spec.family!r}; "
            "pass your own build function to hetplan.runtime"
        )
    h, heads, vocab, seq = spec.hidden_size, spec.num_heads, spec.vocab_size, spec.seq_len
    if not (h and heads and vocab):
        raise HetplanError(f"model {spec.name!r} lacks hidden size, heads or vocabulary")
    llama = spec.family == "llama"
    block = spec.layers[1]
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
    cfg = GPTConfig(ffn=ffn, **base)
    _check_params(spec, cfg)
    return cfg


def _check_params(spec, cfg: GPTConfig) -> None:  # noqa: ANN001
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


def build_preset_model(spec) -> GPT:  # noqa: ANN001
    """The built-in runtime model for a decoder preset (on the current default device)."""
    return GPT(config_from_spec(spec))


# --- what 'hetplan train' builds -------------------------------------------------------
@dataclass(frozen=True)
class ModelBuild:
    """How ``hetplan train`` builds a plan's model: ``build()`` returns the full
    model; ``loss(output, targets)`` its training loss; ``meta_init``: built on
    the meta device and initialised by hetplan (the built-in model), or built
    for real under ``torch.manual_seed(seed)`` (HF models: their rotary and
    other buffers are computed at construction)."""

    build: Callable[[], nn.Module]
    loss: Callable[[Any, torch.Tensor], torch.Tensor]
    meta_init: bool


def model_build(spec) -> ModelBuild:  # noqa: ANN001
    """The built-in model for hetplan's presets; for a model imported from a HF
    config, that HF class built from the config values the plan file embeds."""
    if spec.meta.get("hf_class"):
        return _hf_build(spec)
    return ModelBuild(lambda: build_preset_model(spec), cross_entropy_loss, True)


def _hf_build(spec) -> ModelBuild:  # noqa: ANN001
    values, name = spec.meta.get("hf_config"), spec.meta["hf_class"]
    if not isinstance(values, dict):
        raise HetplanError(f"model {spec.name!r} came from a HF config, but its plan file does not hold the config "
                           "values; make the plan again with this hetplan ('hetplan plan --model config.json')")
    import transformers

    cls = getattr(transformers, name, None)
    if cls is None:
        raise HetplanError(f"transformers {transformers.__version__} has no class {name}; install the version "
                           "the plan was made with")
    config = transformers.AutoConfig.for_model(**values)

    def loss(output: Any, targets: torch.Tensor) -> torch.Tensor:
        return cross_entropy_loss(getattr(output, "logits", output), targets)

    return ModelBuild(lambda: cls(config), loss, False)
