"""The ``smp`` planner: SageMaker model parallelism's automatic partition (Karakus et al. 2021).

What SMP does (§4.5, Appendix C) and how it becomes a hetplan Plan:

* the model is its module tree (:func:`~hetplan.search.smp.tree.module_tree`
  over the ModelSpec's layer names, which are module paths); every module's
  cost is ``α·memory + (1−α)·compute`` (Appendix C.3) with memory = the
  parameters' weight, gradient and optimizer bytes plus the activations kept
  for one micro-batch, and compute = the forward time of one micro-batch, both
  from the shared cost kernel (``CostModel.kernel``) on the cluster's slowest GPU;
* Algorithm 1 (breadth-first over the tree), 2 (balanced segments, D'Hondt
  allocation) and 3 (D'Hondt) assign each layer a pipeline device;
  consecutive layers on one device are one stage;
* the rest as SMP: the pipeline degree is the user's (``pp``) or, since SMP
  makes the user give it, every divisor of the GPU count tried; data
  parallelism over the remaining GPUs; ``tp = 1``; no optimizer sharding
  (``shard_optimizer_state`` defaults to off); every micro-batch size that
  divides the replica's batch; SMP's default "interleaved" pipeline, which
  runs a backward as soon as one is ready (1F1B); SMP's "spread" placement
  (the data-parallel replicas of a stage on neighbouring devices: stage j on
  devices ``j·dp .. j·dp+dp-1``, as ``uniform_plan`` lays them out), not its
  default "cluster" (a replica's stages on neighbouring devices).

SMP itself does not rank plans (its user picks the degrees); every candidate
here is ranked by the shared cost model (``rank_plans``: ``CostModel.estimate``).

The leaves of the tree are the ModelSpec's layers: for a model given as
``module:function`` or an ``nn.Module`` (``hetplan.model.source``) these are
the finest modules the runtime can cut between (its pipeline runs a chain of
modules; ``hetplan.model.chain``), so every plan here can be trained.
A leaf the algorithm gives several devices cannot be cut further: that
pipeline degree is skipped (or refused when asked for), naming the module.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from hetplan.cost.model import CostModel
from hetplan.plan.workload import Workload
from hetplan.errors import HetplanError
from hetplan.plan.spec import Plan, RankedPlan
from hetplan.plan.support import support_of
from hetplan.search.baselines.uniform import uniform_plan
from hetplan.search.base import cost_model_for, rank_plans
from hetplan.search.common.degrees import divisors, micro_batch_sizes
from hetplan.search.smp.tree import TreeNode, module_tree, partition_tree, set_costs, stage_ranges

# SMP's ``memory_weight`` (the paper's α, which the paper gives no default for; its Appendix D
# shows 1.0 and 0.2): the library's default is 0.8 with its default ``optimize="memory"`` and
# 0.2 with ``optimize="speed"`` (sagemaker-python-sdk, doc/api/training/smd_model_parallel_general.rst,
# "PyTorch-specific Parameters").
DEFAULT_ALPHA = 0.8
SCHEDULES = {"interleaved": "1f1b", "simple": "gpipe"}  # SMP's "pipeline" option -> hetplan's schedule


@dataclass(frozen=True)
class SmpSplit:
    """One tree partition: the stages' layer ranges, or the module that could not be cut."""

    stages: tuple[range, ...]
    uncut: str = ""  # why no pipeline of ``pp`` stages came out (a leaf given several devices)


def layer_costs(workload: Workload, cost: CostModel, micro_batch: int) -> tuple[np.ndarray, np.ndarray]:
    """Per layer (memory bytes, forward seconds) for one replica's micro-batch, from the cost kernel."""
    kernel = cost.kernel
    gpu = kernel.slowest_gpu(range(workload.cluster.num_devices))
    state = float(sum(workload.state_bytes))
    memory = kernel.params_per_device(1) * state + kernel.activation_bytes(1, "none", False) * micro_batch
    compute = kernel.layer_times(gpu, micro_batch).fwd_s
    return np.asarray(memory, dtype=float), np.asarray(compute, dtype=float)


