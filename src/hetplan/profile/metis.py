"""Metis's profiling scheme (Metis §4.3) as a ProfileDB the cost model can use.

What Metis measures, and what this format holds:

* **layer times** per GPU type, per TP degree in {1, 2, 4, 8} and per
  micro-batch size in {1, 2, 4, 8, 16, ...}; layers that repeat (the blocks of
  a transformer) share a ``profile_key`` and are profiled once. The time of a
  range of layers is the sum of its layers' times. A micro-batch size that was
  not profiled is *composed* from profiled ones: mbs 7 = mbs 4 + mbs 2 + mbs 1
  (largest first; a remaining fraction of the smallest size counts linearly).
  Layer times are compute only: the cost model adds TP communication.
* **memory of layer compositions**, measured on one GPU type only (memory does
  not depend on the GPU type) for every window of up to ``k + 1`` consecutive
  layers, ``Mem(L(i, j))`` for ``i <= j <= i + k``: O(k·L) runs instead of
  O(L²). Longer ranges are estimated as Metis does::

      Mem(L(m))    = Σ_{n=m-k}^{m-1} (Mem(L(n, m)) − Mem(L(n, m−1))) / k
      Mem(L(i, j)) = Mem(L(i, j−1)) + Mem(L(j))

  (for ``m < k`` the average runs over the windows that exist). A measured
  window is the peak for one micro-batch: weights, gradients, optimizer
  states and that micro-batch's activations. Memory is affine in the
  micro-batch size, so a size that was not profiled is interpolated between
  profiled ones (summing compositions, as for time, would count the weights
  several times). Micro-batches in flight under 1F1B add the per-sample slope.

File format (JSON), readable by plain :meth:`ProfileDB.load` too (which then
ignores the memory part)::

    {"format": "hetplan-metis-profile", "version": 1, "model": "gpt3-1.3b",
     "gpus": ["P100", "T4", "V100-16GB"], "tp": [1, 2, 4, 8], "mbs": [1, 2, 4, 8, 16],
     "entries": [{"layer": "<profile_key>", "gpu": "T4", "tp": 1, "batch": 4,
                  "fwd_s": 0.0123, "bwd_s": 0.0247}, ...],
     "memory": {"gpu": "V100-16GB", "k": 2, "num_layers": 26,
                "windows": {"tp1_mbs1": [[i, j, bytes], ...], ...}}}

A missing entry never crashes a search: ``lookup`` returns None and the cost
model falls back to its analytic estimate; :func:`missing_entries` lists the
gaps so a planner can say so (or refuse, when asked to be strict).

``python -m hetplan.cost.synthetic_profile`` regenerates the shipped synthetic example
(``hetplan/profile/data/metis-example-gpt3-1.3b.json``).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

from hetplan.errors import HetplanError
from hetplan.model.spec import ModelSpec
from hetplan.profile.db import ProfileDB, ProfileEntry, parse_entries, read_profile_json

FORMAT = "hetplan-metis-profile"
PROFILED_TP = (1, 2, 4, 8)  # Metis §4.3: "tp = 1, 2, 4, 8"
PROFILED_MBS = (1, 2, 4, 8, 16)  # Metis §4.3: "mbs = 1, 2, 4, 8, 16 ..."
DEFAULT_K = 2  # maximum composition length minus one; Metis leaves k open
EXAMPLE_PATH = os.path.join(os.path.dirname(__file__), "data", "metis-example-gpt3-1.3b.json")


def compose_batch(batch: float, sizes: Sequence[int]) -> list[tuple[int, float]]:
    """Profiled sizes (with multiplicities) that add up to ``batch``, largest
    first (Metis: mbs 7 = 4 + 2 + 1); a leftover below the smallest profiled
    size is returned as a fraction of it."""
    parts: list[tuple[int, float]] = []
    remaining = float(batch)
    for size in sorted(sizes, reverse=True):
        count = int(remaining // size)
        if count:
            parts.append((size, float(count)))
            remaining -= count * size
    if remaining > 1e-12:
        smallest = min(sizes)
        parts.append((smallest, remaining / smallest))
    return parts


@dataclass
class MetisMemoryProfile:
    """Measured memory of layer windows (one GPU type), and Metis's estimate
    for longer ranges (see the module docstring)."""

    gpu: str
    k: int
    num_layers: int
    # (tp, mbs) -> {(i, j): bytes} for i <= j <= i + k
    windows: dict[tuple[int, int], dict[tuple[int, int], float]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._prefix: dict[tuple[int, int], list[float]] = {}

    def profiled_mbs(self, tp: int) -> list[int]:
        return sorted(m for t, m in self.windows if t == tp)

    def marginal(self, tp: int, mbs: int, m: int) -> float:
        """Mem(L(m)): the memory layer ``m`` adds to a composition."""
        table = self.windows[(tp, mbs)]
        if m == 0:
            return table[(0, 0)]
        terms = [table[(n, m)] - table[(n, m - 1)] for n in range(max(0, m - self.k), m)
                 if (n, m) in table and (n, m - 1) in table]
        if not terms:
            return table.get((m, m), 0.0)
        return sum(terms) / len(terms)

    def _marginal_prefix(self, tp: int, mbs: int) -> list[float]:
        key = (tp, mbs)
        prefix = self._prefix.get(key)
        if prefix is None:
            prefix = [0.0]
            for m in range(self.num_layers):
                prefix.append(prefix[-1] + self.marginal(tp, mbs, m))
            self._prefix[key] = prefix
        return prefix

    def composition(self, i: int, j: int, tp: int, mbs: int) -> float:
        """Mem(L(i, j)) at a profiled (tp, mbs): measured when j − i <= k,
        else the last measured window plus the marginals of the layers after it."""
        table = self.windows[(tp, mbs)]
        if (i, j) in table:
            return table[(i, j)]
        top = min(j, i + self.k)
        while (i, top) not in table and top > i:
            top -= 1
        base = table.get((i, top))
        prefix = self._marginal_prefix(tp, mbs)
        if base is None:
            return prefix[j + 1] - prefix[i]
        return base + prefix[j + 1] - prefix[top + 1]

    def memory(self, i: int, j: int, tp: int, batch: float) -> tuple[float, float] | None:
        """(bytes for one micro-batch of ``batch`` samples, bytes per extra
        sample) for layers i..j, interpolated in the batch size; None when
        this tp was not profiled."""
        sizes = self.profiled_mbs(tp)
        if not sizes:
            return None
        if len(sizes) == 1:
            value = self.composition(i, j, tp, sizes[0])
            return value, 0.0
        below = [s for s in sizes if s <= batch]
        lo = below[-1] if below else sizes[0]
        higher = [s for s in sizes if s > lo]
        hi = higher[0] if higher else lo
        if hi == lo:  # above the largest profiled size: extrapolate from the last two
            lo, hi = sizes[-2], sizes[-1]
        m_lo, m_hi = self.composition(i, j, tp, lo), self.composition(i, j, tp, hi)
        slope = (m_hi - m_lo) / (hi - lo)
        return m_lo + slope * (batch - lo), slope


class MetisProfileDB(ProfileDB):
    """A ProfileDB with Metis's micro-batch composition and composition memory.

    ``lookup`` returns the profiled time of an exact size and composes any
    other size from profiled ones (mbs 7 = 4 + 2 + 1) — the plain ProfileDB
    interpolates between neighbours instead.
    """

    def __init__(self, entries: Iterable[ProfileEntry] = (), memory: MetisMemoryProfile | None = None,
                 model: str = "") -> None:
        super().__init__(entries)
        self.memory_profile = memory
        self.model_name = model

    @property
    def has_memory(self) -> bool:
        return self.memory_profile is not None

    def lookup(self, layer: str, gpu: str, tp: int, batch: float,
               with_tp_comm: bool = False) -> tuple[float, float] | None:
        """Metis's composition (``compose_batch``); its files record no TP
        collectives apart, so ``with_tp_comm`` changes nothing."""
        table = self._by_key.get((layer, gpu, tp))
        if not table or batch <= 0:
            return None
        if float(batch).is_integer() and int(batch) in table:
            return table[int(batch)].compute_times()
        fwd = bwd = 0.0
        for size, count in compose_batch(batch, sorted(table)):
            f, b = table[size].compute_times()
            fwd += f * count
            bwd += b * count
        return fwd, bwd

    def stage_memory(self, a: int, b: int, tp: int, batch: float, in_flight: float) -> float | None:
        """Peak bytes (without the framework overhead) of a GPU running layers
        [a, b) with ``batch`` samples per micro-batch and ``in_flight``
        micro-batches held; None when the memory profile does not cover tp."""
        if self.memory_profile is None or b <= a:
            return None
        result = self.memory_profile.memory(a, b - 1, tp, batch)
        if result is None:
            return None
        one, per_sample = result
        return one + max(0.0, in_flight - 1.0) * per_sample * batch

    # --- files ------------------------------------------------------------------------
    def to_dict(self) -> dict[str, object]:
        entries = self.entries()
        data: dict[str, object] = {
            "format": FORMAT, "version": 1, "model": self.model_name,
            "gpus": sorted({e.gpu for e in entries}),
            "tp": sorted({e.tp for e in entries}),
            "mbs": sorted({e.batch for e in entries}),
            "entries": [e.to_dict() for e in entries],
        }
        if self.memory_profile is not None:
            mp = self.memory_profile
            data["memory"] = {
                "gpu": mp.gpu, "k": mp.k, "num_layers": mp.num_layers,
                "windows": {f"tp{tp}_mbs{mbs}": [[i, j, round(v)] for (i, j), v in sorted(table.items())]
                            for (tp, mbs), table in sorted(mp.windows.items())},
            }
        return data

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=None, separators=(",", ":"))

    @staticmethod
    def from_dict(data: Any, source: str = "profile") -> MetisProfileDB:
        """A profile from parsed JSON of any shape: what is not a profile is one clear error."""
        if not isinstance(data, dict) or "entries" not in data:
            raise HetplanError(f"{source} is not a profile: it has no 'entries' list")
        try:
            entries = parse_entries(data["entries"], source)
            memory = None
            raw = data.get("memory")
            if raw:
                windows: dict[tuple[int, int], dict[tuple[int, int], float]] = {}
                for key, rows in raw["windows"].items():
                    tp_text, mbs_text = key.split("_")
                    table = {(int(i), int(j)): float(v) for i, j, v in rows}
                    windows[(int(tp_text[2:]), int(mbs_text[3:]))] = table
                memory = MetisMemoryProfile(str(raw["gpu"]), int(raw["k"]),
                                            int(raw["num_layers"]), windows)
            return MetisProfileDB(entries, memory, str(data.get("model", "")))
        except (KeyError, TypeError, ValueError) as exc:
            raise HetplanError(f"{source} is malformed: {exc}") from None

    @staticmethod
    def load(path: str | os.PathLike[str]) -> MetisProfileDB:
        path = os.fspath(path)
        return MetisProfileDB.from_dict(read_profile_json(path), f"profile {path}")


def load_example() -> MetisProfileDB:
    """The shipped synthetic profile (GPT-3 1.3B on P100, T4, V100-16GB)."""
    return MetisProfileDB.load(EXAMPLE_PATH)


def missing_entries(profile: ProfileDB, model: ModelSpec, gpu_types: Iterable[str],
                    tps: Iterable[int] = (1,)) -> list[tuple[str, str, int]]:
    """(layer name, GPU type, tp) combinations the profile has no time for."""
    missing = []
    seen: set[str] = set()
    for layer in model.layers:
        if layer.profile_key in seen:
            continue
        seen.add(layer.profile_key)
        for gpu in sorted(set(gpu_types)):
            for tp in tps:
                if not profile.has(layer.profile_key, gpu, tp):
                    missing.append((layer.name, gpu, tp))
    return missing


# --- profiling cost (Metis Table 4, "Profiling" columns) --------------------------------------
def metis_profile_runs(model: ModelSpec, num_gpu_types: int, tps: Sequence[int] = PROFILED_TP,
                       mbs: Sequence[int] = PROFILED_MBS, k: int = DEFAULT_K) -> int:
    """Profiling runs Metis needs: each distinct layer once per GPU type, tp and
    mbs, plus the memory of every window of up to k+1 layers on one GPU type."""
    distinct = len({layer.profile_key for layer in model.layers})
    n = model.num_layers
    windows = sum(min(k, n - 1 - i) + 1 for i in range(n))
    return distinct * num_gpu_types * len(tps) * len(mbs) + windows * len(tps) * len(mbs)


def oracle_profile_runs(model: ModelSpec, num_gpu_types: int, tps: Sequence[int] = PROFILED_TP,
                        mbs: Sequence[int] = PROFILED_MBS) -> int:
    """Profiling runs of the Oracle: time and memory of every composition of
    consecutive layers (a possible stage) on every GPU type, tp and mbs."""
    n = model.num_layers
    return 2 * (n * (n + 1) // 2) * num_gpu_types * len(tps) * len(mbs)
