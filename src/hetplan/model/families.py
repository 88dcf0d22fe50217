"""Builders for the model families the papers train, from their shapes.

Each builder returns a :class:`ModelSpec` whose layers are written out with
the same tensor-by-tensor accounting as :mod:`hetplan.model.layers`: every
tensor autograd keeps for backward is counted once, in the layer whose
backward needs it. Where an implementation keeps more than Megatron's fused
kernels do (HF eager attention, PyTorch < 1.11 softmax, eager RMSNorm), the
``BlockShape`` flags say so; ``docs/models.md`` explains each choice and
checks the result against Galvatron-BMW's Table I.

Builders:

* :func:`bert_model` — BERT pre-training (MLM + NSP), HF ``BertForPreTraining``.
* :func:`vit_model` — ViT image classifier, HF ``ViTForImageClassification``.
* :func:`swin_model` — Swin Transformer classifier, HF ``SwinForImageClassification``.
* :func:`t5_model` — T5 v1.0 encoder-decoder, HF ``T5ForConditionalGeneration``.
* :func:`moe_decoder` — GShard MoE language model (every other MLP is an MoE).
* :func:`wide_resnet` — Wide-ResNet (bottleneck blocks) as in Alpa's benchmark.
* :func:`llama_decoder` — Llama-style decoder (RMSNorm, SwiGLU, GQA, no bias).
* :func:`transgan_generator` — AMP's heterogeneous TransGAN generator.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from hetplan.model.layers import (
    MASK_BYTES,
    BlockShape,
    MLAShape,
    MoEShape,
    embedding_layer,
    lm_head_layer,
    moe_block,
    transformer_block,
)
from hetplan.model.spec import LayerSpec, ModelSpec


def _add_params(layer: LayerSpec, extra: int, replicated: bool = True) -> LayerSpec:
    """``layer`` with ``extra`` more parameters (position-bias tables and the like)."""
    return replace(
        layer,
        params=layer.params + extra,
        params_tp_replicated=layer.params_tp_replicated + (extra if replicated else 0),
        profile_key="",
    )


def _loss_bytes(tokens: int, classes: int, logits_bytes: int, softmax_saves_input: bool) -> float:
    """Bytes cross-entropy keeps for backward: the float32 log-softmax output,
    and (PyTorch < 1.11) its input, the logits, too."""
    kept = 4.0 * tokens * classes
    if softmax_saves_input:
        kept += logits_bytes * tokens * classes
    return kept


# --------------------------------------------------------------------------- BERT


def bert_model(
    name: str,
    num_layers: int,
    hidden: int,
    heads: int,
    seq: int = 512,
    vocab: int = 30522,
    dtype_bytes: int = 4,
    softmax_saves_input: bool = False,
    meta: dict[str, Any] | None = None,
) -> ModelSpec:
    """BERT pre-training model (HF ``BertForPreTraining``): word + position +
    token-type embeddings with LayerNorm, post-LN encoder blocks with GELU MLP
    (4h) and dropout, pooler + next-sentence head, and the MLM head
    (dense + GELU + LayerNorm + vocabulary projection tied to the word
    embeddings) over all ``seq`` positions."""
    p = dtype_bytes
    shape = BlockShape(hidden=hidden, heads=heads, ffn=4 * hidden, seq=seq,
                       softmax_saves_input=softmax_saves_input)
    layers = [embedding_layer("embed", vocab, hidden, seq, p, positions=seq, token_types=2,
                              norm=True, dropout=True, tied_group="word_embeddings")]
    layers += [transformer_block(f"layers.{i}", "encoder", shape, p) for i in range(num_layers)]
    # Pooler (dense + tanh on [CLS]) + NSP classifier, and the MLM transform
    # (dense + GELU + LayerNorm) over every position.
    transform_params = (hidden * hidden + hidden) + (2 * hidden + 2) + (hidden * hidden + hidden) + 2 * hidden
    transform_act = p * seq * hidden * 3 + p * hidden  # dense in, GELU in, LN in; tanh out
    layers.append(LayerSpec(
        name="head.transform", kind="head", params=transform_params,
        params_tp_replicated=transform_params,
        fwd_flops=2.0 * seq * hidden * hidden + 2.0 * hidden * hidden,
        fwd_mem_bytes=p * seq * hidden * 6.0, gemm_count=3,
        act_bytes=transform_act, act_tp_replicated_bytes=transform_act,
        input_bytes=p * seq * hidden, output_bytes=p * seq * hidden + 4.0 * 2,
    ))
    head_act = p * seq * hidden + _loss_bytes(seq, vocab, p, softmax_saves_input)
    layers.append(LayerSpec(
        name="head", kind="head", params=vocab * hidden + vocab, params_tp_replicated=0,
        fwd_flops=2.0 * seq * hidden * vocab, fwd_mem_bytes=4.0 * seq * vocab * 3,
        act_bytes=head_act, act_tp_replicated_bytes=p * seq * hidden,
        input_bytes=p * seq * hidden, output_bytes=4.0, tied_group="word_embeddings",
        tied_params=vocab * hidden,
    ))
    return ModelSpec(name=name, family="bert", layers=tuple(layers), seq_len=seq, dtype_bytes=p,
                     hidden_size=hidden, num_heads=heads, vocab_size=vocab, meta=dict(meta or {}))


# --------------------------------------------------------------------------- ViT


def vit_model(
    name: str,
    num_layers: int,
    hidden: int,
    heads: int,
    image_size: int = 224,
    patch_size: int = 16,
    num_classes: int = 1000,
    dtype_bytes: int = 4,
    dropout: bool = False,
    softmax_saves_input: bool = False,
    meta: dict[str, Any] | None = None,
) -> ModelSpec:
    """Vision Transformer classifier (HF ``ViTForImageClassification``): a
    ``patch_size`` convolution, a [CLS] token and learned positions, pre-LN
    blocks, final LayerNorm and a linear classifier on [CLS]."""
    p = dtype_bytes
    patches = (image_size // patch_size) ** 2
    seq = patches + 1
    image_bytes = p * 3 * image_size * image_size
    embed_params = 3 * patch_size * patch_size * hidden + hidden + hidden + seq * hidden
    layers = [LayerSpec(
        name="embed", kind="embedding", params=embed_params, params_tp_replicated=embed_params,
        fwd_flops=2.0 * patches * 3 * patch_size * patch_size * hidden,
        fwd_mem_bytes=p * seq * hidden * 3.0,
        act_bytes=image_bytes, act_tp_replicated_bytes=image_bytes,  # the conv keeps its input
        input_bytes=image_bytes, output_bytes=p * seq * hidden,
    )]
    shape = BlockShape(hidden=hidden, heads=heads, ffn=4 * hidden, seq=seq, dropout=dropout,
                       softmax_saves_input=softmax_saves_input)
    layers += [transformer_block(f"layers.{i}", "encoder", shape, p) for i in range(num_layers)]
    # Final LayerNorm keeps its input; the classifier reads [CLS] through a view
    # that keeps the whole LayerNorm output alive.
    head_act = 2.0 * p * seq * hidden + _loss_bytes(1, num_classes, p, softmax_saves_input)
    head_params = 2 * hidden + hidden * num_classes + num_classes
    layers.append(LayerSpec(
        name="head", kind="head", params=head_params, params_tp_replicated=2 * hidden,
        fwd_flops=2.0 * hidden * num_classes, fwd_mem_bytes=p * seq * hidden * 2.0,
        act_bytes=head_act, act_tp_replicated_bytes=2.0 * p * seq * hidden,
        input_bytes=p * seq * hidden, output_bytes=4.0,
    ))
    return ModelSpec(name=name, family="vit", layers=tuple(layers), seq_len=seq, dtype_bytes=p,
                     hidden_size=hidden, num_heads=heads, meta=dict(meta or {}))


# --------------------------------------------------------------------------- Swin


def swin_model(
    name: str,
    depths: tuple[int, ...],
    embed_dim: int,
    heads: tuple[int, ...],
    window: int = 7,
    image_size: int = 224,
    patch_size: int = 4,
    num_classes: int = 1000,
    dtype_bytes: int = 4,
    softmax_saves_input: bool = False,
    meta: dict[str, Any] | None = None,
) -> ModelSpec:
    """Swin Transformer classifier (HF ``SwinForImageClassification``):
    ``patch_size`` patch embedding + LayerNorm, stages of window-attention
    blocks (window ``window`` x ``window``, relative-position bias table),
    patch merging (LayerNorm(4C) + linear 4C -> 2C) between stages, final
    LayerNorm, average pooling and a linear classifier. Stage ``i`` has width
    ``embed_dim * 2**i`` and ``(image/patch/2**i)**2`` tokens. No dropout (HF
    defaults); stochastic depth keeps only a per-sample scalar."""
    if len(depths) != len(heads):
        raise ValueError("swin_model: depths and heads need one entry per stage")
    p = dtype_bytes
    side = image_size // patch_size
    tokens = side * side
    win_tokens = window * window
    image_bytes = p * 3 * image_size * image_size
    embed_params = 3 * patch_size * patch_size * embed_dim + embed_dim + 2 * embed_dim
    layers = [LayerSpec(
        name="embed", kind="embedding", params=embed_params, params_tp_replicated=embed_params,
        fwd_flops=2.0 * tokens * 3 * patch_size * patch_size * embed_dim,
        fwd_mem_bytes=p * tokens * embed_dim * 4.0,
        act_bytes=image_bytes + p * tokens * embed_dim,  # conv input, LayerNorm input
        act_tp_replicated_bytes=image_bytes + p * tokens * embed_dim,
        input_bytes=image_bytes, output_bytes=p * tokens * embed_dim,
    )]
    width = embed_dim
    for stage, (depth, num_heads) in enumerate(zip(depths, heads)):
        shape = BlockShape(hidden=width, heads=num_heads, ffn=4 * width, seq=tokens, dropout=False,
                           softmax_saves_input=softmax_saves_input,
                           attn_window=min(win_tokens, tokens))
        table = (2 * window - 1) ** 2 * num_heads  # relative-position bias table
        for j in range(depth):
            block = transformer_block(f"layers.{stage}.blocks.{j}", f"swin{stage}", shape, p)
            layers.append(_add_params(block, table, replicated=False))
        if stage < len(depths) - 1:
            merged = tokens // 4
            act = 2.0 * p * merged * 4 * width  # LayerNorm(4C) input and the linear's input
            layers.append(LayerSpec(
                name=f"layers.{stage}.downsample", kind="patch_merging",
                params=8 * width + 8 * width * width, params_tp_replicated=8 * width,
                fwd_flops=2.0 * merged * 4 * width * 2 * width,
                fwd_mem_bytes=p * merged * 4 * width * 4.0,
                act_bytes=act, act_tp_replicated_bytes=act,
                input_bytes=p * tokens * width, output_bytes=p * merged * 2 * width,
                tp_max=num_heads,
            ))
            tokens, width = merged, 2 * width
    head_params = 2 * width + width * num_classes + num_classes
    head_act = 2.0 * p * tokens * width + _loss_bytes(1, num_classes, p, softmax_saves_input)
    layers.append(LayerSpec(
        name="head", kind="head", params=head_params, params_tp_replicated=2 * width,
        fwd_flops=2.0 * width * num_classes, fwd_mem_bytes=p * tokens * width * 3.0,
        act_bytes=head_act, act_tp_replicated_bytes=2.0 * p * tokens * width,
        input_bytes=p * tokens * width, output_bytes=4.0,
    ))
    return ModelSpec(name=name, family="swin", layers=tuple(layers), seq_len=side * side,
                     dtype_bytes=p, hidden_size=width, num_heads=heads[-1], meta=dict(meta or {}))


# --------------------------------------------------------------------------- T5


def t5_model(
    name: str,
    num_encoder_layers: int,
    num_decoder_layers: int,
    hidden: int = 1024,
    heads: int = 16,
    ffn: int = 4096,
    vocab: int = 32128,
    encoder_seq: int = 512,
    decoder_seq: int = 512,
    relative_buckets: int = 32,
    dtype_bytes: int = 4,
    softmax_saves_input: bool = False,
    meta: dict[str, Any] | None = None,
) -> ModelSpec:
    """T5 v1.0 (HF ``T5ForConditionalGeneration``, e.g. ``t5-large``): shared
    token embedding tied to the LM head, RMSNorm written eagerly (keeps the
    normalized tensor), no biases, ReLU MLP with dropout inside, relative
    position bias in the first layer of each stack, dropout 0.1. The decoder
    runs ``decoder_seq`` tokens and cross-attends to ``encoder_seq``.

    The encoder output feeds the cross-attention of every decoder layer; it
    is one tensor, counted once (in ``decoder.layers.0``), but every decoder
    layer passes it on in a pipeline, so it is in their input/output bytes."""
    p = dtype_bytes
    common: dict[str, Any] = dict(hidden=hidden, heads=heads, ffn=ffn, bias=False, rms_norm=True, dropout=True,
                  activation="relu", mlp_dropout=True, norm_saves_normalized=True,
                  softmax_saves_input=softmax_saves_input)
    enc_shape = BlockShape(seq=encoder_seq, **common)
    bias_table = relative_buckets * heads
    enc_out = p * encoder_seq * hidden
    layers = [embedding_layer("embed", vocab, hidden, encoder_seq, p, dropout=True, tied_group="shared")]
    for i in range(num_encoder_layers):
        block = transformer_block(f"encoder.layers.{i}", "encoder", enc_shape, p)
        layers.append(_add_params(block, bias_table) if i == 0 else block)
    # Final RMSNorm (input and normalized tensor kept) + dropout mask.
    norm_act = 2.0 * p * encoder_seq * hidden + MASK_BYTES * encoder_seq * hidden
    layers.append(LayerSpec(
        name="encoder.final_norm", kind="norm", params=hidden, params_tp_replicated=hidden,
        fwd_flops=0.0, fwd_mem_bytes=p * encoder_seq * hidden * 6.0,
        act_bytes=norm_act, act_tp_replicated_bytes=norm_act,
        input_bytes=enc_out, output_bytes=enc_out,
    ))
    dec_embed = embedding_layer("decoder.embed", vocab, hidden, decoder_seq, p, dropout=True,
                                tied_group="shared")
    layers.append(replace(dec_embed, input_bytes=enc_out + 8.0 * decoder_seq,
                          output_bytes=dec_embed.output_bytes + enc_out, profile_key="",
                          tied_params=vocab * hidden))
    for i in range(num_decoder_layers):
        shape = replace(enc_shape, seq=decoder_seq, cross_attention=True, cross_seq=encoder_seq,
                        save_cross_input=(i == 0))
        block = transformer_block(f"decoder.layers.{i}", "decoder", shape, p)
        block = replace(block, input_bytes=block.input_bytes + enc_out,
                        output_bytes=block.output_bytes + enc_out, profile_key="")
        layers.append(_add_params(block, bias_table) if i == 0 else block)
    norm_act = 2.0 * p * decoder_seq * hidden + MASK_BYTES * decoder_seq * hidden
    layers.append(LayerSpec(
        name="decoder.final_norm", kind="norm", params=hidden, params_tp_replicated=hidden,
        fwd_flops=0.0, fwd_mem_bytes=p * decoder_seq * hidden * 8.0,
        act_bytes=norm_act, act_tp_replicated_bytes=norm_act,
        input_bytes=p * decoder_seq * hidden, output_bytes=p * decoder_seq * hidden,
    ))
    # The LM head (tied to the shared embedding) keeps its scaled input.
    head_act = p * decoder_seq * hidden + _loss_bytes(decoder_seq, vocab, p, softmax_saves_input)
    layers.append(LayerSpec(
        name="head", kind="head", params=vocab * hidden, fwd_flops=2.0 * decoder_seq * hidden * vocab,
        fwd_mem_bytes=4.0 * decoder_seq * vocab * 3, act_bytes=head_act,
        act_tp_replicated_bytes=p * decoder_seq * hidden,
        input_bytes=p * decoder_seq * hidden, output_bytes=4.0, tied_group="shared",
        tied_params=vocab * hidden,
    ))
    info = {"encoder_seq": encoder_seq, "decoder_seq": decoder_seq}
    info.update(meta or {})
    return ModelSpec(name=name, family="t5", layers=tuple(layers), seq_len=encoder_seq, dtype_bytes=p,
                     hidden_size=hidden, num_heads=heads, vocab_size=vocab, meta=info)


# --------------------------------------------------------------------------- MoE


def moe_decoder(
    name: str,
    num_layers: int,
    hidden: int,
    heads: int,
    num_experts: int,
    seq: int = 1024,
    vocab: int = 32000,
    ffn_mult: int = 8,
    top_k: int = 2,
    dtype_bytes: int = 2,
    meta: dict[str, Any] | None = None,
) -> ModelSpec:
    """GShard-style MoE language model as Alpa's benchmark builds it (and
    Metis uses): learned positions, tied embeddings, GELU MLP of width
    ``ffn_mult * hidden`` ("specific to gspmd" in Alpa), and every other
    block's MLP replaced by ``num_experts`` experts with top-2 gating."""
    p = dtype_bytes
    shape = BlockShape(hidden=hidden, heads=heads, ffn=ffn_mult * hidden, seq=seq)
    layers = [embedding_layer("embed", vocab, hidden, seq, p, positions=seq, tied_group="wte")]
    for i in range(num_layers):
        if i % 2 == 1:
            layers.append(moe_block(f"layers.{i}", "moe", shape, p, num_experts, top_k))
        else:
            layers.append(transformer_block(f"layers.{i}", "decoder", shape, p))
    layers.append(lm_head_layer("head", vocab, hidden, seq, p, tied_group="wte", own_weight=False))
    info = {"num_experts": num_experts, "top_k": top_k}
    info.update(meta or {})
    return ModelSpec(name=name, family="moe", layers=tuple(layers), seq_len=seq, dtype_bytes=p,
                     hidden_size=hidden, num_heads=heads, vocab_size=vocab, meta=info)


