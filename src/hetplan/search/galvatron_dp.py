"""Galvatron-BMW's per-stage dynamic program under a memory budget (§IV-A2,
eq. 2–4, Appendix A, Alg. 3), costed with hetplan's shared cost model.

For one pipeline stage (its layers, its device group, the micro-batch size,
the number of micro-batches and how many micro-batches 1F1B keeps in flight
there) every layer gets, for every candidate strategy S_j:

* ``c(l, S_j)``: the layer's contribution to the iteration time — forward,
  backward, recomputation (CKPT) and TP all-reduces for every micro-batch,
  the ZeRO-3 all-gathers / reduce-scatters of SDP overlapped with compute,
  and once per iteration the DP gradient all-reduce overlapped with the last
  backward and the optimizer step — all from :class:`hetplan.cost.CostModel`'s
  building blocks, with the overlap slowdown of §V applied per layer;
* ``O_f + O_ms``: forward memory — model states (per ZeRO stage and TP) plus
  the activations kept for backward times the micro-batches in flight;
* ``O_b``: the backward peak of a checkpointed layer (its recomputed
  activations), and the gathered parameters of an SDP layer.

The DP (eq. 4) runs over the layers with the forward memory as the knapsack
dimension, in bins of ``granularity`` bytes, and carries the last layer's
strategy so that the transformation cost ``R`` between adjacent layers with
different TP degrees (an all-gather of the layer input, as the shared cost
model charges it) can be added. Alg. 3 then walks the forward budgets
``E_fwd`` and checks the full peak ``E_all`` (eq. 2: forward memory + the
largest backward peak + framework overhead) against the device memory: below
``E − b_ub`` every plan fits, so only the distinct plans of the window above
(at most MAX_CANDIDATES at a time, largest budgets first) are backtracked, all
at once with numpy, and the cheapest whose exact ``E_all`` fits is kept — the
paper keeps the largest fitting ``E_fwd``, the same plan unless a larger
budget's plan fails the check.

The DP's objective is additive over layers; the shared cost model is not
quite: it applies the overlap slowdown to a stage's *sums* (all ZeRO-3
traffic against all compute of the stage). So every plan the DP proposes —
one per forward budget — is re-costed exactly as ``CostModel`` would cost it
(same sums, same overlap formula), and the cheapest exact one that fits is
kept. Galvatron's implementation also has a coarse mode that gives all layers
of a stage one strategy; those uniform plans are candidates too, so a stage is
never worse than its best single strategy.

The states of the DP are vectors over the memory bins, so each layer costs a
few numpy operations, and the DPs of several stages run in lockstep in the
same arrays. Transitions are grouped by TP degree, because R only depends on
the TP degrees of the two layers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from hetplan.cost import comm
from hetplan.cost.constants import (
    MEMORY_BANDWIDTH_EFFICIENCY,
    OPTIMIZER_STEP_BYTES_PER_PARAM,
    OVERLAP_SLOWDOWN,
    ZERO3_GATHERED_LAYERS,
)
from hetplan.cost.memory import framework_overhead_bytes, layer_activation_bytes, layer_params_per_device, \
    model_state_bytes
from hetplan.cost.model import CostModel
from hetplan.model.spec import LayerSpec
from hetplan.search.galvatron_space import GStrategy

try:  # follow the shared cost model's overlap formula exactly
    from hetplan.cost.model import overlapped_exposure as _core_overlap
except ImportError:  # pragma: no cover - the core renamed it
    def _core_overlap(comm_s: float, compute_s: float) -> float:
        if comm_s <= 0:
            return 0.0
        return max(comm_s, compute_s) * OVERLAP_SLOWDOWN - compute_s

INF = float("inf")
# Alg. 3's check of E_all walks at most this many distinct forward budgets at a
# time, from the largest down (the paper keeps the largest budget that fits).
MAX_CANDIDATES = 32


def overlap_exposure(comm_s: float, compute_s: float) -> float:
    """Extra time of ``comm_s`` overlapped with ``compute_s`` (Galvatron-BMW §V's
    1.3x slowdown), exactly as the shared cost model charges it."""
    return _core_overlap(comm_s, compute_s)


@dataclass(frozen=True)
class StageContext:
    """What a stage's costs depend on besides its layers."""

    devices: tuple[int, ...]
    micro_batch_size: int
    num_micro_batches: int
    in_flight: float  # micro-batches whose activations the stage holds at its peak (1F1B / GPipe)


# Per-layer time components (seconds), summed per stage as CostModel._stage_timing sums them:
COMPONENTS = (
    "f",  # forward compute, per micro-batch
    "bp",  # backward + recompute compute, per micro-batch
    "tpc",  # TP all-reduces (2 per pass, 3 with CKPT), per micro-batch
    "g",  # ZeRO-3 parameter all-gather, per micro-batch
    "sc",  # ZeRO-3 gradient reduce-scatter, per micro-batch
    "ar",  # DP gradient all-reduce, once per iteration
    "opt",  # optimizer step, once per iteration
)


