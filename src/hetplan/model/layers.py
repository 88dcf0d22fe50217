"""Analytic layer builders: parameters, FLOPs and activation bytes from shapes.

The transformer accounting follows Korthikanti et al. 2022, "Reducing Activation
Recomputation in Large Transformer Models" (arXiv:2205.05198), §4.1, which counts
per layer ``sbh(34 + 5as/h)`` bytes at 16-bit precision, of which ``10sbh`` are
replicated across tensor-parallel ranks and ``5as²b`` form the attention core
that selective recomputation drops. We write each saved tensor out so the same
formula also covers fp32 training (4-byte elements), grouped-query attention,
gated (SwiGLU) MLPs and models without dropout. Dropout masks are 1 byte per
element (Korthikanti §4.1).

FLOPs follow Narayanan et al. 2021 ("Efficient Large-Scale Language Model
Training on GPU Clusters", eq. in §5.1): a multiply-add is 2 FLOPs, so a
``(s×h)·(h×k)`` matmul is ``2shk``; attention scores and scores·V are
``2s²h`` each.
"""

from __future__ import annotations

from dataclasses import dataclass

from hetplan.model.spec import LayerSpec

MASK_BYTES = 1  # dropout masks are stored as 1 byte per element (Korthikanti §4.1)


@dataclass(frozen=True)
class BlockShape:
    """Shape of one transformer block.

    Attributes:
        hidden: model width h.
        heads: attention heads a.
        ffn: MLP inner width (4h in GPT/BERT; ~8h/3 in SwiGLU models).
        seq: sequence length s this block sees.
        kv_heads: key/value heads (grouped-query attention); 0 means = heads.
        gated_mlp: SwiGLU-style MLP with three matrices instead of two.
        bias: linears carry biases (GPT/BERT: yes; Llama: no).
        rms_norm: RMSNorm (weight only) instead of LayerNorm (weight + bias).
        dropout: dropout after attention scores, attention and MLP (training).
        cross_attention: a decoder block that also attends to an encoder output
            of length ``cross_seq`` (T5 decoder).
        cross_seq: encoder sequence length for cross-attention.
        kv_channels: width of one attention head when it is not
            ``hidden // heads`` (T5-3B/11B, Qwen3, Gemma: Megatron's
            ``kv_channels``); 0 means ``hidden // heads`` and an attention
            width of ``hidden``.

    The fields below are optional refinements used by presets to describe what
    a given implementation really keeps for backward; their defaults give
    exactly the Korthikanti accounting above.

        activation: "gelu" (saves its input; the next linear saves its output)
            or "relu" (saves its output, which is also the next linear's input,
            so one tensor fewer unless ``mlp_dropout`` follows it).
        mlp_dropout: dropout on the MLP hidden activation (T5's DenseReluDense):
            a 1-byte mask and a separate dropout output of width ``ffn``.
        norm_saves_normalized: an eager RMSNorm written as
            ``weight * (x * rsqrt(mean(x^2)))`` (HF T5LayerNorm) keeps the
            normalized tensor as well as its input and output: one more
            hidden-sized tensor per norm.
        softmax_saves_input: PyTorch before 1.11 kept the *input* of softmax
            and log_softmax for backward as well as the output (pytorch issue
            #64000, fixed by PR #65242 in 1.11): one more score-sized tensor.
        attn_window: attend within windows of this many tokens (Swin, TransGAN
            local attention) instead of over the whole sequence; 0 = global.
        fused_attention: a fused kernel (FlashAttention / SDPA) that keeps only
            the output and a float32 log-sum-exp per query row, no score matrix.
        save_cross_input: count the encoder output that feeds cross-attention
            K/V in this layer's activations. All decoder layers share one such
            tensor, so a model counts it in one decoder layer only.
    """

    hidden: int
    heads: int
    ffn: int
    seq: int
    kv_heads: int = 0
    gated_mlp: bool = False
    bias: bool = True
    rms_norm: bool = False
    dropout: bool = True
    cross_attention: bool = False
    cross_seq: int = 0
    kv_channels: int = 0
    activation: str = "gelu"
    mlp_dropout: bool = False
    norm_saves_normalized: bool = False
    softmax_saves_input: bool = False
    attn_window: int = 0
    fused_attention: bool = False
    save_cross_input: bool = True

    def __post_init__(self) -> None:
        if self.activation not in ("gelu", "relu"):
            raise ValueError(f"BlockShape.activation must be 'gelu' or 'relu', not {self.activation!r}")

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden // self.heads

    @property
    def attn_width(self) -> int:
        """Width of Q and of the output-projection input (heads x head_dim)."""
        return self.heads * self.kv_channels if self.kv_channels else self.hidden

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads or self.heads


