"""Layer groups: how the searching planners handle models of thousands of layers.

The planners that search layer splits (auto, AMP, Metis, Galvatron, SMP, ...)
build tables over every range of layers or walk every layer per strategy:
their work grows as L² or faster (issue 32: 10,000 layers x 64 H100 ran out of
time and memory). Above ``MAX_SEARCH_LAYERS`` layers they search a *grouped*
model instead:

* **Runs, then groups.** Consecutive layers with equal LayerSpecs (up to their
  names: the same cost class) form runs; each run is cut into groups of at
  most ``g`` layers, as even as the run allows, with ``g`` the smallest size
  that leaves at most ``SEARCH_GROUPS`` groups (or one a run, where there are
  more runs). Runs are never merged with
  each other, so an embedding or a head stays a layer of its own; tied layers
  are never grouped.
* **A group is one layer** whose additive quantities (parameters, FLOPs,
  activation and input bytes, TP traffic, expert parameters...) are its
  members' sums and whose shape (output, TP limit, attention, experts) is theirs.
* **The coarsening** — stated in each plan's notes: pipeline cuts fall only
  between groups (so a pipeline has at most as many stages as groups), and a
  group runs one strategy (ZeRO, recomputation, TP degree) for all its
  members. Per-layer maxima the cost model takes over a stage (the backward working set: under full recomputation a group rebuilds
  all its members' activations at once; the largest tensor) are charged for
  the group as a whole, which can only over-state memory; a group's TP
  collectives are charged as one layer's count of larger messages, and a
  change of strategy inside a stage moves the group's inputs (all members').
* **Exact costs.** The plans found are expanded back to the real layers and
  ranked again with the real model's CostModel: every number a plan carries
  is the real model's.

Models of at most ``MAX_SEARCH_LAYERS`` layers are searched layer by layer,
exactly as before. Two workloads are not grouped: they are searched layer by
layer up to ``MAX_UNGROUPED_LAYERS`` (as before layer groups) and refused above:
one with measured layer times (a profile: its times are per real layer) and
one planned for hetplan's runtime (target "hetplan": the kernel costs the
runtime's modules per layer from the model's shape, ``model/runtime_memory.py``,
which a group's summed fields do not reach).

Cost of the grouping: O(L) to build the groups and expand each plan; the
search then costs what it costs on ``SEARCH_GROUPS`` layers.
"""

from __future__ import annotations

import math
from dataclasses import fields, replace
from typing import Callable, Sequence

from hetplan.cost.model import CostModel
from hetplan.errors import HetplanError, OutOfMemoryError
from hetplan.model.spec import LayerSpec, ModelSpec
from hetplan.plan.spec import Plan, RankedPlan
from hetplan.plan.workload import Workload
from hetplan.search.base import Planner, cost_model_for, rank_plans

# Layers the searching planners search one by one: Llama 3 405B (126 blocks +
# embedding + head = 128) and GPT-3 175B (98) stay ungrouped, as every model
# hetplan planned before layer groups.
MAX_SEARCH_LAYERS = 128
# Groups a longer model is searched in (more where its distinct runs need it, up
# to MAX_SEARCH_LAYERS). Measured with benchmarks/bench_layer_scale.py (GPT
# decoder of 10,000 layers, hidden 1024, 64 H100, batch 512): auto's grouped
# search, the slowest, takes 12.5 CPU s on 32 groups, 18.5 on 48 and 24.4 on 64
# (its exact solves grow as stages x groups²), and auto adds uniform's and
# Megatron's plans of every layer (~10 s) within the 30 s target.
SEARCH_GROUPS = 32
# Layers a workload that cannot be grouped (a profile, hetplan's runtime target) is still searched one
# by one: measured before layer groups (issue 32, gpt_decoder hidden 1024, 64xH100, gbs 512), 300 layers
# took auto 4.8, amp 2.7, metis 1.3 CPU s (smp 21 s); 1,000 took auto over 100 s and metis 9.3 GB.
MAX_UNGROUPED_LAYERS = 320

