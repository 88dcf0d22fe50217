"""Metis device groups and stage-to-device-group mappings (Metis §4.1, §4.2.2).

A *device group* is a set of GPUs that runs one pipeline stage, formed by
picking ``k_i`` GPUs (0 <= k_i <= K_i) from every node ``i``. Nodes may hold
different numbers and types of GPUs, so a group such as one V100 of one node
plus three T4 of another is as valid as a whole 8-GPU node. Two groups are the
same for planning when they have the same size, the same GPU types and the
same kind of nodes (Metis §4.1 compares size, then GPU-type counts, then the
nodes): :func:`group_signature` is that key. Nodes are interchangeable when
they have the same GPU type, GPU count and links.

A *stage mapping* assigns S consecutive pipeline stages to S disjoint device
groups that together use every GPU. Like the authors' planner we build
mappings by laying the cluster's GPUs out node by node in a *node sequence*
(one per ordering of the GPU types) and cutting that line into S contiguous
groups; every permutation of the group sizes is a different stage mapping.
Two prunings keep the number of mappings small (Metis §4.2.2):

* a lower bound on group size, ``N / S * (1 - var)`` (``var`` is a float in
  [0, 1]; 1 disables the bound);
* a maximum permutation length: the two smallest groups are merged into one
  unit (kept adjacent) until at most ``max_permute_len`` units remain, and only
  the orderings of the units are explored.

Everything here is deterministic: GPU types are sorted by name (the authors'
code permuted a ``set`` of types, so its results changed with PYTHONHASHSEED),
and ties are broken by explicit keys, never by hash order.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Iterator, Sequence

from hetplan.cluster.spec import ClusterSpec
from hetplan.errors import HetplanError
from hetplan.search.common.placement import node_first_devices

NodeClass = tuple[str, int, float, float, str]  # (GPU type, GPUs in node, intra Gbps, inter Gbps, zone)


def node_class(cluster: ClusterSpec, node: int) -> NodeClass:
    """What makes a node interchangeable with another: GPU type, size, links, zone."""
    spec = cluster.nodes[node]
    return (spec.gpu.name, spec.num_gpus, spec.intra_bandwidth_gbps, cluster.node_inter_gbps(node), spec.zone)


_UIDS: dict[tuple[str, tuple[int, ...]], int] = {}


def _uid(cluster_name: str, devices: tuple[int, ...]) -> int:
    """A small integer naming a device group (cheap to hash in caches)."""
    key = (cluster_name, devices)
    uid = _UIDS.get(key)
    if uid is None:
        uid = _UIDS[key] = len(_UIDS)
    return uid


@dataclass(frozen=True)
class DeviceGroup:
    """A set of GPUs running one stage.

    Attributes:
        devices: physical GPU ids, node by node (so runs of ``tp`` consecutive
            ids stay inside a node when the node holds a multiple of ``tp``).
        signature: the planning-equivalence key (see :func:`group_signature`).
    """

    devices: tuple[int, ...]
    signature: tuple[tuple[NodeClass, int], ...]
    uid: int = field(default=-1, compare=False)
    sid: int = field(default=-1, compare=False)
    hetero: bool = field(default=False, compare=False)

    @property
    def size(self) -> int:
        return len(self.devices)

    @property
    def gpu_counts(self) -> tuple[tuple[str, int], ...]:
        """(GPU type, count) pairs, sorted by type."""
        counts: dict[str, int] = {}
        for cls, k in self.signature:
            counts[cls[0]] = counts.get(cls[0], 0) + k
        return tuple(sorted(counts.items()))

    @property
    def is_hetero(self) -> bool:
        """More than one GPU type."""
        return self.hetero

    @property
    def num_nodes(self) -> int:
        return len(self.signature)

    def describe(self) -> str:
        """e.g. '4 GPUs: 1 V100-16GB + 3 T4 on 2 nodes'."""
        types = " + ".join(f"{n} {t}" for t, n in self.gpu_counts)
        nodes = f" on {self.num_nodes} nodes" if self.num_nodes > 1 else ""
        return f"{self.size} GPU{'s' if self.size > 1 else ''}: {types}{nodes}"


def group_signature(cluster: ClusterSpec, devices: Sequence[int]) -> tuple[tuple[NodeClass, int], ...]:
    """Size, GPU types and nodes of a group, as a sorted key: for every node
    the group touches, (the node's class, GPUs taken from it)."""
    by_node: dict[int, int] = {}
    for d in devices:
        node = cluster.devices[d].node
        by_node[node] = by_node.get(node, 0) + 1
    return tuple(sorted((node_class(cluster, n), k) for n, k in by_node.items()))


_SIDS: dict[tuple[tuple[NodeClass, int], ...], int] = {}


def make_group(cluster: ClusterSpec, devices: Sequence[int]) -> DeviceGroup:
    devs = tuple(devices)
    signature = group_signature(cluster, devs)
    sid = _SIDS.get(signature)
    if sid is None:
        sid = _SIDS[signature] = len(_SIDS)
    hetero = len({cls[0] for cls, _ in signature}) > 1
    return DeviceGroup(devs, signature, _uid(cluster.name, devs), sid, hetero)


def enumerate_device_groups(cluster: ClusterSpec, sizes: Sequence[int] | None = None,
                            limit: int = 1_000_000) -> list[DeviceGroup]:
    """Every distinct device group of the cluster (Metis §4.1).

    Picks ``k`` GPUs from each node (0 <= k <= the node's GPUs), keeps one
    group per signature (size, GPU types, nodes), and returns them sorted by
    size then signature. ``sizes`` restricts the group sizes (e.g. powers of
    two, as in the paper's §2.2 example). A ValueError names the problem when
    more than ``limit`` groups would be built.
    """
    classes: dict[NodeClass, list[int]] = {}
    for n in range(cluster.num_nodes):
        classes.setdefault(node_class(cluster, n), []).append(n)
    ordered = sorted(classes.items())
    # per class: every multiset of picks over its interchangeable nodes
    per_class: list[list[tuple[int, ...]]] = []
    total = 1
    for cls, nodes in ordered:
        picks = [tuple(sorted(p, reverse=True))
                 for p in itertools.combinations_with_replacement(range(cls[1] + 1), len(nodes))]
        per_class.append(sorted(set(picks)))
        total *= len(per_class[-1])
        if total > limit:
            raise HetplanError(
                f"cluster {cluster.name!r} has more than {limit} distinct device groups; "
                "restrict the sizes or raise the limit"
            )
    wanted = set(sizes) if sizes is not None else None
    firsts = node_first_devices(cluster)
    groups: list[DeviceGroup] = []
    for combo in itertools.product(*per_class):
        size = sum(sum(p) for p in combo)
        if size == 0 or (wanted is not None and size not in wanted):
            continue
        devices: list[int] = []
        for (_, class_nodes), counts in zip(ordered, combo):
            for node, k in zip(class_nodes, counts):
                devices += range(firsts[node], firsts[node] + k)
        groups.append(make_group(cluster, sorted(devices)))
    groups.sort(key=lambda g: (g.size, g.signature))
    return groups


# --- stage sizes and the two prunings ---------------------------------------------
def allowed_group_sizes(cluster: ClusterSpec) -> list[int]:
    """Group sizes Metis explores: powers of two (the authors' device-group
    shapes), the size of every node (so a 3-GPU node can be one group) and the
    whole cluster."""
    n = cluster.num_devices
    sizes = {1 << i for i in range(n.bit_length()) if (1 << i) <= n}
    sizes.update(node.num_gpus for node in cluster.nodes)
    sizes.add(n)
    return sorted(sizes)


def min_group_size(num_gpus: int, num_stages: int, var: float) -> float:
    """Metis §4.2.2 lower bound on device-group size: N / S * (1 - var)."""
    return num_gpus / num_stages * (1.0 - var)


def size_multisets(total: int, parts: int, sizes: Sequence[int], lower: float) -> Iterator[tuple[int, ...]]:
    """Non-decreasing tuples of ``parts`` sizes from ``sizes`` (each >= lower)
    summing to ``total``."""
    usable = sorted(s for s in set(sizes) if s >= lower - 1e-9)
    if not usable:
        return

    def rec(remaining: int, left: int, start: int, prefix: tuple[int, ...]) -> Iterator[tuple[int, ...]]:
        if left == 0:
            if remaining == 0:
                yield prefix
            return
        for i in range(start, len(usable)):
            s = usable[i]
            if s * left > remaining:
                break
            if usable[-1] * left < remaining:
                return
            yield from rec(remaining - s, left - 1, i, prefix + (s,))

    yield from rec(total, parts, 0, ())


def merge_smallest(sizes: Sequence[int], max_permute_len: int) -> list[tuple[int, ...]]:
    """Metis's second pruning: merge the two smallest groups into a pair (a unit
    that stays adjacent) until at most ``max_permute_len`` units remain.

    Paper example: sizes 1,1,1,1,2 with length 3 give units (1,1), (1,1), (2).
    """
    units: list[tuple[int, ...]] = sorted(((s,) for s in sizes), key=lambda u: (sum(u), u))
    limit = max(1, max_permute_len)
    while len(units) > limit:
        merged = units[0] + units[1]
        units = sorted(units[2:] + [merged], key=lambda u: (sum(u), u))
    return units


def distinct_permutations(units: Sequence[tuple[int, ...]]) -> Iterator[tuple[tuple[int, ...], ...]]:
    """Orderings of a multiset of units, each once, in lexicographic order."""
    counts: dict[tuple[int, ...], int] = {}
    for u in units:
        counts[u] = counts.get(u, 0) + 1
    keys = sorted(counts)
    n = len(units)

    def rec(prefix: tuple[tuple[int, ...], ...]) -> Iterator[tuple[tuple[int, ...], ...]]:
        if len(prefix) == n:
            yield prefix
            return
        for k in keys:
            if counts[k]:
                counts[k] -= 1
                yield from rec(prefix + (k,))
                counts[k] += 1

    yield from rec(())


def stage_size_orders(num_gpus: int, num_stages: int, sizes: Sequence[int], var: float,
                      max_permute_len: int) -> Iterator[tuple[int, ...]]:
    """Ordered group sizes (one per stage) for ``num_stages`` stages, with both
    prunings applied. ``var >= 1`` and a ``max_permute_len`` >= the number of
    stages explore every ordering."""
    lower = min_group_size(num_gpus, num_stages, var)
    for multiset in size_multisets(num_gpus, num_stages, sizes, lower):
        units = merge_smallest(multiset, max_permute_len)
        for order in distinct_permutations(units):
            yield tuple(s for unit in order for s in unit)


# --- node sequences and mappings --------------------------------------------------------
def node_sequences(cluster: ClusterSpec) -> list[tuple[int, ...]]:
    """Orders in which to lay out the nodes before cutting them into groups:
    one per ordering of the GPU types (sorted names, so no hash-seed
    dependence); inside a type, larger nodes first, then by index."""
    by_type: dict[str, list[int]] = {}
    for n in range(cluster.num_nodes):
        by_type.setdefault(cluster.nodes[n].gpu.name, []).append(n)
    for nodes in by_type.values():
        nodes.sort(key=lambda n: (-cluster.nodes[n].num_gpus, n))
    sequences = []
    for types in itertools.permutations(sorted(by_type)):
        sequences.append(tuple(n for t in types for n in by_type[t]))
    return sequences


@dataclass(frozen=True)
class StageMapping:
    """Device groups for consecutive stages, and the key that identifies
    equivalent mappings (group signatures plus which neighbours share a node)."""

    groups: tuple[DeviceGroup, ...]
    key: tuple[object, ...]

    @property
    def num_stages(self) -> int:
        return len(self.groups)

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(g.size for g in self.groups)


class _Line:
    """The cluster's GPUs laid out in one node sequence, with cached cuts."""

    def __init__(self, cluster: ClusterSpec, sequence: Sequence[int]) -> None:
        self.cluster = cluster
        firsts = node_first_devices(cluster)  # not node_devices(n), which scans every device per node
        self.devices = [d for n in sequence for d in range(firsts[n], firsts[n] + cluster.nodes[n].num_gpus)]
        self.node_start = set()
        pos = 0
        for n in sequence:
            self.node_start.add(pos)
            pos += cluster.nodes[n].num_gpus
        self._groups: dict[tuple[int, int], DeviceGroup] = {}

    def group(self, start: int, size: int) -> DeviceGroup:
        key = (start, size)
        g = self._groups.get(key)
        if g is None:
            g = self._groups[key] = make_group(self.cluster, self.devices[start:start + size])
        return g

    def cut(self, sizes: Sequence[int]) -> StageMapping:
        groups = []
        shares = []
        start = 0
        for s in sizes:
            if start:
                shares.append(start not in self.node_start)
            groups.append(self.group(start, s))
            start += s
        key = tuple(g.sid for g in groups) + tuple(shares)
        return StageMapping(tuple(groups), key)


def cut_mapping(cluster: ClusterSpec, sequence: Sequence[int], sizes: Sequence[int]) -> StageMapping:
    """Lay the nodes out in ``sequence`` and cut consecutive groups of ``sizes``."""
    if sum(sizes) != cluster.num_devices or len(set(sequence)) != cluster.num_nodes:
        raise HetplanError(f"group sizes {list(sizes)} do not add up to the {cluster.num_devices} GPUs")
    return _Line(cluster, sequence).cut(sizes)


class MappingEnumerator:
    """Distinct stage-to-device-group mappings of a cluster, per number of
    stages (Metis's EnumerateWithPruning), in a deterministic order. Cuts of
    the node lines are cached across stage counts."""

    def __init__(self, cluster: ClusterSpec, var: float = 0.5, max_permute_len: int = 4,
                 sizes: Sequence[int] | None = None) -> None:
        if not 0.0 <= var <= 1.0:
            raise HetplanError(f"var must be a float in [0, 1], got {var}")
        self.cluster = cluster
        self.var = float(var)
        self.max_permute_len = max_permute_len
        self.sizes = list(sizes) if sizes is not None else allowed_group_sizes(cluster)
        self.lines = [_Line(cluster, seq) for seq in node_sequences(cluster)]

    def mappings(self, num_stages: int) -> Iterator[StageMapping]:
        seen: set[tuple[object, ...]] = set()
        n = self.cluster.num_devices
        for order in stage_size_orders(n, num_stages, self.sizes, self.var, self.max_permute_len):
            for line in self.lines:
                mapping = line.cut(order)
                if mapping.key in seen:
                    continue
                seen.add(mapping.key)
                yield mapping


def stage_mappings(cluster: ClusterSpec, num_stages: int, var: float = 0.5, max_permute_len: int = 4,
                   sizes: Sequence[int] | None = None) -> Iterator[StageMapping]:
    """Distinct stage-to-device-group mappings for ``num_stages`` stages."""
    yield from MappingEnumerator(cluster, var, max_permute_len, sizes).mappings(num_stages)
