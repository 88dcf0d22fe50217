"""ProfileDB: measured per-layer times, which the cost model prefers to FLOPs.

AMP §3.4 explains why: small matrices run far below peak and the efficiency
depends on shapes, so a measured time beats a FLOP count. An entry is keyed by
the layer's ``profile_key`` (layers of equal shape share it, so repeated layers
are profiled once — Metis §4.3), the GPU type, the TP degree and the
per-replica batch size. A batch size that was not profiled is estimated from
profiled ones: linearly between the nearest two, or as a sum of profiled sizes
(Metis: mbs 7 = 1 + 2 + 4) when it lies outside them.

File format (JSON; every field and unit in docs/profiling.md)::

    {"format": "hetplan-profile", "version": 2,
     "entries": [{"layer": "decoder:...", "gpu": "T4", "tp": 1, "batch": 4,
                  "fwd_s": 0.0123, "bwd_s": 0.0247, "memory_bytes": 123456,
                  "fwd_spread_s": 0.0002, "bwd_spread_s": 0.0003,
                  "tp_comm_fwd_s": 0.0, "tp_comm_bwd_s": 0.0}],
     "collectives": [{"op": "all_reduce", "ranks": 2, "link": "intra", "bytes": 1024,
                      "time_s": 3.1e-05, "busbw_gbps": 0.26}],
     "fits": [{"op": "all_reduce", "ranks": 2, "link": "intra", "alpha_s": 2.9e-05,
               "bandwidth_gbps": 9.1, "busbw_gbps": 9.1}],
     "unsupported": [{"op": "...", "ranks": 2, "link": "intra", "reason": "..."}],
     "chains": [{"gpu": "T4", "tp": 1, "batch": 4, "layers": ["embedding:...", "decoder:...", "decoder:...",
                 "head:..."], "fwd_s": 0.031, "bwd_s": 0.062}],
     "data_parallel": [{"layer": "decoder:...", "gpu": "T4", "tp": 1, "ranks": 2, "zero": 3, "params": 787456,
                        "fwd_extra_s": 0.004, "bwd_extra_s": 0.009}],
     "host": [{"gpu": "T4", "op_s": 1.4e-05, "ops": 250}],
     "machine": {"hostname": "...", "torch": "2.13.0", ...},
     "settings": {"model": "tiny-gpt", ...}}

Only ``entries`` is required: files that hold nothing else (hetplan before
``hetplan profile``) load as before. Optional entry fields default to 0 and
are written only when set, so an entry of such a file is written back as it was.

``fwd_s``/``bwd_s`` are what the layer took as the runtime runs it, TP
collectives included; ``tp_comm_*_s`` is the part of that which the layer's TP
collectives take when run alone. :meth:`ProfileDB.lookup` returns the compute
part (the difference), because the cost model adds its own TP communication.

``data_parallel`` holds what the runtime's data-parallel wrappers add to a
layer's pass over groups of ``ranks`` processes (ZeRO-0: ``replicate`` and its
gradient all-reduce; ZeRO-3: ``fully_shard`` and its gathers and
reduce-scatters; ZeRO-2 in between), copies and hooks included: :meth:`ProfileDB.data_parallel_rate`
turns them into seconds per parameter, which the cost model uses in place of
its alpha-beta estimate of those collectives.

``host`` holds the host time to dispatch one ATen operator on each GPU type
(``op_s``, from a run of ``ops`` tiny operators, forward and backward under
autocast): :meth:`ProfileDB.host_op_s`, which the cost kernel takes in place of
its default ``HOST_OP_S`` for host-bound passes. The entry keyed
:data:`LOSS_KEY` is the training loss on the head's output (the runtime applies
it outside the head's module), measured beside the layers.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, fields
from typing import Any, Callable, Iterable, Mapping

from hetplan.io import fields as typed
from hetplan.limits import MAX_GLOBAL_BATCH, MAX_GPUS, MAX_GPUS_PER_NODE
from hetplan.errors import HetplanError
from hetplan.io.userfiles import read_json

FORMAT = "hetplan-profile"
VERSION = 2


@dataclass(frozen=True)
class ProfileEntry:
    """One layer kind on one GPU type, TP degree and micro-batch size.

    Times are seconds of one pass on ``batch`` samples on one GPU of the TP
    group; spreads are the interquartile range of the repeats (0: not
    recorded); ``memory_bytes`` is what the layer holds for one micro-batch
    (parameters, gradients, activations saved for backward).
    """

    layer: str
    gpu: str
    tp: int
    batch: int
    fwd_s: float
    bwd_s: float
    memory_bytes: int = 0
    fwd_spread_s: float = 0.0
    bwd_spread_s: float = 0.0
    tp_comm_fwd_s: float = 0.0
    tp_comm_bwd_s: float = 0.0

    def compute_times(self) -> tuple[float, float]:
        """(fwd, bwd) without the TP collectives measured inside them: what the
        cost model wants, as it adds its own TP communication."""
        return max(0.0, self.fwd_s - self.tp_comm_fwd_s), max(0.0, self.bwd_s - self.tp_comm_bwd_s)

    def to_dict(self) -> dict[str, Any]:
        """The entry as JSON, optional fields only when set (old readers and
        old files see the format they know)."""
        data = asdict(self)
        for name in OPTIONAL_ENTRY_FIELDS:
            if not data[name]:
                del data[name]
        return data


_ENTRY_FIELDS = [f.name for f in fields(ProfileEntry)]
_REQUIRED_ENTRY_FIELDS = ("layer", "gpu", "tp", "batch", "fwd_s", "bwd_s")
OPTIONAL_ENTRY_FIELDS = tuple(n for n in _ENTRY_FIELDS if n not in _REQUIRED_ENTRY_FIELDS)


@dataclass(frozen=True)
class CollectivePoint:
    """Median time of one collective on ``bytes`` (the NCCL-tests "size": the
    whole buffer; all-gather's output, reduce-scatter's input) over groups of
    ``ranks`` processes; ``busbw_gbps`` in gigabits per second."""

    op: str
    ranks: int
    link: str
    bytes: int
    time_s: float
    busbw_gbps: float


@dataclass(frozen=True)
class CollectiveFit:
    """time = alpha_s + bytes / bandwidth, fitted over the measured sizes;
    ``bandwidth_gbps`` is that bandwidth (algorithm bandwidth) and
    ``busbw_gbps`` the bus bandwidth it means, both in gigabits per second."""

    op: str
    ranks: int
    link: str
    alpha_s: float
    bandwidth_gbps: float
    busbw_gbps: float


@dataclass(frozen=True)
class Unsupported:
    """A collective the backend could not run (nothing measured for it)."""

    op: str
    ranks: int
    link: str
    reason: str


@dataclass(frozen=True)
class DataParallelPoint:
    """Seconds the runtime's ZeRO-``zero`` wrapper adds to one forward and one
    backward pass of ``layer`` (``params`` parameters on each process, TP
    shards at ``tp``) over groups of ``ranks`` processes: the wrapped layer's
    median minus the plain one's."""

    layer: str
    gpu: str
    tp: int
    ranks: int
    zero: int
    params: int
    fwd_extra_s: float
    bwd_extra_s: float


