"""Stages whose replicas take their own TP degree (``Stage.replica_tp``, issue 35 item 3).

hetplan's planners give all replicas of a stage one TP degree. On a stage
that holds GPUs of several types, each type's replicas may do better at their
own degree (Sailor's mixed replicas): a GPU with memory to spare runs a low
degree (less TP communication), a smaller one the higher degree it needs to
hold its layers. For each stage of a plan that holds several GPU types,
every combination of per-type degrees is tried — powers of two that divide
the type's GPUs, keep each TP group inside one node and divide every layer's
heads — with its best split of the micro-batch, and the plan keeps whichever
stage makes it fastest (its own stage included).

The split of one combination is exact: the stage's micro-batch time is its
slowest replica's (``cost/replica_tp.py``), a replica's time does not fall as
its share grows, and a replica takes no more samples than its GPUs hold.
Giving the samples one at a time to the replica whose time then stays least
minimises the largest time (the greedy is exact for the min-max of
nondecreasing functions); ``tests/test_replica_tp.py`` checks it against
every split of a small stage.
"""

from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import replace
from functools import partial
from typing import Callable, Sequence

from hetplan.cost.memory import in_flight_micro_batches
from hetplan.cost.model import CostModel
from hetplan.cost.replica_tp import replica_fits, replica_time
from hetplan.plan.spec import Plan, RankedPlan, Stage
from hetplan.search.base import rank_key

# Degree combinations tried per stage (a work budget): 4 degrees (1, 2, 4, 8 on
# 8-GPU nodes) for each of 4 GPU types in one stage is 256; a stage with more
# keeps its planner's degrees and the plan's notes say so (``budget_note``).
MAX_DEGREE_COMBINATIONS = 256


def type_groups(cost_model: CostModel, stage: Stage) -> list[tuple[int, ...]]:
    """The stage's devices by GPU type, in order of first appearance."""
    devices = cost_model.cluster.devices
    groups: dict[str, list[int]] = {}
    for d in stage.devices:
        groups.setdefault(devices[d].gpu.name, []).append(d)
    return [tuple(g) for g in groups.values()]


def degree_options(cost_model: CostModel, group: tuple[int, ...]) -> list[int]:
    """TP degrees one GPU type's devices may run: powers of two that divide
    their count, keep every TP group (consecutive devices) in one node and
    divide every layer's heads."""
    kernel = cost_model.kernel
    out = []
    degree = 1
    while degree <= len(group):
        if len(group) % degree == 0 and kernel.all_support_tp(degree):
            grid = kernel.device_array(group).reshape(-1, degree)
            if kernel.cluster_arrays.rows_in_one_node(grid):
                out.append(degree)
        degree *= 2
    return out


