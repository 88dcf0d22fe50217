"""Memory as each tool a plan targets runs it, where the tool differs from the
papers' accounting (``Workload.target``); hetplan's own runtime is
``model/runtime_memory.py`` and ``RUNTIME_STATE_BYTES``. Each effect is here
once, with the tool's source beside it."""

from __future__ import annotations

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