# LayerSpec fields that add up over a group's members (everything a layer costs
# per sample or holds); the other fields describe the layer's shape and are equal
# within a run.
ADDITIVE_FIELDS = (
    "params", "params_tp_replicated", "fwd_flops", "fwd_mem_bytes", "attention_flops", "gemm_count",
    "act_bytes", "act_tp_replicated_bytes", "act_attention_core_bytes", "act_linear_input_bytes",
    "act_linear_input_replicated_bytes", "tp_comm_bytes", "kv_bytes", "expert_params", "expert_flops",
    "dispatch_bytes",
    # each member keeps its input under full recomputation (the checkpoint): the group keeps them all
    "input_bytes",
)


def _cost_class(layer: LayerSpec) -> tuple[object, ...]:
    """Everything about a layer but its name (and the key derived from it)."""
    return tuple(getattr(layer, f.name) for f in fields(LayerSpec) if f.name != "name")


def layer_runs(model: ModelSpec) -> list[range]:
    """Maximal runs of consecutive layers of one cost class (tied layers alone)."""
    runs: list[range] = []
    start = 0
    layers = model.layers
    for index in range(1, len(layers) + 1):
        if index == len(layers) or layers[index].tied_group or layers[start].tied_group \
                or _cost_class(layers[index]) != _cost_class(layers[start]):
            runs.append(range(start, index))
            start = index
    return runs