@dataclass
class _Tally:
    """Accumulates one layer's cost while its tensors are written out."""

    params: int = 0
    params_replicated: int = 0
    flops: float = 0.0
    attention_flops: float = 0.0
    gemms: int = 0
    act: float = 0.0
    act_replicated: float = 0.0
    act_core: float = 0.0
    mem_traffic: float = 0.0
    tp_comm: float = 0.0

    def linear(self, rows: int, d_in: int, d_out: int, bias: bool, row_parallel: bool) -> None:
        """A linear layer applied to ``rows`` tokens. Column-parallel biases are
        split by TP, a row-parallel bias is added after the all-reduce (replicated)."""
        self.params += d_in * d_out + (d_out if bias else 0)
        if bias and row_parallel:
            self.params_replicated += d_out
        self.flops += 2.0 * rows * d_in * d_out
        self.gemms += 1

    def norm(self, width: int, rms: bool) -> None:
        n = width if rms else 2 * width
        self.params += n
        self.params_replicated += n

    def layer(self, name: str, kind: str, boundary_bytes: float, tp_max: int) -> LayerSpec:
        """The tallied block as a LayerSpec whose input and output are ``boundary_bytes``."""
        return LayerSpec(
            name=name, kind=kind, params=self.params, params_tp_replicated=self.params_replicated,
            fwd_flops=self.flops, fwd_mem_bytes=self.mem_traffic, attention_flops=self.attention_flops,
            gemm_count=self.gemms, act_bytes=self.act, act_tp_replicated_bytes=self.act_replicated,
            act_attention_core_bytes=self.act_core, input_bytes=boundary_bytes, output_bytes=boundary_bytes,
            tp_comm_bytes=self.tp_comm, tp_max=tp_max,
        )

    def save(self, num_bytes: float, replicated: bool = False, core: bool = False) -> None:
        self.act += num_bytes
        if replicated:
            self.act_replicated += num_bytes
        if core:
            self.act_core += num_bytes


def _attention(t: _Tally, shape: BlockShape, p: int, q_len: int, kv_len: int, kv_is_self: bool) -> None:
    """Self- or cross-attention sub-block with its pre-norm, residual and dropout."""
    h, a, d = shape.hidden, shape.heads, shape.head_dim
    inner = shape.attn_width
    kv_width = shape.num_kv_heads * d
    t.norm(h, shape.rms_norm)
    t.save(p * q_len * h, replicated=True)  # norm input
    if shape.norm_saves_normalized:
        t.save(p * q_len * h, replicated=True)  # normalized tensor before the weight
    t.save(p * q_len * h, replicated=True)  # QKV input (norm output)
    t.linear(q_len, h, inner, shape.bias, row_parallel=False)  # Q
    t.linear(kv_len, h, 2 * kv_width, shape.bias, row_parallel=False)  # K and V
    if not kv_is_self and shape.save_cross_input:
        t.save(p * kv_len * h, replicated=True)  # encoder output feeding K/V
    t.save(p * q_len * inner)  # Q for QK^T
    t.save(p * kv_len * kv_width)  # K for QK^T
    score_len = min(shape.attn_window, kv_len) if shape.attn_window else kv_len
    scores = a * q_len * score_len
    core_flops = 2.0 * q_len * score_len * inner * 2  # QK^T and scores·V
    t.flops += core_flops
    t.attention_flops += core_flops
    t.gemms += 2
    if shape.fused_attention:
        t.save(4.0 * a * q_len, core=True)  # float32 log-sum-exp per query row
    else:
        if shape.softmax_saves_input:
            t.save(p * scores, core=True)  # softmax input (kept by PyTorch < 1.11)
        t.save(p * scores, core=True)  # softmax output
        # elementwise traffic: scale+mask, softmax, (dropout) read+write the scores
        t.mem_traffic += p * scores * (2 + 2 + (2 if shape.dropout else 0))
        if shape.dropout:
            t.save(MASK_BYTES * scores, core=True)  # attention-dropout mask
            t.save(p * scores, core=True)  # attention-dropout output (input of scores·V)
    t.save(p * kv_len * kv_width)  # V for scores·V
    t.save(p * q_len * inner)  # output-projection input
    t.linear(q_len, inner, h, shape.bias, row_parallel=True)  # output projection
    t.tp_comm += p * q_len * h  # all-reduce after the row-parallel projection
    if shape.dropout:
        t.save(MASK_BYTES * q_len * h, replicated=True)
    # norm (r+w), dropout (r+w), residual add (2r+w)
    t.mem_traffic += p * q_len * h * (2 + (2 if shape.dropout else 0) + 3)