@dataclass(frozen=True)
class ChainPoint:
    """One micro-batch through a chain of layers (``layers``: their profile
    keys, in order) on one GPU of the TP group, run as the runtime runs a
    stage: one layer's output straight into the next one's forward."""

    gpu: str
    tp: int
    batch: int
    layers: tuple[str, ...]
    fwd_s: float
    bwd_s: float


@dataclass(frozen=True)
class HostPoint:
    """Host seconds per dispatched ATen operator on one GPU type (``op_s``),
    from timing ``ops`` tiny operators whose device work is shorter than their dispatch."""

    gpu: str
    op_s: float
    ops: int


# The entry key of the measured loss (no layer's profile_key: those are "<kind>:<shape>")
LOSS_KEY = "loss"
DATA_PARALLEL_ZERO = (0, 2, 3)  # the wrappers hetplan profile measures (runtime/parallelize.apply_dp)
MACHINE_KEYS = ("hostname", "torch", "python", "platform", "device", "backend", "threads", "processes", "cores")
SETTINGS_KEYS = ("model", "seq_len", "cluster", "precision", "tp", "batches", "warmup", "repeats",
                 "comm_max_bytes", "timer", "statistic")
_TOP_KEYS = ("format", "version", "entries", "collectives", "fits", "unsupported", "chains", "data_parallel",
             "host", "machine", "settings")


