"""``hetplan tune``: train the planner's top plans for a few steps and keep the
one that is fastest when measured (AMP's "top-k then measure", issue 11).

Why: the cost model ranks plans by prediction, and predictions miss what it
does not model (kernel efficiency at small shapes, framework overhead, the
runtime's own schedule). A few real steps of a handful of different plans
catch that cheaply; the measurements also feed ``hetplan calibrate``.

Which plans are tried (``select_plans``): walk the planner's ranking and take
a plan only if its *kind* was not taken yet, where a kind is the plan's shape
(``plan_kind``: pp, per-stage (dp, tp), ZeRO stages, recompute, schedule and
micro-batch; not the layer split or the GPU ids); if fewer than k kinds exist,
fill up with the remaining plans in ranking order. So near-duplicates (the same
shape found by two planners) do not crowd out a different plan.

Each trial (``run_trial_subprocess``) is ``python -m torch.distributed.run
--standalone`` with the runtime's trainer (``hetplan.runtime.trainer``), as
``hetplan train`` starts it, also for one process so that a crash cannot take
tune down; it has a timeout after which its whole process tree is killed. A
failed trial is reported with the last error line of its stderr and skipped.
The runner is a parameter of ``tune`` so tests (and other launchers) can
replace it.

The planner's choice never depends on timing; only the measured re-ranking does.
"""

from __future__ import annotations

import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence, TextIO

from hetplan.io import fields
from hetplan.app.planning import run_planner
from hetplan.errors import HetplanError
from hetplan.plan.spec import Plan, RankedPlan
from hetplan.plan.file import plan_file_from_data, workload_record
from hetplan.runtime import launch
from hetplan.runtime.cli import child_env
from hetplan.export.target import RUNTIME, search_for_target
from hetplan.io.userfiles import read_json

MEASUREMENTS_FORMAT = "hetplan-measurements"
MEASUREMENTS_VERSION = 1
DEFAULT_TOP_K = 5
MAX_TOP_K = 32
DEFAULT_STEPS = 3
MAX_STEPS = 1000
DEFAULT_WARMUP = 1
MAX_WARMUP = 100
DEFAULT_TRIAL_TIMEOUT_S = 600.0
# plans asked of the planner per trial wanted: room to find k different kinds
CANDIDATES_PER_TRIAL = 4
DEVICES = ("cpu", "cuda")
_TRIAL_KEYS = ("plan_file", "predicted_step_s", "measured_step_s", "measured_step_times_s",
               "predicted_peak_memory_bytes", "measured_peak_memory_bytes", "status", "device")


# --- which plans -------------------------------------------------------------------------------
def plan_kind(plan: Plan) -> tuple[Any, ...]:
    """The plan's shape: what makes two plans run differently, not where
    (layer split and GPU ids are left out)."""
    stages = tuple((s.dp, s.tp, s.sequence_parallel,
                    tuple(sorted({st.tp or s.tp for st in s.strategies})),
                    tuple(sorted({st.zero for st in s.strategies})),
                    tuple(sorted({st.recompute for st in s.strategies}))) for s in plan.stages)
    return (plan.pp, stages, plan.schedule, plan.virtual_stages, plan.micro_batch_size, plan.num_micro_batches)


def select_plans(ranked: Sequence[Any], k: int) -> list[int]:
    """Indices into ``ranked`` (objects with ``.plan``, best first) of at most
    ``k`` plans to try: the best plan of each kind in ranking order, then, if
    fewer than ``k`` kinds exist, the remaining plans in ranking order."""
    chosen: list[int] = []
    kinds: set[tuple[Any, ...]] = set()
    for i, r in enumerate(ranked):
        kind = plan_kind(r.plan)
        if len(chosen) < k and kind not in kinds:
            kinds.add(kind)
            chosen.append(i)
    rest = [i for i in range(len(ranked)) if i not in chosen]
    return sorted(chosen + rest[:max(0, k - len(chosen))])


