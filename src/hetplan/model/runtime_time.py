"""How hetplan's runtime spends time in each layer of a model: the work its
modules really do, beside what ``hetplan.model.layers`` counts for
Megatron-style training (unfused attention, 16-bit everything).

Written out from the runtime's code, like ``runtime_memory`` for its tensors:

* attention is ``F.scaled_dot_product_attention`` for every model it builds
  (presets included: ``runtime/models.py`` ``AttentionCore``; transformers'
  ``sdpa_attention_forward``): no score matrix is read or written, so a layer's
  attention core runs as a fused kernel (``fused`` on every attention layer);
* elementwise traffic (``traffic``, bytes per sample, forward) is what the
  modules read and write under ``torch.autocast`` over fp32 weights
  (``runtime/precision.py``): norms on the fp32 residual stream, a 16-bit cast
  of a norm's output for every linear that reads it, the activation function
  (GELU; SiLU gate times up projection), the fp32 residual adds, the rotary
  products (HF: in fp32 against fp32 cos/sin, ``apply_rotary_pos_emb``) and HF's
  eager RMSNorm (pow, mean, rsqrt, two products: ``LlamaRMSNorm.forward``); the
  head adds the loss's fp32 passes over the logits
  (``cross_entropy(logits.float())``: the cast, log-softmax, the gather);
* ``weight_fwd`` / ``weight_bwd`` (bytes per micro-batch): autocast casts every weight to 16 bits for each micro-batch (read 4, write 2
  bytes; ``cache_enabled=False``, ``runtime/microbatch.py``), and backward casts
  each 16-bit weight gradient back to fp32 (read 2, write 4) and adds it into
  the fp32 ``.grad`` (read 4 + 4, write 4): 24 bytes a parameter a
  micro-batch, whatever the micro-batch's size;
* ``ops_fwd`` / ``ops_bwd``: the ATen operators the layer dispatches per
  micro-batch (views and casts included: each costs the host its dispatch),
  counted once per layer kind with ``TorchDispatchMode`` on CPU under bf16
  autocast; ``tests/test_runtime_time.py`` recounts the modules and fails when
  these numbers drift. The backward counts exclude the loss's seed gradient;
* full recomputation (``runtime/parallelize.py`` ``_checkpoint_forward``:
  non-reentrant ``torch.utils.checkpoint`` with its default ``early_stop=True``)
  reruns a layer's forward only until every tensor the forward saved for
  backward is back, and a matmul saves its inputs before it runs: the layer's
  last linear (a block's MLP output projection, the LM head) is not rerun, nor
  the residual add after it; the loss runs outside the head's checkpoint
  (``runtime/step.py`` applies it to the head's output) and is not rerun either.
  ``recompute_gemm_share`` is the share of the layer's matmul FLOPs rerun
  (``tests/test_runtime_time.py`` sums the matmuls a recompute dispatches),
  ``recompute_traffic`` its elementwise bytes per sample, ``ops_recompute`` the
  operators the recompute adds to the backward (the checkpoint's own unpacking
  included).

Compiled (``hetplan train --compile``: ``runtime/parallelize.py`` ``apply_compile``
compiles each layer of the plan; the loss runs outside, ``runtime/step.py``),
``runtime_time(spec, compiled=True)`` costs what inductor's generated code runs:

* elementwise traffic: inductor fuses every chain of elementwise operators
  between two matmuls (or SDPA) into one kernel that reads its inputs once and
  writes its outputs once (``torch._inductor.scheduler``'s vertical fusion of
  pointwise and reduction nodes; matmuls stay extern cuBLAS calls in the default
  mode). The generated code for the built-in blocks
  (``benchmarks/count_compiled_kernels.py`` prints it) has these fused kernels:
  first norm and its 16-bit cast (one cast for every linear that reads it); the
  residual add with the second norm and its cast; the rotary products of q and k
  (and, Llama, the attention output's copy to token-major order); the
  activation (SiLU gate times up projection); the last residual add, which
  reruns the first add rather than write its fp32 sum. The weight casts and
  gradient casts stay (a matmul needs its 16-bit weight materialised), and so
  does the loss (eager, outside the graph);
* ``kernels_fwd`` / ``kernels_bwd``: the kernels the compiled graphs launch per
  micro-batch (fused elementwise kernels, extern matmuls, SDPA), counted in
  inductor's generated code; the host launches each from the graph's wrapper,
  without the dispatcher and autograd work an eager operator costs. ``ops_fwd``
  / ``ops_bwd`` keep only what still runs eagerly (the head's loss);
* saved activations: not changed here (``runtime_memory`` costs eager's; on the
  H100 the compiled 8 x 2 run held 40.45 GiB against 42.7 eager, so eager's is
  an upper bound; docs/cost-model.md).

Compiled costs are written out for the built-in dense models (GPT and Llama
blocks); a compiled MoE block (its expert loop breaks the graph) or HF model is
refused (``compiled_refusal``).

Models the runtime builds itself and HF Llama-style decoders (the shapes
``runtime_memory.decoder_shape`` knows) are written out; for others
``runtime_time`` returns None and the ModelSpec's accounting stays.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from hetplan.model.runtime_memory import FP32, DecoderShape, decoder_shape
from hetplan.model.spec import LayerSpec, ModelSpec

# Operators per micro-batch, (forward, backward), counted by tests/test_runtime_time.py
# (torch 2.13, transformers 5.24; CPU bf16 autocast). "hf-llama" head: final norm, lm_head,
# loss and what the model runs once besides its decoder layers (embedding, rotary table, mask).
BLOCK_OPS = {"gpt": (55, 112), "llama": (125, 167), "hf-llama": (98, 165)}
HEAD_OPS = {"gpt": (13, 20), "llama": (19, 35), "hf-llama": (64, 36)}
EMBED_OPS = {"gpt": (4, 6), "llama": (1, 2), "hf-llama": (0, 0)}
# The built-in MoE block: its attention and router, plus a loop over the experts
# (``Experts.forward``, the stacked weights unbound once): operators = base + per expert,
# forward and backward; counted at 2 and 4 experts (tests/test_runtime_time.py for "gpt";
# "llama": the same count on a GPTConfig with RMSNorm, SwiGLU and rotary positions).
MOE_BASE_OPS = {"gpt": (72, 126), "llama": (133, 172)}
MOE_EXPERT_OPS = {"gpt": (9, 19), "llama": (11, 24)}
# Operators full recomputation adds to a layer's backward per micro-batch (module docstring), counted
# by tests/test_runtime_time.py as the backward's operators with and without ``apply_recompute``.
BLOCK_RECOMPUTE_OPS = {"gpt": 96, "llama": 182, "hf-llama": 155}
HEAD_RECOMPUTE_OPS = {"gpt": 15, "llama": 25, "hf-llama": 8}
EMBED_RECOMPUTE_OPS = {"gpt": 2, "llama": 0, "hf-llama": 0}
MOE_BASE_RECOMPUTE_OPS = {"gpt": 117, "llama": 186}
MOE_EXPERT_RECOMPUTE_OPS = {"gpt": 19, "llama": 29}
# Kernels one torch.compile'd layer launches per micro-batch, (forward, backward), and the
# operators of the loss that runs eagerly after the head: counted in inductor's generated code
# for the built-in models (torch 2.13, CPU inductor under bf16 autocast, whose scheduler fuses
# as on GPUs; benchmarks/count_compiled_kernels.py recounts them, about a minute a layer kind).
COMPILED_BLOCK_KERNELS = {"gpt": (14, 19), "llama": (17, 28)}
COMPILED_HEAD_KERNELS = {"gpt": (2, 3), "llama": (2, 3)}
COMPILED_EMBED_KERNELS = {"gpt": (1, 1), "llama": (1, 1)}
LOSS_OPS = (6, 5)  # view, float cast, view, log-softmax, detach, nll / their backward (seed excluded)
# Bytes a parameter per micro-batch the weight casts (forward) and the gradient's cast and
# accumulation (backward) move (module docstring); fp32 training: the accumulation alone.
WEIGHT_FWD_BYTES_PER_PARAM = 4 + 2
WEIGHT_BWD_BYTES_PER_PARAM = (2 + 4) + (4 + 4 + 4)
FP32_GRAD_BYTES_PER_PARAM = 4 + 4 + 4
# fp32 passes of the loss over a logits element: cast 16 -> 32 bits (read 2 write 4), log-softmax
# (read 4, write 4, plus its max/sum reads 4 + 4), nll gather (negligible).
LOSS_BYTES_PER_LOGIT = 6 + 16


@dataclass(frozen=True)
class LayerRun:
    """How the runtime runs one layer (module docstring).

    Attributes:
        traffic: elementwise bytes per sample, forward.
        weight_fwd, weight_bwd: bytes per micro-batch of the weight casts and of the
            gradients' casts and accumulation.
        ops_fwd, ops_bwd: operators dispatched per micro-batch.
        fused: the attention core is one fused kernel (SDPA).
        loss_traffic: the loss's part of ``traffic`` (the head's fp32 passes over the logits).
        recompute_traffic, recompute_gemm_share, ops_recompute: what full recomputation
            reruns (module docstring): elementwise bytes per sample, share of the matmul
            FLOPs, operators added to the backward per micro-batch.
        kernels_fwd, kernels_bwd, kernels_recompute: kernels a compiled layer's graphs
            launch per micro-batch (0: eager); the recompute reruns the forward graph.
    """

    traffic: float
    weight_fwd: float
    weight_bwd: float
    ops_fwd: int
    ops_bwd: int
    fused: bool
    loss_traffic: float = 0.0
    recompute_traffic: float = 0.0
    recompute_gemm_share: float = 1.0
    ops_recompute: int = 0
    kernels_fwd: int = 0
    kernels_bwd: int = 0
    kernels_recompute: int = 0


def _style(shape: DecoderShape) -> str:
    if shape.hf:
        return "hf-llama"
    return "llama" if shape.norm == "rms" else "gpt"


def _norm_traffic(shape: DecoderShape, tokens: float) -> float:
    """A norm over the fp32 residual stream: read and write it once (fused
    ``native_layer_norm`` / ``rms_norm``), HF's eager RMSNorm five passes
    (pow, mean, x * rstd, weight * that: ``LlamaRMSNorm.forward``)."""
    passes = 2 if shape.norm != "hf-rms" else 7
    return passes * FP32 * tokens * shape.hidden


def _cast(elements: float, c: int) -> float:
    """A cast of fp32 elements to ``c`` bytes (read 4, write c); none in fp32 training."""
    return (FP32 + c) * elements if c < FP32 else 0.0


def block_traffic(shape: DecoderShape, c: int) -> float:
    """Elementwise bytes of one decoder block per sample, forward (module docstring)."""
    s, h, f = shape.seq, shape.hidden, shape.ffn
    q, kv = shape.q_width, shape.kv_width
    out = 2 * _norm_traffic(shape, s)
    out += _cast(3 * s * h, c) + _cast((2 if shape.mlp == "swiglu" else 1) * s * h, c)
    out += 2 * (FP32 + c + FP32) * s * h  # two residual adds: fp32 stream + 16-bit branch -> fp32
    if shape.rope:
        # q and k: two products, rotate_half's negate and concatenation, the sum; HF in fp32 (read 16-bit q,
        # write fp32) and cast back for SDPA
        width = FP32 if shape.hf else c
        out += s * (q + kv) * (5 * 2 * width + (c + FP32 if shape.hf else 0))
    if shape.repeats_kv:
        out += 2 * 2 * c * s * q  # K and V expanded to every head (read + write)
    if shape.mask:
        out += c * s * s  # the mask SDPA converts to the query's dtype
    if shape.experts:
        f = shape.expert_ffn * shape.top_k
    out += (3 * 2 * c if shape.mlp == "swiglu" else 2 * c) * s * f  # SiLU and the gate product; GELU/ReLU
    return float(out)


def head_traffic(shape: DecoderShape, c: int) -> float:
    """The final norm, the cast of its output and the loss's fp32 passes over the logits."""
    s = shape.seq
    return float(_norm_traffic(shape, s) + _cast(s * shape.hidden, c) + LOSS_BYTES_PER_LOGIT * s * shape.vocab)


