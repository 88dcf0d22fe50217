"""The `uniform` planner: every uniform 3D configuration, ranked by the cost model.

Context parallelism (long sequences) and expert parallelism (MoE models) join
the degrees where ``common.degrees.enumerate_parallel_degrees`` allows them.

What a user of Megatron-LM / torchtitan would try by hand: every factorisation
``dp × tp × pp`` of the GPUs (TP inside a node), every per-replica micro-batch
size, transformer blocks split evenly (embedding on the first stage, head on
the last, as Megatron-LM does), the same ZeRO stage, recomputation and
activation offloading on every layer, sequence parallelism with TP,
1F1B (and interleaved 1F1B when planning for a tool: ``INTERLEAVE_CHOICES``), devices laid out
TP-innermost, then DP, then PP (Megatron's order). ``uniform_plan`` builds one such plan
(``hetplan estimate --tp/--pp/--dp``).
"""

from __future__ import annotations

import itertools
from dataclasses import replace
from functools import lru_cache
from typing import Iterator

from hetplan.cost.cp_ep import degree_problem
from hetplan.cost.model import CostModel
from hetplan.plan.workload import Workload
from hetplan.errors import HetplanError
from hetplan.plan.spec import Plan, RankedPlan, uniform_stage
from hetplan.plan.support import search_limits
from hetplan.search.base import cost_model_for, rank_plans
from hetplan.search.common.degrees import divisors, enumerate_degrees, enumerate_parallel_degrees
from hetplan.search.common.expert_split import speed_expert_split
from hetplan.search.common.layer_splits import block_split

# ZeRO-1 is left out: in the cost model it is never better than ZeRO-2 (same
# parameter all-gather, an all-reduce instead of a reduce-scatter, whole gradients).
ZERO_CHOICES = (0, 2, 3)
# Every stage, for planning for a tool that runs only some of them (Megatron-LM's
# distributed optimizer is ZeRO-1 and nothing above it: hetplan.export.target).
ALL_ZERO_STAGES = (0, 1, 2, 3)
RECOMPUTE_CHOICES = ("none", "selective", "full")
# Activation offloading (``LayerStrategy.offload``) next to recomputation. It
# only saves memory, so with a cost model ``candidates`` yields an offloaded
# variant only where the same plan without offloading does not fit and the
# variant does (elsewhere it cannot be the best fitting plan).
OFFLOAD_CHOICES = (False, True)
# Model chunks per pipeline stage for interleaved 1F1B (Narayanan et al. 2021
# §2.2.2: the bubble shrinks v-fold for v times the pipeline p2p traffic), next
# to plain 1F1B on every pipelined plan whose stages all hold at least v blocks
# and whose micro-batches are a multiple of pp (what Megatron-LM requires).
# Searched when planning for a tool (hetplan.export.target); by default the uniform
# planner keeps 1F1B, the space auto's exact solve contains (search/auto.py),
# so that auto stays at least as fast as every planner it is compared with.
INTERLEAVE_CHOICES = (2, 4, 8)
# With TP, Megatron-LM's sequence parallelism (Korthikanti et al. 2022 §4.2.2):
# the same communication volume as TP's all-reduces, the norms' and dropouts'
# activations and work split tp ways, so in the cost model it never loses.
# Planning for a tool that cannot run it (DeepSpeed: hetplan.export.target) asks for
# the plans without it too (``ALL_SEQUENCE_PARALLEL``).
SEQUENCE_PARALLEL_CHOICES = (True,)
ALL_SEQUENCE_PARALLEL = (False, True)


def uniform_plan(
    workload: Workload, dp: int, tp: int, pp: int, micro_batch_per_replica: int,
    zero: int = 0, recompute: str = "none", schedule: str = "1f1b", sequence_parallel: bool = False,
    planner: str = "uniform", layer_split: list[range] | None = None, virtual_stages: int = 1,
    cp: int = 1, ep: int = 1, offload: bool = False, expert_split: bool = False,
) -> Plan:
    """One uniform plan on the first dp·cp·tp·pp GPUs of the cluster (context
    parallelism ``cp`` and expert parallelism ``ep`` as in ``plan.Stage``;
    ``expert_split``: each stage's experts split over its EP ranks by their
    GPUs' speed, ``common.expert_split``)."""
    model, cluster = workload.model, workload.cluster
    for name, value in (("dp", dp), ("tp", tp), ("pp", pp), ("cp", cp), ("ep", ep),
                        ("micro-batch", micro_batch_per_replica)):
        if value <= 0:
            raise HetplanError(f"{name} must be positive, got {value}")
    if dp * cp * tp * pp > len(cluster.devices):  # = num_devices, which sums over the nodes on every call
        product = "dp x cp x tp x pp" if cp > 1 else "dp x tp x pp"
        raise HetplanError(
            f"{product} = {dp * cp * tp * pp} GPUs, but cluster {cluster.name!r} has {cluster.num_devices}"
        )
    problem = degree_problem(model, dp, cp, ep)
    if problem:
        raise HetplanError(problem)
    if pp > model.num_layers:
        raise HetplanError(f"pp={pp} exceeds the model's {model.num_layers} layers")
    micro = dp * micro_batch_per_replica
    if workload.global_batch_size % micro:
        raise HetplanError(
            f"global batch {workload.global_batch_size} is not a multiple of dp x micro-batch = {micro}"
        )
    split = layer_split or block_split(model, pp)
    stages = []
    for layers, devices in zip(split, _stage_devices(dp * cp * tp, len(split))):
        experts = speed_expert_split(workload, devices, dp * cp, tp, ep) if expert_split else None
        stages.append(uniform_stage(layers, devices, dp, tp, micro, zero, recompute, sequence_parallel,
                                    offload, cp=cp, ep=ep, ep_split=experts))
    return Plan(
        model=model.name, cluster=cluster.name, global_batch_size=workload.global_batch_size,
        micro_batch_size=micro, num_micro_batches=workload.global_batch_size // micro,
        schedule=schedule, stages=tuple(stages), planner=planner, virtual_stages=virtual_stages,
    )


