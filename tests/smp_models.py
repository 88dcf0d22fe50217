"""Three module trees for the ``smp`` planner (``--model tests.smp_models:gpt`` etc.).

Each function returns ``(model, example_inputs)``; ``batch(name, n, step)``
gives training data and ``LOSSES[name]`` the loss. No dropout, no batch norm
(a micro-batch's statistics would differ from the whole batch's), no buffers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hetplan.runtime.models import GPT, GPTConfig

SRC, TGT, VOCAB, CLASSES = 6, 6, 32, 10


def gpt() -> tuple[nn.Module, torch.Tensor]:
    """hetplan's GPT: embed, layers.0-3, head (tied to the embedding)."""
    cfg = GPTConfig(vocab_size=VOCAB, seq_len=8, hidden=16, heads=2, num_layers=4)
    return GPT(cfg), torch.zeros(2, 8, dtype=torch.long)


class ResBlock(nn.Module):
    """conv-norm-relu-conv-norm plus the block's input: the skip stays inside the block."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1)
        self.norm1 = nn.GroupNorm(2, channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1)
        self.norm2 = nn.GroupNorm(2, channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.norm1(self.conv1(x)))
        return F.relu(x + self.norm2(self.conv2(y)))


class ResNet(nn.Module):
    def __init__(self, channels: int = 8, blocks: int = 4) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, channels, 3, padding=1), nn.GroupNorm(2, channels), nn.ReLU())
        self.blocks = nn.Sequential(*(ResBlock(channels) for _ in range(blocks)))
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, CLASSES))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.stem(x)))


def resnet() -> tuple[nn.Module, torch.Tensor]:
    """A CNN with residual blocks: stem, blocks.0-3 (each with its skip), head."""
    return ResNet(), torch.zeros(2, 3, 8, 8)


class Attention(nn.Module):
    def __init__(self, d: int, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.q, self.kv, self.out = nn.Linear(d, d), nn.Linear(d, 2 * d), nn.Linear(d, d)

    def forward(self, x: torch.Tensor, memory: torch.Tensor, causal: bool) -> torch.Tensor:
        b, n, d = x.shape
        q = self.q(x).view(b, n, self.heads, -1).transpose(1, 2)
        k, v = self.kv(memory).view(b, memory.size(1), 2, self.heads, -1).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        return self.out(y.transpose(1, 2).reshape(b, n, d))


class Mlp(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc, self.proj = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Embed(nn.Module):
    """One token stream in, the source and target streams out."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.tokens = nn.Embedding(VOCAB, d)
        self.src_pos = nn.Embedding(SRC, d)
        self.tgt_pos = nn.Embedding(TGT, d)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        src, tgt = x[:, :SRC], x[:, SRC:]
        return (self.tokens(src) + self.src_pos.weight, self.tokens(tgt) + self.tgt_pos.weight)


