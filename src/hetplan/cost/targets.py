"""Memory and recomputation as each tool a plan targets runs them, where the
tool differs from the papers' accounting (``Workload.target``); hetplan's own
runtime is ``model/runtime_memory.py`` and ``RUNTIME_STATE_BYTES``. Each effect
is here once, with the tool's source beside it (paths are in the installed
packages the ``[tools]`` extra pins: torchtitan 0.3.0, DeepSpeed 0.19.8,
megatron-core 0.16.1)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from hetplan.cost.layers import LayerArrays
from hetplan.model.runtime_memory import FP32, DecoderShape, decoder_shape
from hetplan.model.spec import ModelSpec

# Megatron-LM trains bf16 with gradients accumulated and all-reduced in fp32:
# megatron/training/arguments.py (Megatron-LM core_v0.16.1), validate_args, the
# ``if args.bf16:`` block: "bfloat16 requires gradient accumulation and all-reduce
# to be done in fp32" sets ``accumulate_allreduce_grads_in_fp32 = True`` unless
# ``--grad-reduce-in-bf16`` (which ``hetplan export --format megatron`` does not
# write); training passes it on as DistributedDataParallelConfig.grad_reduce_in_fp32
# (megatron/core/distributed/distributed_data_parallel_config.py:11 in the installed
# megatron-core 0.16.1), whose buffer holds a 4-byte "main_grad" per parameter.
# Megatron's fp16 path keeps the flag's default (off), so only bf16 changes.
MEGATRON_BF16_OPTIMIZER = {"adam-mixed": "adam-mixed-fp32-grads"}


def target_optimizer(target: str, precision: str, optimizer: str) -> str:
    """The ``OPTIMIZER_STATE_BYTES`` entry that says what ``target`` holds for a
    workload costed with ``optimizer`` in ``precision``: Megatron's bf16 keeps
    fp32 gradients; every other target holds what the optimizer names."""
    if target == "megatron" and precision == "bf16":
        return MEGATRON_BF16_OPTIMIZER.get(optimizer, optimizer)
    return optimizer


# torchtitan's selective activation checkpointing is per *op*
# (torchtitan/distributed/activation_checkpoint.py, ``SelectiveAC``): each
# transformer block (``ActivationCheckpointing.apply``, :152-163; the embedding
# and the output layer are not wrapped) runs under
# ``create_selective_checkpoint_contexts`` (:278-287), which keeps the block's
# input (torch.utils.checkpoint) and the outputs of the ops its policy marks
# MUST_SAVE, and recomputes every other op in backward. The policy
# (``wrapped_policy``, :246-274) saves the ops of ``_get_default_save_ops``
# (:31-94: the partitioner's compute-intensive ops, aten.mm among them, the
# SDPA kernels, reduce-scatter and all-to-all) except every second matmul: the
# block's 1st, 3rd, 5th ... mm are kept, the 2nd, 4th ... recomputed (:267-273).
# torchtitan's decoders run q, k, v, SDPA, o (torchtitan/models/common/
# attention.py:764 and :1010), then w1, w3, w2 (models/common/feed_forward.py:54), so a Llama block keeps q, v, SDPA's
# output and log-sum-exp, w1 and w2 and recomputes k, o, w3 and every
# elementwise op (norms, rotary, SiLU, product, residual adds). The policy is
# the same as at torchtitan 9dec370, where the published memory of
# ``tests/test_target_ac.py`` was measured.
TORCHTITAN_SAVES_EVERY = 2  # every second matmul recomputed (activation_checkpoint.py:271)


def _block_matmuls(shape: DecoderShape) -> list[tuple[int, int]]:
    """(input width, output width) of a decoder block's matmuls in the order
    its forward runs them (the SDPA core is not an mm)."""
    h, q, kv, f = shape.hidden, shape.q_width, shape.kv_width, shape.ffn
    attention = [(h, q), (h, kv), (h, kv), (q, h)]
    mlp = [(h, f), (h, f), (f, h)] if shape.mlp == "swiglu" else [(h, f), (f, h)]
    return attention + mlp


def torchtitan_op_ac(shape: DecoderShape, dtype_bytes: int) -> tuple[float, float]:
    """(bytes one sample keeps, share of the block's linear FLOPs recomputed)
    of a dense decoder block under torchtitan's selective op AC (above): the
    block's input, the output of every other matmul from the first, SDPA's
    output and fp32 log-sum-exp."""
    c, s = dtype_bytes, shape.seq
    matmuls = _block_matmuls(shape)
    kept = [i % TORCHTITAN_SAVES_EVERY == 0 for i in range(len(matmuls))]
    saved = c * s * (shape.hidden + shape.q_width + sum(out for (_, out), k in zip(matmuls, kept) if k))
    saved += FP32 * shape.heads * s
    flops = [d_in * d_out for d_in, d_out in matmuls]
    recomputed = sum(f for f, k in zip(flops, kept) if not k) / sum(flops)
    return float(saved), recomputed


# torchtitan's loss is ``cross_entropy(pred.flatten(0, 1).float(), ...)``
# (torchtitan/components/loss.py:32-63) and the trainer deletes the 16-bit
# logits before backward (torchtitan/trainer.py:824, ``del pred``): what the
# head keeps is log-softmax's fp32 output and the targets, and the loss's
# backward adds two more fp32 logits-sized buffers (the gradient
# ``nll_loss_backward`` fills and the one ``_log_softmax_backward_data``
# returns), as in hetplan's runtime (``model.runtime_memory.head``). The freed
# 16-bit logits' memory stays reserved and cannot serve those fp32 buffers,
# each twice its size: PyTorch's caching allocator splits a cached segment for
# a smaller request but never joins segments (c10/cuda/CUDACachingAllocator.cpp;
# "CUDA semantics: memory management": freed memory stays reserved until
# ``empty_cache``), and torchtitan reports the peak reserved
# (torchtitan/components/metrics.py:68 and :527). Under TP
# torchtitan's loss-parallel splits them by vocabulary; the kernel keeps a
# layer's working set whole on every TP rank, so a tp > 1 plan is costed high.
TORCHTITAN_LOSS_GRADIENT_BUFFERS = 2  # fp32, logits-sized
TORCHTITAN_LOSS_FREED_LOGITS = 1  # 16-bit, logits-sized, reserved but unusable


# The tools checkpoint transformer blocks only; the embedding and the head keep
# what they save whatever the plan's recompute: torchtitan wraps the children of
# ``model.layers`` (activation_checkpoint.py:152-163); Megatron-LM's full and
# selective recompute live in its TransformerBlock and attention
# (megatron/core/transformer/transformer_block.py:446 ``_checkpointed_forward``);
# DeepSpeed's ``checkpoint`` keeps just the inputs of what it wraps
# (deepspeed/runtime/activation_checkpointing/checkpointing.py:567-643:
# ``CheckpointFunction.forward`` runs it under no_grad and saves its args), and
# the exported PipelineModule wraps the blocks only (``checkpointable_layers``:
# deepspeed/runtime/pipe/module.py:683-685; by default it would wrap every layer
# with parameters, the embedding too, whose weights then get no gradient: its
# comment at :673-675).
TOOL_TARGETS = ("torchtitan", "megatron", "deepspeed")
UNWRAPPED_KINDS = ("embedding", "head")


def target_arrays(target: str, arrays: LayerArrays, model: ModelSpec) -> LayerArrays:
    """``arrays`` with what ``target`` keeps and recomputes where it differs
    from the model's accounting: under a tool, the embedding and head keep all
    they save and redo nothing when the plan recomputes them (above);
    under torchtitan, its op AC for "selective" on every dense Llama- or
    GPT-style block (``decoder_shape``) and its loss's backward buffers (and
    the freed logits' reserved memory) on the head. Other models keep
    Korthikanti's selective recomputation of the attention core."""
    if target not in TOOL_TARGETS:
        return arrays
    unwrapped = np.array([layer.kind in UNWRAPPED_KINDS for layer in model.layers])
    outside = np.where(unwrapped, np.maximum(arrays.act_bytes - arrays.input_bytes, 0.0),
                       arrays.column("act_outside_bytes"))
    arrays = replace(arrays, act_outside_bytes=outside, checkpointed=~unwrapped)
    shapes = decoder_shape(model) if target == "torchtitan" else None
    if shapes is None:
        return arrays
    core = arrays.act_attention_core_bytes.copy()
    share = np.full(arrays.num_layers, np.nan)
    working = arrays.column("working_bytes").copy()
    for index, (layer, shape) in enumerate(zip(model.layers, shapes)):
        if layer.kind == "head":
            per_logit = TORCHTITAN_LOSS_GRADIENT_BUFFERS * FP32 + TORCHTITAN_LOSS_FREED_LOGITS * model.dtype_bytes
            working[index] = per_logit * shape.seq * shape.vocab
        elif layer.kind != "embedding" and not shape.experts:
            saved, share[index] = torchtitan_op_ac(shape, model.dtype_bytes)
            core[index] = max(arrays.act_bytes[index] - saved, 0.0)
    return replace(arrays, act_attention_core_bytes=core, op_ac_gemm_share=share, working_bytes=working)
