"""Built-in models: every model the AMP, Galvatron-BMW and Metis papers train.

Each preset is a function returning a ModelSpec; ``get_model(name)`` looks one
up. Sizes come from the papers (cited beside each preset) so that planners can
be compared with the papers' own numbers.
"""

from __future__ import annotations

from typing import Callable

from hetplan.errors import HetplanError
from hetplan.model.layers import BlockShape, embedding_layer, lm_head_layer, transformer_block
from hetplan.model.spec import ModelSpec

PresetFn = Callable[[], ModelSpec]
_PRESETS: dict[str, tuple[PresetFn, str]] = {}


def preset(name: str, description: str) -> Callable[[PresetFn], PresetFn]:
    """Register a preset model factory under ``name``."""

    def register(fn: PresetFn) -> PresetFn:
        if name in _PRESETS:
            raise RuntimeError(f"duplicate model preset {name}")
        _PRESETS[name] = (fn, description)
        return fn

    return register


def model_names() -> list[str]:
    return sorted(_PRESETS)


def model_descriptions() -> dict[str, str]:
    return {name: desc for name, (_, desc) in sorted(_PRESETS.items())}


def get_model(name: str) -> ModelSpec:
    """The preset model called ``name``; a clear error lists the known names."""
    if name not in _PRESETS:
        raise HetplanError(
            f"unknown model preset {name!r}; run 'hetplan models' to list presets, "
            "or pass a HF config.json path"
        )
    return _PRESETS[name][0]()


def gpt_decoder(
    name: str,
    num_layers: int,
    hidden: int,
    heads: int,
    seq: int,
    vocab: int = 50257,
    ffn: int = 0,
    dtype_bytes: int = 2,
    family: str = "gpt",
    tied_embeddings: bool = True,
) -> ModelSpec:
    """A GPT-2/GPT-3 style decoder: learned positions, LayerNorm, GELU MLP,
    LM head tied to the token embedding."""
    shape = BlockShape(hidden=hidden, heads=heads, ffn=ffn or 4 * hidden, seq=seq)
    tie = "wte" if tied_embeddings else ""
    layers = [embedding_layer("embed", vocab, hidden, seq, dtype_bytes, positions=seq, tied_group=tie)]
    layers += [transformer_block(f"layers.{i}", "decoder", shape, dtype_bytes) for i in range(num_layers)]
    layers.append(
        lm_head_layer("head", vocab, hidden, seq, dtype_bytes, tied_group=tie, own_weight=not tied_embeddings)
    )
    return ModelSpec(
        name=name, family=family, layers=tuple(layers), seq_len=seq, dtype_bytes=dtype_bytes,
        hidden_size=hidden, num_heads=heads, vocab_size=vocab,
    )


@preset("gpt2-amp", "GPT-2 as in AMP §4.1: 24 layers, hidden 1024, 16 heads, seq 1024")
def _gpt2_amp() -> ModelSpec:
    return gpt_decoder("gpt2-amp", num_layers=24, hidden=1024, heads=16, seq=1024)
