"""Plan and Estimate: what to run, and what the cost model predicts for it.

A :class:`Plan` is everything the runtime needs: the pipeline stages in order,
each with its contiguous layers, its device group (physical GPU ids of the
cluster), its data- and tensor-parallel degrees, how one micro-batch is split
across its data-parallel replicas, and per layer the sharding (ZeRO stage) and
recomputation choice. Different stages may use different (dp, tp) — Metis's
plans do — and a stage's dp replicas may get unequal shares of a micro-batch
when their GPUs differ.

Device-group layout inside a stage: ``devices`` has ``dp * cp * tp`` ids,
TP innermost, then CP, then DP (torchtitan's and Megatron's mesh order):
replica ``r`` owns ``devices[r*cp*tp:(r+1)*cp*tp]``, and inside it context-
parallel rank ``c`` owns the TP group ``devices[(r*cp + c)*tp:(r*cp + c + 1)*tp]``.
Expert parallelism adds no devices: a MoE layer's experts are split over ``ep``
of the ``dp * cp`` devices that share a TP rank (torchtitan and Megatron-Core
borrow EP from the data/context-parallel ranks), and ``ep`` divides ``dp * cp``.

An :class:`Estimate` is the cost model's prediction for one Plan.
"""

from __future__ import annotations

import math
from functools import lru_cache
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Mapping, Sequence

from hetplan.io import fields
from hetplan.errors import HetplanError
from hetplan.limits import MAX_GLOBAL_BATCH, MAX_GPUS

SCHEDULES = ("1f1b", "gpipe", "interleaved-1f1b")
RECOMPUTE = ("none", "selective", "full")
ZERO_STAGES = (0, 1, 2, 3)


@dataclass(frozen=True)
class LayerStrategy:
    """How one layer runs inside its stage.

    Attributes:
        zero: 0 = plain data parallel (replicated states), 1 = optimizer states
            sharded across dp, 2 = + gradients, 3 = + parameters (FSDP / SDP).
        recompute: "none", "selective" (attention core only, Korthikanti §5) or
            "full" (activation checkpointing: keep only the layer input).
        tp: this layer's own TP degree on the stage's devices (0 = the stage's
            tp). Galvatron-BMW picks a (dp, tp) per layer; the layer's dp is
            then len(devices) / tp, and its TP groups are runs of ``tp``
            consecutive devices of the stage.
        offload: keep the layer's saved activations in host memory between its
            forward and backward (SageMaker model parallelism, App. H.3). With
            ``recompute="full"`` only the checkpointed layer input is moved, as
            in SageMaker; with "none"/"selective" whatever the layer saves.
    """

    zero: int = 0
    recompute: str = "none"
    tp: int = 0
    offload: bool = False


