"""The options several commands share, and what they become: the workload
flags (``add_workload_args``) read into ``hetplan.app.WorkloadOptions``
(``workload_options``), the target flags, the training-cost flags."""

from __future__ import annotations

import argparse
from hetplan.app.workload import (
    DEFAULT_CLUSTER, DEFAULT_GLOBAL_BATCH, DEFAULT_MODEL, WorkloadOptions, load_workload as load_options_workload,
)
from hetplan.io.argtypes import at_most, finite_nonneg_float, gpu_prices, name_or_path, positive_int, token_count
from hetplan.plan.workload import Workload
from hetplan.cost.constants import ATTENTION_KERNELS, PRECISION_BYTES, ZERO_IMPLEMENTATIONS
from hetplan.export.tools import DEFAULT_TORCHTITAN_VERSION, TORCHTITAN_VERSIONS
from hetplan.limits import MAX_GLOBAL_BATCH, MAX_GPUS
from hetplan.plan.file import PlanFile
from hetplan.export.target import PLAN_TARGETS

OFFLOAD_SEARCH = ("auto", "never")  # plan/compare --offload: may the planners offload activations
AUTO_BATCH = "auto"  # --global-batch auto: a batch-searching planner chooses it

batch_size = at_most(MAX_GLOBAL_BATCH)  # samples: --global-batch, --micro-batch
degree = at_most(MAX_GPUS)  # a parallel degree: --tp, --pp, --dp, --cp, --ep


def _global_batch(text: str) -> int | str:
    return AUTO_BATCH if text == AUTO_BATCH else batch_size(text)


def add_workload_args(p: argparse.ArgumentParser, batch_auto: bool = True) -> None:
    """The model, cluster, batch and settings of a workload, ``--json`` and the training-cost flags."""
    p.add_argument("--model", type=name_or_path, default=None, help=f"preset name, HF config.json, ModelSpec .json or pkg.mod:function (default {DEFAULT_MODEL})")
    p.add_argument("--cluster", type=name_or_path, default=None, help=f"preset name, NxGPU, or cluster .yaml (default {DEFAULT_CLUSTER})")
    p.add_argument("--global-batch", type=_global_batch if batch_auto else batch_size, default=None,
                   help=f"samples per step (default {DEFAULT_GLOBAL_BATCH})" + ("; 'auto' lets batch-searching "
                                                                                 "planners choose" if batch_auto else ""))
    p.add_argument("--seq-len", type=positive_int, default=None, help="sequence length for HF configs")
    p.add_argument("--memory-limit", default=None, help="usable memory per GPU, e.g. 8GB (default: the GPU's)")
    p.add_argument("--optimizer", default="", help="adam-mixed (16-bit models), adam-mixed-fp32-grads (Megatron bf16, "
                   "FSDP fp32 reduce), adam-bf16-deepspeed (DeepSpeed BF16 optimizer: bf16 + fp32 gradients), "
                   "adam-fp32, sgd-fp32")
    p.add_argument("--profile", default=None, help="measured layer times (ProfileDB JSON)")
    p.add_argument("--calibration", default=None,
                   help="fitted rates from 'hetplan calibrate' (default: the cluster file's 'calibration:')")
    p.add_argument("--no-overlap", action="store_true", help="do not overlap gradient sync with backward")
    p.add_argument("--fp8", action="store_true",
                   help="linear layers' matmuls in FP8 (Transformer Engine), on GPUs with FP8 tensor cores")
    p.add_argument("--precision", choices=tuple(PRECISION_BYTES), default=None,
                   help="training precision (default: the model's; HF configs: bf16); the runtime trains in it")
    p.add_argument("--zero-impl", choices=ZERO_IMPLEMENTATIONS, default=None,
                   help="how ZeRO shards move between nodes: fsdp (PyTorch FSDP, Megatron distributed optimizer, "
                   "hetplan's runtime; default) or deepspeed (each GPU's shard traffic crosses its own NIC)")
    p.add_argument("--attention-kernel", choices=ATTENTION_KERNELS, default=None,
                   help="the fused attention kernel your training calls: flash2 (PyTorch SDPA: hetplan's runtime, "
                   "torchtitan, HF; the default), cudnn (Transformer Engine: Megatron-LM, NeMo; the default with "
                   "--target megatron), triton (MosaicML MPT)")
    p.add_argument("--tp-overlap", action="store_true",
                   help="TP communication overlapped with the matmuls, as Megatron-LM --tp-comm-overlap and "
                   "torchtitan's async TP run it (hetplan's own runtime does not)")
    p.add_argument("--compile", action="store_true",
                   help="cost hetplan's runtime with each layer torch.compiled (hetplan train --compile; "
                   "recorded in the plan, which hetplan train then compiles): fused kernels, fewer launches")
    p.add_argument("--expert-imbalance", type=finite_nonneg_float, default=None,
                   help="MoE models: tokens the busiest expert-parallel rank gets over the average (default 1.25; "
                   "1 = perfect balance; give what your router measures)")
    p.add_argument("--json", dest="json_path", default=None, help="also write the result as JSON here")
    add_training_args(p)


