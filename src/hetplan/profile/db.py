"""ProfileDB: measured per-layer times, which the cost model prefers to FLOPs.

AMP §3.4 explains why: small matrices run far below peak and the efficiency
depends on shapes, so a measured time beats a FLOP count. An entry is keyed by
the layer's ``profile_key`` (layers of equal shape share it, so repeated layers
are profiled once — Metis §4.3), the GPU type, the TP degree and the
per-replica batch size. A batch size that was not profiled is estimated from
profiled ones: linearly between the nearest two, or as a sum of profiled sizes
(Metis: mbs 7 = 1 + 2 + 4) when it lies outside them.

File format (JSON)::

    {"entries": [{"layer": "decoder:...", "gpu": "T4", "tp": 1, "batch": 4,
                  "fwd_s": 0.0123, "bwd_s": 0.0247, "memory_bytes": 123456}]}
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from typing import Iterable

from hetplan.errors import HetplanError
from hetplan.userfiles import read_json


@dataclass(frozen=True)
class ProfileEntry:
    layer: str
    gpu: str
    tp: int
    batch: int
    fwd_s: float
    bwd_s: float
    memory_bytes: int = 0


def read_profile_json(path: str) -> object:
    """Parsed JSON of a profile file; unreadable or malformed files are one clear error."""
    return read_json(path, "profile")


class ProfileDB:
    """Measured layer times; ``lookup`` returns (fwd_s, bwd_s) or None."""

    def __init__(self, entries: Iterable[ProfileEntry] = ()) -> None:
        self._by_key: dict[tuple[str, str, int], dict[int, ProfileEntry]] = {}
        for entry in entries:
            self.add(entry)

    def add(self, entry: ProfileEntry) -> None:
        if entry.batch <= 0 or entry.tp <= 0 or entry.fwd_s < 0 or entry.bwd_s < 0:
            raise HetplanError(f"profile entry for {entry.layer} has non-positive batch/tp or negative time")
        self._by_key.setdefault((entry.layer, entry.gpu, entry.tp), {})[entry.batch] = entry

    def __len__(self) -> int:
        return sum(len(v) for v in self._by_key.values())

    def entries(self) -> list[ProfileEntry]:
        return [e for k in sorted(self._by_key) for _, e in sorted(self._by_key[k].items())]

    def has(self, layer: str, gpu: str, tp: int) -> bool:
        return (layer, gpu, tp) in self._by_key

    def lookup(self, layer: str, gpu: str, tp: int, batch: float) -> tuple[float, float] | None:
        """Time of one forward and backward pass of ``layer`` on ``batch`` samples."""
        table = self._by_key.get((layer, gpu, tp))
        if not table or batch <= 0:
            return None
        if batch in table:
            e = table[int(batch)]
            return e.fwd_s, e.bwd_s
        sizes = sorted(table)
        below = [b for b in sizes if b < batch]
        above = [b for b in sizes if b > batch]
        if below and above:
            lo, hi = table[below[-1]], table[above[0]]
            w = (batch - lo.batch) / (hi.batch - lo.batch)
            return lo.fwd_s + w * (hi.fwd_s - lo.fwd_s), lo.bwd_s + w * (hi.bwd_s - lo.bwd_s)
        # outside the profiled range: compose from profiled sizes, largest first
        remaining, fwd, bwd = float(batch), 0.0, 0.0
        for b in reversed(sizes):
            while remaining >= b:
                fwd += table[b].fwd_s
                bwd += table[b].bwd_s
                remaining -= b
        if remaining > 0:  # a fraction of the smallest profiled size, linearly
            smallest = table[sizes[0]]
            fwd += smallest.fwd_s * remaining / smallest.batch
            bwd += smallest.bwd_s * remaining / smallest.batch
        return fwd, bwd

    # --- files -----------------------------------------------------------------
    def to_json(self) -> str:
        return json.dumps({"entries": [asdict(e) for e in self.entries()]}, indent=1)

    @staticmethod
    def load(path: str | os.PathLike[str]) -> ProfileDB:
        """The measured times of a profile file (any format's ``entries``; see
        ``hetplan.profile.load_profile`` for the format-aware loader)."""
        path = os.fspath(path)
        data = read_profile_json(path)
        try:
            return ProfileDB(ProfileEntry(**e) for e in data["entries"])  # type: ignore[index]
        except (KeyError, TypeError) as exc:
            raise HetplanError(f"profile {path} is malformed: {exc}") from None