@dataclass(frozen=True)
class Stage:
    """One pipeline stage.

    Attributes:
        layers: indices of the model's layers run by this stage (contiguous,
            ascending).
        devices: physical GPU ids, ``dp * cp * tp`` of them, TP innermost.
        dp, tp: data- and tensor-parallel degree inside the stage.
        cp: context-parallel degree: each sample's sequence is split over ``cp``
            ranks (attention exchanges keys/values; Llama 3 §3.3.2).
        ep: expert-parallel degree of the stage's MoE layers (1 for dense
            layers): experts split over ``ep`` ranks, tokens routed by
            all-to-all; divides ``dp * cp``. The experts keep the stage's TP
            (expert tensor parallelism = tp, Megatron-Core's default).
        ep_split: routed experts held by each EP rank, in EP-rank order (rank
            ``i % ep`` of each group of ``ep`` consecutive dp·cp ranks); sums
            to the MoE layers' experts. None: ``experts / ep`` each. Uneven on
            mixed GPUs, like ``dp_split`` (JSON key omitted when None).
        replica_tp: the TP degree of each dp replica, in replica order, where
            replicas differ (Sailor's stages of mixed GPU types); None: every
            replica uses ``tp``. When set, ``tp == max(replica_tp)``, each
            degree divides ``tp``, and ``devices`` holds ``sum(cp * t)`` ids,
            replica after replica, TP innermost. Chunk ``c`` of the ``tp``
            equal chunks of a TP-sharded dimension is held, in replica ``r``,
            by its TP rank ``c // (tp // replica_tp[r])`` (JSON key omitted
            when None).
        dp_split: samples of one micro-batch given to each dp replica; sums to
            the plan's ``micro_batch_size``. Equal on equal GPUs.
        strategies: one LayerStrategy per layer in ``layers`` (same order).
        sequence_parallel: shard the TP-replicated activations along the
            sequence (Megatron-SP), which also makes TP comm reduce-scatter +
            all-gather.
        replica_tp: the TP degree of each dp replica, in replica order (None:
            every replica uses ``tp``). Replicas on different GPU types may
            then run their own degree (Sailor's mixed replicas): ``tp`` is the
            largest, each degree divides it, and ``devices`` holds
            ``sum(cp * t for t in replica_tp)`` ids, replica after replica, TP
            innermost. The layers' weights are cut into ``tp`` shard chunks; a
            replica of degree ``t`` holds ``tp // t`` consecutive chunks per
            TP rank (``shard_holders``). JSON key omitted when None.
    """

    layers: tuple[int, ...]
    devices: tuple[int, ...]
    dp: int
    tp: int
    dp_split: tuple[int, ...]
    strategies: tuple[LayerStrategy, ...]
    sequence_parallel: bool = False
    cp: int = 1
    ep: int = 1
    ep_split: tuple[int, ...] | None = None
    replica_tp: tuple[int, ...] | None = None

    def replica_degree(self, replica: int) -> int:
        """The TP degree of data-parallel replica ``replica``."""
        return self.tp if self.replica_tp is None else self.replica_tp[replica]

    def replica_devices(self, replica: int) -> tuple[int, ...]:
        """The ``cp * tp`` devices of data-parallel replica ``replica`` (its
        own ``cp * replica_tp[replica]`` with mixed degrees)."""
        if self.replica_tp is None:
            size = self.cp * self.tp
            return self.devices[replica * size:(replica + 1) * size]
        start = self.cp * sum(self.replica_tp[:replica])
        return self.devices[start:start + self.cp * self.replica_tp[replica]]

    def shard_holders(self, chunk: int) -> tuple[int, ...]:
        """The devices holding shard chunk ``chunk`` of ``tp`` of a dense layer,
        one per replica (and CP rank): in replica ``r`` its TP rank
        ``chunk // (tp // replica_tp[r])``. These are the data-parallel groups
        a gradient chunk is reduced over."""
        holders: list[int] = []
        for r in range(self.dp):
            degree = self.replica_degree(r)
            rank = chunk // (self.tp // degree)
            own = self.replica_devices(r)
            holders.extend(own[c * degree + rank] for c in range(self.cp))
        return tuple(holders)

    def layer_degrees(self, position: int) -> tuple[int, int]:
        """(dp, tp) of the ``position``-th layer of this stage."""
        tp = self.strategies[position].tp or self.tp
        if self.replica_tp is not None and tp == self.tp:  # mixed degrees: one replica each
            return self.dp, tp
        return len(self.devices) // (tp * self.cp), tp

    @property
    def has_layer_degrees(self) -> bool:
        """Some layer runs with a (dp, tp) other than the stage's."""
        return any(st.tp and st.tp != self.tp for st in self.strategies)

    def tp_groups(self) -> list[tuple[int, ...]]:
        """Runs of ``tp`` consecutive devices, one per (replica, cp rank)
        (of the replica's own degree with ``replica_tp``)."""
        if self.replica_tp is not None:
            return [own[c * t:(c + 1) * t] for r, t in enumerate(self.replica_tp)
                    for own in (self.replica_devices(r),) for c in range(self.cp)]
        return [self.devices[g * self.tp:(g + 1) * self.tp] for g in range(len(self.devices) // self.tp)]

    def dp_groups(self) -> list[tuple[int, ...]]:
        """For each TP rank, the devices holding the same shard of a dense layer
        in every replica and CP rank (gradients of dense layers sync over
        ``dp * cp`` devices; with cp = 1 these are the dp replicas). With
        ``replica_tp``: one group per shard chunk (``shard_holders``)."""
        if self.replica_tp is not None:
            return [self.shard_holders(c) for c in range(self.tp)]
        return [tuple(self.devices[t::self.tp]) for t in range(self.tp)]

    @property
    def num_layers(self) -> int:
        return len(self.layers)


@dataclass(frozen=True)
class Plan:
    """A complete parallel training plan.

    Attributes:
        model: model name the plan was made for (checked on load).
        cluster: cluster name the plan was made for.
        global_batch_size: samples per optimizer step.
        micro_batch_size: samples per pipeline micro-batch, summed over the dp
            replicas of a stage (``micro_batch_per_replica`` is what other
            tools call the micro-batch size; the JSON form uses theirs).
        num_micro_batches: micro-batches per step (gradient accumulation steps).
        schedule: "1f1b", "gpipe" or "interleaved-1f1b".
        stages: pipeline stages in order.
        planner: who made it.
        virtual_stages: model chunks per device for interleaved 1F1B (1 otherwise).
            With ``v`` chunks, stage ``j`` still lists a contiguous run of layers,
            but only its *count* is binding: the runtime cuts the model into
            ``pp·v`` chunks in order and deals them round-robin (device group
            ``j`` runs chunks ``j, j+pp, …``), taking stage ``j``'s count from
            ``layers``. The cost model costs each stage from its listed layers
            and divides the fill/drain by ``v`` (cost/pipeline.py), which agrees
            when layers of one kind repeat.
        notes: free-form remarks from the planner (why, what was not honoured).
    """

    model: str
    cluster: str
    global_batch_size: int
    micro_batch_size: int
    num_micro_batches: int
    schedule: str
    stages: tuple[Stage, ...]
    planner: str = ""
    virtual_stages: int = 1
    notes: tuple[str, ...] = ()

    @property
    def pp(self) -> int:
        return len(self.stages)

    @property
    def micro_batch_per_replica(self) -> int | None:
        """Samples each data-parallel replica takes per micro-batch, as Megatron,
        DeepSpeed and torchtitan mean "micro-batch size"; None where replicas
        take different shares (uneven splits, stages of different dp).
        ``micro_batch_size`` is the micro-batch summed over a stage's replicas."""
        shares = {share for s in self.stages for share in s.dp_split}
        return shares.pop() if len(shares) == 1 else None

    @property
    def num_devices(self) -> int:
        return sum(len(s.devices) for s in self.stages)

    def describe(self) -> str:
        """Compact one-line summary.

        Uniform stages: 'dp4 tp1 pp4 layers 7/7/6/6 z1 mbs 1 x 8 (per replica) 1f1b';
        stages that differ: 'pp2 [dp2 tp2 13L | dp4 tp1 13L split 3:1:...] mb 8 x 4 (split per stage) 1f1b';
        replicas of their own TP degree (``replica_tp``): 'dp5 tp1×4/2', run-length in replica order.
        """

        def extras(s: Stage) -> str:
            zeros = {st.zero for st in s.strategies}
            offloaded = sum(st.offload for st in s.strategies)
            text = ""
            if zeros != {0}:
                text += " z" + "/".join(str(z) for z in sorted(zeros))
            text += _recompute_label(s) + _layer_tp_label(s)
            if offloaded:
                text += " offload" + ("" if offloaded == s.num_layers else f":{offloaded}L")
            if s.sequence_parallel:
                text += " sp"
            return text

        def degrees(s: Stage) -> str:
            tp = "/".join(_runs(s.replica_tp)) if s.replica_tp is not None else str(s.tp)  # '1×4/2': run-length
            text = f"dp{s.dp}" + (f" cp{s.cp}" if s.cp > 1 else "") + f" tp{tp}"
            experts = " experts " + ":".join(map(str, s.ep_split)) if s.ep_split else ""
            return text + (f" ep{s.ep}{experts}" if s.ep > 1 else "")

        def uneven(s: Stage) -> str:
            return " split " + ":".join(map(str, s.dp_split)) if len(set(s.dp_split)) > 1 else ""

        per = self.micro_batch_per_replica
        size = f"mbs {per} x {self.num_micro_batches} (per replica)" if per is not None else \
            f"mb {self.micro_batch_size} x {self.num_micro_batches} (split per stage)"
        tail = f"{size} {self.schedule}"
        if self.virtual_stages > 1:
            tail += f" v{self.virtual_stages}"
        first = self.stages[0]
        same = all((degrees(s), extras(s), uneven(s)) == (degrees(first), extras(first), uneven(first))
                   for s in self.stages)
        if same:
            counts = "/".join(_runs([s.num_layers for s in self.stages]))
            layers = f" layers {counts}" if self.pp > 1 else ""
            return f"{degrees(first)} pp{self.pp}{layers}{extras(first)}{uneven(first)} {tail}"
        parts = [f"{degrees(s)} {s.num_layers}L{extras(s)}{uneven(s)}" for s in self.stages]
        grouped = [part + (f" ×{count}" if count > 1 else "") for part, count in _group_runs(parts)]
        return f"pp{self.pp} [{' | '.join(grouped)}] {tail}"

    # --- serialisation -----------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """JSON form. ``micro_batch_size`` is per data-parallel replica, as in
        every other tool (None where replicas' shares differ: see each stage's
        ``dp_split``); ``micro_batch_total`` is the micro-batch over a stage's
        replicas, this class's ``micro_batch_size``."""
        data = asdict(self)
        for stage in data["stages"]:
            for key in ("ep_split", "replica_tp"):  # None: plans without them read as before
                if stage[key] is None:
                    del stage[key]
        data["micro_batch_size"] = self.micro_batch_per_replica
        data["micro_batch_total"] = self.micro_batch_size
        return data

    @staticmethod
    def from_dict(data: Any) -> Plan:
        """Inverse of to_dict. Every field is read with its exact type and an
        unknown key is refused (hetplan.io.fields): a plan is never trained or
        costed other than as written."""
        plan = fields.mapping("plan", data, _PLAN_KEYS, _PLAN_REQUIRED)
        stages = fields.listing("plan.stages", plan["stages"], MAX_GPUS)
        notes = fields.listing("plan.notes", plan.get("notes", []))
        result = Plan(
            model=fields.text("plan.model", plan["model"]),
            cluster=fields.text("plan.cluster", plan["cluster"]),
            global_batch_size=fields.whole("plan.global_batch_size", plan["global_batch_size"],
                                           maximum=MAX_GLOBAL_BATCH),
            micro_batch_size=_micro_batch_total(plan),
            num_micro_batches=fields.whole("plan.num_micro_batches", plan["num_micro_batches"],
                                           maximum=MAX_GLOBAL_BATCH),
            schedule=fields.text("plan.schedule", plan["schedule"], SCHEDULES),
            stages=tuple(_stage_from_dict(f"plan.stages[{j}]", s) for j, s in enumerate(stages)),
            planner=fields.text("plan.planner", plan.get("planner", "")),
            virtual_stages=fields.whole("plan.virtual_stages", plan.get("virtual_stages", 1)),
            notes=tuple(fields.text(f"plan.notes[{k}]", n) for k, n in enumerate(notes)),
        )
        _check_per_replica(plan, result)
        return result

    def with_changes(self, **changes: Any) -> Plan:
        return replace(self, **changes)


_PLAN_KEYS = ("model", "cluster", "global_batch_size", "micro_batch_size", "micro_batch_total", "num_micro_batches",
              "schedule", "stages", "planner", "virtual_stages", "notes")
_PLAN_REQUIRED = ("model", "cluster", "global_batch_size", "num_micro_batches", "schedule", "stages")
_STAGE_KEYS = ("layers", "devices", "dp", "tp", "dp_split", "strategies", "sequence_parallel", "cp", "ep",
               "ep_split", "replica_tp")
_STRATEGY_KEYS = ("zero", "recompute", "tp", "offload")


def _micro_batch_total(data: Mapping[str, Any]) -> int:
    """Plans written before ``micro_batch_total`` existed (plan files of format
    1 and 2) stored the total under ``micro_batch_size`` (now per replica, and
    null where replicas' shares differ)."""
    key = "micro_batch_total" if "micro_batch_total" in data else "micro_batch_size"
    if key not in data:
        raise HetplanError("plan: missing 'micro_batch_total'")
    return fields.whole(f"plan.{key}", data[key], maximum=MAX_GLOBAL_BATCH)


def _check_per_replica(data: Mapping[str, Any], plan: Plan) -> None:
    """Since format 3 ``micro_batch_size`` is per replica and only written out:
    an edit of it (rather than of ``micro_batch_total`` and ``dp_split``) would
    be ignored, so it must agree."""
    if "micro_batch_total" not in data or "micro_batch_size" not in data:
        return
    given = data["micro_batch_size"]
    if given is not None:
        given = fields.whole("plan.micro_batch_size", given, maximum=MAX_GLOBAL_BATCH)
    if given != plan.micro_batch_per_replica:
        raise HetplanError(f"plan.micro_batch_size is {given} per replica (null: shares differ), but micro_batch_total "
                           f"{plan.micro_batch_size} over the stages' dp_split gives {plan.micro_batch_per_replica}; "
                           "change micro_batch_total and dp_split (or make the plan again with hetplan)")


def _whole_list(where: str, value: Any, minimum: int) -> tuple[int, ...]:
    items = fields.listing(where, value, MAX_GPUS)
    return tuple(fields.whole(f"{where}[{k}]", x, minimum, MAX_GLOBAL_BATCH) for k, x in enumerate(items))


def _stage_from_dict(where: str, data: Any) -> Stage:
    stage = fields.mapping(where, data, _STAGE_KEYS, _STAGE_KEYS[:6])
    strategies = fields.listing(f"{where}.strategies", stage["strategies"], MAX_GPUS)
    return Stage(
        layers=_whole_list(f"{where}.layers", stage["layers"], 0),
        devices=_whole_list(f"{where}.devices", stage["devices"], 0),
        dp=fields.whole(f"{where}.dp", stage["dp"], maximum=MAX_GPUS),
        tp=fields.whole(f"{where}.tp", stage["tp"], maximum=MAX_GPUS),
        dp_split=_whole_list(f"{where}.dp_split", stage["dp_split"], 0),
        strategies=tuple(_strategy_from_dict(f"{where}.strategies[{k}]", st) for k, st in enumerate(strategies)),
        sequence_parallel=fields.flag(f"{where}.sequence_parallel", stage.get("sequence_parallel", False)),
        cp=fields.whole(f"{where}.cp", stage.get("cp", 1), 1, MAX_GPUS),
        ep=fields.whole(f"{where}.ep", stage.get("ep", 1), 1, MAX_GPUS),
        ep_split=None if stage.get("ep_split") is None else _whole_list(f"{where}.ep_split", stage["ep_split"], 1),
        replica_tp=None if stage.get("replica_tp") is None
        else _whole_list(f"{where}.replica_tp", stage["replica_tp"], 1),
    )


def _strategy_from_dict(where: str, data: Any) -> LayerStrategy:
    st = fields.mapping(where, data, _STRATEGY_KEYS)
    zero = fields.whole(f"{where}.zero", st.get("zero", 0), 0)
    if zero not in ZERO_STAGES:
        raise HetplanError(f"{where}.zero must be one of {ZERO_STAGES}, got {zero}")
    return LayerStrategy(zero=zero, recompute=fields.text(f"{where}.recompute", st.get("recompute", "none"), RECOMPUTE),
                         tp=fields.whole(f"{where}.tp", st.get("tp", 0), 0, MAX_GPUS),
                         offload=fields.flag(f"{where}.offload", st.get("offload", False)))


def _group_runs(values: Sequence[Any]) -> list[tuple[Any, int]]:
    """Consecutive equal values as (value, count): [3, 2, 2, 4] -> [(3, 1), (2, 2), (4, 1)]."""
    runs: list[tuple[Any, int]] = []
    for value in values:
        if runs and runs[-1][0] == value:
            runs[-1] = (value, runs[-1][1] + 1)
        else:
            runs.append((value, 1))
    return runs


def _recompute_label(stage: Stage) -> str:
    """' rc:full' when every layer recomputes; ' rc:9/26' when 9 of 26 layers
    recompute in full, ' rc:selective:4/26' for a partial selective policy:
    the label says how much of the stage recomputes, not only whether any does."""
    total = len(stage.strategies)
    parts = []
    for policy in RECOMPUTE[1:]:
        count = sum(st.recompute == policy for st in stage.strategies)
        if count == total:
            parts.append(policy)
        elif count:
            parts.append(("" if policy == "full" else policy + ":") + f"{count}/{total}")
    return " rc:" + ",".join(parts) if parts else ""


def _layer_tp_label(stage: Stage) -> str:
    """' ltp 2×3/4' when layers run their own TP degree (Galvatron-BMW per-layer
    tp), in layer order, run-length; '' when every layer keeps the stage's tp."""
    degrees = [st.tp or stage.tp for st in stage.strategies]
    if set(degrees) == {stage.tp}:
        return ""
    return " ltp " + "/".join(_runs(degrees))


def _runs(values: Sequence[int]) -> list[str]:
    """Run-length form: [3, 2, 2, 2, 4] -> ['3', '2×3', '4']."""
    return [f"{v}×{n}" if n > 2 else "/".join([str(v)] * n) for v, n in _group_runs(values)]


def uniform_stage(
    layers: Sequence[int], devices: Sequence[int], dp: int, tp: int, micro_batch_size: int,
    zero: int = 0, recompute: str = "none", sequence_parallel: bool = False, offload: bool = False,
    cp: int = 1, ep: int = 1, ep_split: tuple[int, ...] | None = None,
) -> Stage:
    """A stage whose replicas split the micro-batch evenly and whose layers all
    use the same strategy (``devices``: dp·cp·tp of them)."""
    if micro_batch_size % dp:
        raise HetplanError(f"micro-batch {micro_batch_size} does not split evenly over dp={dp}")
    return Stage(
        layers=_layer_tuple(layers.start, layers.stop) if isinstance(layers, range) and layers.step == 1
        else tuple(layers), devices=tuple(devices), dp=dp, tp=tp,
        dp_split=(micro_batch_size // dp,) * dp,
        strategies=_uniform_strategies(zero, recompute, offload, len(layers)),
        sequence_parallel=sequence_parallel, cp=cp, ep=ep, ep_split=ep_split,
    )


# Layer ranges and strategy runs shared between candidate plans: a search ranks
# thousands of uniform plans whose stages run the same few ranges, and a
# 10,000-layer stage's tuples take ~0.4 MB (``benchmarks/bench_layer_scale.py``).
SHARED_STAGE_TUPLES = 1024


@lru_cache(maxsize=SHARED_STAGE_TUPLES)
def _layer_tuple(start: int, stop: int) -> tuple[int, ...]:
    """``tuple(range(start, stop))``, one object per range."""
    return tuple(range(start, stop))


@lru_cache(maxsize=SHARED_STAGE_TUPLES)
def _uniform_strategies(zero: int, recompute: str, offload: bool, count: int) -> tuple[LayerStrategy, ...]:
    """``count`` layers of one strategy, one object per (strategy, count)."""
    return (LayerStrategy(zero, recompute, offload=offload),) * count


@dataclass(frozen=True)
class StageEstimate:
    """Per-stage numbers behind an Estimate."""

    fwd_s: float
    bwd_s: float
    recompute_s: float
    tp_comm_s: float
    p2p_s: float
    dp_sync_s: float
    memory_bytes: tuple[int, ...]  # per device of the stage, in its device order
    memory_capacity_bytes: tuple[int, ...]


@dataclass(frozen=True)
class Estimate:
    """What the cost model predicts for one Plan.

    Times are seconds per training iteration (one optimizer step); the parts
    are what the critical path spends on each kind of work, so they add up to
    ``iteration_time_s``.
    """

    iteration_time_s: float
    compute_s: float
    bubble_s: float
    p2p_s: float
    dp_sync_s: float
    tp_comm_s: float
    recompute_s: float
    optimizer_s: float
    samples_per_s: float
    tokens_per_s: float
    mfu: float
    peak_memory_bytes: dict[int, int]
    memory_capacity_bytes: dict[int, int]
    fits: bool
    stages: tuple[StageEstimate, ...] = field(default=())
    lower_bound_s: float = 0.0  # no plan of the workload is faster (cost/bounds.py)
    # offloading plans: each offloading GPU's activations in host memory, and its
    # share of host memory where one limits it (``cost.memory.host_offload_capacity_bytes``)
    host_offload_bytes: dict[int, int] = field(default_factory=dict)
    host_capacity_bytes: dict[int, int] = field(default_factory=dict)
    # parts of ``compute_s`` (not added to the total again): the time the slowest stage's
    # passes wait for the host to dispatch their operators, and its loss's fp32 passes
    host_dispatch_s: float = 0.0
    loss_s: float = 0.0
    # offloaded activations' host transfers that compute does not hide (not part of ``recompute_s``)
    offload_s: float = 0.0

    TIME_PARTS = ("compute_s", "bubble_s", "p2p_s", "dp_sync_s", "tp_comm_s", "recompute_s", "offload_s",
                  "optimizer_s")

    def checked(self) -> Estimate:
        """This estimate with rounding noise clamped (a bubble of -2e-19 s is a
        difference of two equal sums): every time, rate, MFU and byte count
        finite and >= 0, the parts adding up to the total. Anything else is a
        bug in the cost model, and raised as one (never printed as a number)."""
        total = self.iteration_time_s
        noise = 1e-9 * total if math.isfinite(total) else 0.0
        numbers = {name: getattr(self, name) for name in (*self.TIME_PARTS, "iteration_time_s", "samples_per_s",
                                                           "tokens_per_s", "mfu", "lower_bound_s")}
        bad = {k: v for k, v in numbers.items() if not math.isfinite(v) or v < -noise}
        bad.update({f"memory of GPU {d}": m for d, m in self.peak_memory_bytes.items() if m < 0})
        bad.update({f"host memory of GPU {d}": m for d, m in self.host_offload_bytes.items() if m < 0})
        if bad or not total > 0:
            raise RuntimeError(f"cost model bug: the estimate has impossible numbers {bad or {'total': total}}")
        parts = sum(max(0.0, numbers[k]) for k in self.TIME_PARTS)
        if abs(parts - total) > 1e-6 * total:
            raise RuntimeError(f"cost model bug: the parts of the step add up to {parts!r} s, not {total!r} s")
        negative: dict[str, Any] = {k: 0.0 for k, v in numbers.items() if v < 0}
        return replace(self, **negative)

    @property
    def bound_gap(self) -> float | None:
        """How far above the workload's lower bound this plan is (0.25 = 25%);
        None for an estimate without a bound."""
        return self.iteration_time_s / self.lower_bound_s - 1.0 if self.lower_bound_s > 0 else None

    @property
    def max_memory_bytes(self) -> int:
        return max(self.peak_memory_bytes.values())

    @property
    def min_headroom_bytes(self) -> int:
        """Smallest free memory over all GPUs (negative: out of memory)."""
        return min(self.memory_capacity_bytes[d] - m for d, m in self.peak_memory_bytes.items())

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["peak_memory_bytes"] = {str(k): v for k, v in self.peak_memory_bytes.items()}
        data["memory_capacity_bytes"] = {str(k): v for k, v in self.memory_capacity_bytes.items()}
        for key in ("host_offload_bytes", "host_capacity_bytes"):  # only where the plan offloads
            data[key] = {str(k): v for k, v in getattr(self, key).items()}
            if not data[key]:
                del data[key]
        data["max_memory_bytes"] = self.max_memory_bytes
        data["min_headroom_bytes"] = self.min_headroom_bytes
        return data

    @staticmethod
    def from_dict(data: dict[str, Any]) -> Estimate:
        try:
            stages = tuple(
                StageEstimate(**{**s, "memory_bytes": tuple(s["memory_bytes"]),
                                 "memory_capacity_bytes": tuple(s["memory_capacity_bytes"])})
                for s in data.get("stages", ())
            )
            fields = {k: v for k, v in data.items() if k not in ("max_memory_bytes", "min_headroom_bytes")}
            fields["peak_memory_bytes"] = {int(k): int(v) for k, v in data["peak_memory_bytes"].items()}
            fields["memory_capacity_bytes"] = {int(k): int(v) for k, v in data["memory_capacity_bytes"].items()}
            for key in ("host_offload_bytes", "host_capacity_bytes"):
                fields[key] = {int(k): int(v) for k, v in data.get(key, {}).items()}
            fields["stages"] = stages
            return Estimate(**fields)
        except (KeyError, TypeError) as exc:
            raise HetplanError(f"malformed estimate: {exc}") from None


@dataclass(frozen=True)
class RankedPlan:
    """A plan with its shared-cost-model estimate (and a planner's own score)."""

    plan: Plan
    estimate: Estimate
    planner_cost_s: float | None = None  # the planner's own objective, if it has one

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {"plan": self.plan.to_dict(), "estimate": self.estimate.to_dict()}
        if self.planner_cost_s is not None:
            data["planner_cost_s"] = self.planner_cost_s
        return data
