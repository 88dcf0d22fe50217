"""Communication curves over real torch.distributed process groups.

For each collective (all-reduce, all-gather, reduce-scatter, broadcast,
point-to-point send/recv, all-to-all), each group size and each message size
from 1 KiB up to a maximum (doubling, as nccl-tests steps), every process of
the run takes part at once -- all groups of one size run side by side, as the
TP or DP groups of a training job do -- so shared links and cores are as
contended as in training. A repeat's time is the slowest rank's (the
collective is done when every rank is); the curve keeps the median of the
repeats.

Sizes and bandwidths follow nccl-tests (doc/PERFORMANCE.md): ``bytes`` is the
whole buffer (all-gather's output, reduce-scatter's input, each rank's
all-to-all buffer), algbw = bytes / time, and the bus bandwidth, comparable
with the link's speed whatever the collective, is algbw times 2(n-1)/n for
all-reduce, (n-1)/n for all-gather, reduce-scatter and all-to-all, 1 for
broadcast and send/recv. Bandwidths are stored in gigabits per second, the
unit of hetplan's cluster files, so a measured curve reads against the
cluster's ``intra_bandwidth_gbps``.

Each curve is also fitted to time = alpha + bytes / bandwidth (the
alpha-beta model the cost model's data-parallel collectives use), by least
squares on relative errors: plain least squares would let the largest
messages decide alone, and alpha is what the small ones measure.

An operation the backend refuses is recorded as unsupported, not emulated:
an emulation's time is not the collective's.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np

from hetplan.profile.db import CollectiveFit, CollectivePoint, Unsupported
from hetplan.runtime.profiling.timing import Stopwatch, median

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "p2p", "all_to_all")
MIN_BYTES = 1024
ELEMENT_BYTES = 4  # float32 buffers


def bus_factor(op: str, ranks: int) -> float:
    """busbw / algbw for ``op`` over ``ranks`` processes (nccl-tests)."""
    n = ranks
    if op == "all_reduce":
        return 2.0 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    return 1.0


def message_sizes(max_bytes: int, min_bytes: int = MIN_BYTES) -> list[int]:
    """min, 2·min, 4·min, ... up to ``max_bytes`` (itself included)."""
    sizes = []
    size = min_bytes
    while size < max_bytes:
        sizes.append(size)
        size *= 2
    if max_bytes >= min_bytes:
        sizes.append(max_bytes)
    return sizes


def gbps(bytes_per_s: float) -> float:
    """Bytes per second in gigabits per second."""
    return bytes_per_s * 8.0 / 1e9


def fit_alpha_beta(sizes: Sequence[float], times: Sequence[float]) -> tuple[float, float]:
    """(alpha_s, bandwidth in bytes/s) of time = alpha + bytes / bandwidth,
    least squares on relative errors; alpha is held at 0 when the free fit
    makes it negative. ValueError when time does not grow with size (the
    curve never left its latency: it says nothing about bandwidth)."""
    x = np.asarray(sizes, dtype=float)
    t = np.asarray(times, dtype=float)
    if len(x) < 2 or np.any(t <= 0):
        raise ValueError("need two or more sizes with positive times")
    w = 1.0 / t
    (alpha, slope), *_ = np.linalg.lstsq(np.stack([w, w * x], axis=1), w * t, rcond=None)
    if alpha < 0:
        alpha = 0.0
        slope = float(np.sum(w * w * x * t) / np.sum(w * w * x * x))
    if not slope * x.max() > 1e-3 * (alpha + slope * x.max()):  # under 0.1% of the largest message's time
        raise ValueError("time does not grow with the message size: no bandwidth to fit")
    return float(alpha), float(1.0 / slope)


# --- running one collective -----------------------------------------------------------------
def collective_call(op: str, inp: Any, group: Any, ranks: int) -> Callable[[], None]:
    """A call running ``op`` once on ``inp`` over ``group`` (None: the world),
    its output buffers allocated once here. ``p2p``: rank 0 of the group
    sends to rank 1 (a group of two)."""
    import torch
    import torch.distributed as dist

    if op == "all_reduce":
        return lambda: dist.all_reduce(inp, group=group)
    if op == "all_gather":
        out = torch.empty((inp.shape[0] * ranks, *inp.shape[1:]), dtype=inp.dtype, device=inp.device)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        return lambda: gather(out, inp, group=group)
    if op == "reduce_scatter":
        out = torch.empty((inp.shape[0] // ranks, *inp.shape[1:]), dtype=inp.dtype, device=inp.device)
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        return lambda: scatter(out, inp, group=group)
    if op == "all_to_all":
        out = torch.empty_like(inp)
        return lambda: dist.all_to_all_single(out, inp, group=group)
    first = dist.get_global_rank(group, 0) if group is not None else 0
    if op == "broadcast":
        return lambda: dist.broadcast(inp, src=first, group=group)
    if op == "p2p":
        me = dist.get_rank(group) if group is not None else dist.get_rank()
        peer = dist.get_global_rank(group, 1 - me) if group is not None else 1 - me
        return (lambda: dist.send(inp, dst=peer, group=group)) if me == 0 else \
            (lambda: dist.recv(inp, src=peer, group=group))
    raise ValueError(f"unknown collective {op!r}")


def input_for(op: str, nbytes: int, ranks: int, device: Any) -> Any:
    """The input buffer for a message of (about) ``nbytes``: a multiple of
    ``ranks`` elements, so every rank's share is whole."""
    import torch

    count = max(ranks, nbytes // ELEMENT_BYTES // ranks * ranks)
    if op == "all_gather":
        count //= ranks  # each rank contributes its share of the output
    return torch.ones(count, dtype=torch.float32, device=device)


def buffer_bytes(op: str, inp: Any, ranks: int) -> int:
    """The nccl-tests size of a call on ``inp``."""
    nbytes = inp.numel() * inp.element_size()
    return nbytes * ranks if op == "all_gather" else nbytes


def time_call(call: Callable[[], None], warmup: int, repeats: int, stopwatch: Stopwatch) -> list[float]:
    """Seconds of each repeat on every rank at once, the slowest rank's each time."""
    import torch
    import torch.distributed as dist

    for _ in range(warmup):
        call()
    laps = []
    for _ in range(repeats):
        dist.barrier()
        stopwatch.start()
        call()
        stopwatch.mark()
        laps.extend(stopwatch.laps())
    device = "cuda" if stopwatch.cuda else "cpu"
    slowest = torch.tensor(laps, dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return slowest.tolist()


# --- the curves ---------------------------------------------------------------------------------
Progress = Callable[[str, float], None]


def _groups(ranks: int, world: int) -> Any:
    """This rank's group among consecutive groups of ``ranks`` (None: the world)."""
    import torch.distributed as dist

    if ranks == world:
        return None
    group, _ = dist.new_subgroups(group_size=ranks)
    return group


def _pairs(world: int) -> Any:
    """Groups (0, 1), (2, 3), ...; a last odd rank gets a group of its own and idles."""
    import torch.distributed as dist

    pairs = [list(range(r, min(r + 2, world))) for r in range(0, world, 2)]
    group, _ = dist.new_subgroups_by_enumeration(pairs)
    return group


def measure_curves(group_sizes: Sequence[int], max_bytes: int, warmup: int, repeats: int, device: Any,
                   link_of: Callable[[int], str], progress: Progress | None = None,
                   ops: Sequence[str] = OPS) -> tuple[list[CollectivePoint], list[CollectiveFit], list[Unsupported]]:
    """Curves, fits and refusals for every op over groups of each size in
    ``group_sizes`` (``p2p``: pairs of ranks). Every rank of the world calls
    this with the same arguments; every rank returns the same results."""
    import torch.distributed as dist

    world = dist.get_world_size()
    stopwatch = Stopwatch(device)
    sizes = message_sizes(max_bytes)
    points: list[CollectivePoint] = []
    fits: list[CollectiveFit] = []
    refused: list[Unsupported] = []
    groups: dict[tuple[int, bool], Any] = {}
    for ranks, op in curve_list(group_sizes, world, ops):
        key = (ranks, op == "p2p")
        if key not in groups:  # every rank creates the same groups in the same order
            groups[key] = _pairs(world) if op == "p2p" else _groups(ranks, world)
        group = groups[key]
        in_pair = op != "p2p" or dist.get_rank() < world - world % 2
        link = link_of(ranks)
        curve = _one_curve(op, ranks, group, sizes, warmup, repeats, device, stopwatch, in_pair)
        if isinstance(curve, str):
            refused.append(Unsupported(op, ranks, link, curve))
        else:
            points += [CollectivePoint(op, ranks, link, b, t, gbps(b / t * bus_factor(op, ranks)))
                       for b, t in curve]
            fit = _fit(op, ranks, link, curve)
            if fit is not None:
                fits.append(fit)
        if progress is not None:
            progress(f"{op} over {ranks} ranks ({link})", 1.0)
    return points, fits, refused


def curve_list(group_sizes: Sequence[int], world: int, ops: Sequence[str]) -> list[tuple[int, str]]:
    """(group size, op) to measure: p2p once, between pairs; the others per size >= 2."""
    out = [(2, "p2p")] if "p2p" in ops and world >= 2 else []
    for ranks in sorted(set(group_sizes)):
        if ranks >= 2 and world % ranks == 0:
            out += [(ranks, op) for op in ops if op != "p2p"]
    return out


def _one_curve(op: str, ranks: int, group: Any, sizes: Sequence[int], warmup: int, repeats: int, device: Any,
               stopwatch: Stopwatch, active: bool) -> list[tuple[int, float]] | str:
    """(bytes, median seconds) per size, or why the backend refused the op."""
    curve = []
    for nbytes in sizes:
        inp = input_for(op, nbytes, ranks, device)
        call = collective_call(op, inp, group, ranks) if active else (lambda: None)
        if not curve:
            try:  # a backend without this collective (gloo lacks some) is recorded as unsupported
                call()
            except (RuntimeError, NotImplementedError, ValueError) as exc:
                return f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
        curve.append((buffer_bytes(op, inp, ranks), median(time_call(call, warmup, repeats, stopwatch))))
    return curve


def _fit(op: str, ranks: int, link: str, curve: list[tuple[int, float]]) -> CollectiveFit | None:
    try:
        alpha, bandwidth = fit_alpha_beta([b for b, _ in curve], [t for _, t in curve])
    except ValueError:
        return None
    return CollectiveFit(op, ranks, link, alpha, gbps(bandwidth), gbps(bandwidth * bus_factor(op, ranks)))


def predicted_seconds(group_sizes: Sequence[int], world: int, max_bytes: int, warmup: int, repeats: int,
                      link_gbps: float, ops: Sequence[str] = OPS) -> float:
    """A rough duration of :func:`measure_curves` before it runs (for the
    progress line): every byte at the link's speed plus 100 µs a call."""
    calls = (warmup + repeats + 2) * len(message_sizes(max_bytes))
    bytes_per_curve = (warmup + repeats + 2) * 2 * max_bytes
    curves = len(curve_list(group_sizes, world, ops))
    return curves * (calls * 1e-4 + bytes_per_curve * 2 / (link_gbps * 1e9 / 8))