def add_training_args(p: argparse.ArgumentParser) -> None:
    """``--tokens`` and ``--price-per-gpu-hour``: what training costs (``hetplan.app.training``)."""
    p.add_argument("--tokens", type=token_count, default=None,
                   help="tokens to train (e.g. 300B): days and GPU-hours (and cost with prices)")
    p.add_argument("--price-per-gpu-hour", dest="prices", type=gpu_prices, default=None,
                   help="price per GPU-hour: one number, or GPU=PRICE,... per type (e.g. H100=4.9,A100-80GB=1.8)")


def add_target_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", choices=PLAN_TARGETS, default=None,
                   help="keep only plans this tool can run ('hetplan export' succeeds; 'hetplan': hetplan's own "
                   "runtime, the default for models it builds; 'any': every plan, as the papers' planners search), "
                   "and say how much slower the best of them is than the best plan overall (docs/exports.md)")
    p.add_argument("--torchtitan-version", choices=TORCHTITAN_VERSIONS, default=DEFAULT_TORCHTITAN_VERSION,
                   help="with --target torchtitan: the release to run (0.2 runs ZeRO-0 only without TP/PP)")


def add_offload_search_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--offload", choices=OFFLOAD_SEARCH, default="auto",
                   help="activation offloading to host memory: auto (default) lets the planners that search "
                   "recomputation (uniform, auto) offload layers where memory is short and the cost model ranks it "
                   "best; never keeps every plan's activations on the GPU")


def auto_batch(args: argparse.Namespace) -> bool:
    """``--global-batch auto``: the planner chooses the batch."""
    return args.global_batch == AUTO_BATCH


def workload_options(args: argparse.Namespace) -> WorkloadOptions:
    """The workload flags of ``add_workload_args`` (and ``--target``, plan's
    ``--offload auto|never``) as typed options; a flag left out is None."""
    return WorkloadOptions(
        model=args.model, cluster=args.cluster, global_batch=None if auto_batch(args) else args.global_batch,
        seq_len=args.seq_len, memory_limit=args.memory_limit, optimizer=args.optimizer, profile=args.profile,
        calibration=args.calibration, overlap_grad_sync=False if args.no_overlap else None,
        fp8=True if args.fp8 else None, precision=args.precision, zero_impl=args.zero_impl,
        attention_kernel=args.attention_kernel, tp_overlap=True if args.tp_overlap else None,
        expert_imbalance=args.expert_imbalance, target=getattr(args, "target", None),
        compile=True if args.compile else None,
        # plan/compare: --offload auto|never; estimate's --offload (a flag) sets the plan, not a search
        search_offload=getattr(args, "offload", "auto") != "never")


def load_workload(args: argparse.Namespace, global_batch: int | None = None, plan_file: PlanFile | None = None,
                  ) -> Workload:
    """The workload of the command line's flags (``hetplan.app.load_workload``)."""
    return load_options_workload(workload_options(args), global_batch, plan_file)

