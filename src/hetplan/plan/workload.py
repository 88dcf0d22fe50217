"""Workload: a model on a cluster with a batch size and training settings."""

from __future__ import annotations

from dataclasses import dataclass, field

from hetplan.cluster.spec import ClusterSpec
from hetplan.cost.calibration import Calibration
from hetplan.cost.constants import (
    ATTENTION_KERNELS,
    DEFAULT_ATTENTION_KERNEL,
    EXPERT_LOAD_IMBALANCE,
    DEVICE_REPORTED_FRACTION,
    OPTIMIZER_STATE_BYTES,
    PRECISION_BYTES,
    RUNTIME_OPTIMIZER,
    RUNTIME_STATE_BYTES,
    ZERO_IMPLEMENTATIONS,
)
from hetplan.cost.targets import target_optimizer
from hetplan.errors import HetplanError, did_you_mean
from hetplan.limits import MAX_STEP_BYTES
from hetplan.model.spec import LAYER_BYTE_FIELDS
from hetplan.limits import MAX_EXPERT_IMBALANCE
from hetplan.model.spec import ModelSpec

# The code a plan may be made for: hetplan's runtime, the tools hetplan exports to, or none ("").
TARGETS = ("", "hetplan", "torchtitan", "megatron", "deepspeed")
from hetplan.profile.db import ProfileDB


