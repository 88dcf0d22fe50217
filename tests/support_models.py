"""Models given as Python code for the runtime-support tests (``--model tests.support_models:NAME``).

``gpt_with_adapter``: hetplan's GPT blocks (TP plans registered by the
runtime) around a plain ``Adapter`` layer that has none, so that tensor
parallelism runs the adapter whole on every TP rank
(``LayerSpec.tp_replicated``). ``gpt_with_adapter_tp`` registers a TP plan
for it first, so the same model runs the adapter split.
"""

from __future__ import annotations

import torch
from torch import nn

from hetplan.runtime.models import Block, Embed, GPTConfig, Head

CONFIG = GPTConfig(vocab_size=64, seq_len=8, hidden=32, heads=4, num_layers=2)


class Adapter(nn.Module):
    """A residual bottleneck MLP between two blocks (no TP plan registered)."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.down = nn.Linear(hidden, hidden // 2)
        self.up = nn.Linear(hidden // 2, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.up(torch.relu(self.down(x)))


class AdapterGPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = Embed(CONFIG)
        self.block0 = Block(CONFIG)
        self.adapter = Adapter(CONFIG.hidden)
        self.block1 = Block(CONFIG)
        self.head = Head(CONFIG)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.block1(self.adapter(self.block0(self.embed(idx)))))


def gpt_with_adapter() -> tuple[nn.Module, torch.Tensor]:
    return AdapterGPT(), torch.zeros(2, CONFIG.seq_len, dtype=torch.long)


class SplitAdapter(Adapter):
    """The adapter with a Megatron-style TP plan: ``down`` column-, ``up`` row-parallel."""


def _split_adapter_plan(module: SplitAdapter, settings: object) -> dict[str, object]:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {"down": ColwiseParallel(), "up": RowwiseParallel()}


class SplitAdapterGPT(AdapterGPT):
    def __init__(self) -> None:
        super().__init__()
        self.adapter = SplitAdapter(CONFIG.hidden)


def gpt_with_adapter_tp() -> tuple[nn.Module, torch.Tensor]:
    from hetplan.runtime.tp import register_tp_plan

    register_tp_plan(SplitAdapter, _split_adapter_plan)
    return SplitAdapterGPT(), torch.zeros(2, CONFIG.seq_len, dtype=torch.long)
