"""Built-in models: every model the AMP, Galvatron-BMW and Metis papers train.

Each preset is a function returning a ModelSpec; ``get_model(name)`` looks one
up. Sizes come from the papers (cited beside each preset) so that planners can
be compared with the papers' own numbers.
"""

from __future__ import annotations

from typing import Any, Callable

from hetplan.errors import HetplanError, did_you_mean
from hetplan.model.families import (
    bert_model,
    llama_decoder,
    moe_decoder,
    moe_llama_decoder,
    swin_model,
    t5_model,
    transgan_generator,
    vit_model,
    wide_resnet,
)
from hetplan.model.layers import BlockShape, MLAShape, MoEShape, embedding_layer, lm_head_layer, transformer_block
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
            f"unknown model preset {name!r}{did_you_mean(name, _PRESETS)}; run 'hetplan models' to list presets, "
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
    meta: dict[str, Any] | None = None,
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
    # what a tool needs to build the same model (hetplan.export.tools.architecture)
    info: dict[str, Any] = {"architecture": {
        "kv_heads": heads, "ffn": ffn or 4 * hidden, "gated_mlp": False, "norm": "layernorm", "positions": "learned",
        "max_positions": seq, "bias": True, "tied_embeddings": tied_embeddings, "dropout": shape.dropout}}
    info.update(meta or {})
    return ModelSpec(
        name=name, family=family, layers=tuple(layers), seq_len=seq, dtype_bytes=dtype_bytes,
        hidden_size=hidden, num_heads=heads, vocab_size=vocab, meta=info,
    )


@preset("gpt2-amp", "GPT-2 as in AMP §4.3: 24 layers, hidden 1024, 16 heads, seq 1024")
def _gpt2_amp() -> ModelSpec:
    return gpt_decoder("gpt2-amp", num_layers=24, hidden=1024, heads=16, seq=1024,
                       meta={"source": "AMP (NeurIPS'22) §4.3: GPT-2 (L = 24, H = 1024), global batch 32"})


@preset("opt-350m", "OPT-350M as in Sailor's Fig. 8b: 24 layers, hidden 1024, 16 heads, ffn 4096, seq 2048")
def _opt_350m() -> ModelSpec:
    return gpt_decoder("opt-350m", num_layers=24, hidden=1024, heads=16, seq=2048, vocab=50272, ffn=4096,
                       meta={"source": "OPT (Zhang et al. 2022, arXiv:2205.01068) Table 1: 24 layers, 16 heads, "
                                       "d_model 1024; vocab 50272 and seq 2048 from §2.1-2.2; the model of Sailor "
                                       "(SOSP'25) Fig. 8b. Modelled as a GPT-2 style decoder (GELU, learned "
                                       "positions, tied head): the released checkpoint's ReLU and 512-wide "
                                       "embedding projection are not modelled"})


# ----------------------------------------------------------------------------- AMP

@preset("transgan-het", "AMP's heterogeneous TransGAN generator: 12 layers dim 1024 (81 tokens) "
        "+ 12 layers dim 16 (82,944 tokens, 18x18 windows), fp16")
def _transgan_het() -> ModelSpec:
    return transgan_generator("transgan-het", meta={
        "source": "AMP (NeurIPS'22) §4.3 heterogeneous model; shapes from AMP's code "
                  "(het_model.py, ds_pretrain_transgan_pipe.sh: g_depth 12,0,0,0,0,12, bottom_width 9, "
                  "g_window_size 18, gf_dim 1024, --fp16)"})


# ----------------------------------------------------------------- Galvatron-BMW Table I
#
# Galvatron-BMW trained these models from HF transformers 4.16.2 on torch 1.10.2
# in float32 (its training scripts use no autocast; its memory model counts
# 4 x parameter bytes for fp32 Adam). See docs/models.md for how the activation
# sizes of Table I follow from that setup.

_GALVATRON: dict[str, Any] = dict(dtype_bytes=4, softmax_saves_input=True)
_TABLE_I = "Galvatron-BMW (arXiv:2307.02031) Table I"


