"""Galvatron-BMW's search space: decision trees of per-layer hybrid strategies.

Galvatron-BMW §III-B: pipeline parallelism is applied first (Takeaway #1: PP
across device "islands"), splitting the N devices into P equal groups
(Takeaway #2). Inside a group of n = N/P devices, each layer picks one hybrid
strategy, described by a *decision tree*:

* every level of the tree is one paradigm among DP, SDP (sharded DP, ZeRO-3)
  and TP, with a degree in {2, 4, 8, ...}; the degrees multiply to n;
* no paradigm appears twice in a tree;
* the order of the levels matters (which paradigm is outer, which inner);
* every tree comes with and without activation checkpointing (CKPT).

For 8 GPUs (P = 1, 2, 4, 8 → n = 8, 4, 2, 1) that gives 34 trees, 68 with the
CKPT choice; Takeaway #3 ("SDP alone is always better than DP mixed with SDP")
removes the trees holding both DP and SDP: 22 trees, 44 with CKPT — the
numbers the paper states (§III-B, Fig. 3). ``strategy_count`` reproduces them.

hetplan's Stage lays a layer's TP groups out as runs of consecutive devices
(TP innermost, see ``hetplan.plan.spec.LayerStrategy.tp``), so two trees that differ
only in the order of their levels run the same layout here. On the clusters
Galvatron-BMW uses, devices are numbered node by node, so TP innermost keeps
TP (per-layer activation all-reduces, the heaviest traffic) on the fastest
links, which is what the paper's planner picks anyway (Fig. 7). The dynamic
program therefore searches the *distinct* strategies (``effective_strategies``):
7 per 8-GPU group without CKPT, 14 with.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import permutations

from hetplan.plan.spec import LayerStrategy

DP, SDP, TP = "DP", "SDP", "TP"
PARADIGMS = (DP, SDP, TP)


@dataclass(frozen=True)
class TreeStrategy:
    """One leaf path of a decision tree: ordered (paradigm, degree) levels,
    outermost first, and whether the layer is checkpointed."""

    levels: tuple[tuple[str, int], ...]
    ckpt: bool = False

    @property
    def num_devices(self) -> int:
        n = 1
        for _, degree in self.levels:
            n *= degree
        return n

    def degree(self, paradigm: str) -> int:
        for p, d in self.levels:
            if p == paradigm:
                return d
        return 1

    def effective(self) -> GStrategy:
        """The hetplan layout this tree runs as (TP innermost)."""
        tp = self.degree(TP)
        dp = self.num_devices // tp
        if self.degree(DP) > 1 and self.degree(SDP) > 1:
            raise ValueError("DP mixed with SDP has no hetplan layout (Takeaway #3 removes it)")
        return GStrategy(tp=tp, dp=dp, sdp=self.degree(SDP) > 1, ckpt=self.ckpt)

    def label(self) -> str:
        text = "+".join(f"{p}{d}" for p, d in self.levels) or "1 GPU"
        return text + ("+CKPT" if self.ckpt else "")


@dataclass(frozen=True, order=True)
class GStrategy:
    """A distinct per-layer strategy on a stage of ``tp * dp`` devices:
    ``tp``-way tensor parallel, ``dp``-way data parallel — sharded (SDP, ZeRO-3)
    or not — and activation checkpointing or not."""

    tp: int
    dp: int
    sdp: bool = False
    ckpt: bool = False

    def layer_strategy(self) -> LayerStrategy:
        return LayerStrategy(zero=3 if self.sdp and self.dp > 1 else 0,
                             recompute="full" if self.ckpt else "none", tp=self.tp)

    def label(self) -> str:
        """Compact name as in the paper's Fig. 7: 'tp2·sdp4+ckpt'."""
        parts = []
        if self.tp > 1:
            parts.append(f"tp{self.tp}")
        if self.dp > 1:
            parts.append(("sdp" if self.sdp else "dp") + str(self.dp))
        text = "·".join(parts) or "1gpu"
        return text + ("+ckpt" if self.ckpt else "")


def _degrees(n: int, pow2: bool) -> list[int]:
    if pow2:
        out, d = [], 2
        while d <= n:
            if n % d == 0:
                out.append(d)
            d *= 2
        return out
    return [d for d in range(2, n + 1) if n % d == 0]


def _ordered_factorisations(n: int, parts: int, pow2: bool) -> list[tuple[int, ...]]:
    """Ordered tuples of ``parts`` degrees (each > 1) whose product is ``n``."""
    if parts == 0:
        return [()] if n == 1 else []
    out = []
    for d in _degrees(n, pow2):
        for rest in _ordered_factorisations(n // d, parts - 1, pow2):
            out.append((d,) + rest)
    return out


def decision_trees(n: int, paradigms: tuple[str, ...] = PARADIGMS, ckpt_choices: tuple[bool, ...] = (False, True),
                   takeaway3: bool = True, pow2: bool = True) -> list[TreeStrategy]:
    """Every decision-tree strategy for a group of ``n`` devices (§III-B rules).

    ``pow2`` restricts degrees to powers of two (the paper's rule); with
    ``pow2=False`` any divisor is a degree (for groups whose size is not a
    power of two).
    """
    if n < 1:
        raise ValueError("a device group has at least one device")
    if pow2 and n & (n - 1):
        pow2 = False  # a group of 6 or 12 GPUs: fall back to divisors
    trees: list[tuple[tuple[str, int], ...]] = []
    if n == 1:
        trees.append(())
    for depth in range(1, len(paradigms) + 1):
        for order in permutations(paradigms, depth):
            if takeaway3 and DP in order and SDP in order:
                continue
            for degrees in _ordered_factorisations(n, depth, pow2):
                trees.append(tuple(zip(order, degrees)))
    return [TreeStrategy(levels, ckpt) for ckpt in ckpt_choices for levels in trees]


def pp_degrees(num_devices: int, num_layers: int | None = None, any_divisor: bool = True) -> list[int]:
    """PP degrees Galvatron tries: powers of two up to N (Alg. 1 line 4) and,
    beyond the paper, every other divisor of N; never more stages than layers
    (``None``: no layer limit)."""
    if any_divisor:
        degrees = [p for p in range(1, num_devices + 1) if num_devices % p == 0]
    else:
        degrees = [p for p in _degrees(num_devices, True) if num_devices % p == 0]
        degrees = [1] + degrees
    return [p for p in degrees if num_layers is None or p <= num_layers]


def strategy_count(num_devices: int, ckpt: bool = True, takeaway3: bool = True,
                   paradigms: tuple[str, ...] = PARADIGMS) -> int:
    """Per-layer candidate strategies over all PP degrees (the paper's count:
    68 for 8 GPUs before Takeaway #3, 44 after, 22 without CKPT)."""
    total = 0
    for p in pp_degrees(num_devices, any_divisor=False):
        total += len(decision_trees(num_devices // p, paradigms, (False, True) if ckpt else (False,), takeaway3))
    return total


def effective_strategies(n: int, paradigms: tuple[str, ...] = PARADIGMS,
                         ckpt_choices: tuple[bool, ...] = (False, True)) -> list[GStrategy]:
    """The distinct hetplan layouts of the decision trees for ``n`` devices
    (Takeaway #3 applied), sorted by TP degree (the DP groups them by it)."""
    seen = {tree.effective() for tree in decision_trees(n, paradigms, ckpt_choices, takeaway3=True)}
    return sorted(seen)
