"""Planning a workload: run a planner (its best plans the target tool can run,
``hetplan.export.target``), rank and record them. ``hetplan plan`` and the Python call
``hetplan.app.plan`` are this one function, ``plan_workload``."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from typing import Any, Callable

from hetplan.app.records import ranked_record
from hetplan.app.replay import default_replay, replay_record, replay_top, rerank
from hetplan.app.report import PlanReport, plan_report
from hetplan.app.workload import DEFAULT_PLANNER, WorkloadOptions, load_workload
from hetplan.cost.model import CostModel
from hetplan.plan.workload import Workload
from hetplan.errors import HetplanError, OutOfMemoryError
from hetplan.export.tools import DEFAULT_TORCHTITAN_VERSION
from hetplan.model.origin import HFSource
from hetplan.model.spec import ModelSpec
from hetplan.plan.spec import Plan, RankedPlan
from hetplan.plan.file import workload_record
from hetplan.search import get_planner
from hetplan.search.common.replica_tp import widen
from hetplan.export.target import ANY, RUNTIME, TargetResult, default_notes, refusal, search_for_target, target_json, tool_name

DEFAULT_TOP = 5  # plans ``hetplan plan`` shows


def run_planner(planner: Any, workload: Workload, top_k: int, auto_batch: bool,
                beat_s: float = math.inf) -> list[RankedPlan]:
    """The planner's ``top_k`` best plans; ``auto_batch``: it chooses the global
    batch too (a planner that does not search it is refused in one line).
    ``beat_s``: only plans faster matter, told to a planner that ``prunes_by_beat``
    (it may then raise ``NoPlanFaster``); another planner ignores it."""
    if auto_batch and not getattr(planner, "searches_batch_size", False):
        raise HetplanError(f"planner {planner.name!r} does not search the batch size; "
                           "give --global-batch N or use a galvatron planner")
    try:
        if auto_batch:
            return planner.plan_auto_batch(workload, top_k)
        if beat_s < math.inf and getattr(planner, "prunes_by_beat", False):
            return planner.plan(workload, top_k, beat_s=beat_s)
        return planner.plan(workload, top_k)
    except OutOfMemoryError as exc:
        raise _seq_len_hint(exc, workload.model) from None


def runnable_best(planner: Any, workload: Workload, beat_s: float = math.inf) -> RankedPlan:
    """The planner's best plan the default target runs (hetplan's runtime, for
    a model it builds: ``hetplan.export.target.plan_target``); ``beat_s`` as
    ``run_planner`` takes it."""
    found, _ = search_for_target(lambda k: run_planner(planner, workload, k, False, beat_s), workload,
                                 workload.target or None, 1, planner.name)
    return found[0]


# Plans of the planner whose stages ``replica_tp_best`` regroups: the candidates a
# planner reranks by default (``MetisOptions.rerank`` is 4, ``hetplan plan``
# shows 5); more widen the search at a few ms each.
REPLICA_TP_CANDIDATES = 8


def replica_tp_best(planner: Any, workload: Workload, beat_s: float = math.inf) -> RankedPlan:
    """The best of the planner's plans with the replicas of stages that hold
    several GPU types at their own TP degree where that is faster, and of one
    stage over every GPU so regrouped (``search.common.replica_tp.widen``).
    The runtime trains such stages at ZeRO 0 (``runtime/mixed.py``) and
    refuses them with ZeRO > 0 in one line (``plan.layout``). ``beat_s`` is
    not told to the planner: regrouping may bring a plan slower than it under it."""
    ranked = run_planner(planner, workload, REPLICA_TP_CANDIDATES, False)
    return widen(CostModel(workload), ranked, 1)[0]


def _seq_len_hint(exc: OutOfMemoryError, model: ModelSpec) -> OutOfMemoryError:
    """For a model from a HF config, "nothing fits" may just mean a long
    sequence (activations grow with it): say so, and how to change it. Not
    when the weights and optimizer states alone exceed the cluster."""
    text = str(exc)
    if not isinstance(model.source, HFSource) or "optimizer states alone" in text:
        return exc
    how = "the default for this HF config" if model.meta.get("seq_len_default") else "from --seq-len"
    return OutOfMemoryError(f"{text}; or a shorter --seq-len (now {model.seq_len}, {how})")


def check_target_runs(plan: Plan, workload: Workload, torchtitan_version: str) -> None:
    """A plan is costed for the code that will run it: hetplan's runtime unless
    a target tool is given (or saved in the plan file); one that code would
    refuse or run differently is refused here in one line (``hetplan.export.target.refusal``)."""
    tool = workload.target
    why = refusal(plan, workload, tool, torchtitan_version) if tool else ""
    if why:
        hint = ("; to cost it for a tool instead, give --target torchtitan, megatron or deepspeed (or --target any)"
                if tool == RUNTIME else "")
        raise HetplanError(f"{tool_name(tool)} cannot run this plan as costed: {why}{hint}")


@dataclass(frozen=True)
class PlanResult:
    """A planner's ranked plans for a workload, best first.

    ``target``: what keeping only the plans the target tool runs cost (None
    when every plan was kept); ``explicit_target``: the user named the tool
    (not hetplan's runtime by default); ``report``: the best plan's report
    (its workload, cost model and the tokens and prices its numbers assume,
    and the replay check of the plans: ``report.replay``)."""

    planner: str
    search_time_s: float
    plans: tuple[RankedPlan, ...]
    target: TargetResult | None
    explicit_target: bool
    report: PlanReport

    @property
    def best(self) -> RankedPlan:
        return self.plans[0]

    @property
    def workload(self) -> Workload:
        return self.report.workload

    def record(self) -> dict[str, Any]:
        """The plan file ``hetplan plan --json`` writes."""
        extra: dict[str, Any] = {}
        if self.explicit_target and self.target is not None:
            extra = target_json(self.target, self._record(self.target.best_overall))
        return {"planner": self.planner, "search_time_s": self.search_time_s,
                "plans": [self._record(r) for r in self.plans], **extra, **workload_record(self.workload)}

    def _record(self, ranked: RankedPlan) -> dict[str, Any]:
        r = self.report
        data = ranked_record(ranked, r.cost_model, r.tokens, r.prices)
        if r.replay is not None:
            row = next((i for i, p in enumerate(self.plans) if p is ranked), None)
            data["replay"] = replay_record(r.replay.checks[row]) if row is not None else None
        return data


def plan_workload(options: WorkloadOptions, planner: str | Any, top: int = DEFAULT_TOP, auto_batch: bool = False,
                  torchtitan_version: str = DEFAULT_TORCHTITAN_VERSION, tokens: float | None = None,
                  prices: dict[str, float] | None = None, replay: int | None = None) -> PlanResult:
    """``planner``'s ``top`` best plans for the workload of ``options`` that
    its target tool runs (``hetplan.export.target``: hetplan's runtime by default;
    a named tool also gets the uniform planner's plans merged in);
    ``planner``: a name (looked up once the workload loaded) or a planner object;
    ``auto_batch``: the planner chooses the global batch; ``replay``: how many
    of the best plans to check by a replayed step (``hetplan.app.replay``; 0:
    none; None: ``default_replay``), those that do not fit by it ranked last."""
    workload = load_workload(options, global_batch=1 if auto_batch else None)
    rebatch = (lambda batch: load_workload(options, global_batch=batch)) if auto_batch else None
    return plan_loaded(workload, planner, top, rebatch, bool(options.target), options.target == ANY,
                       torchtitan_version, tokens, prices, replay)


def plan_loaded(workload: Workload, planner: str | Any, top: int = DEFAULT_TOP,
                rebatch: Callable[[int], Workload] | None = None, explicit_target: bool = False,
                any_target: bool = False, torchtitan_version: str = DEFAULT_TORCHTITAN_VERSION,
                tokens: float | None = None, prices: dict[str, float] | None = None,
                replay: int | None = None) -> PlanResult:
    """``plan_workload`` for a workload already made (``hetplan replan``'s,
    from a plan file): ``rebatch`` makes it again with the global batch the
    planner chose (None: the batch is given); ``explicit_target``: the user
    named the tool; ``any_target``: the user asked for no target."""
    planner = get_planner(planner) if isinstance(planner, str) else planner
    start = time.perf_counter()
    tool = workload.target or None
    explicit = tool is not None and explicit_target
    ranked, target = search_for_target(lambda k: run_planner(planner, workload, k, rebatch is not None), workload,
                                       tool, top, planner.name, "merge" if explicit else "fallback",
                                       torchtitan_version)
    elapsed = time.perf_counter() - start
    replay = default_replay() if replay is None else replay
    checked = replay_top(ranked, workload, replay) if replay else None
    if checked is not None:
        ranked, checked = rerank(ranked, checked)
    best = ranked[0]
    if rebatch is not None:
        workload = rebatch(best.plan.global_batch_size)
    cost_model = CostModel(workload)
    target_lines = ([target.summary(), *(f"note: {n}" for n in target.notes)] if explicit and target else
                    [f"note: {n}" for n in default_notes(target, workload) if not any_target])
    report = plan_report(workload, cost_model, ranked, best, tokens, prices, target_lines,
                         f"planner  {planner.name}: searched in {elapsed:.2f} s")
    report = replace(report, replay=checked)
    return PlanResult(planner.name, elapsed, tuple(ranked), target, explicit, report)


def plan(model: str | None = None, cluster: str | None = None, global_batch: int | str | None = None, *,
         planner: str | Any = DEFAULT_PLANNER, top: int = DEFAULT_TOP, target: str | None = None,
         torchtitan_version: str = DEFAULT_TORCHTITAN_VERSION, tokens: float | None = None,
         prices: dict[str, float] | None = None, replay: int | None = None, **settings: Any) -> PlanResult:
    """``hetplan plan`` from Python: the best plans for ``model`` on ``cluster``.

    ``model``/``cluster``: a preset name or a file, as ``--model``/``--cluster``
    take them (default: AMP's GPT-2 on its mixed cluster); ``global_batch``:
    samples per step, or "auto" for a planner that chooses it; ``planner``: a
    name (``hetplan planners``) or a planner object; ``target``: keep only the
    plans this tool runs (``hetplan.export.target.PLAN_TARGETS``); ``tokens``/``prices``:
    what the training numbers assume (tokens to train, price per GPU-hour by
    type or "*"); ``replay``: how many of the best plans to check by a
    replayed step (``hetplan.app.replay``; 0: none; None: ``default_replay``); ``settings``: the other ``WorkloadOptions`` (``seq_len``,
    ``memory_limit``, ``precision``, ``optimizer``, ``fp8``, ...).

    >>> result = plan("gpt3-1.3b", "metis-t4-v100-16", 64, top=3)
    >>> result.best.plan.describe(), result.best.estimate.iteration_time_s  # doctest: +SKIP
    """
    if isinstance(global_batch, str) and global_batch != "auto":
        raise HetplanError(f"global_batch takes a number of samples or 'auto', got {global_batch!r}")
    auto_batch = global_batch == "auto"
    batch = global_batch if isinstance(global_batch, int) else None
    options = WorkloadOptions(model=model, cluster=cluster, global_batch=batch, target=target, **settings)
    return plan_workload(options, planner, top, auto_batch, torchtitan_version, tokens, prices, replay)