def _galvatron_meta(extra: str) -> dict[str, Any]:
    return {"source": f"{_TABLE_I}; {extra}",
            "training": "HF transformers 4.16.2, torch 1.10.2, fp32 (Galvatron requirements.txt)"}


for _name, _layers, _hidden, _heads in (
    ("bert-huge-32", 32, 1280, 16),
    ("bert-huge-48", 48, 1280, 16),
    ("bert-xhuge", 128, 2560, 32),
):
    def _make_bert(name: str = _name, layers: int = _layers, hidden: int = _hidden,
                   heads: int = _heads) -> ModelSpec:
        return bert_model(name, layers, hidden, heads, seq=512, vocab=30522, **_GALVATRON,
                          meta=_galvatron_meta("BERT pre-training (MLM+NSP), seq 512, vocab 30522"))

    preset(_name, f"BERT {_layers} layers, hidden {_hidden}, {_heads} heads, seq 512, fp32 "
           f"(Galvatron-BMW Table I)")(_make_bert)

for _name, _layers, _hidden, _heads in (
    ("vit-huge-32", 32, 1280, 16),
    ("vit-huge-48", 48, 1280, 16),
    ("vit-xhuge", 128, 2560, 32),
):
    def _make_vit(name: str = _name, layers: int = _layers, hidden: int = _hidden,
                  heads: int = _heads) -> ModelSpec:
        return vit_model(name, layers, hidden, heads, image_size=224, patch_size=16, **_GALVATRON,
                         meta=_galvatron_meta("ViT on ImageNet-1K, 224x224, patch 16 (197 tokens), no dropout"))

    preset(_name, f"ViT {_layers} layers, hidden {_hidden}, {_heads} heads, 224px patch 16, fp32 "
           f"(Galvatron-BMW Table I)")(_make_vit)

for _name, _enc, _dec_seq in (
    ("t5-large-32", 16, 512),
    ("t5-large-48", 24, 512),
    ("t5-512-4-32", 16, 4),
    ("t5-512-4-48", 24, 4),
):
    def _make_t5(name: str = _name, layers: int = _enc, dec_seq: int = _dec_seq) -> ModelSpec:
        return t5_model(name, layers, layers, hidden=1024, heads=16, ffn=4096, vocab=32128,
                        encoder_seq=512, decoder_seq=dec_seq, **_GALVATRON,
                        meta=_galvatron_meta(f"T5-Large (v1.0) {layers} enc + {layers} dec, "
                                             f"encoder seq 512, decoder seq {dec_seq}"))

    preset(_name, f"T5-Large {_enc} enc + {_enc} dec, hidden 1024, encoder seq 512, decoder seq "
           f"{_dec_seq}, fp32 (Galvatron-BMW Table I)")(_make_t5)

for _name, _depths in (
    ("swin-huge-32", (2, 2, 26, 2)),
    ("swin-huge-48", (2, 2, 42, 2)),
):
    def _make_swin(name: str = _name, depths: tuple[int, ...] = _depths) -> ModelSpec:
        return swin_model(name, depths, embed_dim=320, heads=(8, 16, 32, 64), window=7, **_GALVATRON,
                          meta=_galvatron_meta("Swin-Huge, widths 320/640/1280/2560, heads 8/16/32/64, "
                                               "window 7, 224px patch 4"))

    preset(_name, f"Swin-Huge depths {'/'.join(map(str, _depths))}, widths 320/640/1280/2560, "
           f"window 7, fp32 (Galvatron-BMW Table I)")(_make_swin)


# --------------------------------------------------------------------- Metis Table 2
#
# Metis runs on Alpa and uses Alpa's benchmark models (alpa benchmark suites:
# gpt_specs, moe_specs, wresnet_specs).

_METIS = "Metis (ATC'24) Table 2; shapes from Alpa's benchmark suites"