def smp_split(tree: TreeNode, memory: np.ndarray, compute: np.ndarray, alpha: float, pp: int) -> SmpSplit:
    """Algorithm 1 on ``tree`` for ``pp`` pipeline devices."""
    set_costs(tree, list(memory), list(compute), alpha)
    result = partition_tree(tree, pp)
    if result.uncut:
        name, k = result.uncut[0]
        return SmpSplit((), f"module {name or '<root>'!r} gets {k} devices but the runtime cannot cut inside it")
    ranges = stage_ranges(result.layer_device)
    if len(ranges) < pp:
        return SmpSplit((), f"only {len(ranges)} of {pp} devices get layers")
    return SmpSplit(tuple(ranges))


class SMPPlanner:
    """SageMaker's auto-partition for every pipeline degree (or the given one), ranked by the cost model."""

    name = "smp"

    def __init__(self, alpha: float = DEFAULT_ALPHA, pp: int | None = None, pipeline: str = "interleaved") -> None:
        if not 0.0 <= alpha <= 1.0:
            raise HetplanError(f"SMP's alpha (memory weight) must lie in [0, 1], got {alpha}")
        if pp is not None and pp < 1:
            raise HetplanError(f"the pipeline degree must be at least 1, got {pp}")
        if pipeline not in SCHEDULES:
            raise HetplanError(f"SMP's pipeline is 'interleaved' or 'simple', not {pipeline!r}")
        self.alpha, self.pp, self.pipeline = alpha, pp, pipeline

    def plan(self, workload: Workload, top_k: int = 5, cost: CostModel | None = None) -> list[RankedPlan]:
        cost_model = cost_model_for(workload, cost)
        plans, skipped = self.candidates(workload, cost_model)
        if not plans:
            raise HetplanError(f"SMP's partition gives no runnable plan: {skipped[0]}")
        return rank_plans(cost_model, plans, top_k)

    def candidates(self, workload: Workload, cost: CostModel) -> tuple[list[Plan], list[str]]:
        """Every (pp, micro-batch) plan SMP's partition makes; and why degrees were skipped."""
        model, n = workload.model, workload.cluster.num_devices
        blocker = support_of(model).pipeline
        degrees = self._degrees(workload, blocker)
        tree = module_tree([layer.name for layer in model.layers])
        plans: list[Plan] = []
        skipped: list[str] = []
        for pp in degrees:
            dp = n // pp
            for mbs in micro_batch_sizes(workload.global_batch_size, dp):
                memory, compute = layer_costs(workload, cost, mbs)
                split = smp_split(tree, memory, compute, self.alpha, pp)
                if split.uncut:
                    why = f"pp={pp}: {split.uncut}"
                    if why not in skipped:
                        skipped.append(why)
                    continue
                plans.append(self._plan(workload, pp, dp, mbs, split, blocker))
        if self.pp is not None and self.pp > 1 and not plans and skipped:
            raise HetplanError(f"SMP's partition for {skipped[0]}; use a smaller pipeline degree")
        return plans, skipped or [f"no pipeline degree divides the {n} GPUs and the global batch"]

    def _degrees(self, workload: Workload, blocker: str) -> list[int]:
        n, layers = workload.cluster.num_devices, workload.model.num_layers
        if self.pp is not None:
            if n % self.pp:
                raise HetplanError(f"pp={self.pp} does not divide the cluster's {n} GPUs; give a divisor of {n}")
            if self.pp > 1 and blocker:
                raise HetplanError(f"pp={self.pp}: the runtime cannot pipeline this model ({blocker}); use pp=1")
            if self.pp > layers:
                raise HetplanError(f"pp={self.pp} exceeds the model's {layers} cuttable layers; use pp <= {layers}")
            return [self.pp]
        if blocker:
            return [1]
        return [pp for pp in divisors(n) if pp <= layers and workload.global_batch_size % (n // pp) == 0]

    def _plan(self, workload: Workload, pp: int, dp: int, mbs: int, split: SmpSplit, blocker: str) -> Plan:
        plan = uniform_plan(workload, dp, 1, pp, mbs, schedule=SCHEDULES[self.pipeline], planner=self.name,
                            layer_split=list(split.stages))
        names = [layer.name for layer in workload.model.layers]
        stages = "; ".join(f"{names[r.start]}..{names[r.stop - 1]}" if len(r) > 1 else names[r.start]
                           for r in split.stages)
        notes = [f"SMP tree partition (alpha={self.alpha:g}): {stages}"]
        if blocker:
            notes.append(f"one pipeline stage: the runtime cannot pipeline this model ({blocker})")
        return replace(plan, notes=tuple(notes))
