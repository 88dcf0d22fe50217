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

from dataclasses import dataclass, replace
from typing import Any

from hetplan.model.spec import LayerSpec

MASK_BYTES = 1  # dropout masks are stored as 1 byte per element (Korthikanti §4.1)
# Block kinds whose self-attention is causal: decoder blocks, dense or
# mixture-of-experts (hetplan.model names MoE decoder blocks "moe").
CAUSAL_KINDS = frozenset({"decoder", "moe"})


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


@dataclass(frozen=True)
class MoEShape:
    """The MLP of a mixture-of-experts block: a router picks ``top_k`` of
    ``num_experts`` routed experts for each token (GShard, Lepikhin et al.
    2020, §2.2), and shared experts, when there are any, see every token
    (DeepSeekMoE, Dai et al. 2024, arXiv:2401.06066, §3.2).

    Attributes:
        num_experts: routed experts (Mixtral ``num_local_experts``, Qwen-MoE
            ``num_experts``, DeepSeek ``n_routed_experts``).
        top_k: routed experts per token (``num_experts_per_tok``).
        expert_ffn: inner width of one routed expert.
        shared_ffn: inner width of all shared experts together (DeepSeek
            ``n_shared_experts * moe_intermediate_size``, Qwen2-MoE
            ``shared_expert_intermediate_size``); 0: none.
        shared_gate: a sigmoid gate (a ``hidden x 1`` linear) scales the
            shared experts' output (Qwen2-MoE ``shared_expert_gate``).
        gated: SwiGLU experts (three matrices) rather than GELU (two).
        capacity_factor: token copies the experts process per routed copy
            (> 1 where expert buffers are padded to a fixed capacity; 1 for
            dropless MoE, as Mixtral, Qwen-MoE and DeepSeek train).
    """

    num_experts: int
    top_k: int
    expert_ffn: int
    shared_ffn: int = 0
    shared_gate: bool = False
    gated: bool = True
    capacity_factor: float = 1.0

    def __post_init__(self) -> None:
        if self.num_experts < 1 or not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"MoEShape: need 1 <= top_k ({self.top_k}) <= num_experts ({self.num_experts})")

    def active_params(self, hidden: int) -> int:
        """Expert parameters one token passes through: ``top_k`` routed experts and the shared ones."""
        per_width = (3 if self.gated else 2) * hidden
        return self.top_k * self.expert_ffn * per_width + self.shared_ffn * 3 * hidden


@dataclass(frozen=True)
class MLAShape:
    """DeepSeek's multi-head latent attention (DeepSeek-V2, arXiv:2405.04434,
    §2.1.2-2.1.3; DeepSeek-V3, arXiv:2412.19437, §2.1.1): queries and keys/values
    go through low-rank latents, and each head's key has a ``qk_nope_head_dim``
    part from the KV latent and a ``qk_rope_head_dim`` RoPE part shared by all
    heads.

    Attributes:
        kv_lora_rank: width of the compressed KV latent.
        qk_nope_head_dim, qk_rope_head_dim: per-head query/key widths
            without and with rotary positions.
        v_head_dim: per-head value width.
        q_lora_rank: width of the query latent; 0: a full ``hidden x
            heads*(nope+rope)`` query projection (DeepSeek-V2-Lite).
    """

    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int = 0

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


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
    act_linear: float = 0.0  # saved inputs of linear layers (kept in FP8 under FP8 training)
    act_linear_replicated: float = 0.0
    mem_traffic: float = 0.0
    tp_comm: float = 0.0
    kv: float = 0.0  # self-attention K and V bytes (what context parallelism exchanges)
    expert_params: int = 0
    expert_flops: float = 0.0
    dispatch: float = 0.0  # bytes of one all-to-all (expert parallelism)

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
            act_attention_core_bytes=self.act_core, act_linear_input_bytes=self.act_linear,
            act_linear_input_replicated_bytes=self.act_linear_replicated,
            input_bytes=boundary_bytes, output_bytes=boundary_bytes,
            tp_comm_bytes=self.tp_comm, tp_max=tp_max,
        )

    def save(self, num_bytes: float, replicated: bool = False, core: bool = False, linear: bool = False) -> None:
        """Keep ``num_bytes`` for backward (``linear``: the input of a linear
        layer, saved for its weight gradient)."""
        self.act += num_bytes
        if replicated:
            self.act_replicated += num_bytes
        if core:
            self.act_core += num_bytes
        if linear:
            self.act_linear += num_bytes
            if replicated:
                self.act_linear_replicated += num_bytes


