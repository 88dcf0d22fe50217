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

* **host dispatch** — where the cost model charges hetplan's runtime its
  per-micro-batch host time (``compute.RunOverhead``: eager PyTorch issues
  every operator of a pass, ``HOST_OP_S`` each, on every rank whatever its
  share of the batch), a pass of layer ``l`` takes at least its host time
  ``h_l`` (a pass takes ``max(device, host)``), so one micro-batch through
  stage ``j`` takes ``t_j >= Σ_{l in j} h_l``. The pipeline takes
  ``m·max t + (Σ_j t_j − max t)/v + 2v·Σ c`` (``cost/pipeline.py``): with
  ``v = 1`` that is at least ``Σ_j t_j``; with ``v > 1`` the plan has a
  multiple of ``pp`` micro-batches (``plan/validate.py``), so ``m·max t >=
  pp·max t >= Σ_j t_j``. Either way ``T_pipe >= H = Σ_l h_l``. Not where a
  profile gives measured times, nor where processes share CPU cores
  (``cost/shared_cores.py`` runs a pipeline faster than its closed form).

The pipeline is at least the larger of the compute and host terms, and the
optimizer step follows it (``pipeline.iteration_time``), so the bound is
``max(compute, host) + optimizer``. The per-GPU-type numbers it needs are
gathered once in a :class:`BoundTable`, which ``app/choose.py`` evaluates for
every allocation of a pool: one formula for a cluster and for an allocation.

Loose where the model charges what no bound sees: communication, the pipeline
bubble, imbalance between stages and replicas, recomputation forced by memory.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

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


def host_lower_bound(kernel: CostKernel, gpus: list[GPUSpec]) -> float:
    """The host part (module docstring): the least, over the GPU types, host
    time of one micro-batch through every layer forward and backward; 0 where
    the model charges no host time, a profile measured the layers, or
    processes share CPU cores."""
    if kernel.workload.profile is not None or kernel.core_sharing is not None:
        return 0.0
    totals = [float((run.host_fwd_s + run.host_bwd_s).sum()) for gpu in gpus
              if (run := kernel.unit_work(gpu, 1, False).run) is not None]
    return min(totals) if len(totals) == len(gpus) else 0.0


@dataclass
class BoundTable:
    """What the bound needs of a workload on GPUs of ``types``, computed once:
    each type's least seconds per sample of each layer (``cost``, layers x
    types), the host time of a micro-batch, and the optimizer's bytes. The
    bound of any cluster of these types then needs only how many GPUs of each
    type it has and the sum of their memory bandwidths (``iteration_s``)."""

    types: tuple[str, ...]
    cost: np.ndarray
    batch: int
    host_s: float
    optimizer_bytes: float
    _weights: dict[tuple[int, ...], list[tuple[np.ndarray, float]]] = field(default_factory=dict, repr=False)

    def _weightings(self, present: tuple[int, ...]) -> list[tuple[np.ndarray, float]]:
        """``(y, Σ_l min_g y_g·c[l, g])`` for each weighting of the module
        docstring's LP over the ``present`` types: ``y = 1`` and, for each
        distinct layer ``l*``, ``y_g = 1 / c[l*, g]``."""
        found = self._weights.get(present)
        if found is None:
            cost = self.cost[:, list(present)]
            _, distinct = np.unique(cost, axis=0, return_index=True)
            ys = [np.ones(len(present))] + [1.0 / cost[i] for i in sorted(distinct) if np.all(cost[i] > 0)]
            found = self._weights[present] = [(y, float(np.min(cost * y, axis=1).sum())) for y in ys]
        return found

    def compute_s(self, gpus_per_type: np.ndarray) -> float:
        """The compute part for ``gpus_per_type[g]`` GPUs of type ``types[g]``."""
        present = tuple(int(g) for g in np.flatnonzero(gpus_per_type))
        counts = gpus_per_type[list(present)].astype(float)
        return max(self.batch * numerator / float(counts @ y) for y, numerator in self._weightings(present))

    def iteration_s(self, gpus_per_type: np.ndarray, memory_bandwidth: float) -> float:
        """Seconds no plan on these GPUs (their memory bandwidths summing to
        ``memory_bandwidth`` bytes/s) can beat."""
        optimizer = self.optimizer_bytes / (memory_bandwidth * MEMORY_BANDWIDTH_EFFICIENCY)
        return max(self.compute_s(gpus_per_type), self.host_s) + optimizer


def bound_table(kernel: CostKernel, gpus: list[GPUSpec], batch: int) -> BoundTable:
    """The :class:`BoundTable` of ``kernel``'s workload on ``gpus`` (one spec per type, any order)."""
    ordered = sorted(gpus, key=lambda g: g.name)
    return BoundTable(tuple(g.name for g in ordered), sample_cost_matrix(kernel, ordered, batch), batch,
                      host_lower_bound(kernel, ordered),
                      OPTIMIZER_STEP_BYTES_PER_PARAM * kernel.model.total_params)


def cluster_bound_table(kernel: CostKernel, batch: int) -> tuple[BoundTable, np.ndarray, float]:
    """The table of ``kernel``'s own cluster, its GPUs per type and their summed memory bandwidth."""
    specs = {d.gpu.name: d.gpu for d in kernel.cluster.devices}
    table = bound_table(kernel, list(specs.values()), batch)
    counts = np.zeros(len(table.types))
    for device in kernel.cluster.devices:
        counts[table.types.index(device.gpu.name)] += 1
    bandwidth = sum(d.gpu.memory_bandwidth_bytes_per_s for d in kernel.cluster.devices)
    return table, counts, bandwidth


def iteration_lower_bound(kernel: CostKernel, global_batch_size: int) -> float:
    """Seconds no plan of ``kernel``'s workload at this global batch can beat."""
    table, counts, bandwidth = cluster_bound_table(kernel, global_batch_size)
    return table.iteration_s(counts, bandwidth)
