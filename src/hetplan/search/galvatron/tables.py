"""Galvatron-BMW's per-layer, per-strategy cost tables, read from the shared kernel.

For one stage context (its device group, micro-batch, number of micro-batches
and 1F1B in-flight count) every layer gets, for every candidate strategy S_j
(``space.GStrategy``: tp, dp, SDP, CKPT), the numbers of Galvatron-BMW's
dynamic program (§IV-A2, eq. 2-4):

* ``c(l, S_j)`` split into its components (:data:`COMPONENTS`): forward,
  backward + recomputation and TP all-reduces of the slowest replica per
  micro-batch, ZeRO-3 all-gathers and reduce-scatters per micro-batch, the DP
  gradient all-reduce and the optimizer step per iteration — the kernel's
  layer times, tp-comm bytes and collective rates, and the DP's additive
  per-layer objective from the kernel's combining formulas;
* ``O_f + O_ms``: model states plus activations kept times the micro-batches in flight;
* ``O_b``: the recompute working set of a checkpointed layer, and the
  gathered parameters of an SDP layer; with one micro-batch's activations per
  layer, from which the DP's peak check subtracts what backward has freed.

A layer's worst replica is taken per layer here (the DP needs additive
costs); the planner re-costs every stage it keeps with the kernel's
``CostModel.stage_timing``, which takes the slowest replica per segment, so
the numbers it ranks by are the estimate's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from hetplan.cost.groups import first_appearance
from hetplan.cost.kernel import CostKernel
from hetplan.cost.memory import model_state_bytes
from hetplan.cost.mixed import transform_rate
from hetplan.cost.model import CostModel
from hetplan.cost.pipeline import exposed_grad_sync, overlapped_exposure
from hetplan.search.galvatron.space import GStrategy

INF = float("inf")

# Per-layer components (seconds), summed per stage as the kernel sums a stage:
COMPONENTS = (
    "f",  # forward compute, per micro-batch
    "bp",  # backward + recompute compute, per micro-batch
    "tpc",  # TP all-reduces, per micro-batch
    "g",  # ZeRO-3 parameter all-gather, per micro-batch
    "sc",  # ZeRO-3 gradient reduce-scatter, per micro-batch
    "ar",  # DP gradient all-reduce, once per iteration
    "opt",  # optimizer step, once per iteration
)


@dataclass(frozen=True)
class StageContext:
    """What a stage's costs depend on besides its layers."""

    devices: tuple[int, ...]
    micro_batch_size: int
    num_micro_batches: int
    in_flight: float  # micro-batches whose activations the stage holds at its peak (1F1B / GPipe)


@dataclass
class StageArrays:
    """The tables of a stage's layers as (layers x strategies) arrays."""

    valid: np.ndarray
    cost_s: np.ndarray  # DP objective per layer: m * per-micro-batch time + once-per-iteration time
    fwd_bytes: np.ndarray  # O_f + O_ms: states + activations x in-flight
    bwd_bytes: np.ndarray  # recompute working set
    act_bytes: np.ndarray  # O_f's activations of one micro-batch (what backward frees layer by layer)
    gathered_bytes: np.ndarray
    transform: np.ndarray  # (layers, T, T) per-iteration R entering each layer
    parts: dict[str, np.ndarray]  # the COMPONENTS


