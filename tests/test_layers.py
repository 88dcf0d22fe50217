"""The analytic layer accounting reproduces Korthikanti et al. 2022 exactly."""

import pytest

from hetplan.model.layers import BlockShape, transformer_block


@pytest.mark.parametrize("h,a,s", [(1024, 16, 1024), (6144, 64, 2048), (12288, 96, 2048)])
def test_transformer_block_matches_korthikanti(h: int, a: int, s: int) -> None:
    layer = transformer_block("l", "decoder", BlockShape(hidden=h, heads=a, ffn=4 * h, seq=s), dtype_bytes=2)
    # per sample: s*h*(34 + 5*a*s/h) bytes, 10sh replicated across TP, 5as^2 attention core
    assert layer.act_bytes == pytest.approx(s * h * (34 + 5 * a * s / h))
    assert layer.act_tp_replicated_bytes == pytest.approx(10 * s * h)
    assert layer.act_attention_core_bytes == pytest.approx(5 * a * s * s)
    # 12h^2 + 13h parameters (Megatron GPT block with biases and two LayerNorms)
    assert layer.params == 12 * h * h + 13 * h
    # forward FLOPs: 24 s h^2 + 4 s^2 h (Narayanan et al. 2021)
    assert layer.fwd_flops == pytest.approx(24 * s * h * h + 4 * s * s * h)


def test_fp32_doubles_float_tensors_but_not_masks() -> None:
    shape = BlockShape(hidden=256, heads=4, ffn=1024, seq=128)
    half = transformer_block("l", "decoder", shape, 2)
    full = transformer_block("l", "decoder", shape, 4)
    masks = 2 * 128 * 256 + 4 * 128 * 128  # two hidden-size dropout masks + attention dropout mask
    assert full.act_bytes - masks == pytest.approx(2 * (half.act_bytes - masks))


def test_gqa_and_swiglu_reduce_kv_and_add_gate() -> None:
    mha = transformer_block("l", "d", BlockShape(4096, 32, 11008, 4096, gated_mlp=True, bias=False,
                                                 rms_norm=True, dropout=False), 2)
    gqa = transformer_block("l", "d", BlockShape(4096, 32, 11008, 4096, kv_heads=8, gated_mlp=True, bias=False,
                                                 rms_norm=True, dropout=False), 2)
    # Llama-2-7B block: 4*4096^2 attention + 3*4096*11008 MLP + 2 RMSNorm weights
    assert mha.params == 4 * 4096 * 4096 + 3 * 4096 * 11008 + 2 * 4096
    assert gqa.params == mha.params - 2 * 4096 * (4096 - 1024)
    assert gqa.tp_max == 8 and mha.tp_max == 32


def test_linear_inputs_of_swiglu_and_moe_blocks() -> None:
    """The saved inputs of linear layers (FP8 keeps them in one byte): a
    Llama block's QKV, output-projection and gate/up inputs (2sh each, the
    norm outputs not split by TP) and the down-projection input (2sf); a MoE
    block's expert inputs (2·k·s·h) and down-projection inputs (2·k·s·f)
    instead of the dense MLP's, the router's input not counted (it stays 16-bit)."""
    from hetplan.model.layers import MoEShape

    h, f, s = 256, 688, 128
    shape = BlockShape(h, 4, f, s, gated_mlp=True, bias=False, rms_norm=True, dropout=False)
    dense = transformer_block("l", "decoder", shape, 2)
    assert dense.act_linear_input_bytes == 2 * s * h * 3 + 2 * s * f
    assert dense.act_linear_input_replicated_bytes == 2 * s * h * 2
    k, fe = 2, 96
    moe = transformer_block("m", "moe", shape, 2, moe=MoEShape(8, k, fe))
    assert moe.act_linear_input_bytes == 2 * s * h * 2 + 2 * k * s * h + 2 * k * s * fe
    assert moe.act_linear_input_replicated_bytes == 2 * s * h
