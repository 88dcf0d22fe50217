"""The ``amp`` planner: AMP (Li et al., NeurIPS 2022), Algorithm 1 with AMP's own cost model.

Algorithm 1 (§3.6), faithfully:

1. enumerate the parallel degrees ``(pp, dp, tp)`` with ``pp·dp·tp`` = number
   of GPUs, TP groups inside one node (and ``tp`` dividing every layer's head
   count), ``pp`` at most the number of layers;
2. for each, every micro-batch size ``mbs`` (per data-parallel replica) with
   ``dp·mbs`` dividing the global batch; ``gas = gbs / (dp·mbs)`` micro-batches;
3. device placement by the paper's heuristic (Megatron's, [19]): model-parallel
   (TP) workers in the same node first, then data-parallel, then pipeline
   workers, in device-id order — :func:`hetplan.search.placement.heuristic_placement`;
4. the optimal pipeline layer assignment for that placement (§3.5) — computed
   with :func:`hetplan.search.partition.fast_partition`, which returns the
   same optimum as the paper's DP (``partition="reference"`` runs the paper's
   DP itself);
5. AMP's cost (eq. 3–5), which ranks the strategies.

AMP's cost of a strategy (:class:`AmpCostModel`)::

    T = max_i T_pp_i + max_d T_dpsync_d                                   (eq. 4)
    T_pp_i = (gas − 1)·max_j t_ij + Σ_j e_ij + Σ_j t_ij                    (eq. 5)
    T_dpsync_d = 2(dp − 1)·M_d / (dp · B_min)                              (eq. 3)

``t_ij`` is stage ``j`` of pipeline ``i``: the sum over its layers of the
per-layer time ``t_layer`` on *its own* GPU type (the slowest GPU of its TP
group), at TP degree ``tp`` and micro-batch ``mbs``, including the layer's TP
all-reduces (eq. 3 on the TP group's slowest link) — AMP profiles exactly this
(layer time including MP communication, per TP degree); hetplan's compute
model (or a ProfileDB when the workload has one) stands in for the profile.
``e_ij = v / b`` is one activation transfer to the next stage over the slowest
link among the TP ranks' pairs. ``M_d`` is the gradient bytes of the
parameters device ``d`` holds; ``B_min`` the slowest link of its DP group.

Like the paper, this objective ignores memory, so a top-ranked strategy may
not fit (AMP §4.5: the 7th and 9th of its top 10 TransGAN strategies ran out of
memory). The planner keeps AMP's order — by AMP's own cost — and every
RankedPlan also carries the shared cost model's estimate, whose ``fits`` shows
the OOM ones (``hetplan plan --planner amp`` prints both columns).

Where this differs from the authors' code (not from the paper): per-stage GPU
types instead of a fixed 0.75/0.25 V100/T4 blend of profiles, the minimum
bandwidth over the whole DP group (their loop keeps only the last pair), and
the layer assignment by the DP also when ``gas = 1`` (their code falls back to
a uniform split there).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator, Sequence

import numpy as np

from hetplan.cost.memory import layer_params_per_device
from hetplan.cost.model import CostModel
from hetplan.cost.workload import Workload
from hetplan.errors import HetplanError
from hetplan.plan import Plan, RankedPlan, uniform_stage
from hetplan.search.base import register_planner
from hetplan.search.partition import (
    Partition,
    PartitionProblem,
    fast_partition,
    reference_partition,
)
from hetplan.search.placement import heuristic_placement
from hetplan.search.uniform import divisors, max_tp, tp_fits_nodes
from hetplan.units import format_bytes

PARTITION_SOLVERS = {"fast": fast_partition, "reference": reference_partition}


# --- the strategy space -----------------------------------------------------------------
def enumerate_degrees(workload: Workload) -> list[tuple[int, int, int]]:
    """``(pp, dp, tp)`` with pp·dp·tp = GPUs, TP inside a node, pp ≤ layers, dp | gbs."""
    n = workload.cluster.num_devices
    heads = max_tp(workload)
    degrees = []
    for tp in divisors(n):
        if tp > workload.cluster.max_gpus_per_node or not tp_fits_nodes(workload, tp):
            continue
        if heads < (1 << 30) and heads % tp:
            continue
        for pp in divisors(n // tp):
            dp = n // (tp * pp)
            if pp > workload.model.num_layers or workload.global_batch_size % dp:
                continue
            degrees.append((pp, dp, tp))
    return degrees


def micro_batch_sizes(global_batch_size: int, dp: int) -> list[int]:
    """Per-replica micro-batch sizes for ``dp`` (AMP's ``enumerate_(d.dp)``)."""
    if global_batch_size % dp:
        return []
    return divisors(global_batch_size // dp)


# --- AMP's cost model -------------------------------------------------------------------
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
    """AMP's own cost (eq. 3–5) for one workload, on hetplan's compute model."""

    def __init__(self, workload: Workload, cost_model: CostModel | None = None) -> None:
        self.workload = workload
        self.cost_model = cost_model or CostModel(workload)
        self.model = workload.model
        self.cluster = workload.cluster
        self._layer_cache: dict[tuple[str, int, int, float], np.ndarray] = {}
        self._output = np.array([layer.output_bytes for layer in self.model.layers])
        self._tp_bytes = np.array([layer.tp_comm_bytes for layer in self.model.layers])
        self._grad_bytes = workload.state_bytes[1]
        self._tied = [layer.tied_group for layer in self.model.layers]

    def layer_times(self, group: Sequence[int], micro_batch: int) -> np.ndarray:
        """Prefix sums of ``t_layer`` over the layers on a TP group: forward +
        backward on the group's slowest GPU plus the forward and backward TP
        all-reduces (eq. 3 on the group's slowest link). Entry ``l`` is the
        time of layers ``[0, l)``."""
        tp = len(group)
        gpu = self.cost_model.slowest_gpu(tuple(group))
        bandwidth = self.cluster.min_bandwidth_bytes_per_s(group) if tp > 1 else math.inf
        key = (gpu.name, tp, micro_batch, bandwidth)
        cached = self._layer_cache.get(key)
        if cached is None:
            compute = []
            for index in range(self.model.num_layers):
                t = self.cost_model.layer_time(index, gpu, micro_batch, tp)
                compute.append(t.fwd_s + t.bwd_s)
            times = np.asarray(compute)
            if tp > 1:
                # 2(n−1)M/(nB) per all-reduce, once forward and once backward
                times = times + 2.0 * 2.0 * (tp - 1) * self._tp_bytes * micro_batch / (tp * bandwidth)
            cached = np.concatenate([[0.0], np.cumsum(times)])
            self._layer_cache[key] = cached
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
        sync = []
        for stage in devices:
            if dp < 2:
                sync.append(0.0)
                continue
            slowest = min(self.cluster.min_bandwidth_bytes_per_s([stage[r * tp + t] for r in range(dp)])
                          for t in range(tp))
            sync.append(2.0 * (dp - 1) / (dp * slowest))
        return AmpTerms(devices, dp, tp, micro_batch, prefix, links, tuple(sync))

    def stage_params(self, layers: range, tp: int) -> float:
        """Parameters one device of a stage holds (a tied group counted once)."""
        seen: set[str] = set()
        total = 0.0
        for index in layers:
            group = self._tied[index]
            if group:
                if group in seen:
                    continue
                seen.add(group)
            total += layer_params_per_device(self.model.layers[index], tp)
        return total

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
        sync = max(terms.sync_per_byte[j] * self.stage_params(range(b[j], b[j + 1]), terms.tp) * self._grad_bytes
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


# --- the planner --------------------------------------------------------------------------
@dataclass(frozen=True)
class AmpCandidate:
    """One strategy of Algorithm 1 with AMP's cost."""

    pp: int
    dp: int
    tp: int
    micro_batch: int  # per data-parallel replica (AMP's mbs)
    num_micro_batches: int  # gas
    stage_devices: tuple[tuple[int, ...], ...]
    partition: Partition  # the optimal layer assignment (its cost_s is eq. 5 for the slowest stages)
    cost: AmpCost

    @property
    def boundaries(self) -> tuple[int, ...]:
        return self.partition.boundaries

    def to_plan(self, workload: Workload, planner: str = "amp") -> Plan:
        micro = self.dp * self.micro_batch
        stages = tuple(uniform_stage(layers, devices, self.dp, self.tp, micro)
                       for layers, devices in zip(self.partition.ranges(), self.stage_devices))
        return Plan(model=workload.model.name, cluster=workload.cluster.name,
                    global_batch_size=workload.global_batch_size, micro_batch_size=micro,
                    num_micro_batches=self.num_micro_batches, schedule="1f1b", stages=stages, planner=planner)


class AMPPlanner:
    """AMP's Algorithm 1; ranks by AMP's own cost (eq. 3–5), memory ignored."""

    name = "amp"

    def __init__(self, partition: str = "fast") -> None:
        if partition not in PARTITION_SOLVERS:
            raise HetplanError(f"unknown partition solver {partition!r}; use one of {sorted(PARTITION_SOLVERS)}")
        self.partition = partition

    def strategies(self, workload: Workload) -> Iterator[tuple[int, int, int, int]]:
        """``(pp, dp, tp, mbs)`` in Algorithm 1's order."""
        for pp, dp, tp in enumerate_degrees(workload):
            for micro_batch in micro_batch_sizes(workload.global_batch_size, dp):
                yield pp, dp, tp, micro_batch

    def search(self, workload: Workload, amp_cost: AmpCostModel | None = None) -> list[AmpCandidate]:
        """Every strategy of Algorithm 1, ranked by AMP's cost (ties by plan text)."""
        amp_cost = amp_cost or AmpCostModel(workload)
        solve = PARTITION_SOLVERS[self.partition]
        n = workload.cluster.num_devices
        candidates = []
        for pp, dp, tp, micro_batch in self.strategies(workload):
            gas = workload.global_batch_size // (dp * micro_batch)
            terms = amp_cost.terms(heuristic_placement(n, pp, dp, tp), dp, tp, micro_batch)
            best = solve(amp_cost.partition_problem(terms, gas))
            assert best is not None  # no memory limit: a split always exists
            cost = amp_cost.cost(terms, gas, best.boundaries)
            candidates.append(AmpCandidate(pp, dp, tp, micro_batch, gas, terms.stage_devices, best, cost))
        if not candidates:
            raise HetplanError(
                f"no parallel degrees of the {n} GPUs divide global batch {workload.global_batch_size}; "
                f"choose a multiple of a divisor of {n}"
            )
        candidates.sort(key=lambda c: (c.cost.total_s, c.to_plan(workload).describe()))
        return candidates

    def plan(self, workload: Workload, top_k: int = 5) -> list[RankedPlan]:
        cost_model = CostModel(workload)
        candidates = self.search(workload, AmpCostModel(workload, cost_model))
        ranked = []
        for rank, candidate in enumerate(candidates[:top_k], 1):
            plan = candidate.to_plan(workload, self.name)
            estimate = cost_model.estimate(plan)
            c = candidate.cost
            notes = [f"AMP rank {rank} of {len(candidates)}: AMP cost {c.total_s:.3f} s = pipeline "
                     f"{c.pipeline_s:.3f} s + DP sync {c.dp_sync_s:.3f} s (AMP eq. 3-5; memory not modelled)"]
            if not estimate.fits:
                worst = max(estimate.peak_memory_bytes,
                            key=lambda d: estimate.peak_memory_bytes[d] - estimate.memory_capacity_bytes[d])
                notes.append(f"out of memory: GPU {worst} needs {format_bytes(estimate.peak_memory_bytes[worst])} "
                             f"of {format_bytes(estimate.memory_capacity_bytes[worst])} — AMP's objective ignores "
                             "memory (AMP §4.5), so it ranks this plan anyway")
            ranked.append(RankedPlan(plan.with_changes(notes=tuple(notes)), estimate, c.total_s))
        return ranked


def register() -> None:
    register_planner("amp", "AMP (NeurIPS'22) Algorithm 1: degrees x micro-batch, Megatron placement, optimal "
                     "layer assignment, ranked by AMP's own cost (ignores memory; OOM shown)", AMPPlanner)
