"""Plain-text tables: ranked plans, an estimate's breakdown, memory per GPU."""

from __future__ import annotations

from typing import Sequence

from hetplan.cost.memory import MEMORY_CATEGORIES
from hetplan.cost.workload import Workload
from hetplan.model.spec import ModelSpec
from hetplan.plan import Estimate, Plan, RankedPlan
from hetplan.units import format_bytes, format_time


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


def ranked_table(ranked: Sequence[RankedPlan], show_planner_cost: bool | None = None) -> str:
    """The ranked plans; a planner's own cost is shown (``None``: automatically)
    when it is not the estimate's iteration time (AMP's eq. 3-5, hetero-avg's)."""
    if show_planner_cost is None:
        show_planner_cost = any(r.planner_cost_s is not None and
                                abs(r.planner_cost_s - r.estimate.iteration_time_s) > 1e-9 * r.estimate.iteration_time_s
                                for r in ranked)
    headers = ["#", "plan", "iter time", "samples/s", "tokens/s", "MFU", "max mem/GPU", "fits"]
    if show_planner_cost:
        headers.insert(3, "planner cost")
    rows = []
    for i, r in enumerate(ranked, 1):
        e = r.estimate
        row: list[object] = [i, r.plan.describe(), format_time(e.iteration_time_s), f"{e.samples_per_s:.2f}",
                             f"{e.tokens_per_s:,.0f}", f"{100 * e.mfu:.1f}%", format_bytes(e.max_memory_bytes),
                             "yes" if e.fits else "OOM"]
        if show_planner_cost:
            row.insert(3, format_time(r.planner_cost_s) if r.planner_cost_s is not None else "-")
        rows.append(row)
    return table(headers, rows, [True, False] + [True] * (len(headers) - 2))


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
        ("optimizer step", estimate.optimizer_s),
    ]
    total = estimate.iteration_time_s
    rows = [(name, format_time(t), f"{100 * t / total:.1f}%") for name, t in parts if t > 1e-9]
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
            degrees = f"{stage.dp}x{stage.tp}" + (f" cp{stage.cp}" if stage.cp > 1 else "") + \
                (f" ep{stage.ep}" if stage.ep > 1 else "")
            rows.append([j, gpu, degrees, f"{stage.num_layers} ({names})", *split,
                         format_bytes(used), format_bytes(cap), f"{100 * used / cap:.0f}%",
                         "ok" if used <= cap else "OOM"])
    headers = ["stage", "GPU", "dp x tp", "layers", *MEMORY_CATEGORIES, "peak mem/GPU", "capacity", "used", ""]
    right = [True, False, False, False, *[True] * len(MEMORY_CATEGORIES), True, True, True, False]
    text = table(headers, rows, right)
    host = host_memory_table(plan, estimate, workload)
    return f"{text}\n{host}" if host else text


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


def runtime_pipeline_note(plan: Plan, model: ModelSpec) -> str:
    """Said with a pipelined plan whose model hetplan's own runtime cannot split
    (hetplan.runtime.chain): the plan is still valid for other tools."""
    from hetplan.runtime.support import support_of

    blocker = support_of(model).pipeline
    if plan.pp > 1 and not blocker:  # the model splits; this plan's split points may not (hetplan.model.hf)
        from hetplan.model.hf import tied_span_refusal

        blocker = tied_span_refusal(model, {model.layers[i].name: j % plan.pp for j, stage in enumerate(plan.stages)
                                            for i in stage.layers if i < len(model.layers)})
    if plan.pp == 1 or not blocker or blocker.startswith("unchecked"):
        return ""
    return (f"hetplan.runtime would refuse this plan's {plan.pp} pipeline stages for this model: {blocker} "
            "(exports to Megatron-LM, DeepSpeed and torchtitan are not affected)")


def fine_grained_moe_note(model: ModelSpec) -> str:
    """Said for a model whose routed experts are narrower than its hidden size
    (fine-grained experts, DeepSeekMoE §3.1): the one kind of model whose
    published runs hetplan is known to cost far too fast (docs/cost-model.md,
    "Validation against the frameworks' own published runs")."""
    narrow = [layer for layer in model.layers if layer.is_moe and 0 < layer.expert_ffn < model.hidden_size]
    if not narrow:
        return ""
    return (f"this model's routed experts are fine-grained (width {narrow[0].expert_ffn} < hidden "
            f"{model.hidden_size}); the estimate is likely optimistic: per-expert kernel launches, token "
            "permutation and the dispatcher's host synchronisation are not costed, and published Qwen3-30B-A3B "
            "runs on H100 trained 1.6-2.8x slower than hetplan estimates them. Measure your GPUs with "
            "'hetplan profile' and pass --profile")


def explain(plan: Plan, estimate: Estimate, workload: Workload) -> list[str]:
    """A few plain sentences on why this plan is fast and where it loses time."""
    lines = []
    e = estimate
    biggest = max(
        [("the pipeline bubble", e.bubble_s), ("data-parallel gradient sync", e.dp_sync_s),
         ("tensor-parallel communication", e.tp_comm_s), ("pipeline transfers", e.p2p_s),
         ("recomputation", e.recompute_s)], key=lambda x: x[1])
    lines.append(f"{100 * e.compute_s / e.iteration_time_s:.0f}% of the step is useful compute on the slowest "
                 f"stage; the largest overhead is {biggest[0]} ({format_time(biggest[1])}).")
    if plan.pp > 1:
        lines.append(f"{plan.pp} pipeline stages with {plan.num_micro_batches} micro-batches: bubble "
                     f"{100 * e.bubble_s / e.iteration_time_s:.0f}% of the step.")
    types = {workload.cluster.devices[d].gpu.name for s in plan.stages for d in s.devices}
    if len(types) > 1:
        layers_by_type: dict[str, list[int]] = {}
        for s in plan.stages:
            key = "+".join(sorted({workload.cluster.devices[d].gpu.name for d in s.devices}))
            layers_by_type.setdefault(key, []).append(s.num_layers)
        per_type = [f"{key} stages run {sum(c)} layers ({len(c)} stage{'s' if len(c) > 1 else ''})"
                    for key, c in layers_by_type.items()]
        lines.append("heterogeneous GPUs: " + "; ".join(per_type) + ".")
    lines.append(f"tightest GPU has {format_bytes(e.min_headroom_bytes)} of memory to spare.")
    if e.bound_gap is not None:
        lines.append(f"within {e.bound_gap:.0%} of the lower bound {format_time(e.lower_bound_s)}: no plan of "
                     "this workload can be faster (all compute spread over every GPU at its best, plus the "
                     "optimizer step; communication, bubble and memory limits make real plans slower).")
    return lines
