"""Planner interface and ranking shared by every planner."""

from __future__ import annotations

from typing import Callable, Iterable, Protocol

from hetplan.cost.model import CostModel
from hetplan.cost.workload import Workload
from hetplan.errors import HetplanError, OutOfMemoryError
from hetplan.plan import Plan, RankedPlan
from hetplan.progress import Progress
from hetplan.units import format_bytes


class Planner(Protocol):
    """Searches plans for a workload and returns the best, ranked."""

    name: str

    def plan(self, workload: Workload, top_k: int = 5) -> list[RankedPlan]: ...


def rank_key(ranked: RankedPlan) -> tuple[int, float, str]:
    """Fitting plans first, then fastest; ties broken by the plan text so the
    order never depends on hash seeds or enumeration order."""
    return (0 if ranked.estimate.fits else 1, ranked.estimate.iteration_time_s, ranked.plan.describe())


def rank_plans(cost_model: CostModel, plans: Iterable[Plan], top_k: int,
               require_fit: bool = True) -> list[RankedPlan]:
    """Estimate every plan with the shared cost model and keep the best ``top_k``.

    With ``require_fit`` an OutOfMemoryError explains the closest miss when no
    plan fits; otherwise non-fitting plans are ranked after fitting ones.
    """
    plans = list(plans)
    ranked = []
    with Progress("costing plans", total=len(plans)) as progress:
        for p in plans:
            ranked.append(RankedPlan(p, cost_model.estimate(p)))
            progress.advance()
    if not ranked:
        raise HetplanError("no valid plan exists for this model, cluster and batch size")
    ranked.sort(key=rank_key)
    if require_fit and not ranked[0].estimate.fits:
        raise no_fit_error(cost_model.workload, ranked)
    return ranked[:top_k]


def no_fit_error(workload: Workload, ranked: list[RankedPlan]) -> OutOfMemoryError:
    states = workload.model.total_params * sum(workload.state_bytes)
    total = sum(workload.device_capacity_bytes(d.id) for d in workload.cluster.devices)
    if states > total:
        return OutOfMemoryError(
            f"model {workload.model.name!r} needs {format_bytes(states)} for weights, gradients and optimizer "
            f"states alone, more than the {format_bytes(total)} of all {workload.cluster.num_devices} GPUs; "
            "use a larger cluster or a smaller model"
        )
    closest = min(ranked, key=lambda r: -r.estimate.min_headroom_bytes)
    est = closest.estimate
    worst = max(est.peak_memory_bytes, key=lambda d: est.peak_memory_bytes[d] - est.memory_capacity_bytes[d])
    return OutOfMemoryError(
        f"no plan fits in memory: the closest ({closest.plan.describe()}) needs "
        f"{format_bytes(est.peak_memory_bytes[worst])} on GPU {worst} of {format_bytes(est.memory_capacity_bytes[worst])}; "
        "use a smaller global batch, a larger --memory-limit, or more/larger GPUs"
    )


PlannerFactory = Callable[[], Planner]
_PLANNERS: dict[str, tuple[PlannerFactory, str]] = {}


def register_planner(name: str, description: str, factory: PlannerFactory) -> None:
    _PLANNERS[name] = (factory, description)


def planner_names() -> list[str]:
    return sorted(_PLANNERS)


def planner_descriptions() -> dict[str, str]:
    return {k: v[1] for k, v in sorted(_PLANNERS.items())}


def get_planner(name: str) -> Planner:
    if name not in _PLANNERS:
        raise HetplanError(f"unknown planner {name!r}; choose one of {', '.join(planner_names())}")
    return _PLANNERS[name][0]()