def _attention(t: _Tally, shape: BlockShape, p: int, q_len: int, kv_len: int, kv_is_self: bool) -> None:
    """Self- or cross-attention sub-block with its pre-norm, residual and dropout."""
    h, a, d = shape.hidden, shape.heads, shape.head_dim
    inner = shape.attn_width
    kv_width = shape.num_kv_heads * d
    t.norm(h, shape.rms_norm)
    t.save(p * q_len * h, replicated=True)  # norm input
    if shape.norm_saves_normalized:
        t.save(p * q_len * h, replicated=True)  # normalized tensor before the weight
    t.save(p * q_len * h, replicated=True, linear=True)  # QKV input (norm output)
    t.linear(q_len, h, inner, shape.bias, row_parallel=False)  # Q
    t.linear(kv_len, h, 2 * kv_width, shape.bias, row_parallel=False)  # K and V
    if not kv_is_self and shape.save_cross_input:
        t.save(p * kv_len * h, replicated=True, linear=True)  # encoder output feeding K/V
    t.save(p * q_len * inner)  # Q for QK^T
    t.save(p * kv_len * kv_width)  # K for QK^T
    if kv_is_self:
        t.kv += 2.0 * p * kv_len * kv_width  # K and V of every token
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
    t.save(p * q_len * inner, linear=True)  # output-projection input
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
    t.save(p * s * h, replicated=True, linear=True)  # first linear input (norm output)
    if shape.gated_mlp:
        t.linear(s, h, 2 * f, shape.bias, row_parallel=False)  # gate and up
        t.save(p * s * f)  # activation-function input (gate)
        t.save(p * s * f)  # up projection output
        t.save(p * s * f, linear=not shape.mlp_dropout)  # product: down-projection input
        t.mem_traffic += p * s * f * 5  # silu (r+w) and product (2r+w)
        if shape.mlp_dropout:
            t.save(MASK_BYTES * s * f)  # dropout mask on the product
            t.save(p * s * f, linear=True)  # dropout output: down-projection input
            t.mem_traffic += p * s * f * 2
    elif shape.activation == "relu":
        t.linear(s, h, f, shape.bias, row_parallel=False)
        t.save(p * s * f)  # relu output (its backward, and the next linear's input)
        t.mem_traffic += p * s * f * 2  # relu (r+w)
        if shape.mlp_dropout:
            t.save(MASK_BYTES * s * f)  # dropout mask
            t.save(p * s * f, linear=True)  # dropout output: second linear input
            t.mem_traffic += p * s * f * 2
    else:
        t.linear(s, h, f, shape.bias, row_parallel=False)
        t.save(p * s * f)  # activation-function input
        if shape.mlp_dropout:
            t.save(MASK_BYTES * s * f)  # dropout mask on the activation output
            t.mem_traffic += p * s * f * 2
        t.save(p * s * f, linear=True)  # second linear input
        t.mem_traffic += p * s * f * 2  # gelu (r+w)
    t.linear(s, f, h, shape.bias, row_parallel=True)
    t.tp_comm += p * s * h
    if shape.dropout:
        t.save(MASK_BYTES * s * h, replicated=True)
    t.mem_traffic += p * s * h * (2 + (2 if shape.dropout else 0) + 3)


def _duplicated_linear(t: _Tally, rows: int, d_in: int, d_out: int, bias: bool) -> None:
    """A linear every TP rank holds whole and computes in full (MLA's latent
    down-projections, the MoE router: Megatron-Core builds them with
    ``parallel_mode="duplicated"`` / unpartitioned, megatron/core/transformer/
    multi_latent_attention.py and moe/router.py)."""
    n = d_in * d_out + (d_out if bias else 0)
    t.params += n
    t.params_replicated += n
    t.flops += 2.0 * rows * d_in * d_out
    t.gemms += 1