def _moe_ops(style: str, experts: int) -> tuple[int, int, int]:
    """Forward, backward and full-recompute operators of the built-in MoE block."""
    base, per_expert = MOE_BASE_OPS[style], MOE_EXPERT_OPS[style]
    return (base[0] + per_expert[0] * experts, base[1] + per_expert[1] * experts,
            MOE_BASE_RECOMPUTE_OPS[style] + MOE_EXPERT_RECOMPUTE_OPS[style] * experts)


def _residual_add(shape: DecoderShape, c: int) -> float:
    """Bytes per sample of one residual add: the fp32 stream plus a ``c``-byte branch, written in fp32."""
    return float((FP32 + c + FP32) * shape.seq * shape.hidden)


def block_recompute_gemm_share(shape: DecoderShape) -> float:
    """Share of a block's matmul FLOPs full recomputation reruns: all but its
    MLP's output projection (module docstring); a MoE block's experts all run
    before its combine, which saves their outputs, so it reruns all of them."""
    if shape.experts:
        return 1.0
    h, f = shape.hidden, shape.ffn
    attention = 2 * h * shape.q_width + 2 * h * shape.kv_width
    mlp = (3 if shape.mlp == "swiglu" else 2) * h * f
    return 1.0 - f * h / (attention + mlp)