for _name, _layers, _hidden, _heads in (
    ("gpt3-1.3b", 24, 2048, 32),
    ("gpt3-2.6b", 32, 2560, 32),
    ("gpt3-6.7b", 32, 4096, 32),
    ("gpt3-15b", 48, 5120, 40),
):
    def _make_gpt(name: str = _name, layers: int = _layers, hidden: int = _hidden,
                  heads: int = _heads) -> ModelSpec:
        return gpt_decoder(name, num_layers=layers, hidden=hidden, heads=heads, seq=1024, vocab=51200,
                           meta={"source": f"{_METIS} (suite_manual_gpt gpt_specs)"})

    preset(_name, f"GPT-3 {_layers} layers, hidden {_hidden}, {_heads} heads, seq 1024, vocab 51200 "
           f"(Metis Table 2)")(_make_gpt)

for _name, _layers, _hidden, _experts in (
    ("moe-1.3b", 16, 768, 16),
    ("moe-2.4b", 16, 1024, 16),
    ("moe-10b", 16, 1536, 32),
    ("moe-27b", 16, 2048, 48),
):
    def _make_moe(name: str = _name, layers: int = _layers, hidden: int = _hidden,
                  experts: int = _experts) -> ModelSpec:
        return moe_decoder(name, layers, hidden, heads=16, num_experts=experts, seq=1024, vocab=32000,
                           meta={"source": f"{_METIS} (suite_manual_moe moe_specs); GShard top-2 gating "
                                           "(Lepikhin et al. 2020)"})

    preset(_name, f"GShard MoE {_layers} layers (every other MoE), hidden {_hidden}, {_experts} experts, "
           f"top-2, seq 1024 (Metis Table 2)")(_make_moe)

for _name, _filters, _width in (
    ("wresnet-1b", 320, 2),
    ("wresnet-2b", 448, 2),
    ("wresnet-4b", 640, 2),
    ("wresnet-6.8b", 320, 16),
):
    def _make_wresnet(name: str = _name, filters: int = _filters, width: int = _width) -> ModelSpec:
        return wide_resnet(name, filters, width, meta={
            "source": f"{_METIS} (suite_wresnet wresnet_specs: 224px, 50 layers, fp32)"})

    preset(_name, f"Wide-ResNet-50, base channels {_filters}, width factor {_width}, 224px, fp32 "
           f"(Metis Table 2)")(_make_wresnet)


# ---------------------------------------------------------------- other reference models

@preset("gpt3-175b", "GPT-3 175B: 96 layers, hidden 12288, 96 heads, seq 2048")
def _gpt3_175b() -> ModelSpec:
    return gpt_decoder("gpt3-175b", num_layers=96, hidden=12288, heads=96, seq=2048, vocab=50257,
                       meta={"source": "Brown et al. 2020 (GPT-3) Table 2.1; Korthikanti et al. 2022 Table 3"})


for _name, _layers, _hidden, _heads, _kv, _ffn, _vocab, _seq, _src in (
    ("llama2-7b", 32, 4096, 32, 32, 11008, 32000, 4096, "Touvron et al. 2023 (Llama 2); HF config"),
    ("llama2-70b", 80, 8192, 64, 8, 28672, 32000, 4096, "Touvron et al. 2023 (Llama 2); HF config"),
    ("llama3-8b", 32, 4096, 32, 8, 14336, 128256, 8192, "Llama 3 (Meta 2024); HF config"),
    ("llama3-70b", 80, 8192, 64, 8, 28672, 128256, 8192, "Llama 3 (Meta 2024); HF config"),
):
    def _make_llama(name: str = _name, layers: int = _layers, hidden: int = _hidden, heads: int = _heads,
                    kv: int = _kv, ffn: int = _ffn, vocab: int = _vocab, seq: int = _seq,
                    src: str = _src) -> ModelSpec:
        return llama_decoder(name, layers, hidden, heads, kv, ffn, vocab, seq, meta={"source": src},
                             rope_theta=500000.0 if name.startswith("llama3") else 10000.0)

    preset(_name, f"Llama {_layers} layers, hidden {_hidden}, {_heads} heads / {_kv} KV heads, SwiGLU "
           f"{_ffn}, vocab {_vocab}, seq {_seq}, bf16")(_make_llama)


