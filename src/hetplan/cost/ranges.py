"""Range tables of one per-layer array: a value for every layer range ``[a, b)``,
built on demand instead of held as ``(L+1) x (L+1)`` matrices.

At hetplan's limit of 10,000 layers (``model.spec.MAX_LAYERS``) one such matrix
holds 10⁸ numbers (800 MB), and every stage option held several. A table here
keeps O(L log L) numbers and answers one range in O(1) (``table[a, b]``) or a
block of ranges — rows ``a`` and columns ``b`` given as slices or index arrays —
in the block's size (``table[rows, cols]``): exactly the values the full matrix
held there.
"""

from __future__ import annotations

from typing import Sequence, Union

import numpy as np

Index = Union[int, slice, np.ndarray]

# Up to this many layers a RangeMax also keeps the whole (L+1) x (L+1) matrix
# (at most 0.5 MB), built on its first block query: the searches ask for blocks
# of small models tens of thousands of times, and one fancy index is cheaper
# than the sparse table's per-level passes (same values).
DENSE_LAYERS = 256


def positions(index: Index) -> np.ndarray:
    """Slice or index array -> the positions it names."""
    if isinstance(index, slice):
        return np.arange(index.start or 0, index.stop, index.step or 1)
    return np.asarray(index, dtype=np.int64)


class RangeMax:
    """``[a, b]``: ``scale · max(values[a:b])`` less ``minus[b]``, clamped at 0,
    and 0 where the range is empty (``a >= b``). ``values`` are non-negative
    (bytes); ``minus`` (optional) is a per-end offset such as a prefix sum."""

    def __init__(self, values: np.ndarray, minus: np.ndarray | None = None, scale: float = 1.0) -> None:
        values = np.asarray(values, dtype=float)
        self.num_layers = len(values)
        self._minus = minus
        self._scale = scale
        # sparse table: level p holds the max of every run of 2**p values
        self._levels = [values]
        self._dense: np.ndarray | None = None
        while 2 ** len(self._levels) <= len(values):
            previous, width = self._levels[-1], 2 ** (len(self._levels) - 1)
            self._levels.append(np.maximum(previous[:-width], previous[width:]))

    def __getitem__(self, key: tuple[Index, Index]) -> float | np.ndarray:
        rows, cols = key
        if isinstance(rows, (int, np.integer)) and isinstance(cols, (int, np.integer)):
            return self._one(int(rows), int(cols))
        return self._block(positions(rows)[:, None], positions(cols)[None, :])

    def _one(self, a: int, b: int) -> float:
        """One range (the scalar path of ``_block``)."""
        if a >= b:
            return 0.0
        p = (b - a).bit_length() - 1
        table = self._levels[p]
        out = max(float(table[a]), float(table[b - 2 ** p])) * self._scale
        return out if self._minus is None else max(out - float(self._minus[b]), 0.0)

    def __mul__(self, factor: float) -> RangeMax:
        other = RangeMax.__new__(RangeMax)
        other.__dict__.update(self.__dict__)
        other._scale = self._scale * factor
        return other

    __rmul__ = __mul__

    def _block(self, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
        """The table at every (start, end) pair of the broadcast arrays."""
        if self.num_layers <= DENSE_LAYERS:
            inside = ends > starts  # an empty range is 0, wherever its ends lie (even out of the table)
            n = self.num_layers
            out = self._dense_max()[np.clip(starts, 0, n), np.clip(ends, 0, n)] * self._scale
            if self._minus is not None:
                out = np.maximum(out - self._minus[np.clip(ends, 0, n)], 0.0)
            return np.where(inside, out, 0.0)
        length = ends - starts
        inside = length > 0
        safe = np.where(inside, length, 1)
        level = np.floor(np.log2(safe)).astype(np.int64)
        out = np.zeros(np.broadcast(starts, ends).shape)
        first = np.broadcast_to(starts, out.shape)
        last = np.broadcast_to(ends, out.shape)
        for p in np.unique(level[inside]) if inside.any() else ():
            cells = inside & (level == p)
            table = self._levels[int(p)]
            out[cells] = np.maximum(table[first[cells]], table[last[cells] - 2 ** int(p)])
        out = out * self._scale
        if self._minus is not None:
            out = np.where(inside, np.maximum(out - np.broadcast_to(self._minus[ends], out.shape), 0.0), 0.0)
        return np.where(inside, out, 0.0)

    def _dense_max(self) -> np.ndarray:
        """``[a, b]``: ``max(values[a:b])``, 0 where ``a >= b`` (``DENSE_LAYERS``)."""
        if self._dense is None:
            values, n = self._levels[0], self.num_layers
            dense = np.zeros((n + 1, n + 1))
            for a in range(n):
                dense[a, a + 1:] = np.maximum.accumulate(values[a:])
            self._dense = dense
        return self._dense


class RangeSum:
    """``[a, b]``: ``prefix[b] − prefix[a]`` less, for each correction
    ``(index, previous, share)``, ``share`` when ``a <= previous`` and
    ``index < b`` (a tied weight the range already holds: ``CostKernel.held_params``)."""

    def __init__(self, prefix: np.ndarray, corrections: Sequence[tuple[int, int, float]] = ()) -> None:
        self._prefix = np.asarray(prefix, dtype=float)
        self._corrections = list(corrections)

    def __getitem__(self, key: tuple[Index, Index]) -> float | np.ndarray:
        rows, cols = key
        if isinstance(rows, (int, np.integer)) and isinstance(cols, (int, np.integer)):
            held = float(self._prefix[cols] - self._prefix[rows])
            for index, previous, share in self._corrections:
                if rows <= previous and index < cols:
                    held -= share
            return held
        return self._block(positions(rows)[:, None], positions(cols)[None, :])

    def _block(self, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
        held = self._prefix[ends] - self._prefix[starts]
        for index, previous, share in self._corrections:
            held = held - np.where((starts <= previous) & (ends > index), share, 0.0)
        return held
