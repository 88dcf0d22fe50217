"""Built-in model presets reproduce the papers' published sizes.

The activation checks compare against Galvatron-BMW's Table I, whose
"Acti. Size/sample" column is in MB = 2**20 bytes. docs/models.md explains how
the accounting reproduces it and why the two T5-512/4 rows cannot be matched.
"""

from __future__ import annotations

import re

import pytest

from hetplan.model.layers import BlockShape, moe_block, transformer_block
from hetplan.model.presets import get_model, model_descriptions, model_names

MB = 2**20

REQUIRED = [
    "gpt2-amp", "transgan-het",
    "bert-huge-32", "bert-huge-48", "bert-xhuge", "vit-huge-32", "vit-huge-48", "vit-xhuge",
    "t5-large-32", "t5-large-48", "t5-512-4-32", "t5-512-4-48", "swin-huge-32", "swin-huge-48",
    "gpt3-1.3b", "gpt3-2.6b", "gpt3-6.7b", "gpt3-15b", "gpt3-175b",
    "moe-1.3b", "moe-2.4b", "moe-10b", "moe-27b",
    "wresnet-1b", "wresnet-2b", "wresnet-4b", "wresnet-6.8b",
    "llama2-7b", "llama3-8b", "llama2-70b", "llama3-70b", "tiny-gpt",
]

# Galvatron-BMW Table I: (parameters, activation MB per sample).
TABLE_I = {
    "bert-huge-32": (672e6, 3149.39),
    "bert-huge-48": (987e6, 4657.51),
    "bert-xhuge": (10.2e9, 24210.05),
    "vit-huge-32": (632e6, 646.5),
    "vit-huge-48": (947e6, 968.59),
    "vit-xhuge": (10.1e9, 5313.9),
    "t5-large-32": (502e6, 4119.66),
    "t5-large-48": (737e6, 6107.75),
    "t5-512-4-32": (502e6, 1777.06),
    "t5-512-4-48": (737e6, 2473.10),
    "swin-huge-32": (701e6, 726.59),
    "swin-huge-48": (1016e6, 1016.8),
}
# Rows whose activation size no accounting consistent with the T5-Large rows
# can reproduce (see test_t5_512_4_table_rows_are_inconsistent_with_t5_large).
ACTIVATION_GAP = {"t5-512-4-32", "t5-512-4-48"}


@pytest.fixture(scope="module")
def models():
    return {name: get_model(name) for name in model_names()}


def test_every_required_preset_exists_and_builds(models):
    missing = [name for name in REQUIRED if name not in models]
    assert not missing, f"missing presets: {missing}"
    for name, model in models.items():
        assert model.name == name
        assert model.family, name
        assert "source" in model.meta and model.meta["source"], name
        assert model.total_params > 0 and model.fwd_flops_per_sample > 0 and model.act_bytes_per_sample > 0
        assert name in model_descriptions()


def test_layer_names_are_unique_module_paths(models):
    pattern = re.compile(r"^[a-z_]+(\.[a-z_0-9]+)*$")
    for name, model in models.items():
        names = [layer.name for layer in model.layers]
        assert len(set(names)) == len(names), name
        for layer_name in names:
            assert pattern.match(layer_name), f"{name}: {layer_name!r}"


@pytest.mark.parametrize("name", sorted(TABLE_I))
def test_table_i_parameters_within_5_percent(models, name):
    expected, _ = TABLE_I[name]
    assert models[name].total_params == pytest.approx(expected, rel=0.05)


@pytest.mark.parametrize("name", sorted(set(TABLE_I) - ACTIVATION_GAP))
def test_table_i_activation_per_sample_within_5_percent(models, name):
    _, expected_mb = TABLE_I[name]
    assert models[name].act_bytes_per_sample / MB == pytest.approx(expected_mb, rel=0.05)


def test_table_i_activations_scale_with_depth_like_the_table(models):
    """The 48-layer minus 32-layer difference (16 extra layers, everything
    else equal) isolates one layer's activation: it must match the table's
    difference too, so the agreement is not a cancellation of errors."""
    for short, long in (("bert-huge-32", "bert-huge-48"), ("vit-huge-32", "vit-huge-48"),
                        ("t5-large-32", "t5-large-48"), ("swin-huge-32", "swin-huge-48")):
        ours = (models[long].act_bytes_per_sample - models[short].act_bytes_per_sample) / MB
        paper = TABLE_I[long][1] - TABLE_I[short][1]
        assert ours == pytest.approx(paper, rel=0.05), (short, long)