def layer_run(layer: LayerSpec, shape: DecoderShape, c: int) -> LayerRun:
    """How the runtime runs ``layer`` of a model of ``shape`` in ``c``-byte autocast."""
    style = _style(shape)
    cast = c < FP32
    weights = (WEIGHT_FWD_BYTES_PER_PARAM * layer.params if cast else 0.0,
               (WEIGHT_BWD_BYTES_PER_PARAM if cast else FP32_GRAD_BYTES_PER_PARAM) * layer.params)
    if layer.kind == "embedding":  # nn.Embedding stays fp32 under autocast: its gradient is accumulated only
        traffic = float(2 * FP32 * shape.seq * shape.hidden)  # no matmul: a recompute reruns the lookups at most
        return LayerRun(traffic, 0.0, FP32_GRAD_BYTES_PER_PARAM * layer.params, *EMBED_OPS[style], False,
                        recompute_traffic=traffic, recompute_gemm_share=0.0, ops_recompute=EMBED_RECOMPUTE_OPS[style])
    if layer.kind == "head":  # a recompute reruns the final norm and casts, not the LM head nor the loss
        loss = LOSS_BYTES_PER_LOGIT * shape.seq * shape.vocab
        traffic = head_traffic(shape, c)
        return LayerRun(traffic, *weights, *HEAD_OPS[style], False, loss, traffic - loss, 0.0,
                        HEAD_RECOMPUTE_OPS[style])
    if shape.experts:
        ops_fwd, ops_bwd, ops_recompute = _moe_ops(style, shape.experts)
    else:
        (ops_fwd, ops_bwd), ops_recompute = BLOCK_OPS[style], BLOCK_RECOMPUTE_OPS[style]
    traffic = block_traffic(shape, c)
    return LayerRun(traffic, *weights, ops_fwd, ops_bwd, layer.attention_flops > 0, 0.0,
                    traffic - _residual_add(shape, c), block_recompute_gemm_share(shape), ops_recompute)


