"""One plan's report as data: ``PlanReport`` holds everything ``hetplan plan``,
``hetplan estimate`` and the HTML page (``hetplan report``) say about a plan,
computed once; ``hetplan.report.text`` and ``hetplan.report.html`` only render
it. So the three cannot drift apart in what they compute."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from hetplan.app.explain import explain, model_notes
from hetplan.app.replay import ReplayOutcome
from hetplan.app.training import training_numbers
from hetplan.cost.model import CostModel
from hetplan.export.target import runners
from hetplan.plan.workload import Workload
from hetplan.errors import HetplanError
from hetplan.plan.spec import RankedPlan
from hetplan.plan.file import PlanFile


@dataclass(frozen=True)
class PlanReport:
    """What a report of one plan says.

    ``chosen``: the plan described, costed by ``cost_model``; ``ranked``: the
    rows of the ranked table (``positions``: each row's number, 1.. unless some
    plans of a file could not be costed: ``problems``); ``memory``: the chosen
    plan's peak memory per GPU by category (``CostModel.memory_breakdown``);
    ``why``: ``explain``'s sentences; ``training``: ``training_numbers`` for
    ``tokens`` at ``prices`` (per GPU-hour by type or "*"; None: the cluster
    file's, else the defaults); ``plan_notes``: the planner's notes on the plan;
    ``model_notes``: what qualifies the estimate for this model, and for its
    schedule on its links (the event simulator's check);
    ``target_lines``: what the target restriction cost (``hetplan plan``);
    ``header_extra``: a last header line (the planner and its search time);
    ``replay``: the replay check of the ranked rows (``hetplan.app.replay``;
    None: not asked for); ``runs_on``: per row of ``ranked``, the codes that
    run it (``export.target.runners``)."""

    workload: Workload
    cost_model: CostModel
    ranked: tuple[RankedPlan, ...]
    chosen: RankedPlan
    memory: dict[int, dict[str, int]]
    why: tuple[str, ...]
    training: dict[str, Any]
    tokens: float | None
    prices: dict[str, float] | None
    plan_notes: tuple[str, ...]
    model_notes: tuple[str, ...]
    target_lines: tuple[str, ...] = ()
    header_extra: str = ""
    positions: tuple[int, ...] = ()
    problems: tuple[str, ...] = ()
    replay: ReplayOutcome | None = None
    runs_on: tuple[tuple[str, ...], ...] = ()

    @property
    def cp_ep(self) -> bool:
        """The chosen plan has context or expert parallelism (the breakdown says
        where their exchanges are counted)."""
        return any(s.cp > 1 or s.ep > 1 for s in self.chosen.plan.stages)

    @property
    def chosen_row(self) -> int | None:
        """The chosen plan's row in ``ranked`` (None: it is not among them)."""
        return next((i for i, r in enumerate(self.ranked) if r is self.chosen), None)


def plan_report(workload: Workload, cost_model: CostModel, ranked: Sequence[RankedPlan], chosen: RankedPlan,
                tokens: float | None, prices: dict[str, float] | None, target_lines: Sequence[str] = (),
                header_extra: str = "", positions: Sequence[int] = (), problems: Sequence[str] = ()) -> PlanReport:
    """The report of ``chosen`` (costed by ``cost_model``, of ``workload``) among ``ranked``."""
    plan, estimate = chosen.plan, chosen.estimate
    return PlanReport(
        workload=workload, cost_model=cost_model, ranked=tuple(ranked), chosen=chosen,
        memory=cost_model.memory_breakdown(plan), why=tuple(explain(plan, estimate, workload)),
        training=training_numbers(plan, estimate, workload.cluster, workload.model.seq_len, tokens, prices),
        tokens=tokens, prices=prices, plan_notes=tuple(n for n in plan.notes if n),
        model_notes=model_notes(plan, estimate, cost_model), target_lines=tuple(target_lines), header_extra=header_extra,
        positions=tuple(positions) or tuple(range(1, len(ranked) + 1)), problems=tuple(problems),
        runs_on=tuple(runners(r.plan, workload) for r in ranked))


def file_report(plan_file: PlanFile, index: int, tokens: float | None = None,
                prices: dict[str, float] | None = None) -> PlanReport:
    """The report of plan ``index`` of ``plan_file``, with every plan of the
    file re-estimated with the workload it was made for (a plan that cannot be
    is a problem line, not a failure of the whole report)."""
    plan = plan_file.plan(index)
    workload = plan_file.workload(index)
    cost_model = CostModel(workload)
    chosen = RankedPlan(plan, cost_model.estimate(plan))
    ranked, positions, problems = [], [], []
    models = {workload.global_batch_size: cost_model}
    for k in range(1, len(plan_file.plans) + 1):
        try:
            row = chosen if k == index else _re_estimated(plan_file, k, models)
        except HetplanError as exc:
            problems.append(f"plan {k}: {exc}")
            continue
        ranked.append(row)
        positions.append(k)
    return plan_report(workload, cost_model, ranked, chosen, tokens, prices, positions=positions,
                       problems=problems)


def _re_estimated(plan_file: PlanFile, k: int, models: dict[int, CostModel]) -> RankedPlan:
    """Plan ``k`` of the file costed for its own workload (``models``: one cost
    model per global batch, shared by the plans of that batch)."""
    plan, workload = plan_file.plan(k), plan_file.workload(k)
    cost_model = models.setdefault(workload.global_batch_size, CostModel(workload))
    return RankedPlan(plan, cost_model.estimate(plan))