# --------------------------------------------------------------------------- Wide-ResNet


@dataclass
class _ConvTally:
    """Accumulates a convolutional layer's cost (per sample)."""

    p: int
    params: int = 0
    params_replicated: int = 0
    flops: float = 0.0
    gemms: int = 0
    act: float = 0.0
    mem: float = 0.0

    def conv(self, c_in: int, c_out: int, k: int, side_out: int) -> None:
        self.params += k * k * c_in * c_out
        self.flops += 2.0 * side_out * side_out * k * k * c_in * c_out
        self.gemms += 1

    def batchnorm(self, channels: int, side: int) -> None:
        """BatchNorm keeps its input; two parameters per channel."""
        self.params += 2 * channels
        self.params_replicated += 2 * channels
        self.act += self.p * channels * side * side
        self.mem += 2.0 * self.p * channels * side * side

    def relu(self, channels: int, side: int) -> None:
        """ReLU keeps its output (which the next convolution also reads)."""
        self.act += self.p * channels * side * side
        self.mem += 2.0 * self.p * channels * side * side


def wide_resnet(
    name: str,
    num_filters: int,
    width_factor: int,
    stage_sizes: tuple[int, ...] = (3, 4, 6, 3),
    image_size: int = 224,
    num_classes: int = 1024,
    dtype_bytes: int = 4,
    meta: dict[str, Any] | None = None,
) -> ModelSpec:
    """Wide-ResNet-50 as in Alpa's benchmark (``alpa/model/wide_resnet.py``,
    used by Metis): a 7x7/2 stem with BatchNorm, ReLU and 3x3/2 max-pool,
    then bottleneck blocks (1x1 F, 3x3 F*W with the stage's stride, 1x1 4F,
    BatchNorm after each, projection shortcut when the shape changes), stage
    ``i`` having ``F = num_filters * 2**i``; global average pool and a dense
    classifier. Convolutions have no bias. One layer per bottleneck block:
    later blocks are wider and cost more. ``seq_len`` is 1 (one image)."""
    p = dtype_bytes
    side = image_size // 2
    t = _ConvTally(p)
    image_bytes = p * 3 * image_size * image_size
    t.act += image_bytes  # the stem convolution keeps its input
    t.conv(3, num_filters, 7, side)
    t.batchnorm(num_filters, side)
    t.relu(num_filters, side)
    side //= 2
    t.act += 8.0 * num_filters * side * side  # max-pool argmax indices (int64)
    t.act += p * num_filters * side * side  # max-pool output: the first block's input
    layers = [LayerSpec(
        name="stem", kind="conv_stem", params=t.params, params_tp_replicated=t.params_replicated,
        fwd_flops=t.flops, fwd_mem_bytes=t.mem, gemm_count=t.gemms, act_bytes=t.act,
        act_tp_replicated_bytes=t.act, input_bytes=image_bytes,
        output_bytes=p * num_filters * side * side, tp_max=num_filters,
    )]
    channels = num_filters
    index = 0
    for stage, blocks in enumerate(stage_sizes):
        filters = num_filters * 2**stage
        for j in range(blocks):
            stride = 2 if stage > 0 and j == 0 else 1
            out_side = side // stride
            t = _ConvTally(p)
            t.conv(channels, filters, 1, side)
            t.batchnorm(filters, side)
            t.relu(filters, side)
            t.conv(filters, filters * width_factor, 3, out_side)
            t.batchnorm(filters * width_factor, out_side)
            t.relu(filters * width_factor, out_side)
            t.conv(filters * width_factor, 4 * filters, 1, out_side)
            t.batchnorm(4 * filters, out_side)
            if channels != 4 * filters or stride != 1:
                t.conv(channels, 4 * filters, 1, out_side)  # projection shortcut
                t.batchnorm(4 * filters, out_side)
            t.relu(4 * filters, out_side)  # block output (kept by the final ReLU)
            t.mem += 3.0 * p * 4 * filters * out_side * out_side  # residual add
            layers.append(LayerSpec(
                name=f"layers.{index}", kind=f"bottleneck{stage}", params=t.params,
                params_tp_replicated=t.params_replicated, fwd_flops=t.flops, fwd_mem_bytes=t.mem,
                gemm_count=t.gemms, act_bytes=t.act, act_tp_replicated_bytes=0.0,
                input_bytes=p * channels * side * side,
                output_bytes=p * 4 * filters * out_side * out_side,
                # channel-split TP: two all-reduces per block (after the 3x3 and the last 1x1)
                tp_comm_bytes=p * (filters * width_factor + 4 * filters) * out_side * out_side,
                tp_max=filters,
            ))
            channels, side, index = 4 * filters, out_side, index + 1
    head_params = channels * num_classes + num_classes
    layers.append(LayerSpec(
        name="head", kind="head", params=head_params, params_tp_replicated=num_classes,
        fwd_flops=2.0 * channels * num_classes + channels * side * side,
        fwd_mem_bytes=p * channels * side * side,
        act_bytes=p * channels + 4.0 * num_classes, input_bytes=p * channels * side * side,
        output_bytes=4.0,
    ))
    info = {"num_filters": num_filters, "width_factor": width_factor, "image_size": image_size}
    info.update(meta or {})
    return ModelSpec(name=name, family="wresnet", layers=tuple(layers), seq_len=1, dtype_bytes=p,
                     meta=info)


