"""A lower bound on the iteration time of *every* plan of a workload.

Under the shared cost model an iteration is at least its pipeline time plus
the optimizer step, and the pipeline time is at least the compute time of
each device: every device of stage ``j`` is busy for ``m`` micro-batches of
its replica's work, which takes no more than ``m · max_j t_j <= T_pipe``. So:

* **compute** — every layer processes every sample of the global batch ``B``
  forward and backward. On a GPU of type ``g`` a sample of layer ``l`` costs
  at least ``c[l, g]`` GPU-seconds, whatever the plan: the roofline at TP 1
  with the whole batch in one micro-batch (TP ranks each pay the memory-bound
  part of their share and a kernel launch per micro-batch; larger shares only
  amortise launches), or the cheapest per-sample time a profile measured.
  With ``n_g`` GPUs of type ``g`` all busy at most ``T``, weak LP duality
  gives, for any weights ``y_g >= 0``::

      T >= B · Σ_l min_g (y_g · c[l, g]) / Σ_g n_g · y_g

  We take the best of ``y = 1`` and ``y_g = 1 / c[l*, g]`` for each distinct
  layer ``l*`` (exact when every layer's speed ratios between GPU types are
  the same).
* **optimizer** — every parameter's optimizer state is held by at least one
  device, and the slowest stage's step is at least what any of its devices
  needs at its own memory bandwidth, so the step takes at least
  ``OPTIMIZER_STEP_BYTES_PER_PARAM · P / Σ_d bandwidth_d`` (efficiency applied).

Loose where the model charges what no bound sees: communication, the pipeline
bubble, imbalance between stages and replicas, recomputation forced by memory.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from hetplan.cluster.catalog import GPUSpec
from hetplan.cost.compute import roofline_passes
from hetplan.cost.constants import MEMORY_BANDWIDTH_EFFICIENCY, OPTIMIZER_STEP_BYTES_PER_PARAM
from hetplan.cost.kernel import CostKernel


def sample_cost_matrix(kernel: CostKernel, gpus: list[GPUSpec], batch: int) -> np.ndarray:
    """``c[l, g]``: least GPU-seconds per sample of layer ``l`` on GPU type ``g``
    when no micro-batch holds more than ``batch`` samples."""
    columns = []
    for gpu in gpus:
        unit = kernel.unit_work(gpu, 1, False)
        if unit.expert_tokens is not None:  # experts at their best token side: EP gives them up to ep·batch tokens
            unit = replace(unit, expert_tokens=np.full_like(unit.expert_tokens, np.inf))
        fwd, bwd = roofline_passes(kernel.arrays, gpu, batch, 1, kernel.dtype_bytes, unit=unit)
        cost = (fwd + bwd) / batch
        measured = _profiled_minimum(kernel, gpu)
        if measured is not None:
            cost = np.minimum(cost, measured)
        columns.append(cost)
    return np.stack(columns, axis=1)


def _profiled_minimum(kernel: CostKernel, gpu: GPUSpec) -> np.ndarray | None:
    """Per layer, the least measured ``tp · (fwd + bwd) / batch`` (inf if none):
    interpolated and composed batch sizes never go below it."""
    profile = kernel.workload.profile
    if profile is None:
        return None
    best: dict[str, float] = {}
    for e in profile.entries():
        if e.gpu == gpu.name:
            best[e.layer] = min(best.get(e.layer, np.inf), e.tp * (e.fwd_s + e.bwd_s) / e.batch)
    return np.array([best.get(key, np.inf) for key in kernel.arrays.profile_keys])


def compute_lower_bound(kernel: CostKernel, batch: int) -> float:
    """The compute part (module docstring) for a global batch of ``batch`` samples."""
    counts: dict[str, int] = {}
    specs: dict[str, GPUSpec] = {}
    for device in kernel.cluster.devices:
        counts[device.gpu.name] = counts.get(device.gpu.name, 0) + 1
        specs[device.gpu.name] = device.gpu
    names = sorted(counts)
    cost = sample_cost_matrix(kernel, [specs[n] for n in names], batch)
    n = np.array([counts[name] for name in names], dtype=float)
    _, distinct = np.unique(cost, axis=0, return_index=True)
    weights = [np.ones(len(names))] + [1.0 / cost[i] for i in sorted(distinct) if np.all(cost[i] > 0)]
    return max(batch * float(np.min(cost * y, axis=1).sum()) / float(n @ y) for y in weights)


def optimizer_lower_bound(kernel: CostKernel) -> float:
    """The optimizer part (module docstring)."""
    bandwidth = sum(d.gpu.memory_bandwidth_bytes_per_s for d in kernel.cluster.devices)
    return (OPTIMIZER_STEP_BYTES_PER_PARAM * kernel.model.total_params
            / (bandwidth * MEMORY_BANDWIDTH_EFFICIENCY))


def iteration_lower_bound(kernel: CostKernel, global_batch_size: int) -> float:
    """Seconds no plan of ``kernel``'s workload at this global batch can beat."""
    return compute_lower_bound(kernel, global_batch_size) + optimizer_lower_bound(kernel)
