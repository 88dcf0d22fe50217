"""Plan validation: reject an inconsistent Plan with a message naming the problem.

Checks are about consistency with the model and cluster (every layer exactly
once, in order; every device real and used once; degrees that multiply out;
batch arithmetic; TP degrees the layers support). Memory is not checked here:
a plan that does not fit is valid but gets ``fits = False`` from the cost model.
"""

from __future__ import annotations

from hetplan.cluster.spec import ClusterSpec
from hetplan.errors import HetplanError
from hetplan.model.spec import ModelSpec
from hetplan.plan.spec import RECOMPUTE, SCHEDULES, ZERO_STAGES, Plan, Stage


class InvalidPlanError(HetplanError):
    """The plan contradicts itself, the model or the cluster."""


def validate_plan(plan: Plan, model: ModelSpec, cluster: ClusterSpec, check_names: bool = False) -> None:
    """Raise InvalidPlanError naming the first problem found."""
    if check_names and plan.model != model.name:
        raise InvalidPlanError(f"plan was made for model {plan.model!r}, not {model.name!r}")
    if check_names and plan.cluster != cluster.name:
        raise InvalidPlanError(f"plan was made for cluster {plan.cluster!r}, not {cluster.name!r}")
    _check_batches_and_schedule(plan)
    expected = 0
    used: set[int] = set()
    for j, stage in enumerate(plan.stages):
        where = f"stage {j}"
        expected = _check_layers(where, stage, model, expected)
        _check_devices(where, stage, cluster, used)
        _check_split(where, stage, plan.micro_batch_size)
        _check_expert_split(where, stage, model)
        _check_strategies(where, stage, model, plan.micro_batch_size)
    if expected != model.num_layers:
        raise InvalidPlanError(
            f"stages cover layers 0-{expected - 1}, but the model has {model.num_layers} layers"
        )
    _check_virtual_stages(plan)


def _check_virtual_stages(plan: Plan) -> None:
    """Each of a stage's ``v`` model chunks needs a layer: with fewer, the cost
    model would divide the pipeline bubble by chunks that cannot exist."""
    if plan.virtual_stages == 1:
        return
    if plan.schedule != "interleaved-1f1b":
        raise InvalidPlanError(f"virtual_stages = {plan.virtual_stages} needs the interleaved-1f1b schedule, "
                               f"not {plan.schedule}")
    fewest = min(s.num_layers for s in plan.stages)
    if fewest < plan.virtual_stages:
        raise InvalidPlanError(f"virtual_stages = {plan.virtual_stages}, but a stage has only {fewest} layer(s) "
                               "to cut into that many chunks; use at most that many virtual stages")


def _check_batches_and_schedule(plan: Plan) -> None:
    """The schedule exists and the batch arithmetic adds up."""
    if not plan.stages:
        raise InvalidPlanError("plan has no pipeline stages")
    if plan.schedule not in SCHEDULES:
        raise InvalidPlanError(f"unknown schedule {plan.schedule!r}; use one of {', '.join(SCHEDULES)}")
    if plan.micro_batch_size <= 0 or plan.num_micro_batches <= 0:
        raise InvalidPlanError("micro-batch size and number of micro-batches must be positive")
    if plan.micro_batch_size * plan.num_micro_batches != plan.global_batch_size:
        raise InvalidPlanError(
            f"micro-batch size {plan.micro_batch_size} x {plan.num_micro_batches} micro-batches = "
            f"{plan.micro_batch_size * plan.num_micro_batches}, not the global batch {plan.global_batch_size}"
        )
    if plan.virtual_stages < 1:
        raise InvalidPlanError("virtual_stages must be >= 1")
    if plan.schedule == "interleaved-1f1b" and plan.virtual_stages > 1 and plan.num_micro_batches % plan.pp:
        raise InvalidPlanError(
            f"interleaved 1F1B needs the number of micro-batches ({plan.num_micro_batches}) "
            f"to be a multiple of the number of stages ({plan.pp})"
        )


def _check_layers(where: str, stage: Stage, model: ModelSpec, expected: int) -> int:
    """The stage continues the layers in order; returns the next expected layer."""
    if not stage.layers:
        raise InvalidPlanError(f"{where} has no layers")
    for index in stage.layers:
        if index >= model.num_layers or index < 0:
            raise InvalidPlanError(f"{where} names layer {index}, but the model has {model.num_layers} "
                                   f"(0-{model.num_layers - 1})")
        if index != expected:
            raise InvalidPlanError(
                f"{where} starts or continues at layer {index}, expected layer {expected}: "
                "stages must cover the layers in order, each exactly once"
            )
        expected += 1
    if len(stage.strategies) != len(stage.layers):
        raise InvalidPlanError(f"{where}: {len(stage.strategies)} layer strategies for {len(stage.layers)} layers")
    return expected