@dataclass
class LayerTable:
    """Costs of one layer under every strategy in one stage context (arrays over strategies)."""

    valid: np.ndarray  # bool
    mb_time_s: np.ndarray  # DP objective per micro-batch: compute + TP comm + overlapped ZeRO-3 comm
    once_s: np.ndarray  # DP objective once per iteration: overlapped gradient sync + optimizer step
    states_bytes: np.ndarray  # model states
    act_bytes: np.ndarray  # activations of one micro-batch kept for backward
    bwd_bytes: np.ndarray  # recompute working set of a checkpointed layer (one micro-batch)
    gathered_bytes: np.ndarray  # ZeRO-3 gathered parameters of this layer
    parts: dict[str, np.ndarray]  # the COMPONENTS


@dataclass
class StageSolution:
    """The answer for one stage, costed as the shared cost model costs it."""

    choices: tuple[int, ...]  # strategy index per layer of the stage
    cost_s: float  # the stage alone: m * per-micro-batch time + exposed gradient sync + optimizer
    mb_time_s: float  # per micro-batch: compute, TP comm, transformations, exposed ZeRO-3 comm
    back_s: float  # backward + recompute compute of one micro-batch (what gradient sync overlaps)
    sync_comm_s: float  # DP gradient all-reduce before overlap
    optimizer_s: float
    memory_bytes: float  # exact E_all, as the shared cost model counts it
    capacity_bytes: float


