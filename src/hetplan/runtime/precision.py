"""Training precision as the plan says: fp32, bf16 or fp16 mixed precision.

Mixed precision keeps fp32 master weights, gradients and optimizer states and
runs the forward/backward math in 16 bits (Micikevicius et al. 2018, "Mixed
Precision Training", §3): here ``torch.autocast`` around every forward (one
region per micro-batch: :mod:`hetplan.runtime.microbatch` says why), the
same on every rank and in the single-process reference, so parameters, their
gradients and the data-parallel reductions stay fp32 (FSDP2 reduces fp32
gradients). This is what the cost model's ``adam-mixed-fp32-grads`` optimizer
counts. Activations sent between pipeline stages are what autocast produces
(16-bit for matmul outputs).

fp16 also needs loss scaling (ibid. §3.2): small gradients underflow in fp16.
:class:`LossScaler` is dynamic loss scaling with ``torch.amp.GradScaler``'s
defaults (initial scale 2**16, halve on overflow, double after 2000 good
steps; PyTorch docs, torch.amp.GradScaler). Because the user's own optimizer
steps, an overflowing step leaves every gradient ``None``: PyTorch's optimizers
skip such parameters, so the step is skipped as GradScaler would skip it.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterable

import torch

DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
INITIAL_LOSS_SCALE = 2.0 ** 16  # torch.amp.GradScaler(init_scale=2.**16)
GROWTH_INTERVAL = 2000  # GradScaler(growth_interval=2000)


def autocast(device: torch.device, precision: str) -> Any:
    """The precision context of one whole forward (nothing for fp32): the
    reference's, which runs the global batch in one forward."""
    dtype = DTYPES[precision]
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def precision_of(settings: dict[str, Any], dtype_bytes: int) -> str:
    """The plan's precision: the plan file's setting, else from the model's element size."""
    return settings.get("precision") or ("fp32" if dtype_bytes == 4 else "bf16")


class LossScaler:
    """Dynamic loss scaling for fp16 (module docstring)."""

    def __init__(self) -> None:
        self.scale = INITIAL_LOSS_SCALE
        self.good_steps = 0
        self.skipped_steps = 0

    def unscale(self, grads: Iterable[torch.Tensor], device: torch.device, group: Any = None) -> bool:
        """Divide the gradients by the scale; whether all ranks' are finite (the
        verdict is the same on every rank of ``group``). One grouped kernel per
        (device, dtype) checks and unscales (``_amp_foreach_non_finite_check_and_unscale_``,
        what torch's GradScaler runs; multiplying by 1/scale is exact, the scale
        being a power of two), one all-reduce shares the verdict, and reading it
        is the one host sync (GradScaler.step reads it too)."""
        from torch.distributed.tensor import DTensor

        found = torch.zeros(1, dtype=torch.float32, device=device)
        by_kind: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for g in grads:
            local = g.to_local() if isinstance(g, DTensor) else g
            by_kind.setdefault((local.device, local.dtype), []).append(local)
        for (dev, _), locals_ in by_kind.items():
            found_here = torch.zeros(1, dtype=torch.float32, device=dev)
            torch._amp_foreach_non_finite_check_and_unscale_(
                locals_, found_here, torch.full((1,), 1.0 / self.scale, dtype=torch.float32, device=dev))
            found = torch.maximum(found, found_here.to(device))
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.all_reduce(found, op=torch.distributed.ReduceOp.MAX, group=group)
        finite = not bool(found)
        self._update(finite)
        return finite

    def _update(self, finite: bool) -> None:
        if not finite:
            self.scale /= 2.0
            self.good_steps = 0
            self.skipped_steps += 1
            return
        self.good_steps += 1
        if self.good_steps >= GROWTH_INTERVAL:
            self.scale *= 2.0
            self.good_steps = 0