def _check_devices(where: str, stage: Stage, cluster: ClusterSpec, used: set[int]) -> None:
    """dp x cp x tp real GPUs, none used twice; ep borrowed from dp x cp."""
    if stage.dp <= 0 or stage.tp <= 0 or stage.cp <= 0 or stage.ep <= 0:
        raise InvalidPlanError(f"{where}: dp, cp, tp and ep must be positive")
    if stage.replica_tp is not None:
        expected = stage.cp * sum(stage.replica_tp)
        if len(stage.devices) != expected:
            raise InvalidPlanError(f"{where} has {len(stage.devices)} devices but cp x sum(replica_tp) = {expected}")
    elif len(stage.devices) != stage.dp * stage.cp * stage.tp:
        raise InvalidPlanError(
            f"{where} has {len(stage.devices)} devices but dp x cp x tp = {stage.dp} x {stage.cp} x {stage.tp} "
            f"= {stage.dp * stage.cp * stage.tp}"
        )
    if (stage.dp * stage.cp) % stage.ep:
        raise InvalidPlanError(f"{where}: ep={stage.ep} must divide dp x cp = {stage.dp * stage.cp} "
                               "(expert parallelism uses the data- and context-parallel ranks)")
    for d in stage.devices:
        if d < 0 or d >= cluster.num_devices:
            raise InvalidPlanError(f"{where} uses GPU {d}, but cluster {cluster.name!r} has {cluster.num_devices}")
        if d in used:
            raise InvalidPlanError(f"{where} uses GPU {d}, which another stage or replica already uses")
        used.add(d)


def _check_split(where: str, stage: Stage, micro_batch_size: int) -> None:
    """One positive share per replica, summing to the micro-batch."""
    if len(stage.dp_split) != stage.dp:
        raise InvalidPlanError(f"{where}: dp_split has {len(stage.dp_split)} entries for dp={stage.dp}")
    if any(b <= 0 for b in stage.dp_split):
        raise InvalidPlanError(f"{where}: every dp replica needs at least one sample per micro-batch")
    if sum(stage.dp_split) != micro_batch_size:
        raise InvalidPlanError(
            f"{where}: dp_split {list(stage.dp_split)} sums to {sum(stage.dp_split)}, "
            f"not the micro-batch size {micro_batch_size}"
        )


def _check_expert_split(where: str, stage: Stage, model: ModelSpec) -> None:
    """An uneven ``ep_split``: one count of experts per EP rank, each at least
    one, summing to the experts of every MoE layer of the stage."""
    if stage.ep_split is None:
        return
    experts = {model.layers[i].num_experts for i in stage.layers if 0 <= i < model.num_layers
               and model.layers[i].is_moe}
    if stage.ep == 1 or not experts:
        raise InvalidPlanError(f"{where}: ep_split needs ep > 1 and MoE layers on the stage; remove ep_split")
    if len(stage.ep_split) != stage.ep:
        raise InvalidPlanError(f"{where}: ep_split has {len(stage.ep_split)} entries for ep={stage.ep}")
    if any(n < 1 for n in stage.ep_split):
        raise InvalidPlanError(f"{where}: every EP rank needs at least one expert in ep_split")
    if len(experts) > 1 or sum(stage.ep_split) != min(experts):
        raise InvalidPlanError(f"{where}: ep_split {list(stage.ep_split)} sums to {sum(stage.ep_split)}, not the "
                               f"{min(experts)} experts of every MoE layer of the stage")


def _check_strategies(where: str, stage: Stage, model: ModelSpec, micro_batch_size: int) -> None:
    """Every layer's ZeRO stage, recomputation and TP degree are possible."""
    for index, strategy in zip(stage.layers, stage.strategies):
        if strategy.zero not in ZERO_STAGES:
            raise InvalidPlanError(f"{where}: layer {index} has ZeRO stage {strategy.zero}; use 0-3")
        if strategy.recompute not in RECOMPUTE:
            raise InvalidPlanError(
                f"{where}: layer {index} recompute {strategy.recompute!r}; use one of {', '.join(RECOMPUTE)}"
            )
        if strategy.tp:
            _check_layer_tp(where, stage, index, strategy.tp, micro_batch_size)
        layer = model.layers[index]
        layer_tp = strategy.tp or stage.tp
        if not layer.supports_tp(layer_tp):
            if layer_tp > layer.tp_max:
                raise InvalidPlanError(
                    f"{where}: tp={layer_tp} exceeds what layer {layer.name!r} supports ({layer.tp_max})"
                )
            raise InvalidPlanError(
                f"{where}: tp={layer_tp} does not divide the {layer.tp_max} attention heads of {layer.name!r}"
            )


def _check_layer_tp(where: str, stage: Stage, index: int, tp: int, micro_batch_size: int) -> None:
    """A layer's own TP degree (Galvatron's per-layer strategies) fits the stage."""
    n = len(stage.devices)
    if tp < 0 or n % tp:
        raise InvalidPlanError(f"{where}: layer {index} has tp={tp}, which does not divide the stage's {n} GPUs")
    if tp != stage.tp and len(set(stage.dp_split)) > 1:
        raise InvalidPlanError(
            f"{where}: layer {index} changes tp inside a stage with an uneven dp_split; "
            "use an even split or one tp per stage"
        )
    if micro_batch_size % (n // tp):
        raise InvalidPlanError(
            f"{where}: layer {index} runs dp={n // tp}, which does not divide the micro-batch {micro_batch_size}"
        )