def _cut(run: range, size: int) -> list[range]:
    """``run`` in ceil(len / size) groups whose lengths differ by at most one (longer first)."""
    count = -(-len(run) // size)
    base, extra = divmod(len(run), count)
    out, start = [], run.start
    for g in range(count):
        stop = start + base + (1 if g < extra else 0)
        out.append(range(start, stop))
        start = stop
    return out


def layer_groups(model: ModelSpec, limit: int = MAX_SEARCH_LAYERS,
                 target: int = SEARCH_GROUPS) -> list[range] | None:
    """The groups the search sees, or None when the model has at most ``limit``
    layers (searched one by one): ``target`` groups, or one per run where there
    are more runs. Refuses a model whose distinct runs alone exceed ``limit``:
    nothing identical is left to group."""
    if model.num_layers <= limit:
        return None
    runs = layer_runs(model)
    if len(runs) > limit:
        raise HetplanError(f"model {model.name!r} has {model.num_layers} layers in {len(runs)} runs of differing "
                           f"layers; the searching planners handle at most {limit} such runs: use --planner "
                           "megatron or uniform (even splits), or a model with fewer distinct layers")
    most = max(target, len(runs))
    size = max(1, model.num_layers // most)
    while sum(-(-len(r) // size) for r in runs) > most:
        size += 1
    return [group for run in runs for group in _cut(run, size)]


def _merged(layers: Sequence[LayerSpec]) -> LayerSpec:
    """One layer standing for ``layers`` (one cost class): additive fields summed."""
    first = layers[0]
    if len(layers) == 1:
        return first
    sums = {name: sum(getattr(layer, name) for layer in layers) for name in ADDITIVE_FIELDS}
    return replace(first, name=f"{first.name}..{layers[-1].name}", output_bytes=layers[-1].output_bytes,
                   profile_key="", **sums)


def grouped_model(model: ModelSpec, groups: Sequence[range]) -> ModelSpec:
    """The model the search sees: one layer per group, the same name."""
    return model.with_layers([_merged(model.layers[g.start:g.stop]) for g in groups])


def expand_plan(plan: Plan, groups: Sequence[range], note: str) -> Plan:
    """A plan of the grouped model as a plan of the real one: each group's
    layers, each running its group's strategy."""
    stages = []
    for stage in plan.stages:
        layers: list[int] = []
        strategies = []
        for unit, strategy in zip(stage.layers, stage.strategies):
            layers.extend(groups[unit])
            strategies.extend([strategy] * len(groups[unit]))
        stages.append(replace(stage, layers=tuple(layers), strategies=tuple(strategies)))
    return replace(plan, stages=tuple(stages), notes=plan.notes + (note,))


class GroupedPlanner:
    """A searching planner that sees a model of more than ``MAX_SEARCH_LAYERS``
    layers in layer groups (module docstring); smaller models pass through."""

    def __init__(self, inner: Planner, limit: int = MAX_SEARCH_LAYERS,
                 companions: tuple[Callable[[], Planner], ...] = ()) -> None:
        """``companions``: planners of every layer whose plans the inner
        planner's space contains (auto's uniform and Megatron), run on the real
        model beside the grouped search: the grouped search over-states memory
        and cuts only between groups, so their plans may be better."""
        self.inner = inner
        self.name = inner.name
        self.limit = limit
        self.companions = companions
        self.searches_batch_size = getattr(inner, "searches_batch_size", False)
        self.prunes_by_beat = getattr(inner, "prunes_by_beat", False)

    def plan(self, workload: Workload, top_k: int = 5, cost: CostModel | None = None,
             beat_s: float = math.inf) -> list[RankedPlan]:
        """The inner planner's plans; ``beat_s`` (where it ``prunes_by_beat``)
        reaches it only on the real model: a grouped model's times are not
        the real plans' times, so a search in groups is never pruned by it."""
        def search(w: Workload, k: int, c: CostModel | None, beat: float) -> list[RankedPlan]:
            if beat < math.inf and self.prunes_by_beat:
                return self.inner.plan(w, k, c, beat_s=beat)  # type: ignore[call-arg]  # prunes_by_beat: it takes one
            return self.inner.plan(w, k, c)
        return self._run(workload, top_k, cost, search, beat_s)

    def plan_auto_batch(self, workload: Workload, top_k: int = 5) -> list[RankedPlan]:
        """The inner planner's batch-size search (Galvatron's), on the grouped model."""
        batch_search = getattr(self.inner, "plan_auto_batch")  # only on planners that search the batch size
        return self._run(workload, top_k, None, lambda w, k, c, _: batch_search(w, k))

    def _run(self, workload: Workload, top_k: int, cost: CostModel | None,
             search: Callable[[Workload, int, CostModel | None, float], list[RankedPlan]],
             beat_s: float = math.inf) -> list[RankedPlan]:
        groups = layer_groups(workload.model, self.limit)
        if groups is None:
            return search(workload, top_k, cost, beat_s)
        if workload.profile is not None or workload.target == "hetplan":  # the kernel's ``runtime`` test
            if workload.model.num_layers <= MAX_UNGROUPED_LAYERS:  # as before layer groups: layer by layer
                return search(workload, top_k, cost, beat_s)
            what = "with measured layer times" if workload.profile is not None else "for hetplan's runtime"
            change = "plan without --profile" if workload.profile is not None else "plan for a tool (--target)"
            raise HetplanError(f"planner {self.name!r} searches at most {MAX_UNGROUPED_LAYERS} layers {what}; model "
                               f"{workload.model.name!r} has {workload.model.num_layers}: {change}, or use "
                               "--planner megatron or uniform")
        largest = max(len(g) for g in groups)
        note = (f"layers searched in {len(groups)} groups of up to {largest} identical layers "
                f"({workload.model.num_layers} layers > {self.limit}): pipeline cuts fall between groups, "
                "a group runs one strategy")
        real = cost_model_for(workload, cost)
        try:
            found = search(replace(workload, model=grouped_model(workload.model, groups)), top_k, None, math.inf)
        except OutOfMemoryError as exc:
            if not self.companions:
                raise OutOfMemoryError(f"{exc} (searched in groups of up to {largest} layers)") from exc
            found = []
        plans = [expand_plan(r.plan, groups, note) for r in found]
        if self.companions:
            return rank_plans(real, plans + self._companion_plans(workload, top_k, real, not plans), top_k)
        batches = {p.global_batch_size for p in plans}
        if batches != {workload.global_batch_size}:  # a batch-size search: its order, each at its own batch
            return [RankedPlan(p, CostModel(replace(workload, global_batch_size=p.global_batch_size)).estimate(p))
                    for p in plans]
        return rank_plans(real, plans, top_k)

    def _companion_plans(self, workload: Workload, top_k: int, real: CostModel, needed: bool) -> list[Plan]:
        """The companions' best plans of every layer, noted (``needed`` and none: their last error)."""
        note = f"a plan of every layer by {self.name}'s companion planners (its search ran in layer groups)"
        plans: list[Plan] = []
        error: HetplanError | None = None
        for factory in self.companions:
            try:
                plans += [replace(r.plan, notes=r.plan.notes + (note,)) for r in factory().plan(workload, top_k, real)]
            except HetplanError as exc:
                error = exc
        if needed and not plans and error is not None:
            raise error
        return plans
