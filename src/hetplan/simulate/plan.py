"""A plan's simulated pipeline timeline (checks the closed-form estimate, draws timelines)."""

from __future__ import annotations

from hetplan.cost.model import CostModel
from hetplan.plan.spec import Estimate, Plan
from hetplan.simulate.events import Event, makespan, simulate
from hetplan.simulate.schedule import Action, build_schedule, format_schedule


def stage_pass_times(estimate: Estimate) -> tuple[list[float], list[float], list[float]]:
    """Per-stage forward and backward time of one micro-batch, and p2p times,
    from an Estimate (TP communication split between the passes in proportion
    to their compute; recompute runs in the backward)."""
    fwd, bwd, p2p = [], [], []
    for s in estimate.stages:
        compute = s.fwd_s + s.bwd_s + s.recompute_s
        share = s.fwd_s / compute if compute else 0.5
        fwd.append(s.fwd_s + s.tp_comm_s * share)
        bwd.append(s.bwd_s + s.recompute_s + s.tp_comm_s * (1 - share))
        p2p.append(s.p2p_s)
    return fwd, bwd, p2p[:-1]


def simulate_plan(cost_model: CostModel, plan: Plan, estimate: Estimate | None = None) -> list[Event]:
    """Replay the plan's schedule with the cost model's stage times."""
    estimate = estimate or cost_model.estimate(plan)
    fwd, bwd, p2p = stage_pass_times(estimate)
    return simulate(build_schedule(plan.schedule, plan.pp, plan.num_micro_batches), fwd, bwd, p2p)


__all__ = ["Action", "Event", "build_schedule", "format_schedule", "makespan", "simulate", "simulate_plan",
           "stage_pass_times"]