# --------------------------------------------------------------------------- Llama


def llama_decoder(
    name: str,
    num_layers: int,
    hidden: int,
    heads: int,
    kv_heads: int,
    ffn: int,
    vocab: int,
    seq: int,
    dtype_bytes: int = 2,
    meta: dict[str, Any] | None = None,
    rope_theta: float = 10000.0,
) -> ModelSpec:
    """Llama-style decoder: token embedding (no learned positions: RoPE),
    RMSNorm, grouped-query attention with ``kv_heads`` K/V heads, SwiGLU MLP
    of width ``ffn``, no biases, no dropout, untied LM head. Attention runs in
    a fused kernel (PyTorch SDPA / FlashAttention, as torchtitan trains these
    models), so no score matrix is kept for backward."""
    p = dtype_bytes
    shape = BlockShape(hidden=hidden, heads=heads, ffn=ffn, seq=seq, kv_heads=kv_heads, gated_mlp=True,
                       bias=False, rms_norm=True, dropout=False, fused_attention=True)
    layers = [embedding_layer("embed", vocab, hidden, seq, p, dropout=False)]
    layers += [transformer_block(f"layers.{i}", "decoder", shape, p) for i in range(num_layers)]
    layers.append(lm_head_layer("head", vocab, hidden, seq, p, norm=True, rms_norm=True))
    # what a tool needs to build the same model (hetplan.export.tools.architecture)
    info: dict[str, Any] = {"architecture": {
        "kv_heads": kv_heads, "ffn": ffn, "gated_mlp": True, "norm": "rmsnorm", "positions": "rope",
        "max_positions": seq, "bias": False, "tied_embeddings": False, "dropout": False, "rope_theta": rope_theta}}
    info.update(meta or {})
    return ModelSpec(name=name, family="llama", layers=tuple(layers), seq_len=seq, dtype_bytes=p,
                     hidden_size=hidden, num_heads=heads, vocab_size=vocab, meta=info)


