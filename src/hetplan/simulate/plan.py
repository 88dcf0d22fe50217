"""A plan's simulated pipeline timeline (checks the closed-form estimate, draws timelines)."""

from __future__ import annotations

from hetplan.cost.model import CostModel
from hetplan.plan.spec import Estimate, Plan
from hetplan.simulate.events import Event, makespan, simulate
from hetplan.simulate.schedule import Action, build_schedule, format_schedule

# A plan whose pipeline the event simulator runs this much longer than the estimate's
# closed form is named in a note (``hetplan plan``, ``choose``): on the published runs'
# networks the two agree within this (docs/cost-model.md, "Checked by the event
# simulator"); over links comparable to the stages (48 Gbps between nodes, a link between
# zones) GPipe's one-way phases wait longer than the closed form charges (1F1B's round trips
# it charges: cost.pipeline.one_f_one_b_period).
SIMULATION_TOLERANCE = 0.05
# The schedules the event simulator replays action by action as they run (``build_schedule``).
FAITHFUL_SCHEDULES = ("1f1b", "gpipe")


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
    return simulate_estimate(plan, estimate or cost_model.estimate(plan))


def simulate_estimate(plan: Plan, estimate: Estimate) -> list[Event]:
    """Replay the plan's schedule with the stage times of its estimate."""
    fwd, bwd, p2p = stage_pass_times(estimate)
    return simulate(build_schedule(plan.schedule, plan.pp, plan.num_micro_batches), fwd, bwd, p2p)


def closed_form_pipeline_s(estimate: Estimate) -> float:
    """The estimate's pipeline: its step less the exposed data-parallel sync
    and the optimizer step (``cost/pipeline.py``'s ``T_pipe``)."""
    return estimate.iteration_time_s - estimate.dp_sync_s - estimate.optimizer_s


def simulated_over_closed(plan: Plan, estimate: Estimate) -> float:
    """How much longer the event simulator runs the plan's pipeline than the
    estimate's closed form, as a fraction (0 for one stage, and for interleaved
    1F1B, which the simulator replays at stage granularity as plain 1F1B: its
    bubble would read longer than the schedule's). Where links are comparable
    to the stages, GPipe's one-way phases make it large (docs/cost-model.md,
    Known limits); 1F1B's round trips are in the closed form."""
    if plan.pp == 1 or plan.virtual_stages > 1 or plan.schedule not in FAITHFUL_SCHEDULES:
        return 0.0
    closed = closed_form_pipeline_s(estimate)
    return makespan(simulate_estimate(plan, estimate)) / closed - 1.0 if closed > 0 else 0.0


__all__ = ["SIMULATION_TOLERANCE", "Action", "Event", "build_schedule", "closed_form_pipeline_s", "format_schedule", "makespan",
           "simulate", "simulate_estimate", "simulate_plan", "simulated_over_closed", "stage_pass_times"]
