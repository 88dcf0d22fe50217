"""Plain text: tables (ranked plans, an estimate's breakdown, memory per GPU),
the workload header, and one plan's report (``hetplan.app.report.PlanReport``)
as ``hetplan plan`` and ``hetplan estimate`` print it (``plan_text``,
``estimate_text``; the HTML page, ``report/html.py``, renders the same report)."""

from __future__ import annotations

from typing import Any, Sequence

from hetplan.app.report import PlanReport
from hetplan.cost.constants import DEFAULT_ATTENTION_KERNEL
from hetplan.cost.memory import MEMORY_CATEGORIES
from hetplan.plan.workload import Workload
from hetplan.plan.spec import Estimate, Plan, RankedPlan, Stage
from hetplan.report.training import training_lines
from hetplan.report.runs import LEGEND as RUNS_ON_LEGEND, best_per_tool_lines, runs_on_cell
from hetplan.units import format_bytes, format_count, format_time


def table(headers: Sequence[str], rows: Sequence[Sequence[object]], align_right: Sequence[bool] | None = None) -> str:
    """A fixed-width table; numbers right-aligned by default."""
    cells = [[str(c) for c in row] for row in rows]
    widths = [len(h) for h in headers]
    for row in cells:
        for i, c in enumerate(row):
            widths[i] = max(widths[i], len(c))
    if align_right is None:
        align_right = [all(_is_number(r[i]) for r in cells) if cells else False for i in range(len(headers))]

    def fmt(row: Sequence[str]) -> str:
        return "  ".join(c.rjust(w) if right else c.ljust(w) for c, w, right in zip(row, widths, align_right)).rstrip()

    lines = [fmt(list(headers)), "  ".join("-" * w for w in widths)]
    lines += [fmt(r) for r in cells]
    return "\n".join(lines)


def _is_number(text: str) -> bool:
    try:
        float(text.split()[0].rstrip("%x"))
        return True
    except (ValueError, IndexError):
        return False


def ranked_table(ranked: Sequence[RankedPlan], show_planner_cost: bool | None = None,
                 replays: Sequence[Any] = (), runs_on: Sequence[Sequence[str]] = ()) -> str:
    """The ranked plans; a planner's own cost is shown (``None``: automatically)
    when it is not the estimate's iteration time (AMP's eq. 3-5, hetero-avg's);
    ``replays`` (``hetplan.app.replay.ReplayCheck`` or None per row): a
    "replayed" column beside the analytic peak, and "fits" says "OOM (replay)"
    for a plan the analytic model fits and the replay does not; ``runs_on``:
    per plan, the codes that run it (a "runs on" column)."""
    if show_planner_cost is None:
        show_planner_cost = any(r.planner_cost_s is not None and
                                abs(r.planner_cost_s - r.estimate.iteration_time_s) > 1e-9 * r.estimate.iteration_time_s
                                for r in ranked)
    headers = ["#", "plan", "iter time", "samples/s", "tokens/s", "MFU", "max mem/GPU", "fits"]
    replayed = any(c is not None for c in replays)
    if replayed:
        headers.insert(7, "replayed")
    if show_planner_cost:
        headers.insert(3, "planner cost")
    if runs_on:
        headers.append("runs on")
    rows = []
    for i, r in enumerate(ranked, 1):
        e = r.estimate
        check = replays[i - 1] if replayed else None
        row: list[object] = [i, r.plan.describe(), format_time(e.iteration_time_s), f"{e.samples_per_s:.2f}",
                             f"{e.tokens_per_s:,.0f}", f"{100 * e.mfu:.1f}%", format_bytes(e.max_memory_bytes),
                             _fits(e.fits, check)]
        if replayed:
            row.insert(7, format_bytes(check.peak_bytes) if check is not None else "-")
        if show_planner_cost:
            row.insert(3, format_time(r.planner_cost_s) if r.planner_cost_s is not None else "-")
        if runs_on:
            row.append(runs_on_cell(runs_on[i - 1]))
        rows.append(row)
    return table(headers, rows, [True, False] + [True] * (len(headers) - 2))


def _fits(analytic: bool, check: Any) -> str:
    """The "fits" cell: the analytic verdict, and the replay's where it differs."""
    if not analytic:
        return "OOM"
    return "OOM (replay)" if check is not None and not check.fits else "yes"


# A part of the compute time (host dispatch, the loss) is shown from this share of the step:
# below it the row would say nothing the compute row does not (a reading choice, not a physical one).
SHOWN_COMPUTE_PART = 0.01


