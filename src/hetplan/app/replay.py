"""The replay check of ``hetplan plan`` and ``hetplan estimate``: the top plans'
peak memory by one real training step of hetplan's runtime on fake tensors
(``hetplan.runtime.replay``), beside the analytic peak, and the ranking by it.

The planner side stays torch-free: the runtime's replay is imported only here,
when a check runs, and without torch the check says it was skipped.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass
from typing import Any, Sequence

from hetplan.cost.memory import framework_overhead_bytes
from hetplan.errors import HetplanError
from hetplan.export.target import RUNTIME
from hetplan.plan.spec import RankedPlan
from hetplan.plan.workload import Workload
from hetplan.progress import Progress
from hetplan.units import format_bytes

# Plans ``hetplan plan`` replays by default: its three best. A replay builds one rank per pipeline stage
# and runs one step on fake tensors: on this project's 2-core machine gpt3-1.3b on one H100 (8 x 2) takes
# 3-4 CPU s, Llama-3-70B on 64 H100 26-32 s with one stage and 44-61 s with two (benchmarks/bench_replay.py,
# docs/cost-model.md "The replay check"), so three small plans stay well under a minute.
DEFAULT_REPLAY = 3
REPLAY_ENV = "HETPLAN_REPLAY"  # the default number of plans to replay; "0": no replay unless asked (the tests)


def default_replay() -> int:
    """How many plans a command replays unless told: ``HETPLAN_REPLAY`` if set, else ``DEFAULT_REPLAY``."""
    text = os.environ.get(REPLAY_ENV, "")
    if not text:
        return DEFAULT_REPLAY
    if not text.isdigit():
        raise HetplanError(f"{REPLAY_ENV}={text!r}: give a number of plans to replay (0: none)")
    return int(text)


@dataclass(frozen=True)
class ReplicaPeak:
    """The replay of the replicas of one TP degree and share of a stage of mixed
    TP degrees (``Stage.replica_tp``) on one GPU type: how many of the stage's
    GPUs of that type it stands for, its replayed peak (tensors plus the
    framework overhead), the analytic peak of its fullest GPU and that GPU's memory."""

    stage: int
    tp: int
    samples: int  # its share of each micro-batch (dp_split)
    gpu: str
    gpus: int
    peak_bytes: int
    analytic_bytes: int
    capacity_bytes: int

    def line(self) -> str:
        """One line: which replicas, their replayed and analytic peaks, their GPU's memory."""
        verdict = "" if self.peak_bytes <= self.capacity_bytes else " (does not fit)"
        return (f"stage {self.stage}, tp{self.tp} replica(s) taking {self.samples} sample(s) of each micro-batch on "
                f"{self.gpus}x {self.gpu}: {format_bytes(self.peak_bytes)} replayed, "
                f"{format_bytes(self.analytic_bytes)} analytic, of {format_bytes(self.capacity_bytes)}{verdict}")


@dataclass(frozen=True)
class ReplayCheck:
    """One plan's replay: the peak of its fullest replayed GPU (tensors replayed
    plus the framework overhead the analytic peak also adds), that GPU's memory,
    whether every replayed rank fits (its GPU's memory, and its share of host
    memory for offloaded activations), the seconds it took, and the most
    offloaded activation bytes one GPU kept in host memory (0: none offloaded)."""

    peak_bytes: int
    capacity_bytes: int
    fits: bool
    seconds: float
    host_peak_bytes: int = 0
    replicas: tuple[ReplicaPeak, ...] = ()  # each replayed replica of a stage of mixed TP degrees


@dataclass(frozen=True)
class ReplayOutcome:
    """The replays of a ranked list, aligned with it (None: not replayed),
    ``skipped``: why none ran ('' where they did or none was asked for), and
    ``unreplayed``: per row, why a plan asked for was not replayed ('' where it
    was or was not asked for; the runtime refuses it, or torch stopped)."""

    checks: tuple[ReplayCheck | None, ...]
    skipped: str = ""
    unreplayed: tuple[str, ...] = ()

    @property
    def notes(self) -> tuple[str, ...]:
        """One note per reason a plan was not replayed, naming its rows (#1 is the table's first)."""
        rows: dict[str, list[int]] = {}
        for row, why in enumerate(self.unreplayed, 1):
            if why:
                rows.setdefault(why, []).append(row)
        return tuple(f"plan{'s' if len(r) > 1 else ''} {', '.join(f'#{k}' for k in r)} not replayed: {why}"
                     for why, r in rows.items())

    @property
    def seconds(self) -> float:
        return sum(c.seconds for c in self.checks if c is not None)

    def line(self) -> str:
        """The line the commands print under the table ('' when nothing was asked)."""
        if self.skipped:
            return f"note: replay skipped: {self.skipped}"
        done = [c for c in self.checks if c is not None]
        bad = sum(not c.fits for c in done)
        verdict = f"; {bad} do not fit by it and are ranked last" if bad else ""
        lines = [f"replay: {len(done)} plan(s) checked by one training step of hetplan's runtime on fake tensors "
                 f"in {self.seconds:.1f} s{verdict}"] if done else []
        replicas = [f"replay of plan #{row}, {peak.line()}" for row, c in enumerate(self.checks, 1) if c is not None
                    for peak in c.replicas]
        return "\n".join([*lines, *replicas, *(f"note: {n}" for n in self.notes)])


