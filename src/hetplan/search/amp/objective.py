"""AMP's own cost model (Li et al., NeurIPS 2022, eq. 3-5): the private
objective AMP's planner ranks by.

    T = max_i T_pp_i + max_d T_dpsync_d                                   (eq. 4)
    T_pp_i = (gas − 1)·max_j t_ij + Σ_j e_ij + Σ_j t_ij                    (eq. 5)
    T_dpsync_d = 2(dp − 1)·M_d / (dp · B_min)                              (eq. 3)

``t_ij`` is stage ``j`` of pipeline ``i``: the sum over its layers of the
per-layer time ``t_layer`` on *its own* GPU type (the slowest GPU of its TP
group), at TP degree ``tp`` and micro-batch ``mbs``, including the layer's TP
all-reduces (eq. 3 on the TP group's slowest link) — AMP profiles exactly this
(layer time including MP communication, per TP degree); the shared kernel's
layer times (a ProfileDB where the workload has one) stand in for the profile.
``e_ij = v / b`` is one activation transfer to the next stage over the slowest
link among the TP ranks' pairs. ``M_d`` is the gradient bytes of the
parameters device ``d`` holds; ``B_min`` the slowest link of its DP group.

This is deliberately *not* the shared cost model: AMP ranks by it, memory is
not part of it, and its all-reduces are flat rings over the slowest link.
Every plan AMP returns is re-costed by the shared model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from hetplan.cost.comm import flat_ring_allreduce_time
from hetplan.cost.model import CostModel
from hetplan.errors import HetplanError
from hetplan.plan import Plan
from hetplan.search.common.partition import PartitionProblem


@dataclass(frozen=True)
class AmpCost:
    """AMP's estimate of one strategy (seconds per iteration)."""

    total_s: float  # eq. 4
    pipeline_s: float  # max over pipelines of eq. 5
    dp_sync_s: float  # max over devices of eq. 3
    boundaries: tuple[int, ...]  # the layer assignment costed


@dataclass(frozen=True)
class AmpTerms:
    """What AMP's cost needs for one (degrees, micro-batch, placement), any layer split.

    Attributes:
        stage_devices: each stage's devices, TP innermost.
        dp, tp, micro_batch: degrees and per-replica micro-batch size.
        layer_prefix: ``[i][j]``: prefix sums of ``t_layer`` of pipeline ``i``'s stage ``j``.
        link_bandwidth: ``[i, j]``: bytes/s of boundary ``j`` in pipeline ``i``
            (slowest of the TP ranks' pairs).
        sync_per_byte: per stage, seconds per gradient byte of eq. 3 on its
            slowest DP group (0 when dp = 1).
    """

    stage_devices: tuple[tuple[int, ...], ...]
    dp: int
    tp: int
    micro_batch: int
    layer_prefix: tuple[tuple[np.ndarray, ...], ...]
    link_bandwidth: np.ndarray
    sync_per_byte: tuple[float, ...]

    @property
    def pp(self) -> int:
        return len(self.stage_devices)