def compiled_block_traffic(shape: DecoderShape, c: int) -> float:
    """Elementwise bytes of one compiled decoder block per sample, forward: each
    fused kernel reads its inputs and writes its outputs once (module docstring)."""
    s, h, f = shape.seq, shape.hidden, shape.ffn
    q, kv = shape.q_width, shape.kv_width
    out = float((FP32 + c) * s * h)  # first norm and its cast: the fp32 stream in, one 16-bit output
    out += (FP32 + c + c) * s * h  # residual add, second norm, cast: stream and branch in, norm output out
    out += _last_add(shape, c)
    if shape.rope:
        out += 2 * c * s * (q + kv)  # q and k rotated in one kernel
        out += 2 * c * s * q  # the attention output copied to token-major order for the output projection
    if shape.repeats_kv:
        out += 2 * 2 * c * s * q  # K and V expanded to every head (read + write)
    if shape.mask:
        out += c * s * s
    return float(out + (3 * c if shape.mlp == "swiglu" else 2 * c) * s * f)  # activation (and gate product)


def _last_add(shape: DecoderShape, c: int) -> float:
    """The compiled block's last residual add: the fp32 stream and both 16-bit branches in
    (it reruns the first add), the fp32 sum out."""
    return float((FP32 + 2 * c + FP32) * shape.seq * shape.hidden)