def _compose(table: Mapping[int, ProfileEntry], batch: float,
             times: Callable[[ProfileEntry], tuple[float, float]]) -> tuple[float, float]:
    """(fwd, bwd) ``times`` at ``batch``: measured, linear between the nearest
    two measured sizes, or (outside them) composed from measured sizes,
    largest first (Metis: 7 = 4 + 2 + 1), a fraction of the smallest last."""
    if batch in table:
        return times(table[int(batch)])
    sizes = sorted(table)
    below = [b for b in sizes if b < batch]
    above = [b for b in sizes if b > batch]
    if below and above:
        lo, hi = table[below[-1]], table[above[0]]
        (lo_f, lo_b), (hi_f, hi_b) = times(lo), times(hi)
        w = (batch - lo.batch) / (hi.batch - lo.batch)
        return lo_f + w * (hi_f - lo_f), lo_b + w * (hi_b - lo_b)
    remaining, fwd, bwd = float(batch), 0.0, 0.0
    for b in reversed(sizes):
        while remaining >= b:
            f, g = times(table[b])
            fwd += f
            bwd += g
            remaining -= b
    if remaining > 0:
        f, g = times(table[sizes[0]])
        fwd += f * remaining / sizes[0]
        bwd += g * remaining / sizes[0]
    return fwd, bwd


def read_profile_json(path: str) -> object:
    """Parsed JSON of a profile file; unreadable or malformed files are one clear error."""
    return read_json(path, "profile")


