"""Costing one plan: a saved plan file's, or one uniform dp/tp/pp setting.
``hetplan estimate`` and the Python call ``hetplan.app.estimate`` are
``estimate_plan_file`` and ``estimate_setting``."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, replace
from typing import Any

from hetplan.app.planning import check_target_runs
from hetplan.app.records import ranked_record
from hetplan.app.replay import default_replay, replay_record, replay_top
from hetplan.app.report import PlanReport, plan_report
from hetplan.app.workload import WorkloadOptions, load_workload
from hetplan.cost.model import CostModel
from hetplan.plan.workload import Workload
from hetplan.errors import HetplanError
from hetplan.export.tools import DEFAULT_TORCHTITAN_VERSION
from hetplan.plan.spec import Plan, RankedPlan
from hetplan.plan.file import read_plan_file, workload_record
from hetplan.search.baselines.uniform import uniform_plan
from hetplan.plan.validate import validate_plan


@dataclass(frozen=True)
class UniformSetting:
    """One uniform plan: the same degrees, ZeRO stage and recomputation on every
    stage (``hetplan estimate --tp --pp --dp --micro-batch ...``); ``micro_batch``:
    samples per data-parallel replica per micro-batch; ``offload``: every
    layer's saved activations in host memory."""

    dp: int
    tp: int
    pp: int
    micro_batch: int
    cp: int = 1
    ep: int = 1
    zero: int = 0
    recompute: str = "none"
    schedule: str = "1f1b"
    sequence_parallel: bool = False
    virtual_stages: int = 1
    offload: bool = False


@dataclass(frozen=True)
class EstimateResult:
    """One plan costed for its workload; ``report``: what ``hetplan estimate`` prints."""

    report: PlanReport

    @property
    def ranked(self) -> RankedPlan:
        return self.report.chosen

    @property
    def workload(self) -> Workload:
        return self.report.workload

    def record(self) -> dict[str, Any]:
        """The plan file ``hetplan estimate --json`` writes (with the plan's replay, where it ran)."""
        r = self.report
        data = ranked_record(r.chosen, r.cost_model, r.tokens, r.prices)
        if r.replay is not None:
            data["replay"] = replay_record(r.replay.checks[0])
        return {"plans": [data], **workload_record(r.workload)}

    def replayed(self, replay: bool | None = None) -> EstimateResult:
        """This result with its plan checked by a replayed step (``hetplan.app.replay``), if
        ``replay`` (None: unless ``HETPLAN_REPLAY=0``, ``default_replay``)."""
        if not (default_replay() > 0 if replay is None else replay):
            return self
        r = self.report
        return EstimateResult(dataclasses.replace(r, replay=replay_top([r.chosen], r.workload, 1)))


def estimate_setting(options: WorkloadOptions, setting: UniformSetting,
                     torchtitan_version: str = DEFAULT_TORCHTITAN_VERSION, tokens: float | None = None,
                     prices: dict[str, float] | None = None) -> EstimateResult:
    """The uniform plan of ``setting`` on the workload of ``options``, costed."""
    workload = load_workload(options)
    if setting.virtual_stages > 1 and setting.schedule != "interleaved-1f1b":
        raise HetplanError("--virtual-stages needs --schedule interleaved-1f1b")
    s = setting
    plan = uniform_plan(workload, s.dp, s.tp, s.pp, s.micro_batch, s.zero, s.recompute, s.schedule,
                        s.sequence_parallel, planner="manual", virtual_stages=s.virtual_stages, offload=s.offload,
                        cp=s.cp, ep=s.ep)
    validate_plan(plan, workload.model, workload.cluster)
    return _costed(plan, workload, torchtitan_version, tokens, prices)


def estimate_plan_file(options: WorkloadOptions, path: str | os.PathLike[str], index: int = 1,
                       torchtitan_version: str = DEFAULT_TORCHTITAN_VERSION, tokens: float | None = None,
                       prices: dict[str, float] | None = None) -> EstimateResult:
    """Plan ``index`` of the plan file at ``path``, costed for the workload it
    was made for (``options`` override the file's settings)."""
    plan_file = read_plan_file(path)
    plan = plan_file.plan(index)
    if plan_file.model is None:  # a format-1 file: names only
        options = replace(options, model=options.model or plan.model, cluster=options.cluster or plan.cluster)
    workload = load_workload(options, global_batch=plan.global_batch_size, plan_file=plan_file)
    validate_plan(plan, workload.model, workload.cluster)
    return _costed(plan, workload, torchtitan_version, tokens, prices)


def _costed(plan: Plan, workload: Workload, torchtitan_version: str, tokens: float | None,
            prices: dict[str, float] | None) -> EstimateResult:
    """``plan`` costed, once the code that will run it is known to run it as costed."""
    check_target_runs(plan, workload, torchtitan_version)
    cost_model = CostModel(workload)
    ranked = RankedPlan(plan, cost_model.estimate(plan))
    return EstimateResult(plan_report(workload, cost_model, [ranked], ranked, tokens, prices))


def estimate(plan: UniformSetting | str | os.PathLike[str], *, index: int = 1, model: str | None = None,
             cluster: str | None = None, global_batch: int | None = None, target: str | None = None,
             torchtitan_version: str = DEFAULT_TORCHTITAN_VERSION, tokens: float | None = None,
             prices: dict[str, float] | None = None, replay: bool | None = None, **settings: Any) -> EstimateResult:
    """``hetplan estimate`` from Python: cost one plan, and check it by a replayed
    step of hetplan's runtime (``replay``; None: ``hetplan.app.replay.default_replay``).

    ``plan``: a ``UniformSetting``, or the path of a plan file (``index``: its
    K-th plan); the other arguments as ``hetplan.app.plan`` takes them (with a
    plan file, what is left out is the file's).

    >>> estimate(UniformSetting(dp=4, tp=2, pp=2, micro_batch=2), model="gpt2-amp",
    ...          cluster="16xA100-80GB", global_batch=64).ranked.estimate.fits  # doctest: +SKIP
    """
    options = WorkloadOptions(model=model, cluster=cluster, global_batch=global_batch, target=target, **settings)
    if isinstance(plan, UniformSetting):
        return estimate_setting(options, plan, torchtitan_version, tokens, prices).replayed(replay)
    return estimate_plan_file(options, plan, index, torchtitan_version, tokens, prices).replayed(replay)