# --- trials ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TrialRequest:
    """What a trial runner gets: one plan to train for ``warmup + steps`` steps."""

    plan: Plan
    plan_path: str  # a single-plan plan file holding ``plan``
    work_dir: str  # an empty directory the trial may write to
    num_processes: int
    steps: int  # measured steps
    warmup: int  # steps before them, not measured
    timeout_s: float
    optimizer: str  # the runtime's: "sgd" or "adamw"
    device: str  # what the trial should run on: "cpu" or "cuda"


@dataclass(frozen=True)
class Measurement:
    """What a trial runner returns: every step's time (warm-up included)."""

    step_times_s: tuple[float, ...]
    peak_memory_bytes: int | None
    device: str


class TrialFailed(Exception):
    """A trial that did not finish; the message is the one-line reason."""


TrialRunner = Callable[[TrialRequest], Measurement]


@dataclass(frozen=True)
class Trial:
    """One tried plan, as the measurements file stores it.

    ``measured_step_times_s``: the measured steps only (after the warm-up);
    ``measured_step_s`` is their median. On CPU ``measured_peak_memory_bytes``
    is the peak RSS (interpreter and torch included), not allocator bytes."""

    plan_file: dict[str, Any]  # a complete single-plan plan file (hetplan.plan.file)
    predicted_step_s: float
    measured_step_s: float | None
    measured_step_times_s: tuple[float, ...]
    predicted_peak_memory_bytes: int
    measured_peak_memory_bytes: int | None
    status: str  # "ok" or "failed: <reason>"
    device: str

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def plan(self) -> Plan:
        return Plan.from_dict(self.plan_file["plans"][0]["plan"])

    @property
    def error(self) -> float | None:
        """(predicted - measured) / measured; None without a measurement."""
        if self.measured_step_s is None:
            return None
        return (self.predicted_step_s - self.measured_step_s) / self.measured_step_s

    def to_dict(self) -> dict[str, Any]:
        return {"plan_file": self.plan_file, "predicted_step_s": self.predicted_step_s,
                "measured_step_s": self.measured_step_s, "measured_step_times_s": list(self.measured_step_times_s),
                "predicted_peak_memory_bytes": self.predicted_peak_memory_bytes,
                "measured_peak_memory_bytes": self.measured_peak_memory_bytes, "status": self.status,
                "device": self.device}


@dataclass(frozen=True)
class TuneResult:
    """The trials ranked by measurement: ok ones fastest first, then the failed
    ones in the planner's order; ``planner_ranks[i]`` is trial i's place (1 =
    best) in the planner's ranking."""

    trials: tuple[Trial, ...]
    planner_ranks: tuple[int, ...]
    planner: str = ""
    search_time_s: float = 0.0
    workload_record: dict[str, Any] = field(default_factory=dict)

    @property
    def best(self) -> Trial | None:
        return self.trials[0] if self.trials and self.trials[0].ok else None


def single_plan_file(entry: dict[str, Any], record: dict[str, Any], planner: str) -> dict[str, Any]:
    """A plan file (the form ``hetplan plan --json`` writes) holding one plan entry."""
    return {**record, "planner": planner, "plans": [entry]}


def runtime_optimizer(workload_optimizer: str) -> str:
    """The runtime optimizer closest to the cost model's (its states are in the
    predicted memory): SGD for ``sgd-*``, else AdamW."""
    return "sgd" if workload_optimizer.startswith("sgd") else "adamw"


