"""What hetplan's runtime keeps in memory for each layer of a model, per sample.

``hetplan.model.layers`` counts what Megatron-style training keeps
(Korthikanti et al. 2022): every tensor in the model's precision, unfused
attention scores. hetplan's runtime trains differently, and this module
counts what *its* modules save for backward, written out tensor by tensor
from their code:

* mixed precision is ``torch.autocast`` over fp32 parameters
  (``runtime/precision.py``): embeddings, norms and the residual stream stay
  fp32 (``nn.Embedding`` and ``layer_norm`` are not cast to 16 bits, and an
  fp32 residual plus a 16-bit branch is fp32); every linear casts its input
  to 16 bits itself, so the q, k and v projections keep three copies of their
  norm's output; each 16-bit copy of a weight autocast makes is kept by the
  matmul that uses it, once per micro-batch in flight (``cast_params``;
  ``torch.autocast(cache_enabled=False)``, ``runtime/microbatch.py``);
* attention is ``F.scaled_dot_product_attention``: it keeps its q, k, v,
  output and an fp32 log-sum-exp per query row, no score matrix
  (``runtime/models.py`` ``AttentionCore``; transformers'
  ``sdpa_attention_forward``); a HF model given an attention mask (``hetplan
  train`` pads HF batches: ``runtime/reference.synthetic_inputs``) repeats K
  and V to all heads (``use_gqa_in_sdpa`` is False with a mask) and SDPA keeps
  the mask it converts to the query's dtype, one per layer;
* the loss is ``cross_entropy(logits.float())`` (``runtime/models.py``
  ``cross_entropy_loss``): the runtime holds the 16-bit logits until the
  micro-batch's backward (its loop variable; torch pipelining's
  ``fwd_cache``), log-softmax keeps its fp32 output, and the loss's backward
  adds two more fp32 logits-sized buffers (``working``): the gradient
  ``nll_loss_backward`` fills and the one ``_log_softmax_backward_data``
  returns;
* the LM head's logits are gathered on every TP rank
  (``runtime/tp.py`` ``head_plan``: ``ColwiseParallel(output_layouts=Replicate())``;
  HF plans: ``lm_head: colwise_rep``), so the loss set is whole on each.

Models the runtime builds itself (the GPT/Llama/MoE presets:
``runtime/models.py``) and HF Llama-style decoders (llama, mistral, qwen3)
are written out here; ``tests/test_runtime_memory.py`` holds each against
what the modules really save under fake tensors. Other models keep their
ModelSpec's accounting (``runtime_memory`` returns None for them).

Everything is bytes per sample at the model's sequence length, except the
cast parameters (per micro-batch: a weight copy does not grow with the batch).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from hetplan.model.origin import HFSource, ModuleSource
from hetplan.model.spec import LayerSpec, ModelSpec
from hetplan.plan.support import builtin_refusal

FP32 = 4  # fp32 master weights, norms, residual stream, log-sum-exp and loss (runtime/precision.py)
INDEX_BYTES = 8  # int64 token ids and routing indices
# HF model types whose decoder layer is Llama's (transformers' modeling_llama /
# modeling_mistral / modeling_qwen3: eager RMSNorm, rotary q/k, SwiGLU MLP;
# Qwen3 adds an RMSNorm on each head's q and k).
HF_LLAMA_TYPES = ("llama", "mistral", "qwen3")


@dataclass(frozen=True)
class LayerMemory:
    """What the runtime keeps for one layer, per sample (bytes).

    Attributes:
        saved: everything the layer keeps for its backward pass, plus what
            the runtime holds for it (the logits) and its loss saves.
        replicated: the part tensor parallelism does not divide (the norms'
            fp32 inputs, the 16-bit copies of the inputs of column-parallel
            linears, the routing state); includes ``undivided``.
        undivided: the part neither TP nor sequence parallelism divides (the
            head's gathered input and logits, the loss); includes ``outside``.
        outside: the part kept even when the layer is recomputed: what the
            loss, computed outside the layer's forward, holds.
        core: what selective recomputation (the attention core
            checkpointed) no longer keeps; TP divides it.
        boundary: the layer's input, all a fully recomputed layer keeps
            (besides ``outside``); sequence parallelism divides it.
        working: transient bytes the layer's backward adds beyond ``saved``
            (the loss's gradient buffers); whole on every TP rank.
        fixed: bytes kept once per micro-batch whatever its size (position
            indices, a rotary table), whole on every rank.
        cast_params: dense weights autocast copies to 16 bits, kept for
            backward once per micro-batch (TP divides them).
        cast_expert_params: routed-expert weights copied alike (TP and EP divide them).
        largest_param: elements of the layer's largest dense parameter tensor
            (TP divides it), whose update the optimizer's temporaries match.
        largest_expert_param: elements of its stacked expert weights (TP and EP divide them).
        held: the part of ``outside`` the runtime still holds after the
            layer's backward, until the micro-batch's whole backward is done:
            the logits (its loop variable; torch pipelining's ``fwd_cache``),
            which the layers before it see at their backward.
    """

    saved: float
    replicated: float = 0.0
    undivided: float = 0.0
    outside: float = 0.0
    core: float = 0.0
    boundary: float = 0.0
    working: float = 0.0
    fixed: float = 0.0
    cast_params: int = 0
    cast_expert_params: int = 0
    largest_param: int = 0
    largest_expert_param: int = 0
    held: float = 0.0


@dataclass(frozen=True)
class DecoderShape:
    """A decoder block as the runtime's modules run it.

    Attributes:
        hidden, heads, kv_heads, head_dim, ffn, seq, vocab: sizes.
        norm: "layer" (``nn.LayerNorm``: keeps its input, mean and rstd),
            "rms" (``F.rms_norm``: fused on CUDA, input and rstd; composite on
            CPU, also the normalised tensor) or "hf-rms" (transformers'
            eager RMSNorm: input, rstd and normalised tensor).
        mlp: "gelu", "relu" or "swiglu".
        bias: linears carry biases.
        rope: rotary q and k (HF: computed in fp32 against fp32 cos/sin).
        hf: transformers' attention and rotary code (else runtime/models.py's).
        mask: SDPA gets an attention mask (HF padded batches).
        qk_norm: an RMSNorm on each head's q and k (Qwen3).
        experts, top_k, expert_ffn: the block's MLP is the runtime's MoE (0: dense).
        cuda: the device is a GPU (fused RMSNorm) rather than a CPU.
    """

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    seq: int
    vocab: int
    norm: str = "layer"
    mlp: str = "gelu"
    bias: bool = True
    rope: bool = False
    hf: bool = False
    mask: bool = False
    qk_norm: bool = False
    experts: int = 0
    top_k: int = 0
    expert_ffn: int = 0
    cuda: bool = True

    @property
    def q_width(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def repeats_kv(self) -> bool:
        """K and V reach SDPA repeated to every head: the built-in model always
        repeats them (``AttentionCore.forward``); transformers does when it
        passes a mask (``use_gqa_in_sdpa``)."""
        return self.kv_heads != self.heads and (not self.hf or self.mask)


@dataclass
class _Kept:
    """Bytes of one layer as its tensors are written out (``LayerMemory``'s fields)."""

    sharded: float = 0.0
    replicated: float = 0.0
    undivided: float = 0.0
    outside: float = 0.0
    core: float = 0.0
    fixed: float = 0.0
    cast: int = 0
    cast_experts: int = 0
    largest: int = 0
    largest_expert: int = 0

    def result(self, boundary: float, working: float = 0.0) -> LayerMemory:
        replicated = self.replicated + self.undivided + self.outside
        return LayerMemory(saved=self.sharded + replicated, replicated=replicated,
                           undivided=self.undivided + self.outside, outside=self.outside, core=self.core,
                           boundary=boundary, working=working, fixed=self.fixed, cast_params=self.cast,
                           cast_expert_params=self.cast_experts, largest_param=self.largest,
                           largest_expert_param=self.largest_expert)


def _norm(t: _Kept, shape: DecoderShape, tokens: float) -> None:
    """A pre-norm on the fp32 residual stream: it keeps its input; LayerNorm
    its fp32 mean and rstd (``native_layer_norm``), an RMSNorm its rstd and,
    unless fused, the normalised tensor the weight multiplies."""
    h = shape.hidden
    t.replicated += FP32 * tokens * h
    if shape.norm == "layer":
        t.replicated += 2 * FP32 * tokens
        return
    t.replicated += FP32 * tokens
    if shape.norm == "hf-rms" or not shape.cuda:
        t.replicated += FP32 * tokens * h


def _linear_inputs(t: _Kept, shape: DecoderShape, tokens: float, linears: int, c: int) -> None:
    """The norm's fp32 output as its ``linears`` consumers keep it: one 16-bit
    copy each under autocast (``F.linear`` casts its own input), the fp32
    tensor once in fp32 training. Whole on every TP rank, with sequence
    parallelism too: the runtime gathers the attention's and the MLP's input
    once, before their column-parallel linears, which keep the gathered tensor
    (``runtime/models.py`` ``block_tp_plan``: ``PrepareModuleInput`` from
    ``Shard(1)`` to ``Replicate()``; HF plans alike), where Megatron-LM gathers
    it again in backward (Korthikanti et al. 2022 §4.2.2)."""
    t.undivided += (linears * c if c < FP32 else FP32) * tokens * shape.hidden


def _attention(t: _Kept, shape: DecoderShape, c: int) -> None:
    """Norm, q/k/v projections, SDPA and the output projection (per sample)."""
    s, h = shape.seq, shape.hidden
    q, kv = shape.q_width, shape.kv_width
    _norm(t, shape, s)
    _linear_inputs(t, shape, s, 3, c)
    if shape.qk_norm:  # Qwen3: eager RMSNorm on q and k per head (fp32 input, rstd, normalised; a 16-bit copy)
        t.sharded += (2 * FP32 + c) * s * (q + kv) + FP32 * s * (shape.heads + shape.kv_heads)
    kv_seen = q if shape.repeats_kv else kv  # K and V as SDPA gets them
    sdpa = c * s * (q + 2 * kv_seen) + c * s * q + FP32 * shape.heads * s  # q, k, v, output, log-sum-exp
    if shape.mask:
        # the mask SDPA converts to the query's dtype and keeps, broadcast over the heads (each TP rank keeps
        # it whole; counted with the heads TP divides: under TP a few percent of a layer short)
        sdpa += c * s * s
    t.sharded += sdpa
    # the built-in model's rotary q (stack + flatten: heads-major) makes SDPA's output heads-major too, so
    # the projection's reshape copies it (seen on CPU and CUDA); HF's and the unrotated q are sequence-major
    copied = not shape.hf and shape.rope
    if copied:
        t.sharded += c * s * q
        t.fixed += 2 * c * s * shape.head_dim  # _rope's cos and sin, for q and for k, once per micro-batch
    # what checkpointing the core keeps instead: its inputs (HF: the fp32 rotary outputs) and its output
    rotary = FP32 if shape.hf and shape.rope and c < FP32 else c
    kept = rotary * s * (q + kv) + c * s * kv + (0 if copied else c * s * q)
    t.core += sdpa - kept
    t.cast += h * q + 2 * h * kv + q * h  # q, k, v and output projection weights
    t.largest = max(t.largest, h * q)


def _mlp(t: _Kept, shape: DecoderShape, c: int) -> None:
    """Norm, MLP (its inner activations kept by the activation function and the
    second linear) and the residual add, whose fp32 sum the next norm keeps."""
    s, h, f = shape.seq, shape.hidden, shape.ffn
    _norm(t, shape, s)
    gated = shape.mlp == "swiglu"
    _linear_inputs(t, shape, s, 2 if gated else 1, c)
    inner = {"gelu": 2, "relu": 1, "swiglu": 4}[shape.mlp]  # fc out + act out; relu out; gate, silu, up, product
    t.sharded += inner * c * s * f
    t.cast += (3 if gated else 2) * h * f
    t.largest = max(t.largest, h * f)


def _moe(t: _Kept, shape: DecoderShape, c: int) -> None:
    """The runtime's dropless MoE MLP (``runtime/models.py`` ``MoE``, ``Experts``;
    ``runtime/ep.py`` ``moe_dispatch_combine``): router and top-k in fp32, each
    expert's rows cast to 16 bits, expert biases fp32 (so an expert's first
    matmul plus its bias is fp32), outputs weighted in fp32 and added back."""
    s, h, e, k, f = shape.seq, shape.hidden, shape.experts, shape.top_k, shape.expert_ffn
    rows = k * s  # token copies the experts process
    _norm(t, shape, s)
    _linear_inputs(t, shape, s, 1, c)  # the router's input
    t.replicated += FP32 * s * e + (INDEX_BYTES + FP32) * rows + FP32 * s  # softmax, top-k indices and values, sum
    t.replicated += 3 * INDEX_BYTES * rows  # the sort order and token index of the copies
    t.replicated += c * rows * h  # each expert's rows, cast
    first = FP32 if shape.bias else c  # first matmul's output (plus an fp32 bias)
    inner = {"gelu": first + c, "relu": first + (c if first != c else 0), "swiglu": 3 * c + first}[shape.mlp]
    t.sharded += inner * rows * f
    out = FP32 if shape.bias else c  # expert outputs (plus an fp32 bias)
    t.replicated += (out + FP32) * rows * h + FP32 * rows  # outputs and weights the product keeps, weighted rows
    t.cast += h * e  # the router
    t.cast_experts += (3 if shape.mlp == "swiglu" else 2) * h * f * e
    t.largest = max(t.largest, h * e)
    t.largest_expert = e * h * f  # Experts stacks each matrix of all experts in one parameter


def decoder_block(shape: DecoderShape, dtype_bytes: int) -> LayerMemory:
    """A pre-norm decoder block (attention + MLP or MoE), per sample. Its
    input is the fp32 residual stream, all a fully recomputed block keeps."""
    c = dtype_bytes
    t = _Kept()
    _attention(t, shape, c)
    (_moe if shape.experts else _mlp)(t, shape, c)
    if c == FP32:
        t.cast = t.cast_experts = 0  # no autocast: the matmuls use the weights themselves
    return t.result(boundary=FP32 * shape.seq * shape.hidden)


def embedding(shape: DecoderShape) -> LayerMemory:
    """Token (and position) embedding: ``nn.Embedding`` keeps only its
    indices, the token ids and, once per micro-batch, the learned positions'
    ``arange``."""
    s = shape.seq
    return LayerMemory(saved=INDEX_BYTES * s, replicated=INDEX_BYTES * s, boundary=INDEX_BYTES * s,
                       fixed=0 if shape.rope else INDEX_BYTES * s, largest_param=shape.vocab * shape.hidden)


def rotary_table(shape: DecoderShape) -> float:
    """A HF decoder's rotary table: fp32 cos and sin of every position, made
    once per micro-batch (``LlamaRotaryEmbedding``) and kept by the blocks'
    rotary products; counted with the first block."""
    return 2 * FP32 * shape.seq * shape.head_dim if shape.hf and shape.rope else 0.0


def head(shape: DecoderShape, dtype_bytes: int) -> LayerMemory:
    """Final norm, vocabulary projection and the loss (module docstring):
    the projection's input is gathered on every TP rank, its logits too; the
    logits the runtime holds, log-softmax's fp32 output and the targets are
    kept whoever recomputes the head; the loss's backward adds two fp32
    logits-sized gradients."""
    c = dtype_bytes
    s, h, v = shape.seq, shape.hidden, shape.vocab
    t = _Kept()
    _norm(t, shape, s)
    t.undivided += (c if c < FP32 else FP32) * s * h  # the projection's (gathered) input
    t.outside += c * s * v + FP32 * s * v + INDEX_BYTES * s  # logits, log-softmax output, targets
    t.cast = v * h if c < FP32 else 0
    t.largest = v * h
    return replace(t.result(boundary=FP32 * s * h, working=2 * FP32 * s * v), held=c * s * v)


def runtime_memory(spec: ModelSpec, cuda: bool = True) -> tuple[LayerMemory, ...] | None:
    """Per layer of ``spec``, what hetplan's runtime keeps (module docstring),
    on a GPU (``cuda``) or a CPU; None for a model whose runtime
    implementation is not written out here (it keeps its ModelSpec's accounting)."""
    shape = _decoder_shape(spec, cuda)
    if shape is None:
        return None
    out = []
    for layer in spec.layers:
        if layer.kind == "embedding":
            out.append(embedding(shape))
        elif layer.kind == "head":
            out.append(head(shape, spec.dtype_bytes))
        else:
            block = decoder_block(_block_shape(shape, layer, spec), spec.dtype_bytes)
            first = len(out) == 1
            out.append(replace(block, fixed=block.fixed + rotary_table(shape)) if first else block)
    return tuple(out)


def decoder_shape(spec: ModelSpec, cuda: bool = True) -> tuple[DecoderShape, ...] | None:
    """Per layer of ``spec``, the shape the runtime's modules run it with (a MoE
    block its own experts); None for a model not written out here. Shared with
    ``runtime_time``, which costs the same modules' work."""
    shape = _decoder_shape(spec, cuda)
    if shape is None:
        return None
    return tuple(_block_shape(shape, layer, spec) for layer in spec.layers)


def _block_shape(shape: DecoderShape, layer: LayerSpec, spec: ModelSpec) -> DecoderShape:
    """The shape of one block: a MoE block of the built-in model runs ``num_experts``
    experts of ``expert_ffn`` (the layer's own fields)."""
    if not layer.is_moe:
        return shape
    return replace(shape, experts=layer.num_experts, top_k=layer.top_k,
                   expert_ffn=layer.expert_ffn or shape.ffn)


def _decoder_shape(spec: ModelSpec, cuda: bool) -> DecoderShape | None:
    """The decoder shape of a model the runtime builds (its built-in decoder,
    or a HF Llama-style class); None for any other model."""
    names = [layer.name for layer in spec.layers]
    if isinstance(spec.source, ModuleSource) or len(names) < 3 or spec.layers[0].kind != "embedding" \
            or spec.layers[-1].kind != "head":
        return None
    if isinstance(spec.source, HFSource):
        return _hf_llama_shape(spec, cuda)

    if builtin_refusal(spec):
        return None
    return _builtin_shape(spec, cuda)


def _dense_block(spec: ModelSpec) -> LayerSpec | None:
    return next((layer for layer in spec.layers[1:-1] if not layer.is_moe), None)


def _builtin_shape(spec: ModelSpec, cuda: bool) -> DecoderShape | None:
    """The built-in decoder ``runtime/models.py`` builds for a preset: Llama
    style (RMSNorm, SwiGLU, rotary, no biases) for family "llama", GPT style
    otherwise; key/value heads are the blocks' TP limit; the MLP width is what
    the dense block's parameters leave after attention and norms."""
    block = _dense_block(spec)
    if block is None:
        return None
    h, a = spec.hidden_size, spec.num_heads
    g = block.tp_max or a
    d = h // a
    llama = spec.family == "llama"
    attention = h * a * d + 2 * h * g * d + a * d * h + (0 if llama else a * d + 2 * g * d + h)
    rest = block.params - attention - (2 if llama else 4) * h  # the MLP (and its biases)
    ffn, remainder = divmod(rest, 3 * h) if llama else divmod(rest - h, 2 * h + 1)
    if remainder or ffn <= 0:
        return None
    return DecoderShape(hidden=h, heads=a, kv_heads=g, head_dim=d, ffn=ffn, seq=spec.seq_len,
                        vocab=spec.vocab_size, norm="rms" if llama else "layer", mlp="swiglu" if llama else "gelu",
                        bias=not llama, rope=llama, cuda=cuda)


def _hf_llama_shape(spec: ModelSpec, cuda: bool) -> DecoderShape | None:
    """A HF Llama-style decoder (``HF_LLAMA_TYPES``) from the facts its import
    recorded (``meta["architecture"]``: key/value heads, MLP width, head
    width); None for other HF models and for Llama-style ones with biases."""
    arch = spec.meta.get("architecture") or {}
    model_type = spec.source.model_type if isinstance(spec.source, HFSource) else ""
    if model_type not in HF_LLAMA_TYPES or not arch or arch.get("bias"):
        return None
    h, a = spec.hidden_size, spec.num_heads
    return DecoderShape(hidden=h, heads=a, kv_heads=int(arch["kv_heads"]),
                        head_dim=int(arch.get("kv_channels") or h // a), ffn=int(arch["ffn"]), seq=spec.seq_len,
                        vocab=spec.vocab_size, norm="hf-rms", mlp="swiglu", bias=False, rope=True, hf=True,
                        mask=True, qk_norm=model_type == "qwen3", cuda=cuda)


# Gradients of a dense MLP's inner activations a block's backward holds at once, in units of
# tokens x ffn of the activations' dtype: GELU/ReLU -- the second linear's input gradient (``mm``)
# and the activation function's input gradient (``gelu_backward``) beside it; SwiGLU -- the
# product's gradient and the gradients of its two factors. Seen in the replayed tensors at the
# peak of an offloaded tiny-gpt block's backward (docs/cost-model.md, "The replay check").
MLP_GRADIENTS = {"gelu": 2, "relu": 2, "swiglu": 3}


def backward_gradients(spec: ModelSpec, cuda: bool = True) -> tuple[tuple[float, float], ...] | None:
    """Per layer of ``spec``, per sample: the activation gradients its backward holds at once
    beyond what it saved, as (the part TP divides, the part it does not) -- a dense block's
    MLP gradients (``MLP_GRADIENTS``) and the fp32 gradient of its residual stream. They make
    a stage's peak only where no layer after it still holds its activations, such as an
    offloaded block (its two fetched layers are all it holds); the loss's gradients are the
    head's ``working``. None for a model not written out here; 0 for other layers (and MoE
    blocks: not measured)."""
    shapes = decoder_shape(spec, cuda)
    if shapes is None:
        return None
    return tuple((MLP_GRADIENTS[s.mlp] * spec.dtype_bytes * s.seq * s.ffn, FP32 * s.seq * s.hidden)
                 if layer.kind not in ("embedding", "head") and not s.experts else (0.0, 0.0)
                 for layer, s in zip(spec.layers, shapes))
