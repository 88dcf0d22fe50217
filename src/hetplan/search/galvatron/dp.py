"""Galvatron-BMW's per-stage dynamic program under a memory budget (§IV-A2,
eq. 2–4, Appendix A, Alg. 3), on the shared kernel's tables (``tables.py``).

The DP (eq. 4) runs over a stage's layers with the forward memory
``O_f + O_ms`` as the knapsack dimension, in bins of ``granularity`` bytes,
and carries the last layer's strategy so that the transformation cost ``R``
between adjacent layers with different TP degrees can be added. Alg. 3 then
walks the forward budgets ``E_fwd`` and checks the full peak ``E_all`` (eq. 2:
forward memory + the largest backward peak + framework overhead; the backward
peak as the kernel counts it, a layer's working set less what the layers after
it have freed, ``memory.working_beyond_stored``) against the device memory:
below ``E − b_ub`` every plan fits (``b_ub`` the largest working set, an
upper bound), so only the distinct plans
of the window above (at most MAX_CANDIDATES at a time, largest budgets first)
are backtracked, all at once with numpy, and the cheapest whose exact
``E_all`` fits is kept — the paper keeps the largest fitting ``E_fwd``, the
same plan unless a larger budget's plan fails the check.

The DP's objective is additive over layers; the kernel's stage cost is not
quite (the overlap slowdown applies to a stage's *sums*, and a heterogeneous
stage's slowest replica is taken per segment, not per layer). So the
candidates of the window are screened with the stage formulas applied to
their sums (:func:`stage_objective`), and the chosen plan — and Galvatron's
coarse mode, one strategy for every layer of the stage — is re-costed by the
kernel itself (``CostModel.stage_timing``); the cheaper of the two is kept, so
a stage is never worse than its best single strategy and its numbers are the
estimate's.

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

from hetplan.cost.stage import SegmentTiming
from hetplan.cost.memory import peak_memory_bytes, working_beyond_stored
from hetplan.cost.pipeline import exposed_grad_sync, stage_micro_batch_time
from hetplan.plan.spec import Stage
from hetplan.search.galvatron.tables import COMPONENTS, GalvatronCosts, StageArrays, StageContext, stage_arrays

INF = float("inf")
# Alg. 3's check of E_all walks at most this many distinct forward budgets at a
# time, from the largest down (the paper keeps the largest budget that fits).
MAX_CANDIDATES = 32
# DP cells (problems x layers x strategies x memory bins) solved in lockstep at
# once: ~8 bytes each for the value tables and indices, so ~130 MB at most.
LOCKSTEP_CELLS = 16_000_000


@dataclass
class StageSolution:
    """The answer for one stage, costed by the kernel (as ``estimate`` costs it)."""

    choices: tuple[int, ...]  # strategy index per layer of the stage
    stage: Stage
    timing: SegmentTiming
    cost_s: float  # the stage alone: m * per-micro-batch time + exposed gradient sync + post-step + optimizer
    memory_bytes: float  # the largest peak of its GPUs
    fits: bool  # every GPU within its capacity

    @property
    def mb_time_s(self) -> float:
        return self.timing.per_micro_batch_s


def stage_objective(sums: dict[str, np.ndarray], transform_mb: np.ndarray, m: np.ndarray | float,
                    overlap_grad_sync: bool, slowdown: float) -> tuple[np.ndarray, np.ndarray]:
    """(stage cost, per-micro-batch time) from per-stage sums of the COMPONENTS,
    with the kernel's combining formulas."""
    per_mb = stage_micro_batch_time(sums["f"], sums["bp"], sums["tpc"] + transform_mb, sums["g"], sums["sc"],
                                    slowdown)
    sync = exposed_grad_sync(sums["ar"], sums["bp"], overlap_grad_sync, slowdown)
    return np.asarray(m * per_mb + sync + sums["opt"]), np.asarray(per_mb)


def default_granularity(capacity_bytes: float, bins: int = 256) -> float:
    """Memory bin of the DP: the budget in ``bins`` steps, at least 1 MiB."""
    return max(float(1 << 20), math.ceil(capacity_bytes / bins))