def tune(workload: Any, ranked: Sequence[Any], runner: TrialRunner | None = None, *, top_k: int = DEFAULT_TOP_K,
         steps: int = DEFAULT_STEPS, warmup: int = DEFAULT_WARMUP, timeout_s: float = DEFAULT_TRIAL_TIMEOUT_S,
         device: str = "cpu", planner: str = "", search_time_s: float = 0.0,
         entry: Callable[[Any], dict[str, Any]] | None = None, log: TextIO | None = None) -> TuneResult:
    """Try the ``select_plans`` of ``ranked`` (RankedPlans of ``workload``, best
    first) with ``runner`` (default ``run_trial_subprocess``) and rank them by
    measured step time. ``entry(ranked_plan)``: the plan-file entry to store
    (default ``RankedPlan.to_dict``). A failing trial is recorded, never raised."""
    runner = runner or run_trial_subprocess
    entry = entry or (lambda r: r.to_dict())
    log = log or sys.stderr
    record = workload_record(workload)
    chosen = select_plans(ranked, top_k)
    optimizer = runtime_optimizer(workload.optimizer)
    trials: list[Trial] = []
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="hetplan-tune-") as tmp:
        for n, index in enumerate(chosen):
            r = ranked[index]
            _log_start(log, n, len(chosen), r.plan.describe(), time.perf_counter() - start)
            work = os.path.join(tmp, f"trial{n + 1}")
            os.makedirs(work)
            plan_file = single_plan_file(entry(r), record, planner)
            request = TrialRequest(r.plan, os.path.join(work, "plan.json"), work, r.plan.num_devices, steps, warmup,
                                   timeout_s, optimizer, device)
            trial = _run_trial(runner, request, plan_file, r.estimate)
            print(f"trial {n + 1}/{len(chosen)}: " + (f"ok, {trial.measured_step_s:.4g} s/step" if trial.ok
                                                      else trial.status), file=log, flush=True)
            trials.append(trial)
    order = sorted(range(len(trials)), key=lambda i: (not trials[i].ok, trials[i].measured_step_s or 0.0, i))
    return TuneResult(tuple(trials[i] for i in order), tuple(chosen[i] + 1 for i in order), planner, search_time_s,
                      record)


def _log_start(log: TextIO, n: int, total: int, description: str, elapsed: float) -> None:
    left = f"~{elapsed / n * (total - n):.0f} s left" if n else "time left unknown yet"
    print(f"trial {n + 1}/{total}: {description} ... ({elapsed:.0f} s elapsed, {left})", file=log, flush=True)


def _run_trial(runner: TrialRunner, request: TrialRequest, plan_file: dict[str, Any], estimate: Any) -> Trial:
    """One trial; whatever goes wrong in it becomes its status."""
    with open(request.plan_path, "w", encoding="utf-8") as f:
        json.dump(plan_file, f, indent=1)
    predicted = (float(estimate.iteration_time_s), int(estimate.max_memory_bytes))
    try:
        m = runner(request)
        measured = tuple(float(t) for t in m.step_times_s[request.warmup:])
        if len(measured) < request.steps:
            raise TrialFailed(f"{len(m.step_times_s)} step time(s) came back, expected "
                              f"{request.warmup + request.steps}")
    except KeyboardInterrupt:
        raise
    except TrialFailed as exc:
        return _failed(plan_file, predicted, str(exc), request.device)
    except Exception as exc:  # noqa: BLE001 - a trial never stops the others
        return _failed(plan_file, predicted, f"{type(exc).__name__}: {exc}", request.device)
    peak = int(m.peak_memory_bytes) if m.peak_memory_bytes is not None else None
    return Trial(plan_file, predicted[0], statistics.median(measured), measured, predicted[1], peak, "ok", m.device)


def _failed(plan_file: dict[str, Any], predicted: tuple[float, int], reason: str, device: str) -> Trial:
    reason = " ".join(reason.split())[:300] or "no reason given"
    return Trial(plan_file, predicted[0], None, (), predicted[1], None, f"failed: {reason}", device)