# --------------------------------------------------------------------------- MoE decoders (Mixtral, DeepSeek)


def moe_llama_decoder(
    name: str,
    num_layers: int,
    hidden: int,
    heads: int,
    kv_heads: int,
    vocab: int,
    seq: int,
    moe: MoEShape,
    dense_ffn: int = 0,
    first_dense_layers: int = 0,
    mla: MLAShape | None = None,
    dtype_bytes: int = 2,
    meta: dict[str, Any] | None = None,
    rope_theta: float = 0.0,
) -> ModelSpec:
    """A Llama-style decoder whose MLPs are mixtures of experts, as
    Mixtral (every block: ``moe``) and DeepSeek-V2/V3 (the first
    ``first_dense_layers`` blocks keep a dense SwiGLU MLP of ``dense_ffn``,
    attention is multi-head latent attention ``mla``) are built; the same
    blocks as HF import builds (``hetplan.model.hf``). Fused attention, no
    dropout, untied LM head."""
    p = dtype_bytes
    shape = BlockShape(hidden=hidden, heads=heads, ffn=dense_ffn, seq=seq, kv_heads=kv_heads, gated_mlp=True,
                       bias=False, rms_norm=True, dropout=False, fused_attention=True)
    layers = [embedding_layer("embed", vocab, hidden, seq, p, dropout=False)]
    for i in range(num_layers):
        if i < first_dense_layers:
            layers.append(transformer_block(f"layers.{i}", "decoder", shape, p, mla=mla))
        else:
            layers.append(transformer_block(f"layers.{i}", "moe", shape, p, moe=moe, mla=mla))
    layers.append(lm_head_layer("head", vocab, hidden, seq, p, norm=True, rms_norm=True))
    info: dict[str, Any] = {"num_experts": moe.num_experts, "top_k": moe.top_k, "expert_ffn": moe.expert_ffn,
                            "shared_ffn": moe.shared_ffn, "moe_layers": num_layers - first_dense_layers,
                            "latent_attention": mla is not None}
    if mla is None:  # what a tool needs to build the same model (hetplan.export.tools.architecture)
        info["architecture"] = {
            "kv_heads": kv_heads, "ffn": dense_ffn or moe.expert_ffn, "gated_mlp": True, "norm": "rmsnorm",
            "positions": "rope", "max_positions": seq, "bias": False, "tied_embeddings": False, "dropout": False}
        if rope_theta:
            info["architecture"]["rope_theta"] = rope_theta
    info.update(meta or {})
    return ModelSpec(name=name, family="moe", layers=tuple(layers), seq_len=seq, dtype_bytes=p,
                     hidden_size=hidden, num_heads=heads, vocab_size=vocab, meta=info)


