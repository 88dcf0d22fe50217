"""Planner interface and ranking shared by every planner."""

from __future__ import annotations

from dataclasses import replace
from typing import Iterable, Protocol

from hetplan.cost.model import CostModel
from hetplan.plan.workload import Workload
from hetplan.errors import HetplanError, OutOfMemoryError
from hetplan.plan.spec import Plan, RankedPlan
from hetplan.progress import Progress
from hetplan.units import format_bytes


class Planner(Protocol):
    """Searches plans for a workload and returns the best, ranked.

    ``cost`` lets several planners share one CostModel (and its kernel's
    tables); a planner builds its own when it is not given one.
    """

    name: str

    def plan(self, workload: Workload, top_k: int = 5, cost: CostModel | None = None) -> list[RankedPlan]: ...


class NoPlanFaster(HetplanError):
    """A planner given a time to beat (``plan(..., beat_s=...)``, where its
    ``prunes_by_beat``) proved that no plan of its space is faster."""


def cost_model_for(workload: Workload, cost: CostModel | None) -> CostModel:
    """A CostModel for ``workload``: ``cost`` itself if it is for it, one sharing
    its kernel's tables if only the global batch differs, else a new one.
    Every planner starts here, so a workload no plan can fit (its model states
    exceed all GPUs together: ``states_refusal``) is refused before any search."""
    why = states_refusal(workload)
    if why:
        raise OutOfMemoryError(why)
    if cost is None or cost.workload.profile is not workload.profile:
        return CostModel(workload)
    if cost.workload is workload:
        return cost
    if replace(cost.workload, global_batch_size=workload.global_batch_size) != workload:
        return CostModel(workload)
    if cost.workload.global_batch_size == workload.global_batch_size:
        return cost
    return CostModel(workload, kernel=cost.kernel)


def rank_key(ranked: RankedPlan) -> tuple[int, float, str]:
    """Fitting plans first, then fastest; ties broken by the plan text so the
    order never depends on hash seeds or enumeration order."""
    return (0 if ranked.estimate.fits else 1, ranked.estimate.iteration_time_s, ranked.plan.describe())


def sorted_by_rank(scored: list[tuple[tuple[int, float], Plan]]) -> list[tuple[tuple[int, float], Plan]]:
    """``(fits, time)``-keyed plans in ``rank_key`` order: the plan text, which
    takes a ``describe()`` per plan, is only read where fit and time tie."""
    scored = sorted(scored, key=lambda item: item[0])
    start = 0
    while start < len(scored):
        end = start + 1
        while end < len(scored) and scored[end][0] == scored[start][0]:
            end += 1
        if end - start > 1:
            scored[start:end] = sorted(scored[start:end], key=lambda item: item[1].describe())
        start = end
    return scored


# When nothing fits, the error names the closest miss among this many of the fastest plans.
NO_FIT_CANDIDATES = 32


def rank_plans(cost_model: CostModel, plans: Iterable[Plan], top_k: int,
               require_fit: bool = True) -> list[RankedPlan]:
    """Cost every plan with the shared cost model and keep the best ``top_k``.

    Candidates are ranked by ``CostModel.quick`` (the estimate's time and fit)
    and only the kept ones get a full Estimate. With ``require_fit`` an
    OutOfMemoryError explains the closest miss when no plan fits; otherwise
    non-fitting plans are ranked after fitting ones.
    """
    plans = list(plans)
    if not plans:
        raise HetplanError("no valid plan exists for this model, cluster and batch size")
    scored = []
    with Progress("costing plans", total=len(plans)) as progress:
        for p in plans:
            time_s, fits = cost_model.quick(p)
            scored.append(((0 if fits else 1, time_s), p))
            progress.advance()
    scored = sorted_by_rank(scored)
    if require_fit and scored[0][0][0]:
        closest = [RankedPlan(p, cost_model.estimate(p)) for _, p in scored[:NO_FIT_CANDIDATES]]
        raise no_fit_error(cost_model.workload, closest)
    return [RankedPlan(p, cost_model.estimate(p), key[1]) for key, p in scored[:top_k]]


def states_refusal(workload: Workload) -> str:
    """Why no plan can fit, by arithmetic alone ("" if one may): the model's
    weights, gradients and optimizer states, sharded perfectly over every GPU,
    already exceed their memory together (DeepSeek-V3 on 64 GPUs)."""
    states = workload.model.total_params * sum(workload.state_bytes)
    total = sum(workload.device_capacity_bytes(d.id) for d in workload.cluster.devices)
    if states <= total:
        return ""
    return (f"model {workload.model.name!r} needs {format_bytes(states)} for weights, gradients and optimizer "
            f"states alone, more than the {format_bytes(total)} of all {workload.cluster.num_devices} GPUs; "
            "use a larger cluster or a smaller model")


def no_fit_error(workload: Workload, ranked: list[RankedPlan]) -> OutOfMemoryError:
    """The error for "nothing fits": the model's states exceed the cluster, or
    the closest miss and what to change."""
    why = states_refusal(workload)
    if why:
        return OutOfMemoryError(why)
    closest = min(ranked, key=lambda r: (-r.estimate.min_headroom_bytes, r.plan.describe()))
    est = closest.estimate
    worst = max(est.peak_memory_bytes, key=lambda d: est.peak_memory_bytes[d] - est.memory_capacity_bytes[d])
    return OutOfMemoryError(
        f"no plan fits in memory: the closest ({closest.plan.describe()}) needs "
        f"{format_bytes(est.peak_memory_bytes[worst])} on GPU {worst} of {format_bytes(est.memory_capacity_bytes[worst])}; "
        "use a smaller global batch, a larger --memory-limit, or more/larger GPUs"
    )