# --- the subprocess runner --------------------------------------------------------------------
def run_trial_subprocess(request: TrialRequest) -> Measurement:
    """Train the plan with ``hetplan.runtime.trainer`` under torchrun
    (standalone, ``request.num_processes`` processes) and read its summary."""
    out = os.path.join(request.work_dir, "out")
    worker = ["-m", "hetplan.runtime.trainer", "--plan", request.plan_path,
              "--steps", str(request.warmup + request.steps), "--optimizer", request.optimizer,
              "--out", out, "--quiet", "--trust-plan-code"]  # tune wrote the plan, of the model the user named
    env = {**child_env(), "HETPLAN_PG_TIMEOUT_S": repr(max(1.0, 0.8 * request.timeout_s))}
    if request.device == "cpu":
        env["HETPLAN_DEVICE"] = "cpu"
    stderr_path = os.path.join(request.work_dir, "stderr.txt")
    code = run_process_group(launch.standalone_argv(request.num_processes, worker), env, request.timeout_s,
                             stderr_path)
    with open(stderr_path, encoding="utf-8", errors="replace") as f:
        stderr = f.read()[-65536:]
    if code != 0:
        raise TrialFailed(failure_reason(stderr, code))
    try:
        with open(os.path.join(out, "summary.json"), encoding="utf-8") as f:
            summary = json.load(f)
    except (OSError, ValueError) as exc:
        raise TrialFailed(f"the trainer wrote no readable summary.json ({exc})") from None
    return Measurement(tuple(summary["step_times_s"]), summary.get("peak_memory_bytes"),
                       summary.get("device", request.device))


def run_process_group(argv: Sequence[str], env: dict[str, str] | None, timeout_s: float, stderr_path: str) -> int:
    """Run ``argv`` in its own session, stderr to ``stderr_path``; its exit
    status. Past ``timeout_s`` (or on Ctrl-C) kill its process group and every
    descendant (torchrun starts its workers in sessions of their own) and
    raise TrialFailed."""
    with open(stderr_path, "w", encoding="utf-8") as err:
        proc = subprocess.Popen(list(argv), env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=err, start_new_session=True)
        try:
            return proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            kill_tree(proc)
            raise TrialFailed(f"timed out after {timeout_s:g} s (--trial-timeout); its processes were killed") \
                from None
        except BaseException:
            kill_tree(proc)
            raise


def kill_tree(proc: subprocess.Popen[Any]) -> None:
    """SIGKILL ``proc``'s process group and all its descendants (found first,
    while they still hang under it), then reap ``proc``."""
    found = _descendants(proc.pid)
    for pid in [proc.pid, *found]:
        try:
            if os.getpgid(pid) == pid:  # a group leader (proc, torchrun's workers): its whole group
                os.killpg(pid, signal.SIGKILL)
            else:
                os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


def _descendants(root: int) -> list[int]:
    """Every process below ``root`` (Linux /proc, else ``ps``)."""
    children: dict[int, list[int]] = {}
    for pid, ppid in _process_parents():
        children.setdefault(ppid, []).append(pid)
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.append(child)
                todo.append(child)
    return found