def mixed_stage(stage: Stage, groups: Sequence[tuple[int, ...]], degrees: Sequence[int]) -> Stage:
    """``stage``'s layers and strategies on its type groups at ``degrees`` (one
    per group): runs of each group's degree form its replicas, in group order.
    ``replica_tp`` is None when every replica has one degree. The split is
    even-ish (each replica one sample or more); ``best_split`` chooses it."""
    replica_tp = tuple(t for g, t in zip(groups, degrees) for _ in range(len(g) // t))
    devices = tuple(d for g in groups for d in g)
    dp = len(replica_tp)
    total = sum(stage.dp_split)
    split = tuple(total // dp + (1 if r < total % dp else 0) for r in range(dp))
    return replace(stage, devices=devices, dp=dp, tp=max(replica_tp), dp_split=split,
                   replica_tp=replica_tp if len(set(replica_tp)) > 1 else None)


def best_split(cost_model: CostModel, stage: Stage, micro_batch_size: int, in_flight: float,
               first_backward: bool) -> tuple[int, ...] | None:
    """The split of ``micro_batch_size`` over the stage's replicas that
    minimises its slowest replica's time with every replica's GPUs within
    memory (module docstring); None when no split fits. Replicas alike
    (``_replica_class``) are costed once per share."""
    classes = [_replica_class(cost_model, stage, r) for r in range(stage.dp)]
    caps_of: dict[object, int] = {}
    times: dict[tuple[object, int], float] = {}
    for r, c in enumerate(classes):
        if c not in caps_of:
            caps_of[c] = _largest_share(partial(_fits, cost_model, stage, r, micro_batch_size, in_flight,
                                                first_backward), micro_batch_size)
    caps = [caps_of[c] for c in classes]
    if min(caps) < 1 or sum(caps) < micro_batch_size:
        return None

    def time_at(r: int, share: int) -> float:
        key = (classes[r], share)
        if key not in times:
            times[key] = replica_time(cost_model.kernel, stage, r, share, micro_batch_size)
        return times[key]

    shares = [1] * stage.dp
    queue = [(time_at(r, 2), r) for r in range(stage.dp) if caps[r] >= 2]
    heapq.heapify(queue)
    for _ in range(micro_batch_size - stage.dp):
        _, r = heapq.heappop(queue)
        shares[r] += 1
        if shares[r] < caps[r]:
            heapq.heappush(queue, (time_at(r, shares[r] + 1), r))
    return tuple(shares)


def _replica_class(cost_model: CostModel, stage: Stage, replica: int) -> tuple[object, ...]:
    """What a replica's time and memory at a share depend on: its degree, its
    GPUs' types, capacities and overheads, and its TP link."""
    kernel = cost_model.kernel
    devices = stage.replica_devices(replica)
    return (len(devices), tuple(cost_model.cluster.devices[d].gpu.name for d in devices),
            tuple(cost_model.workload.device_capacity_bytes(d) for d in devices),
            tuple(kernel.overhead_bytes(d) for d in devices), kernel.tp_link(devices) if len(devices) > 1 else None)


def _fits(cost_model: CostModel, stage: Stage, replica: int, micro_batch_size: int, in_flight: float,
          first_backward: bool, share: int) -> bool:
    """Replica ``replica``'s GPUs hold their layers with ``share`` samples (``replica_fits``)."""
    return replica_fits(cost_model.kernel, stage, replica, share, micro_batch_size, in_flight, first_backward,
                        cost_model.workload.device_capacity_bytes)


def _largest_share(fits: Callable[[int], bool], limit: int) -> int:
    """The largest share in [0, limit] that ``fits`` (memory grows with the share)."""
    lo, hi = 0, limit
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo


def degree_choices(cost_model: CostModel, stage: Stage) -> tuple[list[tuple[int, ...]], list[list[int]]]:
    """The stage's GPU-type groups and each one's degree options; none for a
    stage of one type or with what ``replica_tp`` cannot combine with."""
    if stage.cp > 1 or stage.ep > 1 or stage.sequence_parallel or stage.has_layer_degrees:
        return [], []
    groups = type_groups(cost_model, stage)
    if len(groups) < 2:
        return [], []
    return groups, [degree_options(cost_model, g) for g in groups]


def stage_variants(cost_model: CostModel, plan: Plan, j: int) -> list[Stage]:
    """Stage ``j`` of ``plan`` at every combination of per-type degrees, each
    with its best split (those that fit and whose dp the micro-batch covers);
    none past ``MAX_DEGREE_COMBINATIONS``."""
    stage = plan.stages[j]
    groups, options = degree_choices(cost_model, stage)
    if not groups or math.prod(map(len, options)) > MAX_DEGREE_COMBINATIONS:
        return []
    in_flight = in_flight_micro_batches(plan.schedule, j, plan.pp, plan.num_micro_batches, plan.virtual_stages)
    out = []
    for degrees in itertools.product(*options):
        candidate = mixed_stage(stage, groups, degrees)
        if candidate.dp > plan.micro_batch_size:
            continue
        split = best_split(cost_model, candidate, plan.micro_batch_size, in_flight,
                           in_flight >= plan.num_micro_batches)
        if split is not None:
            out.append(replace(candidate, dp_split=split))
    return out


def budget_note(cost_model: CostModel, plan: Plan) -> str:
    """What the work budget left out of ``plan``'s stages ('' when nothing)."""
    cut = [j for j, stage in enumerate(plan.stages)
           if math.prod(map(len, degree_choices(cost_model, stage)[1])) > MAX_DEGREE_COMBINATIONS]
    if not cut:
        return ""
    return (f"stage {', '.join(map(str, cut))}: more than {MAX_DEGREE_COMBINATIONS} combinations of per-type TP "
            "degrees; kept the planner's degrees (search/common/replica_tp.MAX_DEGREE_COMBINATIONS)")


def with_replica_tp(cost_model: CostModel, plan: Plan, keep_own: bool = True) -> Plan | None:
    """``plan`` with each stage that holds several GPU types at the per-type
    degrees and split that make the plan fastest, stage by stage in order:
    ``plan`` itself when none is faster (``keep_own``; else None, for a seed
    whose own degrees are no plan: ``one_stage_seeds``)."""
    best, best_key = (plan, _key(cost_model, plan)) if keep_own else (None, None)
    for j in range(plan.pp):
        current = best or plan
        for stage in stage_variants(cost_model, current, j):
            candidate = replace(current, stages=current.stages[:j] + (stage,) + current.stages[j + 1:])
            key = _key(cost_model, candidate)
            if best_key is None or key < best_key:
                best, best_key = candidate, key
    if best is None:
        return None
    mixed = [j for j, s in enumerate(best.stages) if s.replica_tp is not None]
    notes = [budget_note(cost_model, plan)]
    if best is not plan:
        notes.append(f"stage {', '.join(map(str, mixed))}: replicas of their own TP degree (replica_tp, "
                     "search/common/replica_tp.py)" if mixed else
                     "stages regrouped by GPU type with their best split (search/common/replica_tp.py)")
    notes = [n for n in notes if n]
    return replace(best, notes=best.notes + tuple(notes)) if notes else best


def _key(cost_model: CostModel, plan: Plan) -> tuple[int, float, str]:
    """``rank_key`` of a plan from ``CostModel.quick``."""
    time_s, fits = cost_model.quick(plan)
    return (0 if fits else 1, time_s, plan.describe())


def one_stage_seeds(cost_model: CostModel, plans: Sequence[Plan]) -> list[Plan]:
    """One stage over every GPU of a cluster of several GPU types (Sailor's
    mixed replicas need stages that hold several types), for each number of
    micro-batches of ``plans``, with the layer strategies of the first
    layer of the first plan; its replicas' degrees are for
    ``with_replica_tp`` to choose (``keep_own=False``)."""
    cluster = cost_model.cluster
    if not plans or len({d.gpu.name for d in cluster.devices}) < 2:
        return []
    first = plans[0]
    layers = tuple(range(cost_model.model.num_layers))
    strategy = replace(first.stages[0].strategies[0], tp=0)
    out = []
    for m in sorted({p.num_micro_batches for p in plans}):
        micro_batch = first.global_batch_size // m
        n = cluster.num_devices
        split = tuple(micro_batch // n + (1 if r < micro_batch % n else 0) for r in range(n))
        stage = Stage(layers, tuple(range(n)), n, 1, split, (strategy,) * len(layers))
        out.append(replace(first, micro_batch_size=micro_batch, num_micro_batches=m, stages=(stage,),
                           virtual_stages=1, schedule="1f1b" if first.virtual_stages > 1 else first.schedule,
                           notes=()))
    return out


def widen(cost_model: CostModel, ranked: Sequence[RankedPlan], top_k: int) -> list[RankedPlan]:
    """``ranked``, each of its plans with replicas of their own TP degree
    (``with_replica_tp``) where that is faster, and the best of the one-stage
    seeds (``one_stage_seeds``), ranked: the best ``top_k``."""
    out: list[RankedPlan] = []
    found: list[Plan | None] = []
    for r in ranked:
        plan = with_replica_tp(cost_model, r.plan) or r.plan
        same = (plan.stages, plan.num_micro_batches) == (r.plan.stages, r.plan.num_micro_batches)
        out.append(RankedPlan(plan, r.estimate, r.planner_cost_s) if same and plan is not r.plan else r)
        found.append(plan)
    seen = {(r.plan.stages, r.plan.num_micro_batches) for r in ranked}
    found += [with_replica_tp(cost_model, seed, keep_own=False)
              for seed in one_stage_seeds(cost_model, [r.plan for r in ranked])]
    for new in found:
        if new is not None and (new.stages, new.num_micro_batches) not in seen:
            seen.add((new.stages, new.num_micro_batches))
            out.append(RankedPlan(new, cost_model.estimate(new)))
    return sorted(out, key=rank_key)[:top_k]