class ProfileDB:
    """Measured layer times (``lookup`` returns (fwd_s, bwd_s) or None), and
    what else ``hetplan profile`` measured: collectives, fits, the machine."""

    def __init__(self, entries: Iterable[ProfileEntry] = (), *, collectives: Iterable[CollectivePoint] = (),
                 fits: Iterable[CollectiveFit] = (), unsupported: Iterable[Unsupported] = (),
                 chains: Iterable[ChainPoint] = (), data_parallel: Iterable[DataParallelPoint] = (),
                 host: Iterable[HostPoint] = (), machine: Mapping[str, Any] | None = None,
                 settings: Mapping[str, Any] | None = None) -> None:
        self._by_key: dict[tuple[str, str, int], dict[int, ProfileEntry]] = {}
        for entry in entries:
            self.add(entry)
        self.collectives = sorted(collectives, key=lambda c: (c.op, c.link, c.ranks, c.bytes))
        self.fits = sorted(fits, key=lambda f: (f.op, f.link, f.ranks))
        self.unsupported = sorted(unsupported, key=lambda u: (u.op, u.link, u.ranks))
        self.chains = sorted(chains, key=lambda c: (c.gpu, c.tp, c.batch))
        self.data_parallel = sorted(data_parallel, key=lambda d: (d.gpu, d.tp, d.ranks, d.zero, d.layer))
        for point in self.data_parallel:
            if point.zero not in DATA_PARALLEL_ZERO:
                raise HetplanError(f"profile data_parallel entry for {point.layer}: zero must be one of "
                                   f"{', '.join(map(str, DATA_PARALLEL_ZERO))}, got {point.zero}")
        self.host = sorted(host, key=lambda h: h.gpu)
        for host_point in self.host:
            if host_point.op_s <= 0 or host_point.ops <= 0:
                raise HetplanError(f"profile host entry for {host_point.gpu}: op_s and ops must be positive")
        self.machine = dict(machine or {})
        self.settings = dict(settings or {})

    def add(self, entry: ProfileEntry) -> None:
        if entry.batch <= 0 or entry.tp <= 0 or entry.fwd_s < 0 or entry.bwd_s < 0:
            raise HetplanError(f"profile entry for {entry.layer} has non-positive batch/tp or negative time")
        self._by_key.setdefault((entry.layer, entry.gpu, entry.tp), {})[entry.batch] = entry

    def __len__(self) -> int:
        return sum(len(v) for v in self._by_key.values())

    def entries(self) -> list[ProfileEntry]:
        return [e for k in sorted(self._by_key) for _, e in sorted(self._by_key[k].items())]

    def layers(self) -> set[str]:
        """The layer keys measured at any GPU type, TP degree and batch (the loss included)."""
        return {layer for layer, _, _ in self._by_key}

    def host_op_s(self, gpu: str) -> float | None:
        """Measured host seconds per dispatched operator on ``gpu``; None where not measured."""
        return next((h.op_s for h in self.host if h.gpu == gpu), None)

    def has(self, layer: str, gpu: str, tp: int) -> bool:
        return (layer, gpu, tp) in self._by_key

    def includes_tp_comm(self, layer: str, gpu: str, tp: int) -> bool:
        """Whether the measured times of ``layer`` at ``tp`` hold its TP
        collectives (``hetplan profile`` timed them inside the layer, and apart)."""
        table = self._by_key.get((layer, gpu, tp), {})
        return tp > 1 and any(e.tp_comm_fwd_s > 0 or e.tp_comm_bwd_s > 0 for e in table.values())

    def lookup(self, layer: str, gpu: str, tp: int, batch: float,
               with_tp_comm: bool = False) -> tuple[float, float] | None:
        """Time of one forward and backward pass of ``layer`` on ``batch``
        samples: compute only, or as measured, TP collectives included."""
        table = self._by_key.get((layer, gpu, tp))
        if not table or batch <= 0:
            return None
        if with_tp_comm:
            return _compose(table, batch, lambda e: (e.fwd_s, e.bwd_s))
        return _compose(table, batch, ProfileEntry.compute_times)

    def chain_factor(self, gpu: str, tp: int, batch: float) -> float:
        """How much longer the layers take chained in one micro-batch than one
        by one (the chain's time over the sum of its layers' entries), at the
        measured batch nearest ``batch``; 1 where no chain was measured."""
        points = [c for c in self.chains if c.gpu == gpu and c.tp == tp]
        if not points or batch <= 0:
            return 1.0
        near = min(points, key=lambda c: (abs(math.log(c.batch / batch)), c.batch))
        parts = [self.lookup(key, gpu, tp, near.batch, with_tp_comm=self.includes_tp_comm(key, gpu, tp))
                 for key in near.layers]
        known = [p for p in parts if p is not None]
        alone = sum(f + b for f, b in known) if len(known) == len(parts) else 0.0
        return (near.fwd_s + near.bwd_s) / alone if alone > 0 else 1.0

    def data_parallel_rate(self, gpu: str, tp: int, ranks: int, zero: int) -> tuple[float, float] | None:
        """(forward, backward) seconds per parameter held that the runtime's
        ZeRO-``zero`` wrapper adds over groups of ``ranks`` processes of ``gpu``
        at TP degree ``tp``, over all the layers measured (their extra time over
        their parameters); None when not measured."""
        points = [d for d in self.data_parallel if (d.gpu, d.tp, d.ranks, d.zero) == (gpu, tp, ranks, zero)]
        params = sum(d.params for d in points)
        if not params:
            return None
        return sum(d.fwd_extra_s for d in points) / params, sum(d.bwd_extra_s for d in points) / params

    # --- files -----------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """The JSON object of the file; parts with nothing in them are left out."""
        data: dict[str, Any] = {"format": FORMAT, "version": VERSION,
                                "entries": [e.to_dict() for e in self.entries()]}
        parts = {"collectives": [asdict(c) for c in self.collectives], "fits": [asdict(f) for f in self.fits],
                 "unsupported": [asdict(u) for u in self.unsupported],
                 "chains": [{**asdict(c), "layers": list(c.layers)} for c in self.chains],
                 "data_parallel": [asdict(d) for d in self.data_parallel],
                 "host": [asdict(h) for h in self.host], "machine": self.machine,
                 "settings": self.settings}
        data.update({k: v for k, v in parts.items() if v})
        return data

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    @staticmethod
    def from_dict(data: Any, source: str = "profile") -> ProfileDB:
        """A ProfileDB from its JSON object, every key and value checked (one
        HetplanError naming the file, the place and the key). A file of
        another format (Metis's) gives its ``entries`` only."""
        if not isinstance(data, dict):
            raise HetplanError(f"{source} is malformed: it must be a JSON object with an 'entries' list")
        if data.get("format", FORMAT) != FORMAT:
            return ProfileDB(parse_entries(data.get("entries"), source))
        typed.mapping(f"{source}", data, _TOP_KEYS, ("entries",))
        return ProfileDB(
            parse_entries(data["entries"], source),
            collectives=_records(data.get("collectives", []), CollectivePoint, f"{source}: collectives"),
            fits=_records(data.get("fits", []), CollectiveFit, f"{source}: fits"),
            unsupported=_records(data.get("unsupported", []), Unsupported, f"{source}: unsupported"),
            chains=_records(data.get("chains", []), ChainPoint, f"{source}: chains"),
            data_parallel=_records(data.get("data_parallel", []), DataParallelPoint, f"{source}: data_parallel"),
            host=_records(data.get("host", []), HostPoint, f"{source}: host"),
            machine=_flat_object(data.get("machine", {}), MACHINE_KEYS, f"{source}: machine"),
            settings=_flat_object(data.get("settings", {}), SETTINGS_KEYS, f"{source}: settings"),
        )

    @staticmethod
    def load(path: str | os.PathLike[str]) -> ProfileDB:
        """The profile file at ``path`` (any format's ``entries``; see
        ``hetplan.profile.load_profile`` for the format-aware loader)."""
        path = os.fspath(path)
        return ProfileDB.from_dict(read_profile_json(path), f"profile {path}")