def _process_parents() -> list[tuple[int, int]]:
    if os.path.isdir("/proc/self"):
        pairs = []
        for name in os.listdir("/proc"):
            if name.isdigit():
                try:
                    with open(f"/proc/{name}/stat", encoding="utf-8", errors="replace") as f:
                        stat = f.read()
                except OSError:
                    continue
                pairs.append((int(name), int(stat.rsplit(")", 1)[1].split()[1])))
        return pairs
    try:
        text = subprocess.run(["ps", "-A", "-o", "pid=,ppid="], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [(int(a), int(b)) for a, b in (line.split() for line in text.splitlines() if len(line.split()) == 2)]


_RANK_PREFIX = re.compile(r"^\[(?:default)?rank\d+\]:\s*")
_EXCEPTION = re.compile(r"^[A-Za-z_][\w.]*(?:Error|Exception|Interrupt|Exit)\b:?")
_SIGNAL = re.compile(r"Signal \d+ \(\w+\) received by PID \d+")


def failure_reason(stderr: str, code: int) -> str:
    """The last error line of a failed trial's stderr: a ``hetplan: error``
    line, else the last exception line (not torchrun's ChildFailedError), else
    the signal that killed a worker, else the exit status and the last line."""
    lines = [_RANK_PREFIX.sub("", line).strip() for line in stderr.splitlines()]
    lines = [line for line in lines if line]
    for line in reversed(lines):
        if line.startswith("hetplan: error"):
            return line[len("hetplan: "):]
    for line in reversed(lines):
        if _EXCEPTION.match(line) and "ChildFailedError" not in line:
            return line
    for line in reversed(lines):
        found = _SIGNAL.search(line)
        if found:
            return f"{found.group(0)}" + (" (out of memory?)" if "SIGKILL" in line else "")
    return f"exit status {code}" + (f": {lines[-1]}" if lines else "")


# --- where trials can run ------------------------------------------------------------------------
def trial_device(cluster: Any) -> str:
    """'cpu' or 'cuda': where this machine can train the cluster's plans; a
    HetplanError saying what to do when it cannot (trials run here, on one node)."""
    fix = "run hetplan tune on one node of the cluster (a one-node cluster file, e.g. --cluster 8xH100), " \
          "or use --cluster local-cpu-N to try plans on N CPU processes"
    if cluster.num_nodes > 1:
        raise HetplanError(f"hetplan tune trains each plan on this machine, but cluster {cluster.name!r} has "
                           f"{cluster.num_nodes} nodes; {fix}")
    if all(d.gpu.name.upper() == "CPU" for d in cluster.devices):
        return "cpu"
    try:
        import torch
    except ImportError:
        raise HetplanError("hetplan tune needs torch to train: pip install 'hetplan[torch]'") from None
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if cluster.num_devices > have:
        raise HetplanError(f"cluster {cluster.name!r} has {cluster.num_devices} GPUs on its node, but this machine "
                           f"has {have} CUDA device(s); {fix}")
    return "cuda"


# --- the measurements file -----------------------------------------------------------------------
def measurements_dict(trials: Sequence[Trial]) -> dict[str, Any]:
    return {"format": MEASUREMENTS_FORMAT, "version": MEASUREMENTS_VERSION, "trials": [t.to_dict() for t in trials]}


def read_measurements(path: str | os.PathLike[str]) -> list[Trial]:
    """The trials of a ``hetplan tune`` measurements file, every field checked
    (a malformed file is one HetplanError line naming the field)."""
    path = os.fspath(path)
    data = read_json(path, "measurements file", "regenerate it with 'hetplan tune'")
    try:
        return parse_measurements(data)
    except HetplanError as exc:
        raise HetplanError(f"measurements file {path}: {exc}") from None


def parse_measurements(data: Any) -> list[Trial]:
    """``read_measurements`` of already parsed JSON."""
    top = fields.mapping("the file", data, ("format", "version", "trials"), ("format", "version", "trials"))
    if top["format"] != MEASUREMENTS_FORMAT:
        raise HetplanError(f"format must be {MEASUREMENTS_FORMAT!r}, got {top['format']!r}")
    version = fields.whole("version", top["version"])
    if version > MEASUREMENTS_VERSION:
        raise HetplanError(f"version {version} is newer than this hetplan reads ({MEASUREMENTS_VERSION}); "
                           "upgrade hetplan")
    items = fields.listing("trials", top["trials"])
    if not items:
        raise HetplanError("holds no trials")
    return [_parse_trial(f"trials[{k}]", item) for k, item in enumerate(items)]


def _parse_trial(where: str, data: Any) -> Trial:
    t = fields.mapping(where, data, _TRIAL_KEYS, _TRIAL_KEYS)
    _check_plan_file(f"{where}.plan_file", t["plan_file"])
    status = fields.text(f"{where}.status", t["status"])
    if status != "ok" and not status.startswith("failed: "):
        raise HetplanError(f"{where}.status must be 'ok' or 'failed: <reason>', got {status!r}")
    measured = _optional(f"{where}.measured_step_s", t["measured_step_s"], lambda w, v: fields.number(w, v))
    times = tuple(fields.number(f"{where}.measured_step_times_s[{k}]", v, strict=False)
                  for k, v in enumerate(fields.listing(f"{where}.measured_step_times_s", t["measured_step_times_s"])))
    if status == "ok" and (measured is None or not times):
        raise HetplanError(f"{where}: status 'ok' needs measured_step_s and measured_step_times_s")
    if status != "ok" and measured is not None:
        raise HetplanError(f"{where}: a failed trial has measured_step_s null, got {measured:g}")
    return Trial(
        plan_file=t["plan_file"],
        predicted_step_s=fields.number(f"{where}.predicted_step_s", t["predicted_step_s"]),
        measured_step_s=measured,
        measured_step_times_s=times,
        predicted_peak_memory_bytes=fields.whole(f"{where}.predicted_peak_memory_bytes",
                                                 t["predicted_peak_memory_bytes"], 0),
        measured_peak_memory_bytes=_optional(f"{where}.measured_peak_memory_bytes", t["measured_peak_memory_bytes"],
                                             lambda w, v: fields.whole(w, v, 0)),
        status=status,
        device=fields.text(f"{where}.device", t["device"], DEVICES),
    )


def _optional(where: str, value: Any, read: Callable[[str, Any], Any]) -> Any:
    return None if value is None else read(where, value)


def _check_plan_file(where: str, data: Any) -> None:
    """A complete plan file with exactly one plan, valid on its model and cluster."""
    pf = plan_file_from_data(where, data)
    if len(pf.plans) != 1:
        raise HetplanError(f"{where} must hold one plan, got {len(pf.plans)}")
    if pf.model is None or pf.cluster is None:
        raise HetplanError(f"{where} must embed model_spec and cluster_spec (a plan file of format 2 or later)")
    pf.plan(1)


# --- planning and results ----------------------------------------------------------------------
def tune_candidates(workload: Any, planner: Any, top_k: int) -> tuple[list[RankedPlan], float]:
    """The planner's best plans to choose ``top_k`` trials from (room for
    different kinds: ``CANDIDATES_PER_TRIAL`` per trial), only plans hetplan's
    runtime runs as costed (``hetplan.runtime.support``: the trials train them);
    and the search time."""
    start = time.perf_counter()
    ranked, _ = search_for_target(lambda k: run_planner(planner, workload, k, False), workload, RUNTIME,
                                  top_k * CANDIDATES_PER_TRIAL, planner.name)
    return ranked, time.perf_counter() - start


def measurements_path(out: str, given: str | None) -> str:
    """Where the measurements go: ``given``, else beside ``out`` as <stem>.measurements.json."""
    return given or os.path.splitext(out)[0] + ".measurements.json"


def tuned_plan_file(result: TuneResult) -> dict[str, Any]:
    """The plan file of the plans that ran, fastest measured first (``hetplan tune -o``)."""
    return {**result.workload_record, "planner": result.planner, "search_time_s": result.search_time_s,
            "plans": [t.plan_file["plans"][0] for t in result.trials if t.ok]}


def result_json(result: TuneResult) -> dict[str, Any]:
    """The table as JSON (--json)."""
    rows = []
    for i, (t, rank) in enumerate(zip(result.trials, result.planner_ranks), 1):
        rows.append({"rank": i if t.ok else None, "plan": t.plan.describe(), "planner_rank": rank,
                     "predicted_step_s": t.predicted_step_s, "measured_step_s": t.measured_step_s,
                     "error": t.error, "predicted_peak_memory_bytes": t.predicted_peak_memory_bytes,
                     "measured_peak_memory_bytes": t.measured_peak_memory_bytes, "status": t.status,
                     "device": t.device})
    best_rank = result.planner_ranks[0] if result.best is not None else None
    return {"planner": result.planner, "search_time_s": result.search_time_s, "trials": rows,
            "best_planner_rank": best_rank, "planner_best_agreed": best_rank == 1}