def breakdown(estimate: Estimate, cp_ep: bool = False) -> str:
    """Where the iteration time goes (the parts add up to the total); ``cp_ep``:
    the plan has context or expert parallelism, whose K/V exchanges and
    all-to-alls the cost model counts with the TP communication."""
    parts = [
        ("compute (bottleneck stage)", estimate.compute_s),
        ("pipeline bubble", estimate.bubble_s),
        ("pipeline p2p", estimate.p2p_s),
        ("data-parallel sync (exposed)", estimate.dp_sync_s),
        ("tensor-parallel comm" + (" (+ CP K/V, EP all-to-all)" if cp_ep else ""), estimate.tp_comm_s),
        ("recompute", estimate.recompute_s),
        ("activation offload (exposed)", estimate.offload_s),
        ("optimizer step", estimate.optimizer_s),
    ]
    total = estimate.iteration_time_s
    rows = [(name, format_time(t), f"{100 * t / total:.1f}%") for name, t in parts if t > 1e-9]
    shown = [(f"  of which {name}", t) for name, t in (("host dispatch", estimate.host_dispatch_s),
                                                        ("loss", estimate.loss_s)) if t >= SHOWN_COMPUTE_PART * total]
    rows[1:1] = [(name, format_time(t), f"{100 * t / total:.1f}%") for name, t in shown] if rows else []
    rows.append(("total", format_time(total), "100.0%"))
    return table(["time goes to", "seconds", "share"], rows, [False, True, True])


def memory_table(plan: Plan, estimate: Estimate, workload: Workload,
                 breakdown: dict[int, dict[str, int]] | None = None) -> str:
    """Peak memory per stage and GPU type (the fullest GPU of that type), split
    into parameters, gradients, optimizer states, activations and buffers
    where ``breakdown`` (``CostModel.memory_breakdown``) is given."""
    rows = []
    for j, (stage, se) in enumerate(zip(plan.stages, estimate.stages)):
        first, last = stage.layers[0], stage.layers[-1]
        names = f"{workload.model.layers[first].name}..{workload.model.layers[last].name}"
        by_type: dict[str, list[int]] = {}
        for i, d in enumerate(stage.devices):
            by_type.setdefault(workload.cluster.devices[d].gpu.name, []).append(i)
        for gpu, positions in sorted(by_type.items()):
            worst = max(positions, key=lambda i: se.memory_bytes[i] / se.memory_capacity_bytes[i])
            used, cap = se.memory_bytes[worst], se.memory_capacity_bytes[worst]
            parts = (breakdown or {}).get(stage.devices[worst])
            split = [format_bytes(parts[k]) for k in MEMORY_CATEGORIES] if parts else ["-"] * len(MEMORY_CATEGORIES)
            degrees = f"{stage.dp}x{_type_tp(stage, positions)}" + (f" cp{stage.cp}" if stage.cp > 1 else "") + \
                (f" ep{stage.ep}" if stage.ep > 1 else "")
            rows.append([j, gpu, degrees, f"{stage.num_layers} ({names})", *split,
                         format_bytes(used), format_bytes(cap), f"{100 * used / cap:.0f}%",
                         "ok" if used <= cap else "OOM"])
    headers = ["stage", "GPU", "dp x tp", "layers", *MEMORY_CATEGORIES, "peak mem/GPU", "capacity", "used", ""]
    right = [True, False, False, False, *[True] * len(MEMORY_CATEGORIES), True, True, True, False]
    text = table(headers, rows, right)
    host = host_memory_table(plan, estimate, workload)
    return f"{text}\n{host}" if host else text


def _type_tp(stage: Stage, positions: list[int]) -> str:
    """The TP degree of the replicas holding the stage's devices at ``positions``
    (their own degrees, '1/2', with ``Stage.replica_tp``)."""
    if stage.replica_tp is None:
        return str(stage.tp)
    replica_of = [r for r in range(stage.dp) for _ in stage.replica_devices(r)]
    return "/".join(str(t) for t in sorted({stage.replica_tp[replica_of[i]] for i in positions}))


def host_memory_table(plan: Plan, estimate: Estimate, workload: Workload) -> str:
    """Offloaded activations in host memory per stage and GPU type (the
    fullest GPU of that type) against its share of the node's host memory;
    empty for a plan that offloads nothing."""
    host, limit = estimate.host_offload_bytes, estimate.host_capacity_bytes
    if not host:
        return ""
    rows = []
    for j, stage in enumerate(plan.stages):
        by_type: dict[str, list[int]] = {}
        for d in stage.devices:
            if d in host:
                by_type.setdefault(workload.cluster.devices[d].gpu.name, []).append(d)
        for gpu, devices in sorted(by_type.items()):
            worst = max(devices, key=lambda d: host[d] / limit[d] if d in limit else 0.0)
            cap = limit.get(worst)
            rows.append([j, gpu, "host (offloaded)", format_bytes(host[worst]),
                         format_bytes(cap) if cap is not None else "its own memory",
                         f"{100 * host[worst] / cap:.0f}%" if cap else "-",
                         "over host memory" if cap is not None and host[worst] > cap else "ok"])
    return table(["stage", "GPU", "memory", "per GPU", "host share", "used", ""], rows,
                 [True, False, False, True, True, True, False])