class AmpCostModel:
    """AMP's own cost (eq. 3–5) for one workload, on the shared kernel's layer times."""

    def __init__(self, cost_model: CostModel) -> None:
        self.cost_model = cost_model
        self.kernel = cost_model.kernel
        self.workload = cost_model.workload
        self.model = cost_model.model
        self.cluster = cost_model.cluster
        self._layer_cache: dict[tuple[str, int, int, float], np.ndarray] = {}
        self._output = self.kernel.arrays.output_bytes
        self._grad_bytes = self.workload.state_bytes[1]

    def layer_times(self, group: Sequence[int], micro_batch: int) -> np.ndarray:
        """Prefix sums of ``t_layer`` over the layers on a TP group: forward +
        backward on the group's slowest GPU plus the forward and backward TP
        all-reduces (eq. 3: flat rings on the group's slowest link). Entry
        ``l`` is the time of layers ``[0, l)``."""
        tp = len(group)
        gpu = self.kernel.slowest_gpu(group)
        ring = flat_ring_allreduce_time(self.cluster, group, 1.0) if tp > 1 else 0.0
        key = (gpu.name, tp, micro_batch, ring)
        cached = self._layer_cache.get(key)
        if cached is None:
            t = self.kernel.layer_times(gpu, micro_batch, tp)
            times = t.fwd_s + t.bwd_s + self.kernel.tp_comm_bytes("none") * micro_batch * ring
            cached = self._layer_cache[key] = np.concatenate([[0.0], np.cumsum(times)])
        return cached

    def terms(self, stage_devices: Sequence[Sequence[int]], dp: int, tp: int, micro_batch: int) -> AmpTerms:
        """Everything about a strategy that does not depend on the layer split."""
        pp = len(stage_devices)
        devices = tuple(tuple(d) for d in stage_devices)
        prefix = tuple(tuple(self.layer_times(devices[j][i * tp:(i + 1) * tp], micro_batch) for j in range(pp))
                       for i in range(dp))
        links = np.full((dp, max(pp - 1, 0)), math.inf)
        for i in range(dp):
            for j in range(pp - 1):
                src = devices[j][i * tp:(i + 1) * tp]
                dst = devices[j + 1][i * tp:(i + 1) * tp]
                links[i, j] = min(self.cluster.bandwidth_bytes_per_s(a, b) for a, b in zip(src, dst))
        sync = tuple(max(flat_ring_allreduce_time(self.cluster, [stage[r * tp + t] for r in range(dp)], 1.0)
                         for t in range(tp)) for stage in devices)
        return AmpTerms(devices, dp, tp, micro_batch, prefix, links, sync)

    def partition_problem(self, terms: AmpTerms, num_micro_batches: int) -> PartitionProblem:
        """eq. 5 as a layer-assignment problem: each stage at the pace of its
        slowest pipeline, each boundary at its slowest link. Equal to the
        slowest pipeline's eq. 5 whenever one pipeline is slowest at every stage
        (always so for the heuristic placement on clusters listed by GPU type)."""
        pp, n = terms.pp, self.model.num_layers
        segments = np.empty((pp, n + 1, n + 1))
        for j in range(pp):
            distinct = list({id(terms.layer_prefix[i][j]): terms.layer_prefix[i][j] for i in range(terms.dp)}.values())
            prefix = np.asarray(distinct)
            segments[j] = np.max(prefix[:, None, :] - prefix[:, :, None], axis=0)
        boundary = None
        if pp > 1:
            slowest = terms.link_bandwidth.min(axis=0)  # per boundary
            boundary = self._output[None, :n - 1] * terms.micro_batch / slowest[:, None]
        return PartitionProblem.from_segments(segments, num_micro_batches, boundary)

    def cost(self, terms: AmpTerms, num_micro_batches: int, boundaries: Sequence[int]) -> AmpCost:
        """eq. 4 for the strategy ``terms`` with the given layer assignment."""
        pp, b, gas = terms.pp, tuple(boundaries), num_micro_batches
        pipeline = 0.0
        for i in range(terms.dp):
            prefix = terms.layer_prefix[i]
            stage = [float(prefix[j][b[j + 1]] - prefix[j][b[j]]) for j in range(pp)]
            sends = [float(self._output[b[j + 1] - 1]) * terms.micro_batch / terms.link_bandwidth[i, j]
                     for j in range(pp - 1)]
            pipeline = max(pipeline, (gas - 1) * max(stage) + math.fsum(sends) + math.fsum(stage))
        sync = max(terms.sync_per_byte[j] * self.kernel.held_params(terms.tp, b[j], b[j + 1]) * self._grad_bytes
                   for j in range(pp))
        return AmpCost(pipeline + sync, pipeline, sync, b)

    def plan_cost(self, plan: Plan) -> AmpCost:
        """AMP's cost of any plan whose stages share one (dp, tp) and split the
        micro-batch evenly (e.g. Megatron's or an exhaustive enumeration's)."""
        dp, tp = plan.stages[0].dp, plan.stages[0].tp
        if any((s.dp, s.tp) != (dp, tp) or len(set(s.dp_split)) > 1 for s in plan.stages):
            raise HetplanError("AMP's cost model needs one (dp, tp) for all stages and an even micro-batch split")
        bounds = [plan.stages[0].layers[0]] + [s.layers[-1] + 1 for s in plan.stages]
        terms = self.terms([s.devices for s in plan.stages], dp, tp, plan.micro_batch_size // dp)
        return self.cost(terms, plan.num_micro_batches, bounds)