def test_t5_512_4_table_rows_are_inconsistent_with_t5_large(models):
    """Why the two T5-512/4 rows are a documented gap: between 32 and 48
    layers the table adds 8 encoder + 8 decoder layers for 696 MB, i.e. 87 MB
    per encoder+decoder pair, less than one T5-Large encoder layer (same
    shape, same sequence 512), which the T5-Large rows put at ~91 MB. Our
    model keeps the honest encoder and stays below the table."""
    slope = (TABLE_I["t5-512-4-48"][1] - TABLE_I["t5-512-4-32"][1]) / 8
    encoder = models["t5-512-4-32"].layers[models["t5-512-4-32"].layer_index("encoder.layers.1")]
    assert encoder.act_bytes / MB > slope
    large = models["t5-large-32"].layers[models["t5-large-32"].layer_index("encoder.layers.1")]
    assert encoder.act_bytes == large.act_bytes
    for name in ACTIVATION_GAP:
        assert models[name].act_bytes_per_sample / MB < TABLE_I[name][1]


def test_t5_512_4_decoder_layers_are_far_lighter_than_encoder_layers(models):
    model = models["t5-512-4-48"]
    enc = [layer for layer in model.layers if layer.name.startswith("encoder.layers.")]
    dec = [layer for layer in model.layers if layer.name.startswith("decoder.layers.")]
    assert len(enc) == len(dec) == 24
    assert max(layer.act_bytes for layer in dec) * 10 < min(layer.act_bytes for layer in enc)
    # ... while each decoder layer holds more parameters (the cross-attention).
    assert min(layer.params for layer in dec) > max(layer.params for layer in enc[1:])


@pytest.mark.parametrize("name, expected", [
    ("gpt3-1.3b", 1.3e9), ("gpt3-2.6b", 2.6e9), ("gpt3-6.7b", 6.7e9), ("gpt3-15b", 15e9),
    ("gpt3-175b", 175e9),
    ("moe-1.3b", 1.3e9), ("moe-2.4b", 2.4e9), ("moe-10b", 10e9), ("moe-27b", 27e9),
    ("wresnet-1b", 1e9), ("wresnet-2b", 2e9), ("wresnet-4b", 4e9), ("wresnet-6.8b", 6.8e9),
    ("gpt2-amp", 355e6),
])
def test_parameter_counts_match_the_names(models, name, expected):
    assert models[name].total_params == pytest.approx(expected, rel=0.05)


@pytest.mark.parametrize("name, expected", [
    # Parameter counts of the released checkpoints (HF model cards / safetensors index).
    ("llama2-7b", 6_738_415_616), ("llama2-70b", 68_976_648_192),
    ("llama3-8b", 8_030_261_248), ("llama3-70b", 70_553_706_496),
])
def test_llama_parameter_counts_within_1_percent(models, name, expected):
    assert models[name].total_params == pytest.approx(expected, rel=0.01)


def test_llama_presets_use_gqa_swiglu_and_no_score_matrix(models):
    model = models["llama3-8b"]
    block = model.layers[1]
    h, s, kv = 4096, 8192, 8 * 128
    # q, k, v, o + gate/up/down + two RMSNorm weights, no biases.
    assert block.params == 2 * h * h + 2 * h * kv + 3 * h * 14336 + 2 * h
    assert block.tp_max == 8  # TP cannot split 8 KV heads further
    # fused attention keeps no s x s scores: the core is the float32 log-sum-exp only
    assert block.act_attention_core_bytes == 4.0 * 32 * s
    assert models["llama3-8b"].layers[-1].tied_group == ""  # untied LM head


def test_moe_flops_per_token_far_below_a_dense_model_of_the_same_size(models):
    for name in ("moe-1.3b", "moe-2.4b", "moe-10b", "moe-27b"):
        model = models[name]
        flops_per_token = model.fwd_flops_per_sample / model.seq_len
        dense_equivalent = 2.0 * model.total_params  # forward FLOPs per token of a dense model
        assert flops_per_token < 0.35 * dense_equivalent, name
    big = models["moe-27b"]
    assert big.fwd_flops_per_sample / big.seq_len < 0.1 * 2.0 * big.total_params


def test_moe_layer_counts_all_experts_but_routes_top2():
    shape = BlockShape(hidden=512, heads=8, ffn=4096, seq=128)
    dense = transformer_block("d", "decoder", shape, 2)
    for experts in (4, 16):
        moe = moe_block("m", "moe", shape, 2, num_experts=experts, top_k=2)
        expert_params = 2 * 512 * 4096 + 4096 + 512
        assert moe.params - dense.params == (experts - 1) * expert_params + 512 * experts
        mlp_flops = 2.0 * 128 * 2 * 512 * 4096
        # two routed experts: one extra MLP's worth of FLOPs, plus the router
        assert moe.fwd_flops - dense.fwd_flops == pytest.approx(mlp_flops + 2.0 * 128 * 512 * experts)
    with pytest.raises(ValueError):
        moe_block("m", "moe", shape, 2, num_experts=2, top_k=3)