def _latent_attention(t: _Tally, shape: BlockShape, mla: MLAShape, p: int, s: int) -> None:
    """Multi-head latent attention with its pre-norm and residual (HF
    ``DeepseekV3Attention``): q = W_qb·norm(W_qa·x) (or W_q·x), latent
    c = norm(W_kva·x) with a shared RoPE key part, [k_nope | v] = W_kvb·c,
    scores over ``nope + rope`` query/key widths, output from ``heads x
    v_head_dim``. The latent projections and their norms are duplicated on
    every TP rank; the up-projections split by heads."""
    h, a = shape.hidden, shape.heads
    qk_width, v_width = a * mla.qk_head_dim, a * mla.v_head_dim
    r_q, r_kv = mla.q_lora_rank, mla.kv_lora_rank
    t.norm(h, shape.rms_norm)
    t.save(p * s * h, replicated=True)  # norm input
    t.save(p * s * h, replicated=True, linear=True)  # norm output: input of the query and KV down-projections
    if r_q:
        _duplicated_linear(t, s, h, r_q, shape.bias)  # q_a_proj
        t.norm(r_q, shape.rms_norm)  # q_a_layernorm
        t.save(p * s * r_q, replicated=True)  # latent norm input
        t.save(p * s * r_q, replicated=True, linear=True)  # q_b_proj input
        t.linear(s, r_q, qk_width, False, row_parallel=False)  # q_b_proj
    else:
        t.linear(s, h, qk_width, False, row_parallel=False)  # q_proj
    _duplicated_linear(t, s, h, r_kv + mla.qk_rope_head_dim, shape.bias)  # kv_a_proj_with_mqa
    t.norm(r_kv, shape.rms_norm)  # kv_a_layernorm
    t.save(p * s * r_kv, replicated=True)  # latent norm input
    t.save(p * s * r_kv, replicated=True, linear=True)  # kv_b_proj input
    t.linear(s, r_kv, a * (mla.qk_nope_head_dim + mla.v_head_dim), False, row_parallel=False)  # kv_b_proj
    t.save(p * s * qk_width)  # Q for QK^T
    t.save(p * s * qk_width)  # K for QK^T (nope part per head, rope part copied into every head)
    t.kv += p * s * (qk_width + v_width)  # per-head K and V after the up-projection (what CP exchanges)
    scores = a * s * s
    core_flops = 2.0 * s * s * (qk_width + v_width)  # QK^T and scores·V
    t.flops += core_flops
    t.attention_flops += core_flops
    t.gemms += 2
    if shape.fused_attention:
        t.save(4.0 * a * s, core=True)  # float32 log-sum-exp per query row
    else:
        t.save(p * scores, core=True)  # softmax output
        t.mem_traffic += p * scores * (2 + 2 + (2 if shape.dropout else 0))
        if shape.dropout:
            t.save(MASK_BYTES * scores, core=True)  # attention-dropout mask
            t.save(p * scores, core=True)  # attention-dropout output
    t.save(p * s * v_width)  # V for scores·V
    t.save(p * s * v_width, linear=True)  # output-projection input
    t.linear(s, v_width, h, shape.bias, row_parallel=True)  # o_proj
    t.tp_comm += p * s * h
    if shape.dropout:
        t.save(MASK_BYTES * s * h, replicated=True)
    # norm (r+w), dropout (r+w), residual add (2r+w); the two latent norms (r+w)
    t.mem_traffic += p * s * h * (2 + (2 if shape.dropout else 0) + 3) + p * s * (r_q + r_kv) * 2


def _moe_mlp(t: _Tally, shape: BlockShape, moe: MoEShape, p: int, s: int) -> None:
    """Pre-norm, router, ``top_k`` routed experts per token, shared experts,
    residual. Parameters count every expert; FLOPs and activations count the
    token copies the experts really process (dropless, index-based dispatch:
    no one-hot dispatch/combine tensors). Experts are split by TP like a
    dense MLP (Megatron-Core's expert tensor parallelism); the router is
    duplicated."""
    h, e, f = shape.hidden, moe.num_experts, moe.expert_ffn
    rows = moe.top_k * s * moe.capacity_factor  # token copies the routed experts process
    t.norm(h, shape.rms_norm)
    t.save(p * s * h, replicated=True)  # norm input
    t.save(p * s * h, replicated=True)  # norm output: router, dispatch and shared-expert input
    _duplicated_linear(t, s, h, e, False)  # router
    t.save(4.0 * s * e)  # float32 router probabilities, kept for backward
    t.mem_traffic += 4.0 * s * e * 3  # softmax/sigmoid and top-k over the router logits
    width = (2 if moe.gated else 1) * f  # first expert matrix (gate and up when gated)
    experts = e * (h * width + f * h + (width + h if shape.bias else 0))
    t.params += experts
    t.expert_params += experts
    t.flops += 2.0 * rows * (h * width + f * h)
    t.expert_flops += 2.0 * rows * (h * width + f * h)
    t.dispatch += p * rows * h  # every routed token copy's hidden state, out and back (all-to-all)
    t.gemms += 2  # one grouped GEMM per expert matrix
    t.save(p * rows * h, linear=True)  # dispatched expert inputs
    if moe.gated:
        t.save(p * rows * f * 2)  # gate (SiLU input) and up
        t.save(p * rows * f, linear=True)  # their product: down-projection input
        t.mem_traffic += p * rows * f * 5  # silu (r+w) and product (2r+w)
    else:
        t.save(p * rows * f)  # GELU input
        t.save(p * rows * f, linear=True)  # second linear input
        t.mem_traffic += p * rows * f * 2
    t.save(p * rows * h)  # expert outputs, weighted by the router when combined
    t.mem_traffic += p * rows * h * 4 + p * s * h  # dispatch (r+w), weighted combine (r+w), sum (w)
    if moe.shared_ffn:
        fs = moe.shared_ffn
        t.linear(s, h, 2 * fs, False, row_parallel=False)  # shared gate and up
        t.save(p * s * fs * 2)  # SiLU input, up
        t.save(p * s * fs, linear=True)  # product: shared down-projection input
        t.linear(s, fs, h, False, row_parallel=True)  # shared down
        t.mem_traffic += p * s * fs * 5 + p * s * h * 3  # silu, product; add to the routed output
        if moe.shared_gate:
            _duplicated_linear(t, s, h, 1, False)  # shared_expert_gate
            t.save(p * s + p * s * h)  # sigmoid output and the shared output it scales
            t.mem_traffic += p * s * h * 3
    t.tp_comm += p * s * h
    if shape.dropout:
        t.save(MASK_BYTES * s * h, replicated=True)
    t.mem_traffic += p * s * h * (2 + (2 if shape.dropout else 0) + 3)