@lru_cache(maxsize=16)
def _stage_devices(size: int, pp: int) -> tuple[tuple[int, ...], ...]:
    """Stage j's GPUs, ``size`` of them from ``j * size`` on. Cached: the
    variants of one (dp, tp, pp) (micro-batch, ZeRO, recomputation) then share
    one tuple per stage instead of building thousands of ids again."""
    return tuple(tuple(range(j * size, (j + 1) * size)) for j in range(pp))


def uniform_configs(workload: Workload) -> Iterator[tuple[int, int, int, int]]:
    """(dp, tp, pp, micro-batch per replica) using all GPUs."""
    for pp, dp, tp in enumerate_degrees(workload):
        for u in divisors(workload.global_batch_size // dp):
            yield dp, tp, pp, u


class UniformPlanner:
    """Enumerate uniform 3D plans (all dp/tp/pp, micro-batch, ZeRO, recompute)."""

    name = "uniform"

    def __init__(self, zero_choices: tuple[int, ...] = ZERO_CHOICES,
                 recompute_choices: tuple[str, ...] = RECOMPUTE_CHOICES,
                 offload_choices: tuple[bool, ...] = OFFLOAD_CHOICES,
                 sequence_parallel_choices: tuple[bool, ...] = SEQUENCE_PARALLEL_CHOICES,
                 interleave_choices: tuple[int, ...] = ()) -> None:
        self.zero_choices = zero_choices
        self.interleave_choices = interleave_choices
        self.sequence_parallel_choices = sequence_parallel_choices
        self.recompute_choices = recompute_choices
        self.offload_choices = offload_choices

    def candidates(self, workload: Workload, cost: CostModel | None = None) -> Iterator[Plan]:
        """Every uniform plan; context and expert parallelism where
        ``enumerate_parallel_degrees`` allows them (long sequences, MoE models);
        activation offloading with ``Workload.search_offload``. With ``cost``,
        an offloaded variant only where the plan without offloading does not
        fit and the variant does (``OFFLOAD_CHOICES``; memory checks only)."""
        offload = True in self.offload_choices and workload.search_offload
        limits = search_limits(workload)  # what the workload's target runs (hetplan.runtime.support)
        recomputes = limits.recompute_choices(self.recompute_choices)
        for pp, dp, cp, tp, ep in enumerate_parallel_degrees(workload):
            splits = self._expert_splits(workload, ep) if limits.uneven_experts else (False,)
            for u in divisors(workload.global_batch_size // dp):
                for zero in self.zero_choices:
                    if zero and dp * cp == 1:
                        continue
                    for recompute, sp, by_speed in itertools.product(
                            recomputes, limits.sequence_parallel_choices(self.sequence_parallel_choices, tp, cp, ep),
                            splits):
                        plan = uniform_plan(workload, dp, tp, pp, u, zero, recompute, sequence_parallel=sp,
                                            planner=self.name, cp=cp, ep=ep, expert_split=by_speed)
                        if by_speed and not any(s.ep_split for s in plan.stages):  # the even one again
                            continue
                        yield plan
                        yield from interleaved_variants(plan, self.interleave_choices)
                        if not offload or cost is not None and _fits(cost, plan):
                            continue
                        offloaded = uniform_plan(workload, dp, tp, pp, u, zero, recompute, sequence_parallel=sp,
                                                 planner=self.name, cp=cp, ep=ep, offload=True,
                                                 expert_split=by_speed)
                        if cost is None or _fits(cost, offloaded):
                            yield offloaded
                            yield from interleaved_variants(offloaded, self.interleave_choices)

    @staticmethod
    def _expert_splits(workload: Workload, ep: int) -> tuple[bool, ...]:
        """Even experts, and on mixed GPUs experts by speed as well."""
        mixed = ep > 1 and len({d.gpu.name for d in workload.cluster.devices}) > 1
        return (False, True) if mixed else (False,)

    def plan(self, workload: Workload, top_k: int = 5, cost: CostModel | None = None) -> list[RankedPlan]:
        cost = cost_model_for(workload, cost)
        plans = list(self.candidates(workload, cost))
        if not plans:
            raise HetplanError(
                f"global batch {workload.global_batch_size} cannot be divided over any data-parallel "
                f"degree of the {workload.cluster.num_devices} GPUs; choose a multiple of a divisor of "
                f"{workload.cluster.num_devices}"
            )
        return rank_plans(cost, plans, top_k)


def interleaved_variants(plan: Plan, choices: tuple[int, ...] = INTERLEAVE_CHOICES) -> Iterator[Plan]:
    """``plan`` (1F1B, pp > 1) with interleaved 1F1B of each ``INTERLEAVE_CHOICES``
    chunk count its stages and micro-batches allow. The same layers, devices
    and strategies: only the schedule's bubble, p2p traffic and in-flight
    activations change."""
    if plan.pp == 1 or plan.schedule != "1f1b" or plan.num_micro_batches % plan.pp:
        return
    fewest = min(stage.num_layers for stage in plan.stages)
    for v in choices:
        if v <= fewest:
            yield replace(plan, schedule="interleaved-1f1b", virtual_stages=v)


def _fits(cost: CostModel, plan: Plan) -> bool:
    """Every stage within memory (``CostModel.stage_fits``: no timing, cheap)."""
    return all(cost.stage_fits(plan, j) for j in range(plan.pp))