def _mlp(t: _Tally, shape: BlockShape, p: int, s: int) -> None:
    h, f = shape.hidden, shape.ffn
    t.norm(h, shape.rms_norm)
    t.save(p * s * h, replicated=True)  # norm input
    if shape.norm_saves_normalized:
        t.save(p * s * h, replicated=True)  # normalized tensor before the weight
    t.save(p * s * h, replicated=True)  # first linear input (norm output)
    if shape.gated_mlp:
        t.linear(s, h, 2 * f, shape.bias, row_parallel=False)  # gate and up
        t.save(p * s * f)  # activation-function input (gate)
        t.save(p * s * f)  # up projection output
        t.save(p * s * f)  # product: down-projection input
        t.mem_traffic += p * s * f * 5  # silu (r+w) and product (2r+w)
        if shape.mlp_dropout:
            t.save(MASK_BYTES * s * f)  # dropout mask on the product
            t.save(p * s * f)  # dropout output: down-projection input
            t.mem_traffic += p * s * f * 2
    elif shape.activation == "relu":
        t.linear(s, h, f, shape.bias, row_parallel=False)
        t.save(p * s * f)  # relu output (its backward, and the next linear's input)
        t.mem_traffic += p * s * f * 2  # relu (r+w)
        if shape.mlp_dropout:
            t.save(MASK_BYTES * s * f)  # dropout mask
            t.save(p * s * f)  # dropout output: second linear input
            t.mem_traffic += p * s * f * 2
    else:
        t.linear(s, h, f, shape.bias, row_parallel=False)
        t.save(p * s * f)  # activation-function input
        if shape.mlp_dropout:
            t.save(MASK_BYTES * s * f)  # dropout mask on the activation output
            t.mem_traffic += p * s * f * 2
        t.save(p * s * f)  # second linear input
        t.mem_traffic += p * s * f * 2  # gelu (r+w)
    t.linear(s, f, h, shape.bias, row_parallel=True)
    t.tp_comm += p * s * h
    if shape.dropout:
        t.save(MASK_BYTES * s * h, replicated=True)
    t.mem_traffic += p * s * h * (2 + (2 if shape.dropout else 0) + 3)


def transformer_block(name: str, kind: str, shape: BlockShape, dtype_bytes: int) -> LayerSpec:
    """One pre-/post-norm transformer block (attention + MLP), per sample.

    With 16-bit elements, ``ffn = 4h``, ``kv_heads = heads`` and dropout, the
    activation total is exactly Korthikanti's ``sh(34 + 5as/h)``, replicated
    part ``10sh`` and attention core ``5as²``.
    """
    p, s = dtype_bytes, shape.seq
    t = _Tally()
    _attention(t, shape, p, s, s, kv_is_self=True)
    if shape.cross_attention:
        _attention(t, shape, p, s, shape.cross_seq, kv_is_self=False)
    _mlp(t, shape, p, s)
    return t.layer(name, kind, p * s * shape.hidden, shape.num_kv_heads)


def embedding_layer(
    name: str,
    vocab: int,
    hidden: int,
    seq: int,
    dtype_bytes: int,
    positions: int = 0,
    token_types: int = 0,
    norm: bool = False,
    dropout: bool = True,
    tied_group: str = "",
) -> LayerSpec:
    """Token (+ learned position / type) embedding. Vocabulary-parallel under TP
    (Megatron), so its output is all-reduced across the TP group."""
    p = dtype_bytes
    params = vocab * hidden + positions * hidden + token_types * hidden + (2 * hidden if norm else 0)
    act = 0.0
    if norm:
        act += p * seq * hidden
    if dropout:
        act += MASK_BYTES * seq * hidden
    return LayerSpec(
        name=name,
        kind="embedding",
        params=params,
        params_tp_replicated=positions * hidden + token_types * hidden + (2 * hidden if norm else 0),
        fwd_flops=0.0,
        fwd_mem_bytes=p * seq * hidden * 3.0,
        gemm_count=1,
        act_bytes=act,
        act_tp_replicated_bytes=act,
        input_bytes=8.0 * seq,  # int64 token ids
        output_bytes=p * seq * hidden,
        tp_comm_bytes=p * seq * hidden,
        tied_group=tied_group,
    )