def transformer_block(
    name: str,
    kind: str,
    shape: BlockShape,
    dtype_bytes: int,
    *,
    moe: MoEShape | None = None,
    mla: MLAShape | None = None,
) -> LayerSpec:
    """One pre-/post-norm transformer block (attention + MLP), per sample.

    With 16-bit elements, ``ffn = 4h``, ``kv_heads = heads`` and dropout, the
    activation total is exactly Korthikanti's ``sh(34 + 5as/h)``, replicated
    part ``10sh`` and attention core ``5as²``.

    ``moe`` replaces the MLP by routed (and shared) experts (Mixtral,
    Qwen-MoE, DeepSeek); ``mla`` replaces the attention by DeepSeek's
    multi-head latent attention. ``shape.ffn`` is then unused or, for MLA
    blocks without ``moe``, the width of their dense MLP.
    """
    p, s = dtype_bytes, shape.seq
    t = _Tally()
    if mla is not None:
        if shape.cross_attention:
            raise ValueError(f"transformer_block {name!r}: latent attention has no cross-attention form")
        _latent_attention(t, shape, mla, p, s)
    else:
        _attention(t, shape, p, s, s, kv_is_self=True)
    if shape.cross_attention:
        _attention(t, shape, p, s, shape.cross_seq, kv_is_self=False)
    if moe is not None:
        _moe_mlp(t, shape, moe, p, s)
    else:
        _mlp(t, shape, p, s)
    layer = t.layer(name, kind, p * s * shape.hidden, shape.heads if mla is not None else shape.num_kv_heads)
    window = min(shape.attn_window, s) if shape.attn_window else 0
    attention = "sliding" if window else ("causal" if kind in CAUSAL_KINDS else "full")
    extra: dict[str, Any] = {}
    if moe is not None:
        extra = dict(num_experts=moe.num_experts, top_k=moe.top_k, expert_ffn=moe.expert_ffn,
                     shared_expert_ffn=moe.shared_ffn, capacity_factor=float(moe.capacity_factor),
                     expert_params=t.expert_params, expert_flops=t.expert_flops, dispatch_bytes=t.dispatch)
    return replace(layer, attention=attention, attention_window=window, kv_bytes=t.kv, **extra)


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
    """A GShard-style block (Lepikhin et al. 2020, §2.2): its MLP of width
    ``shape.ffn`` (GELU) becomes ``num_experts`` experts with top-``top_k``
    gating. The same builder as every MoE block (``transformer_block`` with a
    ``MoEShape``); kept for the presets that describe a model this way."""
    if num_experts < 1 or not 1 <= top_k <= num_experts:
        raise ValueError(f"moe_block {name!r}: need 1 <= top_k <= num_experts")
    moe = MoEShape(num_experts, top_k, shape.ffn, gated=shape.gated_mlp, capacity_factor=capacity_factor)
    return transformer_block(name, kind, shape, dtype_bytes, moe=moe)
