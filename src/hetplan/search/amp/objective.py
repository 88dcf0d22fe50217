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

from hetplan.cluster.catalog import GPUSpec
from hetplan.cost.comm import flat_ring_allreduce_time
from hetplan.cost.groups import first_appearance
from hetplan.cost.model import CostModel
from hetplan.errors import HetplanError
from hetplan.plan.spec import Plan
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
        pipelines: the pipelines ``i`` that differ from every earlier one (in
            their stages' tables or links); the others cost the same as one of
            them. Empty: every pipeline.
    """

    stage_devices: tuple[tuple[int, ...], ...]
    dp: int
    tp: int
    micro_batch: int
    layer_prefix: tuple[tuple[np.ndarray, ...], ...]
    link_bandwidth: np.ndarray
    sync_per_byte: tuple[float, ...]
    pipelines: tuple[int, ...] = ()

    @property
    def pp(self) -> int:
        return len(self.stage_devices)

    @property
    def distinct_pipelines(self) -> Sequence[int]:
        return self.pipelines or range(self.dp)


class AmpCostModel:
    """AMP's own cost (eq. 3–5) for one workload, on the shared kernel's layer times."""

    def __init__(self, cost_model: CostModel) -> None:
        self.cost_model = cost_model
        self.kernel = cost_model.kernel
        self.workload = cost_model.workload
        self.model = cost_model.model
        self.cluster = cost_model.cluster
        self._layer_cache: dict[tuple[str, int, int, float], np.ndarray] = {}
        self._flat: dict[object, float] = {}
        self._output = self.kernel.arrays.output_bytes
        self._grad_bytes = self.workload.state_bytes[1]

    def layer_times(self, group: Sequence[int], micro_batch: int) -> np.ndarray:
        """Prefix sums of ``t_layer`` over the layers on a TP group: forward +
        backward on the group's slowest GPU plus the forward and backward TP
        all-reduces (eq. 3: flat rings on the group's slowest link). Entry
        ``l`` is the time of layers ``[0, l)``."""
        return self._layer_prefix(self.kernel.slowest_gpu(group), group, micro_batch)

    def _layer_prefix(self, gpu: GPUSpec, group: Sequence[int], micro_batch: int) -> np.ndarray:
        """``layer_times`` of a TP group whose slowest GPU is ``gpu``."""
        tp = len(group)
        ring = flat_ring_allreduce_time(self.cluster, group, 1.0) if tp > 1 else 0.0
        key = (gpu.name, tp, micro_batch, ring)
        cached = self._layer_cache.get(key)
        if cached is None:
            t = self.kernel.layer_times(gpu, micro_batch, tp)
            times = t.fwd_s + t.bwd_s + self.kernel.tp_comm_bytes("none") * micro_batch * ring
            cached = self._layer_cache[key] = np.concatenate([[0.0], np.cumsum(times)])
        return cached

    def terms(self, stage_devices: Sequence[Sequence[int]], dp: int, tp: int, micro_batch: int) -> AmpTerms:
        """Everything about a strategy that does not depend on the layer split.

        Replicas (TP groups) of one stage with the same slowest GPU and group
        shape share one prefix table (``CostKernel.replica_classes``), the
        data-parallel groups are costed once per shape (``CostKernel.dp_groups``)
        and the links are read off per-device arrays: no work per replica
        beyond numpy's, which on 4,096 GPUs is most of the replicas."""
        pp = len(stage_devices)
        devices = tuple(tuple(d) for d in stage_devices)
        grids = [np.asarray(d, dtype=np.int64).reshape(dp, tp) for d in devices]
        classes, tables = zip(*(self._replica_prefixes(grid, micro_batch) for grid in grids))
        prefix = tuple(zip(*(tuple(table[c] for c in stage.tolist()) for stage, table in zip(classes, tables))))
        links = np.full((dp, max(pp - 1, 0)), math.inf)
        arrays = self.kernel.cluster_arrays
        for j in range(pp - 1):
            links[:, j] = arrays.link_bytes_per_s(grids[j], grids[j + 1]).min(axis=1)
        sync = tuple(self._sync_per_byte(stage, tp) for stage in devices)
        # pipelines alike in every stage's table and every link cost alike: keep the first of each
        rows = np.concatenate([np.stack(classes, axis=1).astype(np.float64), links], axis=1)
        pipelines = tuple(sorted(np.unique(rows, axis=0, return_index=True)[1].tolist()))
        return AmpTerms(devices, dp, tp, micro_batch, prefix, links, sync, pipelines)

    def _replica_prefixes(self, grid: np.ndarray, micro_batch: int) -> tuple[np.ndarray, list[np.ndarray]]:
        """The class of each replica (row) of a stage's device grid, and
        ``layer_times`` of each class (replicas of one slowest GPU and one TP
        group shape), computed once per class."""
        gpu, link, representatives = self.kernel.replica_classes(grid)
        firsts, classes = first_appearance(gpu * len(representatives) + link)
        tables = []
        for r in firsts.tolist():
            group = tuple(grid[representatives[link[r]]].tolist())
            tables.append(self._layer_prefix(self.kernel.cluster_arrays.gpus[gpu[r]], group, micro_batch))
        return classes, tables

    def _sync_per_byte(self, stage: tuple[int, ...], tp: int) -> float:
        """eq. 3 per byte on the stage's slowest DP group (one per group shape;
        no sync without data parallelism)."""
        if len(stage) // tp < 2:
            return 0.0
        groups = self.kernel.dp_groups(stage, tp)
        return max(self._flat_ring(g, shape) for g, shape in zip(groups.representatives, groups.key[0]))

    def _flat_ring(self, group: tuple[int, ...], shape: object) -> float:
        """eq. 3 per byte over ``group``, once per group shape (it reads only
        the group's size and slowest link)."""
        found = self._flat.get(shape)
        if found is None:
            found = self._flat[shape] = flat_ring_allreduce_time(self.cluster, group, 1.0)
        return found

    def partition_problem(self, terms: AmpTerms, num_micro_batches: int) -> PartitionProblem:
        """eq. 5 as a layer-assignment problem: each stage at the pace of its
        slowest pipeline, each boundary at its slowest link. Equal to the
        slowest pipeline's eq. 5 whenever one pipeline is slowest at every stage
        (always so for the heuristic placement on clusters listed by GPU type)."""
        pp, n = terms.pp, self.model.num_layers
        segments = np.empty((pp, n + 1, n + 1))
        for j in range(pp):
            distinct = list({id(terms.layer_prefix[i][j]): terms.layer_prefix[i][j]
                             for i in terms.distinct_pipelines}.values())
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
        for i in terms.distinct_pipelines:
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