@preset("mixtral-8x7b", "Mixtral 8x7B: 32 MoE layers, hidden 4096, 32 heads / 8 KV heads, 8 SwiGLU experts "
        "of 14336, top-2, vocab 32000, seq 4096, bf16")
def _mixtral_8x7b() -> ModelSpec:
    return moe_llama_decoder("mixtral-8x7b", 32, 4096, 32, 8, 32000, 4096, MoEShape(8, 2, 14336), rope_theta=1e6, meta={
        "source": "Jiang et al. 2024 (Mixtral of Experts, arXiv:2401.04088) Table 1; "
                  "HF mistralai/Mixtral-8x7B-v0.1 config.json (rope_theta 1e6)"})


@preset("deepseek-v2-lite", "DeepSeek-V2-Lite: 27 layers (first dense), hidden 2048, 16 heads, MLA (KV rank 512), "
        "64 routed experts of 1408 top-6 + 2 shared, vocab 102400, seq 4096, bf16")
def _deepseek_v2_lite() -> ModelSpec:
    return moe_llama_decoder(
        "deepseek-v2-lite", 27, 2048, 16, 16, 102400, 4096, MoEShape(64, 6, 1408, shared_ffn=2 * 1408),
        dense_ffn=10944, first_dense_layers=1,
        mla=MLAShape(kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128),
        meta={"source": "DeepSeek-AI 2024 (DeepSeek-V2, arXiv:2405.04434) Appendix B; "
                        "HF deepseek-ai/DeepSeek-V2-Lite config.json"})


@preset("deepseek-v3", "DeepSeek-V3: 61 layers (first 3 dense), hidden 7168, 128 heads, MLA (KV rank 512, Q rank "
        "1536), 256 routed experts of 2048 top-8 + 1 shared, vocab 129280, seq 4096, bf16 (no MTP module)")
def _deepseek_v3() -> ModelSpec:
    return moe_llama_decoder(
        "deepseek-v3", 61, 7168, 128, 128, 129280, 4096, MoEShape(256, 8, 2048, shared_ffn=2048),
        dense_ffn=18432, first_dense_layers=3,
        mla=MLAShape(kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, q_lora_rank=1536),
        meta={"source": "DeepSeek-AI 2024 (DeepSeek-V3, arXiv:2412.19437) §4.2; HF deepseek-ai/DeepSeek-V3 "
                        "config.json (the multi-token-prediction module is left out)"})


@preset("tiny-gpt", "Tiny GPT for runtime tests: 4 layers, hidden 64, 4 heads, vocab 256, seq 32, fp32")
def _tiny_gpt() -> ModelSpec:
    return gpt_decoder("tiny-gpt", num_layers=4, hidden=64, heads=4, seq=32, vocab=256, dtype_bytes=4,
                       meta={"source": "hetplan test model (GPT-2 style, tied embeddings)"})


@preset("tiny-moe", "Tiny GShard-style MoE for runtime tests: 4 layers (1 and 3 MoE), hidden 64, 4 heads, "
                    "4 GELU experts of 256, top-2, vocab 256, seq 32, fp32")
def _tiny_moe() -> ModelSpec:
    return moe_decoder("tiny-moe", 4, 64, heads=4, num_experts=4, seq=32, vocab=256, ffn_mult=4, top_k=2,
                       dtype_bytes=4, meta={"source": "hetplan test model (GShard-style, tied embeddings)"})


@preset("tiny-llama-bf16", "Tiny Llama for runtime tests of mixed precision: 4 layers, hidden 64, 4 heads / 2 KV "
                           "heads, SwiGLU 128, vocab 256, seq 32, bf16")
def _tiny_llama_bf16() -> ModelSpec:
    return llama_decoder("tiny-llama-bf16", 4, 64, 4, 2, 128, 256, 32, dtype_bytes=2,
                         meta={"source": "hetplan test model (Llama style, untied head)"})
