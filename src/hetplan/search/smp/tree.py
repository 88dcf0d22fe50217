"""SageMaker's tree partitioning (Karakus et al. 2021, §4.5 and Appendix C), torch-free.

The model is a tree of modules (here: the module paths of the ModelSpec's
layers, which are the units the runtime can cut between); every node has a
normalised cost ``c(n)`` (Appendix C.3). Algorithm 1 walks the tree
breadth-first from the root with the set of (virtual) pipeline devices
``P(root) = [0, D)``; a node with several devices splits its children into
``|P(n)|`` balanced contiguous segments (eq. 2, dynamic programme eq. 3) and
hands its devices to the segments with D'Hondt's method (Algorithm 3),
recursing into segments that get several devices and hold several children
(Algorithm 2).

One change makes the result a pipeline the runtime can run (see
docs/planners/smp.md): D'Hondt decides *how many* devices each segment gets,
and the segments take consecutive runs of ``P(n)`` in execution order (the
paper hands device ``p`` to the segment with the largest quotient, which can
put device 0 after device 1 in execution order: harmless for SMP's
request/response servers, not for a chain of stages). A segment that gets no
device joins its neighbour's device (the paper: the parent's ``P(n)[0]``,
which is the same device for a leading segment).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from hetplan.errors import HetplanError


@dataclass
class TreeNode:
    """A module of the tree: ``layers`` are the ModelSpec layer indices below it, in execution order."""

    name: str
    layers: list[int] = field(default_factory=list)
    children: list["TreeNode"] = field(default_factory=list)
    cost: float = 0.0  # C(n), the unnormalised recursive cost (Appendix C.3)

    @property
    def is_leaf(self) -> bool:
        return not self.children


def module_tree(layer_names: Sequence[str]) -> TreeNode:
    """The module hierarchy above the layers, from their dotted module paths.

    Each layer is a leaf; every proper prefix of a path is a container node
    (``blocks`` above ``blocks.0``). Children are ordered by execution (their
    first layer). A container whose layers are not consecutive (a module
    called between two of its children's) cannot be one segment of a chain;
    its children are attached to its parent instead.
    """
    if not layer_names:
        raise HetplanError("the model has no layers to partition")
    root = TreeNode("")
    nodes = {"": root}
    for index, name in enumerate(layer_names):
        parts = name.split(".")
        parent = root
        for depth in range(1, len(parts) + 1):
            path = ".".join(parts[:depth])
            node = nodes.get(path)
            if node is None:
                node = nodes[path] = TreeNode(path)
                parent.children.append(node)
            elif node.is_leaf and node.layers and depth < len(parts):
                raise HetplanError(f"layer {name!r} lies inside layer {path!r}: layers must be disjoint modules")
            node.layers.append(index)
            parent = node
        if parent.children:
            raise HetplanError(f"layer {name!r} contains other layers: layers must be disjoint modules")
    root.layers = list(range(len(layer_names)))
    _flatten_scattered(root)
    return root


def _flatten_scattered(node: TreeNode) -> None:
    """Replace containers with non-consecutive layers by their children, then order children by execution."""
    changed = True
    while changed:
        changed = False
        kids: list[TreeNode] = []
        for child in node.children:
            if child.children and child.layers != list(range(child.layers[0], child.layers[-1] + 1)):
                kids.extend(child.children)
                changed = True
            else:
                kids.append(child)
        node.children = kids
    node.children.sort(key=lambda c: c.layers[0])
    for child in node.children:
        _flatten_scattered(child)


def set_costs(root: TreeNode, memory: Sequence[float], compute: Sequence[float], alpha: float) -> None:
    """Appendix C.3: ``C̄(m) = α·w(m) + (1−α)·ψ(m)`` with ``w``, ``ψ`` of a module
    including its submodules, and ``C(n) = C̄(n) + Σ C(children)`` (super-additive).

    The paper leaves the units of ``w`` (bytes) and ``ψ`` (seconds) open; each is
    taken here as a fraction of the whole model's, so α weighs like against like.
    When no compute is known (all zero), ψ is the paper's fallback: the number
    of descendant modules.
    """
    if not 0.0 <= alpha <= 1.0:
        raise HetplanError(f"alpha must lie in [0, 1], got {alpha}")
    total_w, total_psi = float(sum(memory)), float(sum(compute))
    descendants = _count_descendants(root)
    use_count = total_psi <= 0.0

    def own(node: TreeNode) -> float:
        w = sum(memory[i] for i in node.layers) / total_w if total_w > 0 else 0.0
        if use_count:
            psi = descendants[id(node)] / max(descendants[id(root)], 1)
        else:
            psi = sum(compute[i] for i in node.layers) / total_psi
        return alpha * w + (1.0 - alpha) * psi

    def visit(node: TreeNode) -> float:
        node.cost = own(node) + sum(visit(c) for c in node.children)
        return node.cost

    visit(root)
    if root.cost <= 0.0:
        raise HetplanError("every module of the model has zero cost; it has no parameters, activations or compute")


def _count_descendants(root: TreeNode) -> dict[int, int]:
    out: dict[int, int] = {}

    def visit(node: TreeNode) -> int:
        out[id(node)] = 1 + sum(visit(c) for c in node.children)
        return out[id(node)]

    visit(root)
    return out


def balanced_segments(costs: Sequence[float], k: int) -> list[range]:
    """Eq. (2)-(3): split ``costs`` into ``min(k, len)`` consecutive non-empty
    segments minimising the largest segment sum. Among optimal splits the one
    with the earliest cuts is returned (deterministic)."""
    n = len(costs)
    k = max(1, min(k, n))
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[j][i]: smallest largest-sum splitting the first i items into j segments
    best = [[inf] * (n + 1) for _ in range(k + 1)]
    cut = [[0] * (n + 1) for _ in range(k + 1)]
    best[0][0] = 0.0
    for j in range(1, k + 1):
        for i in range(j, n + 1):
            for s in range(j - 1, i):
                value = max(best[j - 1][s], prefix[i] - prefix[s])
                if value < best[j][i] - 1e-15 * max(1.0, abs(value)):
                    best[j][i], cut[j][i] = value, s
    bounds = [n]
    for j in range(k, 0, -1):
        bounds.append(cut[j][bounds[-1]])
    bounds.reverse()
    return [range(bounds[j], bounds[j + 1]) for j in range(k)]


def dhondt_seats(costs: Sequence[float], seats: int) -> list[int]:
    """D'Hondt (largest averages): each seat goes to the party with the largest
    ``cost / (seats_so_far + 1)``; ties to the earliest party."""
    counts = [0] * len(costs)
    for _ in range(seats):
        k = max(range(len(costs)), key=lambda i: (costs[i] / (counts[i] + 1), -i))
        counts[k] += 1
    return counts


def dhondt_sets(devices: Sequence[int], costs: Sequence[float]) -> list[list[int]]:
    """Algorithm 3 as printed: devices handed out in order, each to the segment
    with the largest quotient (which devices, not just how many)."""
    counts = [0] * len(costs)
    sets: list[list[int]] = [[] for _ in costs]
    for p in devices:
        k = max(range(len(costs)), key=lambda i: (costs[i] / (counts[i] + 1), -i))
        counts[k] += 1
        sets[k].append(p)
    return sets


def partition_children(devices: list[int], nodes: list[TreeNode], total: float) -> list[list[int]]:
    """Algorithm 2 with in-order device runs: the device set of each node of ``nodes``."""
    costs = [n.cost / total for n in nodes]
    segments = balanced_segments(costs, len(devices))
    counts = dhondt_seats([sum(costs[i] for i in s) for s in segments], len(devices))
    out: list[list[int]] = [[] for _ in nodes]
    start = 0
    runs: list[list[int]] = []
    for count in counts:
        runs.append(devices[start:start + count])
        start += count
    for j, seg in enumerate(segments):
        run = runs[j] or [_neighbour_device(runs, j)]
        if len(run) == 1 or len(seg) == 1:
            for i in seg:
                out[i] = list(run)
        else:
            inner = partition_children(run, [nodes[i] for i in seg], total)
            for i, sub in zip(seg, inner):
                out[i] = sub
    return out


def _neighbour_device(runs: list[list[int]], j: int) -> int:
    """The device a segment without one joins: the previous segment's last, else the next one's first."""
    for k in range(j - 1, -1, -1):
        if runs[k]:
            return runs[k][-1]
    return next(r[0] for r in runs[j + 1:] if r)


@dataclass(frozen=True)
class TreePartition:
    """Algorithm 1's result: the device of every layer, and leaves given several devices (they cannot be cut)."""

    layer_device: tuple[int, ...]
    uncut: tuple[tuple[str, int], ...]  # (module, devices it was given) for leaves with more than one


def partition_tree(root: TreeNode, num_devices: int) -> TreePartition:
    """Algorithm 1: breadth-first from the root with devices ``[0, num_devices)``."""
    if num_devices < 1:
        raise HetplanError(f"the pipeline degree must be at least 1, got {num_devices}")
    device_sets = {id(root): list(range(num_devices))}
    layer_device = [0] * len(root.layers)
    uncut: list[tuple[str, int]] = []
    queue = [root]
    while queue:
        node = queue.pop(0)
        devices = device_sets[id(node)]
        if node.is_leaf:
            for i in node.layers:
                layer_device[i] = devices[0]
            if len(devices) > 1:
                uncut.append((node.name, len(devices)))
            continue
        if len(devices) > 1:
            sets = partition_children(devices, node.children, root.cost)
        else:
            sets = [list(devices) for _ in node.children]
        for child, s in zip(node.children, sets):
            device_sets[id(child)] = s
            queue.append(child)
    return TreePartition(tuple(layer_device), tuple(uncut))


def stage_ranges(layer_device: Sequence[int]) -> list[range]:
    """Consecutive layers on one device form a stage; devices must not decrease along the chain."""
    ranges: list[range] = []
    start = 0
    for i in range(1, len(layer_device) + 1):
        if i == len(layer_device) or layer_device[i] != layer_device[start]:
            ranges.append(range(start, i))
            start = i
    devices = [layer_device[r.start] for r in ranges]
    if devices != sorted(devices) or len(set(devices)) != len(devices):
        raise AssertionError(f"tree partition is not a chain of stages: {list(layer_device)}")
    return ranges