# --- checking what a file holds ---------------------------------------------------------
_ENTRY_KINDS = {"layer": "text", "gpu": "text", "tp": "tp", "batch": "batch", "memory_bytes": "count"}
_RECORD_KINDS = {"ops": "whole", "op": "text", "link": "text", "reason": "text", "ranks": "ranks", "bytes": "whole",
                 "layer": "text", "gpu": "text", "zero": "count", "params": "whole", "tp": "tp", "batch": "batch",
                 "layers": "texts"}
# The largest a counted field may be: a TP group lies within one node (at most
# MAX_GPUS_PER_NODE GPUs), a measured batch is at most a global batch; an entry
# past them could never be looked up (a plan cannot have that TP degree), so
# counting it would report measurements hetplan never uses.
_MAXIMA = {"tp": MAX_GPUS_PER_NODE, "batch": MAX_GLOBAL_BATCH, "ranks": MAX_GPUS}


def _value(where: str, kind: str, value: Any) -> Any:
    if kind == "text":
        return typed.text(where, value)
    if kind in _MAXIMA:
        return typed.whole(where, value, minimum=1, maximum=_MAXIMA[kind])
    if kind == "whole":
        return typed.whole(where, value, minimum=1)
    if kind == "count":
        return typed.whole(where, value, minimum=0)
    if kind == "texts":
        return tuple(typed.text(f"{where}[{i}]", v) for i, v in enumerate(typed.listing(where, value)))
    return typed.number(where, value, minimum=0.0, strict=False)


def parse_entry(raw: Any, where: str) -> ProfileEntry:
    """One entry object: known keys only, the required ones present, typed values."""
    typed.mapping(where, raw, _ENTRY_FIELDS, _REQUIRED_ENTRY_FIELDS)
    return ProfileEntry(**{k: _value(f"{where}: {k}", _ENTRY_KINDS.get(k, "number"), v) for k, v in raw.items()})


def parse_entries(raw: Any, source: str) -> list[ProfileEntry]:
    """The ``entries`` list of a profile file (any format), each entry checked."""
    if raw is None:
        raise HetplanError(f"{source} is malformed: it has no 'entries' list")
    items = typed.listing(f"{source} is malformed: entries", raw)
    return [parse_entry(e, f"{source} is malformed: entries[{i}]") for i, e in enumerate(items)]


def _records(raw: Any, cls: type, where: str) -> list[Any]:
    names = [f.name for f in fields(cls)]
    out = []
    for i, item in enumerate(typed.listing(where, raw)):
        at = f"{where}[{i}]"
        typed.mapping(at, item, names, names)
        out.append(cls(**{k: _value(f"{at}: {k}", _RECORD_KINDS.get(k, "number"), v) for k, v in item.items()}))
    return out


def _flat_object(raw: Any, allowed: Iterable[str], where: str) -> dict[str, Any]:
    """An object of known keys whose values are text, numbers or lists of numbers."""
    typed.mapping(where, raw, allowed)
    for key, value in raw.items():
        items = value if isinstance(value, list) else [value]
        for item in items:
            if isinstance(item, bool) or not isinstance(item, (str, int, float)):
                raise HetplanError(f"{where}: {key} must be text, a number or a list of numbers, got {value!r}")
            if isinstance(item, float):
                typed.number(f"{where}: {key}", item, minimum=None)
    return dict(raw)