class EncoderLayer(nn.Module):
    """Self-attention and MLP on the source; the target passes through."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln1, self.attn, self.ln2, self.mlp = nn.LayerNorm(d), Attention(d), nn.LayerNorm(d), Mlp(d)

    def forward(self, src: torch.Tensor, tgt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.ln1(src)
        src = src + self.attn(h, h, causal=False)
        return src + self.mlp(self.ln2(src)), tgt


class EncoderNorm(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)

    def forward(self, src: torch.Tensor, tgt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.norm(src), tgt


class DecoderLayer(nn.Module):
    """Causal self-attention, cross-attention to the encoder's memory, MLP."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln1, self.self_attn = nn.LayerNorm(d), Attention(d)
        self.ln2, self.cross_attn = nn.LayerNorm(d), Attention(d)
        self.ln3, self.mlp = nn.LayerNorm(d), Mlp(d)

    def forward(self, memory: torch.Tensor, tgt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.ln1(tgt)
        tgt = tgt + self.self_attn(h, h, causal=True)
        tgt = tgt + self.cross_attn(self.ln2(tgt), memory, causal=False)
        return memory, tgt + self.mlp(self.ln3(tgt))


class Encoder(nn.Module):
    def __init__(self, d: int, n: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(EncoderLayer(d) for _ in range(n))
        self.final = EncoderNorm(d)

    def forward(self, src: torch.Tensor, tgt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        for layer in self.layers:
            src, tgt = layer(src, tgt)
        return self.final(src, tgt)


class Decoder(nn.Module):
    def __init__(self, d: int, n: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(DecoderLayer(d) for _ in range(n))

    def forward(self, memory: torch.Tensor, tgt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        for layer in self.layers:
            memory, tgt = layer(memory, tgt)
        return memory, tgt


class Head(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm, self.lm = nn.LayerNorm(d), nn.Linear(d, VOCAB)

    def forward(self, memory: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        return self.lm(self.norm(tgt))


class EncoderDecoder(nn.Module):
    """A tiny transformer encoder-decoder; the encoder's memory travels beside the target through the decoder."""

    def __init__(self, d: int = 16, layers: int = 2) -> None:
        super().__init__()
        self.embed = Embed(d)
        self.encoder = Encoder(d, layers)
        self.decoder = Decoder(d, layers)
        self.head = Head(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(*self.decoder(*self.encoder(*self.embed(x))))


def encdec() -> tuple[nn.Module, torch.Tensor]:
    """embed, encoder.layers.0-1, encoder.final, decoder.layers.0-1, head."""
    return EncoderDecoder(), torch.zeros(2, SRC + TGT, dtype=torch.long)


class TwoInputEncDec(EncoderDecoder):
    """The same model called the usual way, ``forward(src, tgt)``: not a chain, so one pipeline stage."""

    def forward(self, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        return super().forward(torch.cat([src, tgt], dim=1))


def encdec_two_inputs() -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    return TwoInputEncDec(), (torch.zeros(2, SRC, dtype=torch.long), torch.zeros(2, TGT, dtype=torch.long))


def batch(name: str, n: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A learnable batch for model ``name``, the same on every rank for a step."""
    g = torch.Generator().manual_seed(1000 + step)
    if name == "resnet":
        x = torch.randn(n, 3, 8, 8, generator=g)
        return x, (x.mean(dim=(1, 2, 3)) > 0).long() + 2 * (x[:, 0].mean(dim=(1, 2)) > 0).long()
    if name == "gpt":
        tokens = torch.randint(0, VOCAB, (n, 9), generator=g)
        return tokens[:, :-1], tokens[:, 1:]
    src = torch.randint(0, VOCAB, (n, SRC), generator=g)
    return torch.cat([src, src.flip(1)], dim=1), src.flip(1)  # the target is the reversed source


def token_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.reshape(-1, output.size(-1)).float(), target.reshape(-1))


LOSSES = {"gpt": token_loss, "resnet": F.cross_entropy, "encdec": token_loss}
BUILDERS = {"gpt": gpt, "resnet": resnet, "encdec": encdec}


# --- for `hetplan train --plan` (tests/distributed/test_train_user_module.py) -------------------
class LMGPT(GPT):
    """hetplan's GPT with its own training loss: next-token prediction on its input tokens."""

    def hetplan_loss(self, logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        return token_loss(logits[:, :-1], tokens[:, 1:])


def gpt_lm() -> tuple[nn.Module, torch.Tensor]:
    """The GPT tree with ``hetplan_loss``; the targets are the inputs (no example targets)."""
    cfg = GPTConfig(vocab_size=VOCAB, seq_len=8, hidden=16, heads=2, num_layers=4)
    return LMGPT(cfg), torch.zeros(2, 8, dtype=torch.long)


class ClassifierResNet(ResNet):
    def hetplan_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits, labels)


def resnet_classes() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """The CNN with class labels as example targets, made on the CPU so that their range 0..9 is seen."""
    return ClassifierResNet(), torch.zeros(2, 3, 8, 8), torch.tensor([0, CLASSES - 1], device="cpu")