def workload_header(workload: Workload, extra: str = "") -> str:
    """The lines every command starts with: model, cluster, batch and settings,
    measured or calibrated costs, and ``extra`` (a last line)."""
    m, c = workload.model, workload.cluster
    seq = f"seq {m.seq_len}" + (" (default; set --seq-len)" if m.meta.get("seq_len_default") else "")
    lines = [f"model    {m.name}: {m.num_layers} layers, {format_count(m.total_params)} params, {seq}",
             f"cluster  {c.name}: {c.summary()}",
             f"batch    {workload.global_batch_size} samples/step, {workload.precision}, optimizer {workload.optimizer}"
             + (", FP8 matmuls" if workload.fp8 else "")
             + (", DeepSpeed ZeRO collectives" if workload.zero_implementation == "deepspeed" else "")
             + (f", {workload.attention_kernel} attention" if workload.attention_kernel != DEFAULT_ATTENTION_KERNEL
                else "")
             + (", TP communication overlapped" if workload.tp_comm_overlap else "")
             + (", layers torch.compiled" if workload.compile else "")
             + (f", memory limit {format_bytes(workload.memory_limit_bytes)}/GPU" if workload.memory_limit_bytes else "")]
    if workload.profile is not None:
        measured_dp = len(getattr(workload.profile, "data_parallel", ()))
        lines.append(f"costs    measured layer times ({len(workload.profile)} profile entries)"
                     + (f" and data-parallel wrappers ({measured_dp} points)" if measured_dp else "")
                     + " where the profile has them, the analytic model elsewhere")
        lines += _profile_coverage(workload)
    if workload.calibration is not None:
        lines.append(f"rates    calibrated: {workload.calibration.describe()}")
    if extra:
        lines.append(extra)
    return "\n".join(lines)


def _profile_coverage(workload: Workload) -> list[str]:
    """What a profile measured beyond layer times (the host time per operator)
    and the model's layer kinds it did not measure, which stay modelled."""
    profile = workload.profile
    lines = []
    host = getattr(profile, "host", ())
    if host:
        lines.append("host     dispatch measured: " + ", ".join(f"{h.op_s * 1e6:.3g} us per operator on {h.gpu}"
                                                          for h in host))
    measured = profile.layers() if profile is not None else set()
    missing = list(dict.fromkeys(layer.name for layer in workload.model.layers if layer.profile_key not in measured))
    if missing:
        lines.append(f"modelled {len(missing)} layer(s) the profile does not hold: {', '.join(missing[:4])}"
                     + (", ..." if len(missing) > 4 else ""))
    return lines


def _checks(report: PlanReport) -> tuple[Any, ...]:
    """The report's replay checks per ranked row (none where it was not replayed)."""
    return report.replay.checks if report.replay is not None else ()


def report_memory_table(report: PlanReport) -> str:
    """``memory_table`` of the report's chosen plan."""
    return memory_table(report.chosen.plan, report.chosen.estimate, report.workload, report.memory)


# Printed once under ``plan``'s table: what the plan column's words mean (the
# whole notation, every label Plan.describe writes: docs/report.md "Plan notation").
PLAN_NOTATION = ("plan notation: ppN [stage | stage ...] pipeline stages (one setting when all agree), dpD/tpT/cpC/epE "
                 "data/tensor/context/expert-parallel degrees, NL layers, zK ZeRO stage, rc:full or rc:9/26 "
                 "recomputed layers, mbs B x M (per replica) micro-batch size x count; docs/report.md#plan-notation")


def plan_text(report: PlanReport, quiet: bool = False) -> str:
    """What ``hetplan plan`` prints: the header, the ranked plans, what the
    target cost, and (not ``quiet``) where the best plan's time and memory go,
    why, the time to train and the notes."""
    where = [RUNS_ON_LEGEND, *best_per_tool_lines(report.ranked, report.runs_on, report.positions)]
    blocks = [workload_header(report.workload, report.header_extra),
              "\n".join([ranked_table(report.ranked, None, _checks(report), runs_on=report.runs_on), PLAN_NOTATION,
                         *where])]
    if report.target_lines:
        blocks.append("\n".join(report.target_lines))
    if report.replay is not None and report.replay.line():
        blocks.append(report.replay.line())
    if not quiet:
        best = report.chosen
        blocks += [f"best plan: {best.plan.describe()}\n{breakdown(best.estimate, report.cp_ep)}",
                   report_memory_table(report),
                   "\n".join([*(f"- {line}" for line in (*report.why, *training_lines(report.training))),
                              *(f"- note: {note}" for note in (*report.plan_notes, *report.model_notes))])]
    return "\n\n".join(blocks)


def estimate_text(report: PlanReport) -> str:
    """What ``hetplan estimate`` prints: the header, the plan's row, where its
    time and memory go, the time to train and the notes on the model."""
    lines = [*(f"- {line}" for line in training_lines(report.training)),
             *(f"note: {note}" for note in report.model_notes)]
    if report.replay is not None and report.replay.line():
        lines.append(report.replay.line())
    return "\n\n".join([workload_header(report.workload), ranked_table([report.chosen], None, _checks(report)),
                         breakdown(report.chosen.estimate, report.cp_ep), report_memory_table(report),
                         "\n".join(lines)])