def test_wide_resnet_later_blocks_are_heavier_in_parameters(models):
    """Wide-ResNet is Metis's heterogeneous model: each stage halves the
    resolution and doubles the width, so a block's parameters (model-state
    memory, gradient traffic) grow ~4x per stage while its activations shrink;
    FLOPs per block stay within 1.5x of each other by ResNet's design."""
    for name in ("wresnet-1b", "wresnet-2b", "wresnet-4b", "wresnet-6.8b"):
        blocks = [layer for layer in models[name].layers if layer.name.startswith("layers.")]
        assert len(blocks) == 16
        first, last = blocks[1], blocks[-1]  # same position within their stage
        assert last.params > 50 * first.params, name
        assert last.act_bytes < first.act_bytes, name
        params = [layer.params for layer in blocks]
        stage_starts = [0, 3, 7, 13]
        for a, b in zip(stage_starts, stage_starts[1:]):
            assert min(params[b:]) > max(params[a:b]), name
        flops = [layer.fwd_flops for layer in blocks]
        assert max(flops) < 1.5 * min(flops), name
    assert models["wresnet-6.8b"].seq_len == 1 and models["wresnet-6.8b"].dtype_bytes == 4


def test_transgan_halves_are_heterogeneous(models):
    model = models["transgan-het"]
    wide = [l for l in model.layers if l.kind == "transgan1024"]
    narrow = [l for l in model.layers if l.kind == "transgan16"]
    assert len(wide) == len(narrow) == 12
    assert wide[0].params > 1000 * narrow[0].params
    assert narrow[0].act_bytes > 50 * wide[0].act_bytes
    assert model.meta["tokens_low"] == 288 * 288 and model.meta["dim_low"] == 16


def test_tiny_gpt_is_small_and_fp32(models):
    model = models["tiny-gpt"]
    assert model.dtype_bytes == 4 and model.seq_len == 32 and model.vocab_size == 256
    assert model.hidden_size == 64 and model.num_heads == 4
    assert [layer.name for layer in model.layers] == ["embed", "layers.0", "layers.1", "layers.2",
                                                      "layers.3", "head"]


def test_korthikanti_block_accounting_is_exact():
    """Korthikanti et al. 2022 §4.1: sbh(34 + 5as/h) bytes at 16-bit with
    dropout, 10sbh of it replicated under TP and 5as²b in the attention core."""
    for s, h, a in ((2048, 6144, 64), (1024, 1024, 16), (512, 1280, 16)):
        layer = transformer_block("l", "decoder", BlockShape(hidden=h, heads=a, ffn=4 * h, seq=s), 2)
        assert layer.act_bytes == pytest.approx(s * h * (34 + 5 * a * s / h), rel=1e-12)
        assert layer.act_tp_replicated_bytes == pytest.approx(10 * s * h, rel=1e-12)
        assert layer.act_attention_core_bytes == pytest.approx(5 * a * s * s, rel=1e-12)


def test_accounting_options_change_what_they_say():
    base = BlockShape(hidden=1024, heads=16, ffn=4096, seq=512)
    ref = transformer_block("l", "e", base, 4)
    scores = 16 * 512 * 512
    old_torch = transformer_block("l", "e", BlockShape(**{**base.__dict__, "softmax_saves_input": True}), 4)
    assert old_torch.act_bytes - ref.act_bytes == 4 * scores
    windowed = transformer_block("l", "e", BlockShape(**{**base.__dict__, "attn_window": 64}), 4)
    assert ref.act_attention_core_bytes / windowed.act_attention_core_bytes == pytest.approx(512 / 64)
    fused = transformer_block("l", "e", BlockShape(**{**base.__dict__, "fused_attention": True}), 4)
    assert fused.act_attention_core_bytes == 4 * 16 * 512
    assert fused.fwd_flops == ref.fwd_flops
    relu = transformer_block("l", "e", BlockShape(**{**base.__dict__, "activation": "relu"}), 4)
    assert ref.act_bytes - relu.act_bytes == 4 * 512 * 4096
    with pytest.raises(ValueError):
        BlockShape(hidden=8, heads=2, ffn=32, seq=4, activation="tanh")
