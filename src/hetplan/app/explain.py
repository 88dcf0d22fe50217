"""What a plan's report says in words besides its numbers: why the plan is
fast (``explain``) and the notes that qualify an estimate for this model
(``model_notes``: hetplan's runtime cannot pipeline it; its experts are
fine-grained). Computed once for ``hetplan.app.report.PlanReport``; the text
and HTML renderers print them."""

from __future__ import annotations

from hetplan.cost.model import CostModel
from hetplan.plan.workload import Workload
from hetplan.plan.support import tied_span_refusal
from hetplan.model.spec import ModelSpec
from hetplan.plan.spec import Estimate, Plan
from hetplan.plan.support import support_of
from hetplan.simulate.plan import SIMULATION_TOLERANCE, simulated_over_closed
from hetplan.units import format_bytes, format_time


def runtime_pipeline_note(plan: Plan, model: ModelSpec) -> str:
    """Said with a pipelined plan whose model hetplan's own runtime cannot split
    (hetplan.model.chain): the plan is still valid for other tools."""
    blocker = support_of(model).pipeline
    if plan.pp > 1 and not blocker:  # the model splits; this plan's split points may not (hetplan.model.hf)
        blocker = tied_span_refusal(model, {model.layers[i].name: j % plan.pp for j, stage in enumerate(plan.stages)
                                            for i in stage.layers if i < len(model.layers)})
    if plan.pp == 1 or not blocker or blocker.startswith("unchecked"):
        return ""
    return (f"hetplan.runtime would refuse this plan's {plan.pp} pipeline stages for this model: {blocker} "
            "(exports to Megatron-LM, DeepSpeed and torchtitan are not affected)")


def model_notes(plan: Plan, estimate: Estimate, cost_model: CostModel) -> tuple[str, ...]:
    """The notes that qualify ``plan``'s estimate for its model, and for its
    schedule on its links (none: an empty tuple)."""
    model = cost_model.model
    return tuple(n for n in (runtime_pipeline_note(plan, model), fine_grained_moe_note(model),
                             simulator_note(plan, estimate)) if n)


def simulator_note(plan: Plan, estimate: Estimate) -> str:
    """Said when the event simulator runs the plan's pipeline more than
    ``SIMULATION_TOLERANCE`` longer than its estimate (docs/cost-model.md,
    Known limits: GPipe's one-way phases over links comparable to the stages)."""
    over = simulated_over_closed(plan, estimate)
    if over <= SIMULATION_TOLERANCE:
        return ""
    return (f"the event simulator runs this plan's pipeline {over:.0%} longer than its estimate: its schedule's "
            "waits over links comparable to its stages are longer than the closed form charges (GPipe's one-way "
            "phases; docs/cost-model.md, Known limits); its time is optimistic by up to that much "
            "('hetplan estimate --simulate' shows both)")


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
         ("recomputation", e.recompute_s), ("activation offload transfers", e.offload_s)], key=lambda x: x[1])
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
        per_type = [f"{key} stages run {sum(c)} layer{'s' if sum(c) > 1 else ''} "
                    f"({len(c)} stage{'s' if len(c) > 1 else ''})"
                    for key, c in layers_by_type.items()]
        lines.append("heterogeneous GPUs: " + "; ".join(per_type) + ".")
    lines.append(f"tightest GPU has {format_bytes(e.min_headroom_bytes)} of memory to spare.")
    if e.bound_gap is not None:
        lines.append(f"step time {e.bound_gap:.0%} above the lower bound {format_time(e.lower_bound_s)}: no plan "
                     "of this workload can be faster (all compute spread over every GPU at its best, plus the "
                     "optimizer step; communication, bubble and memory limits make real plans slower).")
    return lines