def lm_head_layer(
    name: str,
    vocab: int,
    hidden: int,
    seq: int,
    dtype_bytes: int,
    norm: bool = True,
    rms_norm: bool = False,
    transform: bool = False,
    tied_group: str = "",
    own_weight: bool = True,
) -> LayerSpec:
    """Final norm + vocabulary projection + cross-entropy.

    The logits are kept for backward in fp32 by the loss (softmax of a
    16-bit input is computed in fp32 in Megatron and HF), so they count 4
    bytes per element whatever the training precision. ``own_weight=False``
    means the projection reuses the embedding matrix (tied, counted there).
    ``transform`` adds BERT's dense + GELU + LayerNorm prediction transform.
    """
    p = dtype_bytes
    params = 0
    replicated = 0
    act = 0.0
    flops = 0.0
    if transform:
        params += hidden * hidden + hidden + 2 * hidden
        replicated += 3 * hidden
        flops += 2.0 * seq * hidden * hidden
        act += p * seq * hidden * 3
    if norm:
        n = hidden if rms_norm else 2 * hidden
        params += n
        replicated += n
        act += p * seq * hidden
    act += p * seq * hidden  # projection input
    if own_weight:
        params += vocab * hidden
    elif tied_group:
        params += vocab * hidden  # the tied copy; ModelSpec counts the group once
    flops += 2.0 * seq * hidden * vocab
    act += 4.0 * seq * vocab  # fp32 logits / softmax for the loss
    return LayerSpec(
        name=name,
        kind="head",
        params=params,
        params_tp_replicated=replicated,
        fwd_flops=flops,
        fwd_mem_bytes=4.0 * seq * vocab * 3,
        gemm_count=2 if transform else 1,
        act_bytes=act,
        act_tp_replicated_bytes=p * seq * hidden * (2 if norm else 1),
        input_bytes=p * seq * hidden,
        output_bytes=4.0,
        tp_comm_bytes=0.0,
        tied_group=tied_group,
        tied_params=vocab * hidden if (tied_group and not own_weight) else 0,
    )


def moe_block(
    name: str,
    kind: str,
    shape: BlockShape,
    dtype_bytes: int,
    num_experts: int,
    top_k: int = 2,
    capacity_factor: float = 1.0,
) -> LayerSpec:
    """A transformer block whose MLP is a mixture of ``num_experts`` experts
    with top-``top_k`` gating (GShard, Lepikhin et al. 2020, §2.2).

    Parameters count every expert; FLOPs and activations count only the
    ``top_k`` routed copies of each token (times ``capacity_factor``, the
    padding of the expert buffers). The router is a ``hidden x num_experts``
    linear whose float32 softmax is kept for backward; the one-hot dispatch
    and combine tensors of the einsum formulation are not counted (index-based
    dispatch does not materialise them).
    """
    if num_experts < 1 or not 1 <= top_k <= num_experts:
        raise ValueError(f"moe_block {name!r}: need 1 <= top_k <= num_experts")
    p, s, h, f = dtype_bytes, shape.seq, shape.hidden, shape.ffn
    rows = top_k * s * capacity_factor  # token copies the experts process
    t = _Tally()
    _attention(t, shape, p, s, s, kv_is_self=True)
    t.norm(h, shape.rms_norm)
    t.save(p * s * h, replicated=True)  # norm input
    t.save(p * s * h, replicated=True)  # router and dispatch input (norm output)
    t.linear(s, h, num_experts, False, row_parallel=False)  # router
    t.save(4.0 * s * num_experts)  # float32 router softmax, kept for backward
    t.params += num_experts * (h * f + f * h + (f + h if shape.bias else 0))  # all experts
    t.flops += 2.0 * rows * (h * f + f * h)
    t.gemms += 2
    t.save(p * rows * h)  # dispatched expert inputs
    t.save(p * rows * f)  # activation-function input
    t.save(p * rows * f)  # second expert linear input
    t.save(p * rows * h)  # expert outputs, weighted by the gates when combined
    t.mem_traffic += p * rows * (2 * h + 2 * f + 2 * h)  # dispatch, gelu, combine
    t.tp_comm += p * s * h
    if shape.dropout:
        t.save(MASK_BYTES * s * h, replicated=True)
    t.mem_traffic += p * s * h * (2 + (2 if shape.dropout else 0) + 3)
    return t.layer(name, kind, p * s * h, shape.num_kv_heads)