@dataclass
class _Packed:
    """The usable problems' tables padded into (problems, depth, slots) arrays;
    shorter stages are padded at the front with free "null" layers."""

    usable: list[int]  # indices into the problems
    fronts: list[int]  # null layers in front of each
    cost: np.ndarray  # float32, inf where not allowed
    weight: np.ndarray  # forward memory in bins
    fwd: np.ndarray
    bwd: np.ndarray
    act: np.ndarray
    gathered: np.ndarray
    parts: dict[str, np.ndarray]
    valid: np.ndarray
    transform: np.ndarray  # (problems, depth, T, T), float64, per iteration
    ms: np.ndarray  # micro-batches per problem
    caps: np.ndarray
    overheads: np.ndarray
    budgets: np.ndarray  # bins of usable memory per problem

    @property
    def depth(self) -> int:
        return self.cost.shape[1]


@dataclass
class _Forward:
    """The DP's value tables: per layer, per slot, per budget."""

    history: list[np.ndarray]
    group_history: list[np.ndarray]
    final: np.ndarray  # (problems, width): best cost per forward budget


def solve_stage(costs: GalvatronCosts, indices: Sequence[int], ctx: StageContext,
                granularity_bytes: float) -> StageSolution | None:
    """Alg. 3 for one stage: the cheapest per-layer strategies whose peak memory
    fits the device memory (None when nothing fits)."""
    return solve_stages(costs, [(indices, ctx)], granularity_bytes)[0]