@dataclass(frozen=True)
class Workload:
    """What to train, where, and how.

    Attributes:
        model, cluster: the ModelSpec and ClusterSpec.
        global_batch_size: samples per optimizer step.
        optimizer: key of ``OPTIMIZER_STATE_BYTES`` ("adam-mixed" for 16-bit
            models, "adam-fp32" for fp32 ones by default). For target
            "hetplan" it names the runtime's optimizer (``RUNTIME_OPTIMIZER``:
            Adam variants are its AdamW, the default, since that is what
            models are trained with; ``hetplan train``'s own default, SGD with
            momentum, holds 4 bytes less per parameter, so a plan that fits
            with AdamW fits with it).
        memory_limit_bytes: cap on usable memory per GPU (Galvatron's budgets);
            0 means each GPU's own capacity.
        overlap_grad_sync: overlap gradient sync with the last backward pass
            (Galvatron-BMW §V), paying the overlap slowdown.
        profile: measured layer times, preferred over FLOP estimates.
        fp8: linear layers' matmuls run in FP8 (Transformer Engine), on GPUs
            that have FP8 tensor cores; everything else keeps the model's dtype.
        precision: "fp32", "bf16" or "fp16" (``PRECISION_BYTES``); must match
            the model's ``dtype_bytes``; default from it (2 bytes: bf16).
        zero_implementation: how sharded data parallelism (ZeRO stages 1-3)
            moves its shards: "fsdp" (PyTorch FSDP/FSDP2, Megatron's
            distributed optimizer, hetplan's runtime) or "deepspeed"
            (DeepSpeed ZeRO); see ``ZERO_IMPLEMENTATIONS``.
        calibration: the user's measured rates (``hetplan calibrate``), applied
            by the cost kernel to compute, link bandwidth and latency.
        expert_imbalance: tokens the busiest expert-parallel rank processes
            over the average (``EXPERT_LOAD_IMBALANCE``; >= 1).
        search_offload: planners may offload a layer's saved activations to
            host memory (``LayerStrategy.offload``) where the cost model ranks
            it best; False (``hetplan plan --offload never``) keeps them on the
            GPU in every plan searched. A search setting: costs ignore it.
        attention_kernel: the fused attention implementation the run calls
            (``ATTENTION_KERNELS``): "flash2" (PyTorch SDPA: hetplan's runtime,
            torchtitan, HF), "cudnn" (Transformer Engine: Megatron-LM, NeMo),
            "triton" (MosaicML's MPT kernel); they differ up to 3x per GPU.
        tp_comm_overlap: TP's all-gathers and reduce-scatters run split under
            the matmuls they feed (Megatron-LM ``--tp-comm-overlap`` with
            Transformer Engine, torchtitan's async TP with torch.compile):
            only what outlasts a layer's compute stays exposed. hetplan's own
            runtime does not overlap them.
        compile: hetplan's runtime ``torch.compile``s each layer (``hetplan train
            --compile``): the cost kernel costs the compiled graphs' kernels, traffic
            and saved activations (``hetplan.model.runtime_time``); target "hetplan" only.
        target: the code that will train the plans (``TARGETS``): "hetplan"
            (hetplan's runtime: the planners search only what it runs,
            ``hetplan.plan.support.search_limits``), a tool's name, or ""
            (none: every plan the cost model costs, as the papers search).
    """

    model: ModelSpec
    cluster: ClusterSpec
    global_batch_size: int
    optimizer: str = ""
    memory_limit_bytes: int = 0
    overlap_grad_sync: bool = True
    profile: ProfileDB | None = field(default=None, compare=False)
    fp8: bool = False
    zero_implementation: str = "fsdp"
    precision: str = ""
    calibration: Calibration | None = field(default=None, compare=False)
    expert_imbalance: float = EXPERT_LOAD_IMBALANCE
    search_offload: bool = field(default=True, compare=False)
    attention_kernel: str = DEFAULT_ATTENTION_KERNEL
    tp_comm_overlap: bool = False
    target: str = ""
    compile: bool = False

    def __post_init__(self) -> None:
        self._check_precision()
        if self.global_batch_size <= 0:
            raise HetplanError(f"global batch size must be positive, got {self.global_batch_size}")
        if not self.optimizer:
            object.__setattr__(self, "optimizer", "adam-mixed" if self.model.dtype_bytes == 2 else "adam-fp32")
        if self.optimizer not in OPTIMIZER_STATE_BYTES:
            raise HetplanError(
                f"unknown optimizer {self.optimizer!r}; choose one of {sorted(OPTIMIZER_STATE_BYTES)}"
            )
        if self.fp8 and self.model.dtype_bytes != 2:
            raise HetplanError("--fp8 runs the matmuls of a 16-bit model in FP8; this model trains in "
                               f"{self.model.dtype_bytes}-byte elements")
        if self.zero_implementation not in ZERO_IMPLEMENTATIONS:
            raise HetplanError(f"unknown ZeRO implementation {self.zero_implementation!r}; choose one of "
                               f"{', '.join(sorted(ZERO_IMPLEMENTATIONS))}")
        if self.attention_kernel not in ATTENTION_KERNELS:
            raise HetplanError(f"unknown attention kernel {self.attention_kernel!r}; choose one of "
                               f"{', '.join(ATTENTION_KERNELS)}")
        if self.target not in TARGETS:
            raise HetplanError(f"unknown target {self.target!r}{did_you_mean(self.target, filter(None, TARGETS))}; choose one of {', '.join(t for t in TARGETS if t)}")
        if self.compile and self.target != "hetplan":
            raise HetplanError("--compile costs hetplan's runtime's compiled layers: plan for --target hetplan "
                               f"(a model hetplan trains), or drop --compile (target {self.target or 'any'!r})")
        if self.memory_limit_bytes < 0:
            raise HetplanError("memory limit must be positive")
        self._check_step_bytes()
        if not 1.0 <= self.expert_imbalance <= MAX_EXPERT_IMBALANCE:
            raise HetplanError(f"expert load imbalance must be between 1 (perfect balance) and "
                               f"{MAX_EXPERT_IMBALANCE:g}, got {self.expert_imbalance:g}")

    def _check_step_bytes(self) -> None:
        """The bytes one step keeps (every layer's per-sample bytes x the global
        batch) within MAX_STEP_BYTES, so no per-GPU byte count can overflow the
        planners' int64 arrays."""
        per_sample = sum(getattr(layer, name) for layer in self.model.layers for name in LAYER_BYTE_FIELDS)
        step = per_sample * self.global_batch_size
        if step > MAX_STEP_BYTES:
            raise HetplanError(f"one step of {self.model.name} at global batch {self.global_batch_size:,} keeps "
                               f"{step:.3g} bytes, above hetplan's limit of {MAX_STEP_BYTES:.3g} (2^60); "
                               "check the model's per-layer bytes or lower the global batch")

    def _check_precision(self) -> None:
        """Default: what the model is costed in (4 bytes: fp32, 2: bf16); a
        given precision must match it, or the plan would cost another model."""
        if not self.precision:
            object.__setattr__(self, "precision", "fp32" if self.model.dtype_bytes == 4 else "bf16")
        if self.precision not in PRECISION_BYTES:
            raise HetplanError(f"unknown precision {self.precision!r}; choose one of {', '.join(PRECISION_BYTES)}")
        if PRECISION_BYTES[self.precision] != self.model.dtype_bytes:
            raise HetplanError(
                f"model {self.model.name!r} is costed in {self.model.dtype_bytes}-byte elements, not {self.precision}; "
                "presets keep their papers' precision: use a HF config.json (built in the precision you ask for) "
                "or drop --precision"
            )

    @property
    def runtime_optimizer(self) -> str:
        """The runtime's optimizer ("adamw" or "sgd") this workload's optimizer stands for."""
        return RUNTIME_OPTIMIZER[self.optimizer]

    @property
    def state_bytes(self) -> tuple[int, int, int]:
        """(weight, gradient, optimizer-state) bytes per parameter: the
        optimizer's as the target tool holds it (``cost.targets.target_optimizer``:
        Megatron's bf16 keeps fp32 gradients), or what hetplan's runtime holds
        for it (``RUNTIME_STATE_BYTES``)."""
        if self.target == "hetplan":
            return RUNTIME_STATE_BYTES[self.runtime_optimizer]
        return OPTIMIZER_STATE_BYTES[target_optimizer(self.target, self.precision, self.optimizer)]

    def device_capacity_bytes(self, device: int) -> int:
        """A device's memory, capped by ``memory_limit_bytes``; for hetplan's
        runtime what a GPU reports to CUDA (``DEVICE_REPORTED_FRACTION``)."""
        spec = self.cluster.devices[device]
        capacity = spec.memory_bytes
        if self.target == "hetplan" and spec.gpu.catalog_name != "CPU":
            capacity = int(capacity * DEVICE_REPORTED_FRACTION)
        if self.memory_limit_bytes:
            capacity = min(capacity, self.memory_limit_bytes)
        return capacity