def replay_top(ranked: Sequence[RankedPlan], workload: Workload, count: int) -> ReplayOutcome:
    """Replay the first ``count`` plans of ``ranked`` (0: none)."""
    if count <= 0 or not ranked:
        return ReplayOutcome((None,) * len(ranked))
    why = skip_reason(workload)
    if why:
        return ReplayOutcome((None,) * len(ranked), why)
    checks: list[ReplayCheck | None] = [None] * len(ranked)
    unreplayed = [""] * len(ranked)
    with Progress("replay: plans", total=min(count, len(ranked))) as progress:
        for k, r in enumerate(ranked[:count]):
            try:
                checks[k] = replay_one(r, workload)
            except HetplanError as exc:
                unreplayed[k] = str(exc)
            except Exception as exc:  # noqa: BLE001 -- torch under fake tensors; the check says it did not run
                unreplayed[k] = (f"torch stopped the fake step "
                                 f"({type(exc).__name__}: {str(exc).splitlines()[-1][:160] if str(exc) else ''})")
            progress.advance()
    return ReplayOutcome(tuple(checks), unreplayed=tuple(unreplayed))


def skip_reason(workload: Workload) -> str:
    """Why the plans of ``workload`` cannot be replayed ('' where they can)."""
    if workload.target and workload.target != RUNTIME:
        return f"the replay runs hetplan's runtime, and these plans are for {workload.target}"
    try:
        import hetplan.runtime.replay  # noqa: F401 -- torch-optional: the planner side imports without torch
    except ImportError:
        return "torch is not installed (pip install 'hetplan[torch]' to check plans by a replayed step)"
    return ""


def replay_one(ranked: RankedPlan, workload: Workload) -> ReplayCheck:
    """One plan's replay, against the memory of every GPU whose rank a replayed
    rank stands for (a stage's GPUs may be of several types) and, for offloaded
    activations, against each one's share of host memory."""
    from hetplan.runtime.replay_micro import fast_replay

    start = time.perf_counter()
    return replay_check(fast_replay(ranked.plan, workload.model), ranked, workload, time.perf_counter() - start)


def replay_check(replay: Any, ranked: RankedPlan, workload: Workload, seconds: float) -> ReplayCheck:
    """``replay`` (a ``runtime.replay.PlanReplay`` of ``ranked``'s plan) against its GPUs' memory (``replay_one``)."""
    estimate = ranked.estimate
    held = [(s, d) for s in replay.stages for d in (s.devices or (s.device,))]
    totals = [(s.peak_bytes + _overhead(workload, d), estimate.memory_capacity_bytes[d]) for s, d in held]
    host_fits = all(s.host_peak_bytes <= estimate.host_capacity_bytes.get(d, s.host_peak_bytes) for s, d in held)
    peak, cap = max(totals, key=lambda t: t[0] / t[1])  # the fullest replayed GPU
    return ReplayCheck(peak, cap, host_fits and all(p <= c for p, c in totals), seconds,
                       max(s.host_peak_bytes for s in replay.stages), mixed_replica_peaks(replay, ranked, workload))


def mixed_replica_peaks(replay: Any, ranked: RankedPlan, workload: Workload) -> tuple[ReplicaPeak, ...]:
    """One :class:`ReplicaPeak` per replayed rank of a stage of mixed TP degrees
    and GPU type of the devices it stands for (``runtime.replay.replayed_ranks``:
    one rank per share and degree; the GPU type changes no tensor, only the
    memory it is checked against)."""
    out = []
    for s in replay.stages:
        stage = ranked.plan.stages[s.stage]
        if stage.replica_tp is None:
            continue
        replica = next(r for r in range(stage.dp) if s.device in stage.replica_devices(r))
        by_gpu: dict[str, list[int]] = {}
        for d in s.devices or (s.device,):
            by_gpu.setdefault(workload.cluster.devices[d].gpu.name, []).append(d)
        for gpu, devices in sorted(by_gpu.items()):
            fullest = max(devices, key=lambda d: (s.peak_bytes + _overhead(workload, d))
                          / ranked.estimate.memory_capacity_bytes[d])
            out.append(ReplicaPeak(s.stage, stage.replica_degree(replica), stage.dp_split[replica], gpu, len(devices),
                                   s.peak_bytes + _overhead(workload, fullest),
                                   max(ranked.estimate.peak_memory_bytes[d] for d in devices),
                                   ranked.estimate.memory_capacity_bytes[fullest]))
    return tuple(out)


def _overhead(workload: Workload, device: int) -> int:
    """The framework overhead the cost model adds to a GPU's tensors (``cost.memory``)."""
    return framework_overhead_bytes(workload.cluster.devices[device].gpu.name.upper() == "CPU")


def rerank(ranked: Sequence[RankedPlan], outcome: ReplayOutcome) -> tuple[list[RankedPlan], ReplayOutcome]:
    """The plans in their order, those that do not fit by their replay moved
    last (in their order): a plan the replay shows out of memory is never the
    recommended one while another fits."""
    order = sorted(range(len(ranked)), key=lambda i: _runs_out(outcome.checks[i]))
    unreplayed = tuple(outcome.unreplayed[i] for i in order) if outcome.unreplayed else ()
    return [ranked[i] for i in order], ReplayOutcome(tuple(outcome.checks[i] for i in order), outcome.skipped,
                                                     unreplayed)


def _runs_out(check: ReplayCheck | None) -> bool:
    return check is not None and not check.fits


def replay_record(check: ReplayCheck | None) -> dict[str, Any] | None:
    """A plan's replay in the JSON a command writes (None: not replayed)."""
    if check is None:
        return None
    host = {"host_peak_memory_bytes": check.host_peak_bytes} if check.host_peak_bytes else {}
    replicas = {"replicas": [asdict(r) for r in check.replicas]} if check.replicas else {}
    return {"peak_memory_bytes": check.peak_bytes, "capacity_bytes": check.capacity_bytes, **host,
            "fits": check.fits, "seconds": round(check.seconds, 3), **replicas}