def solve_stages(costs: GalvatronCosts, problems: Sequence[tuple[Sequence[int], StageContext]],
                 granularity_bytes: float) -> list[StageSolution | None]:
    """Alg. 3 for several stages that share a strategy set, run in lockstep (in
    chunks of at most LOCKSTEP_CELLS DP cells, which bounds the memory)."""
    if not problems:
        return []
    depth = max(len(indices) for indices, _ in problems)
    width = max(costs.capacity_bytes(ctx.devices) for _, ctx in problems) / granularity_bytes + 2
    per_problem = depth * costs.slot_shape[0] * costs.slot_shape[1] * width
    size = max(1, int(LOCKSTEP_CELLS // per_problem))
    out: list[StageSolution | None] = []
    for start in range(0, len(problems), size):
        out += _solve_lockstep(costs, problems[start:start + size], granularity_bytes)
    return out


def _solve_lockstep(costs: GalvatronCosts, problems: Sequence[tuple[Sequence[int], StageContext]],
                    granularity_bytes: float) -> list[StageSolution | None]:
    out: list[StageSolution | None] = [None] * len(problems)
    packed = _pack(costs, problems, float(granularity_bytes))
    if packed is None:
        return out
    forward = _forward(costs, packed)
    picks = _window_picks(costs, packed, forward, float(granularity_bytes))
    coarse = _coarse_picks(costs, packed)
    for row, k in enumerate(packed.usable):
        indices, ctx = problems[k]
        options = [c for c in (picks[row], coarse[row]) if c is not None]
        solved = [_solution(costs, indices, ctx, choice) for choice in options]
        fitting = [s for s in solved if s.fits]
        if fitting:
            out[k] = min(fitting, key=lambda s: s.cost_s)
    return out


# --- the steps -------------------------------------------------------------------------------
def _pack(costs: GalvatronCosts, problems: Sequence[tuple[Sequence[int], StageContext]],
          gran: float) -> _Packed | None:
    """Stack the problems whose every layer has a strategy that fits at all."""
    arrays = [stage_arrays(costs, idx, ctx) for idx, ctx in problems]
    caps = np.array([costs.capacity_bytes(ctx.devices) for _, ctx in problems])
    overheads = np.array([costs.overhead_bytes(ctx.devices) for _, ctx in problems])
    budgets = np.floor((caps - overheads) / gran).astype(np.int64)
    usable, allowed, weights = [], {}, {}
    for k, a in enumerate(arrays):
        if budgets[k] <= 0:
            continue
        w = np.rint(a.fwd_bytes / gran)
        ok = a.valid & (w <= budgets[k])
        if ok.any(axis=1).all():
            usable.append(k)
            allowed[k] = ok
            weights[k] = np.where(ok, w, 0).astype(np.int64)
    if not usable:
        return None
    return _fill(costs, problems, arrays, usable, allowed, weights, caps, overheads, budgets)


def _fill(costs: GalvatronCosts, problems: Sequence[tuple[Sequence[int], StageContext]],
          arrays: list[StageArrays], usable: list[int], allowed: dict[int, np.ndarray],
          weights: dict[int, np.ndarray], caps: np.ndarray, overheads: np.ndarray,
          budgets: np.ndarray) -> _Packed:
    """Pad the usable problems into common arrays (null layers in front)."""
    slot_of = costs.slot_of
    num_groups, per_group = costs.slot_shape
    n_slots = num_groups * per_group
    depth = max(len(problems[k][0]) for k in usable)
    shape = (len(usable), depth, n_slots)
    cost = np.full(shape, INF, dtype=np.float32)
    weight = np.zeros(shape, dtype=np.int64)
    fwd, bwd, act, gathered = np.zeros(shape), np.zeros(shape), np.zeros(shape), np.zeros(shape)
    parts = {name: np.zeros(shape) for name in COMPONENTS}
    valid = np.zeros(shape, dtype=bool)
    transform = np.zeros((len(usable), depth, num_groups, num_groups))
    fronts = []
    for row, k in enumerate(usable):
        a = arrays[k]
        front = depth - a.cost_s.shape[0]
        fronts.append(front)
        cost[row, :front] = 0.0  # null layers: free, any slot
        valid[row, :front] = True
        valid[row, front:, slot_of] = a.valid.T
        cost[row, front:, slot_of] = np.where(allowed[k], a.cost_s, INF).T
        weight[row, front:, slot_of] = weights[k].T
        fwd[row, front:, slot_of] = a.fwd_bytes.T
        bwd[row, front:, slot_of] = a.bwd_bytes.T
        act[row, front:, slot_of] = a.act_bytes.T
        gathered[row, front:, slot_of] = a.gathered_bytes.T
        for name in COMPONENTS:
            parts[name][row, front:, slot_of] = np.where(a.valid, a.parts[name], 0.0).T
        transform[row, front + 1:] = a.transform[1:]
    ms = np.array([problems[k][1].num_micro_batches for k in usable], dtype=float)
    sel = np.array(usable)
    return _Packed(usable, fronts, cost, weight, fwd, bwd, act, gathered, parts, valid, transform, ms, caps[sel],
                   overheads[sel], budgets[sel])


def _forward(costs: GalvatronCosts, p: _Packed) -> _Forward:
    """Eq. 4 over the layers: value per (slot, forward budget), all problems at once."""
    num_groups, per_group = costs.slot_shape
    num_u = len(p.usable)
    trans = p.transform.astype(np.float32)
    width = int(p.budgets.max()) + 1
    slot_group = np.repeat(np.arange(num_groups), per_group)
    base = (np.arange(num_u)[:, None, None] * (num_groups * 2 * width) + slot_group[None, :, None] * (2 * width)
            + width + np.arange(width)[None, None, :])
    index = (base[:, None, :, :] - p.weight[:, :, :, None]).astype(np.int32)  # (problems, depth, slots, width)
    pad = np.full((num_u, num_groups, 2 * width), INF, dtype=np.float32)
    f = np.zeros((num_u, num_groups * per_group, width), dtype=np.float32)
    history, group_history = [], []
    for layer in range(p.depth):
        g_min = f.reshape(num_u, num_groups, per_group, width).min(axis=2)
        group_history.append(g_min)
        k_min = (g_min[:, :, None, :] + trans[:, layer, :, :, None]).min(axis=1) if num_groups > 1 else g_min
        pad[:, :, width:] = k_min
        f = pad.ravel()[index[:, layer]]
        f += p.cost[:, layer, :, None]
        history.append(f)
    return _Forward(history, group_history, f.min(axis=1))


def _window_picks(costs: GalvatronCosts, p: _Packed, fw: _Forward, gran: float) -> list[list[int] | None]:
    """Alg. 3: forward budgets below (top − largest backward peak) always fit, so
    only the window above needs the full E_all check; below it the cheapest
    plan is the window's bottom. Only budgets where the optimum changes hold
    distinct plans, so only those are backtracked. If rounding makes the whole
    window fail, the next window down is tried. Returns each problem's slots."""
    beyond_forward = peak_memory_bytes(0.0, 0.0, 0.0, p.bwd, p.gathered, 0.0)
    peak = np.where(np.isfinite(p.cost), beyond_forward, 0.0).max(axis=(1, 2))
    span = int(np.ceil(peak.max() / gran)) + 3
    top = p.budgets.copy()
    picks: list[list[int] | None] = [None] * len(p.usable)
    todo = list(range(len(p.usable)))
    while todo:
        lists = [_distinct_budgets(fw.final[row], int(top[row]), span) for row in todo]
        count = max(len(x) for x in lists)
        cand = np.array([np.concatenate([x, np.full(count - len(x), x[-1])]) for x in lists], dtype=np.int64)
        found = _backtrack(costs, p, fw, np.array(todo), cand)
        remaining = []
        for i, row in enumerate(todo):
            chosen = found[i]
            if chosen is not None:
                picks[row] = chosen[p.fronts[row]:]
                continue
            below = int(lists[i][-1]) - 1  # nothing in this window fits: continue below it
            if below >= 0 and np.isfinite(fw.final[row, :below + 1]).any():
                top[row] = below
                remaining.append(row)
        todo = remaining
    return picks


def _distinct_budgets(final: np.ndarray, hi: int, span: int) -> np.ndarray:
    """The budgets of the window [hi − span, hi] where the optimum changes, largest first."""
    lo = max(0, hi - span)
    seg = final[lo:hi + 1]
    change = np.ones(len(seg), dtype=bool)
    change[1:] = seg[1:] < seg[:-1]
    picks = (np.nonzero(change & np.isfinite(seg))[0] + lo)[::-1][:MAX_CANDIDATES]
    return picks if len(picks) else np.array([hi])


def _backtrack(costs: GalvatronCosts, p: _Packed, fw: _Forward, rows: np.ndarray,
               cand: np.ndarray) -> list[list[int] | None]:
    """Recover the strategies (slots) of candidate forward budgets, check their
    exact E_all and screen them by ``stage_objective``; each problem's
    cheapest fitting one (None if none fits)."""
    choices = _walk_back(costs, p, fw, rows, cand)
    layer_axis = np.arange(p.depth)[:, None, None]
    prob_axis = rows[None, :, None]

    def gather(values: np.ndarray) -> np.ndarray:
        return values[prob_axis, layer_axis, choices]

    working = working_beyond_stored(gather(p.act), gather(p.bwd), axis=0)
    e_all = np.asarray(peak_memory_bytes(gather(p.fwd).sum(axis=0), 0.0, 0.0, working,
                                         gather(p.gathered).max(axis=0), p.overheads[rows][:, None]))
    fits: np.ndarray = (e_all <= p.caps[rows][:, None]) & np.isfinite(fw.final[rows[:, None], cand])
    sums = {name: gather(p.parts[name]).sum(axis=0) for name in COMPONENTS}
    screen, _ = stage_objective(sums, _transform_sums(costs, p, rows, choices), p.ms[rows][:, None],
                                costs.workload.overlap_grad_sync, costs.kernel.overlap_slowdown)
    result: list[list[int] | None] = []
    for i in range(len(rows)):
        ok = np.nonzero(fits[i])[0]
        if not len(ok):
            result.append(None)
            continue
        pick = ok[np.lexsort((e_all[i, ok], screen[i, ok]))[0]]
        result.append([int(c) for c in choices[:, i, pick]])
    return result


def _walk_back(costs: GalvatronCosts, p: _Packed, fw: _Forward, rows: np.ndarray, cand: np.ndarray) -> np.ndarray:
    """(depth, problems, candidates) slots. The predecessor of a layer's strategy
    is found as the forward pass chose it: the best TP group (R only depends on
    TP degrees), then the best slot inside that group; ties keep the layer's own
    strategy so that identical layers form runs."""
    num_groups, per_group = costs.slot_shape
    n_slots = num_groups * per_group
    slot_group = np.repeat(np.arange(num_groups), per_group)
    trans = p.transform.astype(np.float32)[rows]
    r_axis, r3 = rows[:, None], rows[:, None, None]
    last = fw.history[-1][r3, np.arange(n_slots)[None, :, None], cand[:, None, :]]
    s_cur = last.argmin(axis=1)
    e_cur = cand.copy()
    choices = np.empty((p.depth,) + cand.shape, dtype=np.int64)
    p_axis = np.arange(len(rows))[:, None, None]
    t_axis = np.arange(num_groups)[None, :, None]
    k_axis = np.arange(per_group)[None, :, None]
    for layer in range(p.depth - 1, -1, -1):
        choices[layer] = s_cur
        if layer == 0:
            break
        e_cur = np.maximum(e_cur - p.weight[r_axis, layer, s_cur], 0)
        e3 = e_cur[:, None, :]
        vals = fw.group_history[layer][r3, t_axis, e3] + trans[:, layer][p_axis, t_axis, slot_group[s_cur][:, None, :]]
        t_best = vals.argmin(axis=1)
        low = vals.min(axis=1)
        inside = fw.history[layer - 1][r3, t_best[:, None, :] * per_group + k_axis, e3]
        s_best = t_best * per_group + inside.argmin(axis=1)
        here = fw.history[layer - 1][r_axis, s_cur, e_cur]
        s_cur = np.where(here <= low + 1e-6 * np.abs(low), s_cur, s_best)
    return choices


def _transform_sums(costs: GalvatronCosts, p: _Packed, rows: np.ndarray, choices: np.ndarray) -> np.ndarray:
    """Per micro-batch R of each candidate (problems, candidates)."""
    if p.depth < 2:
        return np.zeros(choices.shape[1:])
    _, per_group = costs.slot_shape
    groups = choices // per_group
    per_mb = p.transform[rows] / p.ms[rows][:, None, None, None]
    p_idx = np.arange(len(rows))[None, :, None]
    return per_mb[p_idx, np.arange(1, p.depth)[:, None, None], groups[:-1], groups[1:]].sum(axis=0)


def _coarse_picks(costs: GalvatronCosts, p: _Packed) -> list[list[int] | None]:
    """Galvatron's coarse mode: the one strategy for every layer of the stage
    that fits and screens cheapest."""
    ok = p.valid.all(axis=1)
    memory = peak_memory_bytes(p.fwd.sum(axis=1), 0.0, 0.0, working_beyond_stored(p.act, p.bwd, axis=1),
                               p.gathered.max(axis=1),
                               p.overheads[:, None])
    ok &= memory <= p.caps[:, None]
    sums = {name: p.parts[name].sum(axis=1) for name in COMPONENTS}
    screen, _ = stage_objective(sums, np.zeros(ok.shape), p.ms[:, None], costs.workload.overlap_grad_sync,
                                costs.kernel.overlap_slowdown)
    screen = np.where(ok, screen, INF)
    picks: list[list[int] | None] = []
    for row in range(len(p.usable)):
        slot = int(screen[row].argmin())
        picks.append([slot] * (p.depth - p.fronts[row]) if ok[row, slot] else None)
    return picks


def _solution(costs: GalvatronCosts, indices: Sequence[int], ctx: StageContext, slots: list[int]) -> StageSolution:
    """The stage of these slots, costed by the kernel."""
    chosen = tuple(costs.strategy_at_slot[s] for s in slots)
    stage = stage_of(costs, indices, ctx, chosen)
    timing = costs.cost_model.stage_timing(stage, ctx.micro_batch_size)
    memory = np.asarray(costs.cost_model.device_memory(stage, ctx.micro_batch_size, ctx.in_flight), dtype=np.int64)
    fits = bool((memory <= costs.kernel.cluster_arrays.capacity[costs.kernel.device_array(ctx.devices)]).all())
    tail = exposed_grad_sync(timing.grad_sync_s, timing.back_s, costs.workload.overlap_grad_sync,
                             costs.kernel.overlap_slowdown)
    cost = ctx.num_micro_batches * timing.per_micro_batch_s + tail + timing.post_step_s + timing.optimizer_s
    return StageSolution(chosen, stage, timing, float(cost), float(memory.max()), fits)


def stage_of(costs: GalvatronCosts, indices: Sequence[int], ctx: StageContext, chosen: Sequence[int]) -> Stage:
    """The Plan stage running ``indices`` with the chosen strategies; the stage's
    own (dp, tp) is its layers' most common one."""
    strategies = [costs.strategies[c] for c in chosen]
    tps = [s.tp for s in strategies]
    tp = max(sorted(set(tps)), key=tps.count)
    dp = len(ctx.devices) // tp
    mbs = ctx.micro_batch_size
    return Stage(layers=tuple(indices), devices=ctx.devices, dp=dp, tp=tp, dp_split=(mbs // dp,) * dp,
                 strategies=tuple(s.layer_strategy() for s in strategies))