class GalvatronCosts:
    """Per-layer, per-strategy tables for the stage contexts of one search."""

    def __init__(self, cost_model: CostModel, strategies: Sequence[GStrategy]) -> None:
        self.cost_model = cost_model
        self.kernel: CostKernel = cost_model.kernel
        self.workload = cost_model.workload
        self.model = cost_model.model
        self.cluster = cost_model.cluster
        self.strategies = tuple(strategies)
        self.tps = sorted({s.tp for s in self.strategies})
        self._build_slots()
        self._stacked: dict[tuple[object, ...], dict[str, np.ndarray]] = {}
        self._sigs: dict[tuple[int, ...], tuple[object, ...]] = {}

    def _build_slots(self) -> None:
        """Strategies live in (TP degree, slot) cells so the per-TP minimum is one reduction."""
        group_of = [self.tps.index(s.tp) for s in self.strategies]
        per_group = max(group_of.count(g) for g in range(len(self.tps)))
        self.slot_shape = (len(self.tps), per_group)
        slots, seen = [], [0] * len(self.tps)
        for g in group_of:
            slots.append(g * per_group + seen[g])
            seen[g] += 1
        self.slot_of = np.array(slots, dtype=np.int64)
        self.strategy_at_slot = {slot: k for k, slot in enumerate(slots)}

    def release(self) -> None:
        """Drop the cached tables (they are rebuilt on demand): a search over many
        batch sizes would otherwise keep every context's tables."""
        self._stacked.clear()

    # --- device groups ----------------------------------------------------------------
    def signature(self, devices: tuple[int, ...]) -> tuple[object, ...]:
        """Devices that cost the same get the same signature: GPU type, memory,
        and node layout (relative node numbers and the nodes' links). With a
        device-to-device bandwidth matrix the devices themselves."""
        sig = self._sigs.get(devices)
        if sig is None:
            if self.cluster.bandwidth_matrix_gbps is not None:
                sig = ("ids",) + devices
            else:  # per device, as numbers: GPU type, memory, node relative to the first, the node's links
                arrays = self.kernel.cluster_arrays
                ids = self.kernel.device_array(devices)
                node = arrays.node[ids]
                sig = ("devices", np.stack([arrays.gpu[ids], arrays.capacity[ids], node - node[0],
                                            arrays.node_links[node]]).tobytes())
            self._sigs[devices] = sig
        return sig

    def capacity_bytes(self, devices: tuple[int, ...]) -> float:
        """Usable memory of the stage's devices (the smallest; memory limit applied)."""
        return float(self.kernel.cluster_arrays.capacity[self.kernel.device_array(devices)].min())

    def overhead_bytes(self, devices: tuple[int, ...]) -> float:
        """Framework memory no plan can use (the shared memory model's constant)."""
        return float(self.kernel.cluster_arrays.overhead[self.kernel.device_array(devices)].max())

    # --- tables -------------------------------------------------------------------------
    def stacked(self, ctx: StageContext) -> dict[str, np.ndarray]:
        """Tables of every model layer in ``ctx`` as (layers x strategies) arrays;
        ``"dup_*"`` entries hold the rows of a layer whose tied weight an
        earlier layer of its stage already holds."""
        key = (self.signature(ctx.devices), ctx.micro_batch_size, ctx.num_micro_batches, ctx.in_flight)
        found = self._stacked.get(key)
        if found is None:
            timing_key = key[:-1]
            timing = self._stacked.get(timing_key)
            if timing is None:
                timing = self._stacked[timing_key] = self._build(ctx)
            found = dict(timing)
            for prefix in ("", "dup_"):
                found[prefix + "fwd"] = timing[prefix + "states"] + timing[prefix + "act"] * ctx.in_flight
            self._stacked[key] = found
        return found

    def _build(self, ctx: StageContext) -> dict[str, np.ndarray]:
        """Every column but the in-flight-dependent forward memory (``stacked`` adds it)."""
        n_layers, n_s = self.kernel.num_layers, len(self.strategies)
        names = ("valid", "mb", "once", "states", "act", "bwd", "gathered") + COMPONENTS
        columns: dict[str, list[np.ndarray]] = {name: [] for name in names + tuple("dup_" + c for c in names)}
        for s in self.strategies:
            compute = self._compute(s, ctx)  # the same with or without the tied copy
            for prefix, tied_copy in (("", False), ("dup_", True)):
                for name, value in self._strategy_columns(s, ctx, tied_copy, compute).items():
                    columns[prefix + name].append(value)
        out = {name: np.stack(values, axis=1) for name, values in columns.items()}
        assert out["mb"].shape == (n_layers, n_s)
        out["transform"] = self._transform(ctx)
        m = ctx.num_micro_batches
        for prefix in ("", "dup_"):
            out[prefix + "cost"] = np.where(out[prefix + "valid"], m * out[prefix + "mb"] + out[prefix + "once"], INF)
        return out

    def _valid(self, s: GStrategy, ctx: StageContext) -> bool:
        """The strategy's degrees use the stage's devices and split its micro-batch."""
        return s.tp * s.dp == len(ctx.devices) and ctx.micro_batch_size % s.dp == 0

    def _compute(self, s: GStrategy, ctx: StageContext) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Forward, backward + recompute and TP comm per layer (zeros where the strategy is invalid)."""
        if not self._valid(s, ctx):
            return (np.zeros(self.kernel.num_layers),) * 3
        return self._worst_replica(s, ctx, ctx.micro_batch_size / s.dp, "full" if s.ckpt else "none")

    def _strategy_columns(self, s: GStrategy, ctx: StageContext, tied_copy: bool,
                          compute: tuple[np.ndarray, np.ndarray, np.ndarray]) -> dict[str, np.ndarray]:
        """One strategy's column for every layer (``tied_copy``: the layer's tied
        weight is already held by an earlier layer of the stage; ``compute``: ``_compute``)."""
        k = self.kernel
        n = k.num_layers
        recompute = "full" if s.ckpt else "none"
        valid = k.supports_tp(s.tp) & self._valid(s, ctx)
        batch = ctx.micro_batch_size / s.dp
        f, bp, tpc = compute
        params = k.params_per_device(s.tp) - (k.tied_share(s.tp) if tied_copy else 0.0)
        zero = 3 if s.sdp and s.dp > 1 else 0
        g = sc = ar = np.zeros(n)
        if s.dp > 1 and zero:
            g = params * k.weight_bytes * k.dp_collective_rate("allgather", ctx.devices, s.tp)
            sc = params * k.grad_bytes * k.dp_collective_rate("reduce_scatter", ctx.devices, s.tp)
        elif s.dp > 1:
            ar = params * k.grad_bytes * k.dp_collective_rate("allreduce", ctx.devices, s.tp)
        mb = f + bp + tpc + overlapped_exposure(g, f, k.overlap_slowdown) + overlapped_exposure(g + sc, bp, k.overlap_slowdown)
        opt = params * k.optimizer_rate(ctx.devices) / (s.dp if zero else 1)
        once = exposed_grad_sync(ar, bp, self.workload.overlap_grad_sync, k.overlap_slowdown) + opt
        return {
            "valid": valid, "mb": np.where(valid, mb, INF), "once": np.where(valid, once, INF),
            "states": np.asarray(model_state_bytes(params, zero, s.dp, self.workload.state_bytes,
                                                   self.workload.zero_implementation)),
            "act": k.activation_bytes(s.tp, recompute, False) * batch,
            "bwd": k.backward_working_bytes(s.tp, recompute, False) * batch,
            "gathered": k.params_per_device(s.tp) * k.weight_bytes if zero else np.zeros(n),
            "f": f, "bp": bp, "tpc": tpc, "g": g, "sc": sc, "ar": ar, "opt": opt,
        }

    def _worst_replica(self, s: GStrategy, ctx: StageContext, batch: float,
                       recompute: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Forward, backward + recompute and TP comm of the slowest replica, per layer."""
        k = self.kernel
        best: tuple[np.ndarray, ...] | None = None
        seen: set[tuple[object, ...]] = set()
        grid = k.device_array(ctx.devices).reshape(s.dp, s.tp)
        gpus, links, representatives = k.replica_classes(grid)  # alike replicas cost alike: one of each
        tp_links = [k.tp_link(tuple(grid[r].tolist())) if s.tp > 1 else (0.0, 0.0) for r in representatives]
        for r in first_appearance(gpus * len(representatives) + links)[0].tolist():
            gpu, tp_link = k.cluster_arrays.gpus[gpus[r]], tp_links[links[r]]
            if (gpu.name, tp_link) in seen:
                continue
            seen.add((gpu.name, tp_link))
            t = k.layer_times(gpu, batch, s.tp, recompute)
            tpc = k.tp_comm_time(recompute, batch, tp_link, t)
            total = t.fwd_s + t.back_s + tpc
            if best is None:
                best = (total, t.fwd_s, t.back_s, tpc)
                continue
            slower = total > best[0]
            best = tuple(np.where(slower, new, old)
                         for new, old in zip((total, t.fwd_s, t.back_s, tpc), best))
        assert best is not None
        return best[1], best[2], best[3]

    def _transform(self, ctx: StageContext) -> np.ndarray:
        """(layers, T, T): R entering each layer from a previous layer's TP
        degree (rows) to its own (columns), per iteration."""
        rates = np.array([[transform_rate(self.kernel, ctx.devices, a, b) for b in self.tps] for a in self.tps])
        per_layer: np.ndarray = self.kernel.arrays.input_bytes * ctx.micro_batch_size * ctx.num_micro_batches
        return per_layer[:, None, None] * rates[None]


def stage_arrays(costs: GalvatronCosts, indices: Sequence[int], ctx: StageContext) -> StageArrays:
    """Stack the layer tables of a stage (a tied layer whose group an earlier
    layer of the stage holds takes its ``dup_`` rows)."""
    full = costs.stacked(ctx)
    lo, hi = indices[0], indices[-1] + 1
    assert hi - lo == len(indices), "stage layers must be contiguous"
    dup = (costs.kernel.arrays.tied_previous[lo:hi] >= lo)[:, None]

    def rows(name: str) -> np.ndarray:
        if not dup.any():
            return full[name][lo:hi]
        return np.where(dup, full["dup_" + name][lo:hi], full[name][lo:hi])

    return StageArrays(rows("valid"), rows("cost"), rows("fwd"), rows("bwd"), rows("act"), rows("gathered"),
                       full["transform"][lo:hi], {name: rows(name) for name in COMPONENTS})