def compiled_layer_run(layer: LayerSpec, shape: DecoderShape, c: int) -> LayerRun:
    """How the runtime runs ``layer`` compiled (module docstring): eager's weight casts and
    embedding, fused elementwise traffic, the compiled graphs' kernels, the loss eager."""
    eager, style = layer_run(layer, shape, c), _style(shape)
    if layer.kind == "embedding":
        forward, backward = COMPILED_EMBED_KERNELS[style]
        return replace(eager, ops_fwd=0, ops_bwd=0, ops_recompute=0, kernels_fwd=forward, kernels_bwd=backward,
                       kernels_recompute=forward)
    if layer.kind == "head":
        forward, backward = COMPILED_HEAD_KERNELS[style]
        rerun = float(_norm_compiled(shape, c))
        return replace(eager, traffic=rerun + eager.loss_traffic, recompute_traffic=rerun, ops_fwd=LOSS_OPS[0],
                       ops_bwd=LOSS_OPS[1], ops_recompute=0, kernels_fwd=forward, kernels_bwd=backward,
                       kernels_recompute=forward)
    forward, backward = COMPILED_BLOCK_KERNELS[style]
    traffic = compiled_block_traffic(shape, c)
    return replace(eager, traffic=traffic, recompute_traffic=traffic - _last_add(shape, c), ops_fwd=0, ops_bwd=0,
                   ops_recompute=0, kernels_fwd=forward, kernels_bwd=backward, kernels_recompute=forward)


def _norm_compiled(shape: DecoderShape, c: int) -> float:
    """A compiled norm and its cast: the fp32 stream read once, the c-byte output written once."""
    return float((FP32 + c) * shape.seq * shape.hidden)


def compiled_refusal(spec: ModelSpec, cuda: bool = True) -> str:
    """Why ``spec`` compiled cannot be costed ("" where it can): compiled costs are
    written out for the built-in dense GPT and Llama models only."""
    shapes = decoder_shape(spec, cuda)
    if shapes is None or any(s.hf for s in shapes):
        return (f"--compile is costed for hetplan's built-in models only (GPT and Llama presets), not "
                f"{spec.name!r}; drop --compile (hetplan train --compile still compiles it, uncosted)")
    if any(s.experts for s in shapes):
        return (f"--compile is not costed for mixture-of-experts blocks ({spec.name!r}: the expert loop breaks "
                "the compiled graph); drop --compile")
    return ""


def runtime_time(spec: ModelSpec, cuda: bool = True, compiled: bool = False) -> tuple[LayerRun, ...] | None:
    """Per layer of ``spec``, how hetplan's runtime runs it (module docstring), each
    layer ``torch.compile``d if ``compiled`` (``compiled_refusal`` must be ""); None for
    a model whose runtime implementation is not written out here."""
    shapes = decoder_shape(spec, cuda)
    if shapes is None or (_style(shapes[1]) not in MOE_BASE_OPS and any(s.experts for s in shapes)):
        return None
    run = compiled_layer_run if compiled else layer_run
    return tuple(run(layer, shape, spec.dtype_bytes) for layer, shape in zip(spec.layers, shapes))