# --------------------------------------------------------------------------- TransGAN


def transgan_generator(
    name: str,
    depth_high: int = 12,
    depth_low: int = 12,
    dim: int = 1024,
    heads: int = 4,
    bottom: int = 9,
    window: int = 18,
    latent_dim: int = 512,
    dtype_bytes: int = 2,
    meta: dict[str, Any] | None = None,
) -> ModelSpec:
    """AMP's heterogeneous TransGAN generator (AMP §4.3, "12 layers with
    dimensions 1024, and 12 layers with dimensions 16"), built as AMP's code
    builds it (``g_depth 12,0,0,0,0,12``, ``bottom_width 9``,
    ``g_window_size 18``, ``gf_dim 1024``, DeepSpeed ``--fp16``):

    * ``embed``: latent (512) -> linear to ``bottom**2`` tokens of ``dim``;
    * ``layers.0..11``: blocks of width ``dim`` on 9x9 = 81 tokens (global
      attention over the 81 tokens);
    * ``upsample``: five resolution doublings with no blocks (two bicubic
      ones keeping the width, three pixel shuffles dividing it by 4), to
      288x288 = 82,944 tokens of width ``dim / 64`` = 16, with the per-stage
      position embeddings;
    * ``layers.12..23``: blocks of width 16 on 82,944 tokens, attention in
      18x18 = 324-token windows (AMP's cost model: ``s = 4 * bottom**2``);
    * ``head``: 1x1 convolution to RGB.

    PixelNorm (no parameters) stands in for LayerNorm, each attention has a
    relative-position bias table and a noise-strength scalar. The two halves
    have almost the same activation volume per layer boundary but very
    different FLOPs and memory: AMP's heterogeneous model."""
    p = dtype_bytes
    tokens = bottom * bottom
    layers = [LayerSpec(
        name="embed", kind="embedding",
        params=latent_dim * tokens * dim + tokens * dim + tokens * dim,
        params_tp_replicated=tokens * dim,
        fwd_flops=2.0 * latent_dim * tokens * dim, fwd_mem_bytes=p * tokens * dim * 3.0,
        act_bytes=p * latent_dim, act_tp_replicated_bytes=p * latent_dim,
        input_bytes=p * latent_dim, output_bytes=p * tokens * dim,
    )]

    def block(i: int, width: int, seq: int, win: int) -> LayerSpec:
        shape = BlockShape(hidden=width, heads=heads, ffn=4 * width, seq=seq, rms_norm=True,
                           dropout=False, attn_window=win)
        layer = transformer_block(f"layers.{i}", f"transgan{width}", shape, p)
        # PixelNorm has no weight (the rms_norm tally gave it ``width`` each);
        # add the relative-position table and the noise-strength scalar.
        side = int(round(min(win or seq, seq) ** 0.5))
        extra = (2 * side - 1) ** 2 * heads + 1 - 2 * width
        return _add_params(layer, extra)

    layers += [block(i, dim, tokens, 0) for i in range(depth_high)]
    # Upsampling: bicubic x2 twice (width kept), pixel shuffle x2 three times (width / 4).
    sides, widths = [], []
    side, width = bottom, dim
    for step in range(5):
        side *= 2
        if step >= 2:
            width //= 4
        sides.append(side)
        widths.append(width)
    pos_params = sum(s * s * w for s, w in zip(sides, widths))
    low_tokens, low_dim = sides[-1] ** 2, widths[-1]
    layers.append(LayerSpec(
        name="upsample", kind="upsample", params=pos_params, params_tp_replicated=pos_params,
        fwd_flops=0.0, fwd_mem_bytes=float(sum(p * s * s * w * 3 for s, w in zip(sides, widths))),
        act_bytes=0.0, input_bytes=p * tokens * dim, output_bytes=p * low_tokens * low_dim,
    ))
    layers += [block(depth_high + i, low_dim, low_tokens, window * window) for i in range(depth_low)]
    layers.append(LayerSpec(
        name="head", kind="head", params=low_dim * 3 + 3, params_tp_replicated=low_dim * 3 + 3,
        fwd_flops=2.0 * low_tokens * low_dim * 3, fwd_mem_bytes=p * low_tokens * (low_dim + 3) * 1.0,
        act_bytes=p * low_tokens * low_dim, act_tp_replicated_bytes=p * low_tokens * low_dim,
        input_bytes=p * low_tokens * low_dim, output_bytes=p * low_tokens * 3,
    ))
    info = {"tokens_high": tokens, "tokens_low": low_tokens, "dim_low": low_dim,
            "attn_window_low": window * window}
    info.update(meta or {})
    return ModelSpec(name=name, family="transgan", layers=tuple(layers), seq_len=tokens, dtype_bytes=p,
                     hidden_size=dim, num_heads=heads, meta=info)