class GalvatronCosts:
    """Per-layer, per-strategy cost and memory tables from the shared cost model."""

    def __init__(self, cost_model: CostModel, strategies: Sequence[GStrategy]) -> None:
        self.cm = cost_model
        self.workload = cost_model.workload
        self.model = cost_model.model
        self.cluster = cost_model.cluster
        self.strategies = tuple(strategies)
        self.tps = sorted({s.tp for s in self.strategies})
        self.group_of = np.array([self.tps.index(s.tp) for s in self.strategies], dtype=np.int64)
        self.group_starts = np.array([int(np.nonzero(self.group_of == g)[0][0]) for g in range(len(self.tps))],
                                     dtype=np.int64)
        self._stacked: dict[tuple, dict[str, np.ndarray]] = {}
        per_group = max(int((self.group_of == g).sum()) for g in range(len(self.tps)))
        self.slot_shape = (len(self.tps), per_group)
        slots = []
        for k, g in enumerate(self.group_of):
            slots.append(int(g) * per_group + int(k - self.group_starts[g]))
        self.slot_of = np.array(slots, dtype=np.int64)
        self.strategy_at_slot = {slot: k for k, slot in enumerate(slots)}
        self._tables: dict[tuple, LayerTable] = {}
        self._rates: dict[tuple, tuple[float, float, float]] = {}
        self._replicas: dict[tuple, list[tuple[int, ...]]] = {}
        self._sigs: dict[tuple[int, ...], tuple] = {}
        self._kinds: tuple[list[int], np.ndarray] | None = None
        self._inputs: tuple[list[int], np.ndarray] | None = None
        self._slowest: dict[tuple[int, ...], object] = {}

    # --- helpers ------------------------------------------------------------------
    def signature(self, devices: tuple[int, ...]) -> tuple:
        """Devices that cost the same get the same signature: GPU type, memory,
        and node layout (relative node numbers and the nodes' links). With a
        device-to-device bandwidth matrix the devices themselves."""
        sig = self._sigs.get(devices)
        if sig is None:
            cluster = self.cluster
            if cluster.bandwidth_matrix_gbps is not None:
                sig = ("ids",) + devices
            else:
                first = cluster.devices[devices[0]].node
                parts = []
                for d in devices:
                    dev = cluster.devices[d]
                    node = cluster.nodes[dev.node]
                    parts.append((dev.gpu.name, self.workload.device_capacity_bytes(d), dev.node - first,
                                  node.intra_bandwidth_gbps, cluster.node_inter_gbps(dev.node)))
                sig = tuple(parts)
            self._sigs[devices] = sig
        return sig

    def _comm_rates(self, devices: tuple[int, ...], tp: int) -> tuple[float, float, float]:
        """Seconds per byte of all-gather, reduce-scatter and all-reduce across the
        DP groups of a layer with ``tp`` on ``devices`` (the slowest group; the
        collectives are linear in bytes)."""
        key = (devices, tp)
        if key not in self._rates:
            dp = len(devices) // tp
            groups = [tuple(devices[r * tp + t] for r in range(dp)) for t in range(tp)]
            probe = 1e9
            rates = tuple(max(fn(self.cluster, g, probe, tp) for g in groups) / probe
                          for fn in (comm.allgather_time, comm.reduce_scatter_time, comm.allreduce_time))
            self._rates[key] = rates  # type: ignore[assignment]
        return self._rates[key]

    def _distinct_replicas(self, devices: tuple[int, ...], tp: int) -> list[tuple[int, ...]]:
        """TP groups of a layer with ``tp`` on ``devices`` that can differ in cost
        (same GPU types on the same nodes cost the same)."""
        key = (devices, tp)
        if key not in self._replicas:
            seen, out = set(), []
            for r in range(len(devices) // tp):
                group = devices[r * tp:(r + 1) * tp]
                sig = tuple((self.cluster.devices[d].gpu.name, self.cluster.devices[d].node) for d in group)
                if self.cluster.bandwidth_matrix_gbps is not None:
                    sig = group  # type: ignore[assignment]
                if sig not in seen:
                    seen.add(sig)
                    out.append(group)
            self._replicas[key] = out
        return self._replicas[key]

    def layer_supports(self, index: int, tp: int) -> bool:
        return layer_supports_tp(self.model.layers[index], tp)

    # --- tables ---------------------------------------------------------------------
    def table(self, index: int, tied_duplicate: bool, ctx: StageContext) -> LayerTable:
        """Cost table of layer ``index`` in a stage context (cached per layer kind)."""
        layer = self.model.layers[index]
        key = (layer.profile_key, layer.params, layer.act_bytes, tied_duplicate, self.signature(ctx.devices),
               ctx.micro_batch_size, ctx.num_micro_batches)
        cached = self._tables.get(key)
        if cached is not None:
            return cached
        weight_b, grad_b, _ = self.workload.state_bytes
        n_s = len(self.strategies)
        valid = np.zeros(n_s, dtype=bool)
        mb = np.full(n_s, INF)
        once = np.full(n_s, INF)
        states = np.zeros(n_s)
        act = np.zeros(n_s)
        bwd = np.zeros(n_s)
        gathered = np.zeros(n_s)
        parts = {name: np.zeros(n_s) for name in COMPONENTS}
        n = len(ctx.devices)
        b = ctx.micro_batch_size
        m = ctx.num_micro_batches
        for k, s in enumerate(self.strategies):
            if s.tp * s.dp != n or b % s.dp or not self.layer_supports(index, s.tp):
                continue
            batch = b / s.dp
            recompute = "full" if s.ckpt else "none"
            worst = None
            for group in self._distinct_replicas(ctx.devices, s.tp):
                gpu = self._slowest.get(group)
                if gpu is None:
                    gpu = self._slowest[group] = self.cm.slowest_gpu(group)
                t = self.cm.layer_time(index, gpu, batch, s.tp, recompute)
                c = 0.0
                if s.tp > 1:
                    # CostModel.tp_comm_time: an all-reduce of tp_comm_bytes x batch (linear in bytes)
                    c = self._group_rate("ar", group) * layer.tp_comm_bytes * batch * (3.0 if s.ckpt else 2.0)
                total = t.fwd_s + t.bwd_s + t.recompute_s + c
                if worst is None or total > worst[0]:
                    worst = (total, t.fwd_s, t.bwd_s + t.recompute_s, c)
            assert worst is not None
            per_mb, fwd, back, tp_comm = worst
            parts["f"][k], parts["bp"][k], parts["tpc"][k] = fwd, back, tp_comm
            params = layer_params_per_device(layer, s.tp)  # communicated and updated (as _stage_timing counts)
            held_params = params  # in memory (as device_memory counts: a tied copy's shared weight once per stage)
            if tied_duplicate:
                held_params -= getattr(layer, "tied_params", layer.params) / s.tp
            sync = 0.0
            if s.dp > 1:
                ag, rs, ar = self._comm_rates(ctx.devices, s.tp)
                if s.sdp:
                    gather = params * weight_b * ag
                    scatter = params * grad_b * rs
                    per_mb += overlap_exposure(gather, fwd) + overlap_exposure(gather + scatter, back)
                    parts["g"][k], parts["sc"][k] = gather, scatter
                else:
                    reduce = params * grad_b * ar
                    sync = overlap_exposure(reduce, back) if self.workload.overlap_grad_sync else reduce
                    parts["ar"][k] = reduce
            zero = 3 if (s.sdp and s.dp > 1) else 0
            held = params / s.dp if zero else params
            gpu = self._slowest.get(ctx.devices)
            if gpu is None:
                gpu = self._slowest[ctx.devices] = self.cm.slowest_gpu(ctx.devices)
            optimizer = held * OPTIMIZER_STEP_BYTES_PER_PARAM / (gpu.memory_bandwidth_bytes_per_s
                                                                * MEMORY_BANDWIDTH_EFFICIENCY)
            valid[k] = True
            mb[k] = per_mb
            once[k] = sync + optimizer
            parts["opt"][k] = optimizer
            states[k] = model_state_bytes(held_params, zero, s.dp, self.workload.state_bytes)
            act[k] = layer_activation_bytes(layer, s.tp, recompute, False) * batch
            if s.ckpt:
                bwd[k] = layer_activation_bytes(layer, s.tp, "none", False) * batch
            if zero == 3:
                gathered[k] = held_params * weight_b
        table = LayerTable(valid, mb, once, states, act, bwd, gathered, parts)
        self._tables[key] = table
        return table

    def transform_s(self, index: int, tp_a: int, tp_b: int, ctx: StageContext) -> float:
        """Per-micro-batch transformation cost R (forward + backward) entering
        layer ``index`` when the previous layer used ``tp_a`` and this one ``tp_b``
        (the shared cost model's all-gather of the layer input over the larger TP group)."""
        if tp_a == tp_b:
            return 0.0
        n = len(ctx.devices)
        big = max(tp_a, tp_b)
        num_bytes = self.model.layers[index].input_bytes * ctx.micro_batch_size / min(n // tp_a, n // tp_b)
        key = ("ag-worst", ctx.devices, big)
        rate = self._rates.get(key)
        if rate is None:
            rate = max(self._group_rate("ag", ctx.devices[r * big:(r + 1) * big]) for r in range(n // big))
            self._rates[key] = rate  # type: ignore[assignment]
        return 2.0 * rate * num_bytes  # type: ignore[operator]

    def _group_rate(self, kind: str, group: tuple[int, ...]) -> float:
        """Seconds per byte of an all-reduce ("ar") or all-gather ("ag") on ``group``."""
        key = (kind, group)
        rate = self._rates.get(key)
        if rate is None:
            fn = comm.allreduce_time if kind == "ar" else comm.allgather_time
            rate = fn(self.cluster, group, 1e9) / 1e9
            self._rates[key] = rate  # type: ignore[assignment]
        return rate  # type: ignore[return-value]

    def transform_matrix(self, index: int, ctx: StageContext) -> np.ndarray:
        """R between TP degrees (rows: previous layer, columns: this layer), per iteration."""
        key = ("R", self.model.layers[index].input_bytes, self.signature(ctx.devices), ctx.micro_batch_size,
               ctx.num_micro_batches)
        cached = self._tables.get(key)
        if cached is None:
            t = len(self.tps)
            matrix = np.zeros((t, t))
            for a in range(t):
                for b in range(t):
                    matrix[a, b] = self.transform_s(index, self.tps[a], self.tps[b], ctx) * ctx.num_micro_batches
            self._tables[key] = matrix  # type: ignore[assignment]
            cached = matrix  # type: ignore[assignment]
        return cached  # type: ignore[return-value]

    def layer_kinds(self) -> tuple[list[int], np.ndarray]:
        """Representative layer of each distinct layer kind, and each layer's kind."""
        if self._kinds is None:
            firsts: dict[tuple, int] = {}
            kind_of = []
            for i, layer in enumerate(self.model.layers):
                key = (layer.profile_key, layer.params, layer.act_bytes, layer.kind, layer.tp_max)
                kind_of.append(list(firsts).index(key) if key in firsts else len(firsts))
                firsts.setdefault(key, i)
            self._kinds = (list(firsts.values()), np.array(kind_of, dtype=np.int64))
        return self._kinds

    def input_kinds(self) -> tuple[list[int], np.ndarray]:
        """Representative layer of each distinct input size, and each layer's."""
        if self._inputs is None:
            firsts: dict[float, int] = {}
            input_of = []
            for i, layer in enumerate(self.model.layers):
                key = layer.input_bytes
                input_of.append(list(firsts).index(key) if key in firsts else len(firsts))
                firsts.setdefault(key, i)
            self._inputs = (list(firsts.values()), np.array(input_of, dtype=np.int64))
        return self._inputs

    def table_rows(self, t: LayerTable, ctx: StageContext) -> dict[str, np.ndarray]:
        """One layer's rows of the stacked arrays."""
        m = ctx.num_micro_batches
        return {
            "valid": t.valid,
            "cost": np.where(t.valid, m * t.mb_time_s + t.once_s, INF),
            "mb": t.mb_time_s,
            "once": t.once_s,
            "fwd": t.states_bytes + t.act_bytes * ctx.in_flight,
            "bwd": t.bwd_bytes,
            "gathered": t.gathered_bytes,
            **t.parts,
        }

    def stacked(self, ctx: StageContext) -> dict[str, np.ndarray]:
        """Tables of every model layer in ``ctx`` as (layers x strategies) arrays."""
        sig = self.signature(ctx.devices)
        all_key = ("all", sig, ctx.micro_batch_size, ctx.num_micro_batches, ctx.in_flight)
        cached = self._stacked.get(all_key)
        if cached is not None:
            return cached
        time_key = ("time", sig, ctx.micro_batch_size, ctx.num_micro_batches)
        timing = self._stacked.get(time_key)
        if timing is None:
            kinds, kind_of = self.layer_kinds()
            tables = [self.table(first, False, ctx) for first in kinds]
            inputs, input_of = self.input_kinds()
            m = ctx.num_micro_batches
            timing = {
                "valid": np.array([t.valid for t in tables])[kind_of],
                "mb": np.array([t.mb_time_s for t in tables])[kind_of],
                "once": np.array([t.once_s for t in tables])[kind_of],
                "states": np.array([t.states_bytes for t in tables])[kind_of],
                "act": np.array([t.act_bytes for t in tables])[kind_of],
                "bwd": np.array([t.bwd_bytes for t in tables])[kind_of],
                "gathered": np.array([t.gathered_bytes for t in tables])[kind_of],
                "transform": np.array([self.transform_matrix(first, ctx) for first in inputs])[input_of],
            }
            for name in COMPONENTS:
                timing[name] = np.array([t.parts[name] for t in tables])[kind_of]
            timing["cost"] = np.where(timing["valid"], m * timing["mb"] + timing["once"], INF)
            self._stacked[time_key] = timing
        out = {k: timing[k] for k in ("valid", "cost", "mb", "once", "bwd", "gathered", "transform") + COMPONENTS}
        out["fwd"] = timing["states"] + timing["act"] * ctx.in_flight
        self._stacked[all_key] = out
        return out

    def capacity_bytes(self, devices: tuple[int, ...]) -> float:
        """Usable memory of the stage's devices (the smallest; memory limit applied)."""
        key = ("cap", devices)
        value = self._rates.get(key)
        if value is None:
            value = float(min(self.workload.device_capacity_bytes(d) for d in devices))
            self._rates[key] = value  # type: ignore[assignment]
        return value  # type: ignore[return-value]

    def overhead_bytes(self, devices: tuple[int, ...]) -> float:
        """Framework memory no plan can use (the shared memory model's constant)."""
        key = ("overhead", devices)
        value = self._rates.get(key)
        if value is None:
            value = float(max(framework_overhead_bytes(self.cluster.devices[d].gpu.name == "CPU") for d in devices))
            self._rates[key] = value  # type: ignore[assignment]
        return value  # type: ignore[return-value]


def layer_supports_tp(layer: LayerSpec, tp: int) -> bool:
    """The TP degree is allowed for this layer (as ``hetplan.validate`` checks:
    at most ``tp_max``, and dividing the heads of a transformer block)."""
    if tp == 1:
        return True
    if tp > layer.tp_max:
        return False
    if layer.kind not in ("embedding", "head") and layer.tp_max < (1 << 30) and layer.tp_max % tp:
        return False
    return True


def tied_duplicates(model_layers: Sequence, indices: Sequence[int]) -> list[bool]:
    """For each layer of a stage: its tied parameters are already held by an
    earlier layer of the same stage (the shared memory model counts them once)."""
    seen: set[str] = set()
    out = []
    for i in indices:
        group = model_layers[i].tied_group
        out.append(bool(group) and group in seen)
        if group:
            seen.add(group)
    return out


@dataclass
class StageArrays:
    """The tables of a stage's layers stacked into (layers x strategies) arrays."""

    valid: np.ndarray
    cost_s: np.ndarray  # DP objective per layer: m * per-micro-batch time + once-per-iteration time
    mb_time_s: np.ndarray
    once_s: np.ndarray
    fwd_bytes: np.ndarray  # O_f + O_ms: states + activations x in-flight
    bwd_bytes: np.ndarray
    gathered_bytes: np.ndarray
    transform: np.ndarray  # (layers, T, T) per-iteration R entering each layer
    parts: dict[str, np.ndarray]  # the COMPONENTS, (layers x strategies)


def stage_arrays(costs: GalvatronCosts, indices: Sequence[int], ctx: StageContext) -> StageArrays:
    """Stack the layer tables of a stage (cached per context, sliced per stage)."""
    full = costs.stacked(ctx)
    lo, hi = indices[0], indices[-1] + 1
    assert hi - lo == len(indices), "stage layers must be contiguous"
    cut = {k: v[lo:hi] for k, v in full.items()}
    dups = tied_duplicates(costs.model.layers, indices)
    if any(dups):
        cut = {k: v.copy() for k, v in cut.items()}
        for pos, dup in enumerate(dups):
            if dup:
                t = costs.table(indices[pos], True, ctx)
                for k, v in costs.table_rows(t, ctx).items():
                    cut[k][pos] = v
    return StageArrays(cut["valid"], cut["cost"], cut["mb"], cut["once"], cut["fwd"], cut["bwd"], cut["gathered"],
                       cut["transform"], {name: cut[name] for name in COMPONENTS})


def solve_stage(costs: GalvatronCosts, indices: Sequence[int], ctx: StageContext,
                granularity_bytes: float) -> StageSolution | None:
    """Alg. 3 for one stage: the cheapest per-layer strategies whose peak memory
    fits the device memory (None when nothing fits)."""
    return solve_stages(costs, [(indices, ctx)], granularity_bytes)[0]


def solve_stages(costs: GalvatronCosts, problems: Sequence[tuple[Sequence[int], StageContext]],
                 granularity_bytes: float) -> list[StageSolution | None]:
    """Alg. 3 for several stages that share a strategy set, run in lockstep.

    Every stage is a separate DP; stacking them into one array lets numpy do
    the work of all in the same calls. Shorter stages are padded at the front
    with free "null" layers, which leave ``C(0, ·) = 0`` unchanged. Strategies
    live in (TP degree, slot) cells so the per-TP minimum is one reduction.
    """
    if not problems:
        return []
    gran = float(granularity_bytes)
    num = len(problems)
    arrays = [stage_arrays(costs, idx, ctx) for idx, ctx in problems]
    caps = np.array([costs.capacity_bytes(ctx.devices) for _, ctx in problems])
    overheads = np.array([costs.overhead_bytes(ctx.devices) for _, ctx in problems])
    nbs = np.floor((caps - overheads) / gran).astype(np.int64)
    out: list[StageSolution | None] = [None] * num
    slot_of = costs.slot_of
    num_groups, per_group = costs.slot_shape
    n_slots = num_groups * per_group
    usable = []
    ok_masks = {}
    weights = {}
    for k in range(num):
        if nbs[k] <= 0:
            continue
        a = arrays[k]
        w = np.rint(a.fwd_bytes / gran)
        ok = a.valid & (w <= nbs[k])
        if ok.any(axis=1).all():
            usable.append(k)
            ok_masks[k] = ok
            weights[k] = np.where(ok, w, 0).astype(np.int64)
    if not usable:
        return out
    depth = max(len(problems[k][0]) for k in usable)
    sel = np.array(usable)
    num_u = len(usable)
    cost = np.full((num_u, depth, n_slots), INF, dtype=np.float32)
    weight = np.zeros((num_u, depth, n_slots), dtype=np.int64)
    fwd = np.zeros((num_u, depth, n_slots))
    bwd = np.zeros((num_u, depth, n_slots))
    gath = np.zeros((num_u, depth, n_slots))
    parts = {name: np.zeros((num_u, depth, n_slots)) for name in COMPONENTS}
    valid = np.zeros((num_u, depth, n_slots), dtype=bool)
    trans64 = np.zeros((num_u, depth, num_groups, num_groups))
    ms = np.array([problems[k][1].num_micro_batches for k in usable], dtype=float)
    fronts = []
    for row, k in enumerate(usable):
        a = arrays[k]
        front = depth - a.cost_s.shape[0]
        fronts.append(front)
        cost[row, :front] = 0.0  # null layers: free, any slot
        valid[row, :front] = True
        valid[row, front:, slot_of] = a.valid.T
        cost[row, front:, slot_of] = np.where(ok_masks[k], a.cost_s, INF).T
        weight[row, front:, slot_of] = weights[k].T
        fwd[row, front:, slot_of] = a.fwd_bytes.T
        bwd[row, front:, slot_of] = a.bwd_bytes.T
        gath[row, front:, slot_of] = a.gathered_bytes.T
        for name in COMPONENTS:
            parts[name][row, front:, slot_of] = np.where(a.valid, a.parts[name], 0.0).T
        trans64[row, front + 1:] = a.transform[1:]
    trans = trans64.astype(np.float32)
    width = int(nbs[sel].max()) + 1
    slot_group = np.repeat(np.arange(num_groups), per_group)
    base = (np.arange(num_u)[:, None, None] * (num_groups * 2 * width) + slot_group[None, :, None] * (2 * width)
            + width + np.arange(width)[None, None, :])
    index = base[:, None, :, :] - weight[:, :, :, None]  # (problems, depth, slots, width)
    pad = np.full((num_u, num_groups, 2 * width), INF, dtype=np.float32)
    f = np.zeros((num_u, n_slots, width), dtype=np.float32)
    history = []
    group_history = []  # group minima of the previous layer's states, per step
    for l in range(depth):
        g_min = f.reshape(num_u, num_groups, per_group, width).min(axis=2)
        group_history.append(g_min)
        if num_groups > 1:
            k_min = (g_min[:, :, None, :] + trans[:, l, :, :, None]).min(axis=1)
        else:
            k_min = g_min
        pad[:, :, width:] = k_min
        f = pad.ravel()[index[:, l]]
        f += cost[:, l, :, None]
        history.append(f)

    # Alg. 3: forward budgets below (top − largest backward peak) always fit, so
    # only the window above needs the full E_all check; below it the cheapest
    # plan is the window's bottom. Only budgets where the optimum changes hold
    # distinct plans, so only those are backtracked. If rounding makes the
    # whole window fail, the next window down is tried.
    final = f.min(axis=1)  # (problems, width)
    peak = np.where(np.isfinite(cost), bwd + ZERO3_GATHERED_LAYERS * gath, 0.0).max(axis=(1, 2))
    span = int(np.ceil(peak.max() / gran)) + 3
    top = nbs[sel].copy()
    todo = list(range(num_u))
    while todo:
        lists = []
        for row in todo:
            hi = int(top[row])
            lo = max(0, hi - span)
            seg = final[row, lo:hi + 1]
            finite = np.isfinite(seg)
            change = np.ones(len(seg), dtype=bool)
            change[1:] = seg[1:] < seg[:-1]
            picks = (np.nonzero(change & finite)[0] + lo)[::-1][:MAX_CANDIDATES]  # the largest budgets first
            lists.append(picks if len(picks) else np.array([hi]))
        count = max(len(x) for x in lists)
        cand = np.array([np.concatenate([x, np.full(count - len(x), x[-1])]) for x in lists], dtype=np.int64)
        rows = np.array(todo)
        found = _backtrack(history, group_history, per_group, rows, cand, final, weight, trans, slot_group, fwd,
                           bwd, gath, overheads[sel], caps[sel], parts, trans64 / ms[:, None, None, None], ms,
                           costs.workload.overlap_grad_sync)
        nxt = []
        for i, row in enumerate(todo):
            res = found[i]
            k = usable[row]
            if res is not None:
                slots, memory, numbers = res
                chosen = tuple(costs.strategy_at_slot[sl] for sl in slots[fronts[row]:])
                out[k] = StageSolution(chosen, *numbers, memory, float(caps[k]))
            else:  # nothing in this window fits: continue below its lowest budget
                below = int(lists[i][-1]) - 1
                if below >= 0 and np.isfinite(final[row, :below + 1]).any():
                    top[row] = below
                    nxt.append(row)
        todo = nxt
    # Galvatron's coarse mode: one strategy for every layer of the stage
    ok = valid.all(axis=1)
    memory = (fwd.sum(axis=1) + bwd.max(axis=1) + ZERO3_GATHERED_LAYERS * gath.max(axis=1)
              + overheads[sel][:, None])
    ok &= memory <= caps[sel][:, None]
    sums = {name: parts[name].sum(axis=1) for name in COMPONENTS}
    total, per_mb, _ = exact_stage_cost(sums, np.zeros(ok.shape), ms[:, None], costs.workload.overlap_grad_sync)
    total = np.where(ok, total, INF)
    for row, k in enumerate(usable):
        slot = int(total[row].argmin())
        if not ok[row, slot] or (out[k] is not None and total[row, slot] >= out[k].cost_s * (1 - 1e-12)):
            continue
        strategy = costs.strategy_at_slot[slot]
        out[k] = StageSolution((strategy,) * len(problems[k][0]), float(total[row, slot]), float(per_mb[row, slot]),
                               float(sums["bp"][row, slot]), float(sums["ar"][row, slot]),
                               float(sums["opt"][row, slot]), float(memory[row, slot]), float(caps[k]))
    return out


def _backtrack(history: list[np.ndarray], group_history: list[np.ndarray], per_group: int, rows: np.ndarray,
               cand: np.ndarray, final: np.ndarray, weight: np.ndarray, trans: np.ndarray, slot_group: np.ndarray,
               fwd: np.ndarray, bwd: np.ndarray, gath: np.ndarray, overheads: np.ndarray,
               caps: np.ndarray, parts: dict[str, np.ndarray], trans_mb: np.ndarray, ms: np.ndarray,
               overlap_grad_sync: bool) -> list[tuple[list[int], float, tuple[float, ...]] | None]:
    """Recover the strategies (slots) of candidate forward budgets, compute their
    exact E_all and exact cost, and return each problem's cheapest fitting one.

    The predecessor of a layer's strategy is found in two steps, as the forward
    pass chose it: the best TP group (R only depends on TP degrees), then the
    best slot inside that group; ties keep the layer's own strategy so that
    identical layers form runs."""
    depth = len(history)
    n_slots = history[0].shape[1]
    num_groups = group_history[0].shape[1]
    r_axis = rows[:, None]
    r3 = rows[:, None, None]
    values = final[r_axis, cand]
    last = history[-1][r3, np.arange(n_slots)[None, :, None], cand[:, None, :]]
    s_cur = last.argmin(axis=1)
    e_cur = cand.copy()
    choices = np.empty((depth,) + cand.shape, dtype=np.int64)
    p_axis = np.arange(len(rows))[:, None, None]
    t_axis = np.arange(num_groups)[None, :, None]
    k_axis = np.arange(per_group)[None, :, None]
    trans_rows = trans[rows]  # (problems, depth, T, T)
    for l in range(depth - 1, -1, -1):
        choices[l] = s_cur
        if l == 0:
            break
        e_cur = np.maximum(e_cur - weight[r_axis, l, s_cur], 0)
        e3 = e_cur[:, None, :]
        vals = group_history[l][r3, t_axis, e3]  # (problems, groups, candidates)
        vals = vals + trans_rows[:, l][p_axis, t_axis, slot_group[s_cur][:, None, :]]
        t_best = vals.argmin(axis=1)
        low = vals.min(axis=1)
        inside = history[l - 1][r3, t_best[:, None, :] * per_group + k_axis, e3]  # (problems, slots of group, cand.)
        s_best = t_best * per_group + inside.argmin(axis=1)
        here = history[l - 1][r_axis, s_cur, e_cur]
        s_cur = np.where(here <= low + 1e-6 * np.abs(low), s_cur, s_best)
    layer_axis = np.arange(depth)[:, None, None]
    prob_axis = rows[None, :, None]
    e_all = (fwd[prob_axis, layer_axis, choices].sum(axis=0) + bwd[prob_axis, layer_axis, choices].max(axis=0)
             + ZERO3_GATHERED_LAYERS * gath[prob_axis, layer_axis, choices].max(axis=0) + overheads[rows][:, None])
    fits = (e_all <= caps[rows][:, None]) & np.isfinite(values)
    sums = {name: parts[name][prob_axis, layer_axis, choices].sum(axis=0) for name in COMPONENTS}
    p_idx = np.arange(len(rows))[None, :, None]
    groups_of = slot_group[choices]  # (depth, problems, candidates)
    transform = trans_mb[rows][p_idx, np.arange(1, depth)[:, None, None], groups_of[:-1], groups_of[1:]].sum(axis=0) \
        if depth > 1 else np.zeros(cand.shape)
    exact, per_mb, _ = exact_stage_cost(sums, transform, ms[rows][:, None], overlap_grad_sync)
    result: list[tuple[list[int], float, tuple[float, ...]] | None] = []
    for i in range(len(rows)):
        ok = np.nonzero(fits[i])[0]
        if not len(ok):
            result.append(None)
            continue
        order = np.lexsort((e_all[i, ok], exact[i, ok]))
        pick = ok[order[0]]
        numbers = (float(exact[i, pick]), float(per_mb[i, pick]), float(sums["bp"][i, pick]),
                   float(sums["ar"][i, pick]), float(sums["opt"][i, pick]))
        result.append(([int(c) for c in choices[:, i, pick]], float(e_all[i, pick]), numbers))
    return result


def _overlap_fast(comm_s: np.ndarray, compute_s: np.ndarray) -> np.ndarray:
    """The shared cost model's overlap formula, vectorised: max(c, p)·s − p for c > 0."""
    c, p = np.broadcast_arrays(np.asarray(comm_s, dtype=float), np.asarray(compute_s, dtype=float))
    return np.where(c > 0, np.maximum(c, p) * OVERLAP_SLOWDOWN - p, 0.0)


def _matches_core() -> bool:
    probes = [(0.0, 1.0), (0.5, 1.0), (2.0, 1.0), (1e-3, 0.0), (3.0, 3.0)]
    return all(abs(float(_overlap_fast(np.array(c), np.array(p))) - overlap_exposure(c, p)) <= 1e-12 * (1 + c + p)
               for c, p in probes)


# the fast path while it agrees with CostModel's formula; else call the model's function per element
_overlap_vec = _overlap_fast if _matches_core() else np.vectorize(overlap_exposure, otypes=[float])


def exact_stage_cost(sums: dict[str, np.ndarray], transform_mb: np.ndarray, m: int,
                     overlap_grad_sync: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(stage cost, per-micro-batch time, exposed gradient sync) from per-stage
    sums of the COMPONENTS, as CostModel charges a stage: the ZeRO-3 gathers
    overlap the stage's forward, gathers + reduce-scatters its backward, the DP
    gradient all-reduce its last backward (Galvatron-BMW §V's slowdown)."""
    f, bp = sums["f"], sums["bp"]
    per_mb = f + bp + sums["tpc"] + transform_mb + _overlap_vec(sums["g"], f) + _overlap_vec(sums["g"] + sums["sc"], bp)
    sync = _overlap_vec(sums["ar"], bp) if overlap_grad_sync else sums["ar"]
    return m * per_mb + sync + sums["opt"], per_mb, sync


def default_granularity(capacity_bytes: float, bins: int = 256) -> float:
    """Memory bin of the DP: the budget in ``bins`` steps, at least 1 MiB."""
    return max(float(1 << 20), math.ceil(capacity_bytes / bins))
