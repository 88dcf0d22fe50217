"""Device groups up to symmetry, computed with numpy over per-device arrays.

On a cluster described by nodes (no device-to-device matrix), what a
collective over a group costs (``cost/comm.py``) depends only on how many of
the group's GPUs sit on each node and on those nodes' links: the formulas take
maxima and minima over the nodes, never anything that depends on which node is
which. Two groups with the same multiset of (node links and zone, GPUs of the
group on the node) — the group's :meth:`ClusterArrays.shape` — therefore cost the same
to the last bit, and the kernel computes a collective once per shape. On a
4,096-GPU cluster all 8 data-parallel groups of a 1,024-GPU stage have one
shape, and so do the stages of a uniform plan.

A stage's devices come as a ``(dp, tp)`` grid (TP innermost); its replicas'
GPUs, nodes and memory kinds are read off that grid with numpy, so no stage
costs a Python loop over its devices. On a cluster given by a bandwidth matrix
every link may differ: a group's shape is then the group itself.
"""

from __future__ import annotations

import math
from typing import Hashable, Sequence

import numpy as np

from hetplan.cluster.spec import ClusterSpec

SMALL_GROUP = 16  # groups up to this size get their shape without numpy


class ClusterArrays:
    """Per-device and per-node numbers of one cluster, as numpy arrays."""

    def __init__(self, cluster: ClusterSpec, capacity: list[int], overhead: list[int],
                 host: list[float] | None = None) -> None:
        """``host``: per device, bytes of offloaded activations its host share holds (default: no limit)."""
        host = host if host is not None else [math.inf] * len(capacity)
        self.matrix = cluster.bandwidth_matrix_gbps is not None
        devices = cluster.devices
        self.node = np.fromiter((d.node for d in devices), np.int64, len(devices))
        # a node's links: its fabric, its NIC and its zone (which links cross to other zones)
        links: dict[tuple[float, float, str], int] = {}
        self._node_list = self.node.tolist()
        self.node_links = np.array([links.setdefault((node.intra_bandwidth_gbps, cluster.node_inter_gbps(i), node.zone),
                                                     len(links)) for i, node in enumerate(cluster.nodes)],
                                   dtype=np.int64)
        self._link_list = self.node_links.tolist()
        self.intra_gbps = np.array([node.intra_bandwidth_gbps for node in cluster.nodes], dtype=np.float64)
        self.inter_gbps = np.array([cluster.node_inter_gbps(i) for i in range(len(cluster.nodes))], dtype=np.float64)
        zones = {zone: i for i, zone in enumerate(dict.fromkeys(node.zone for node in cluster.nodes))}
        self.zone = np.array([zones[node.zone] for node in cluster.nodes], dtype=np.int64)
        self.inter_zone_gbps = cluster.inter_zone_bandwidth_gbps
        self._matrix_gbps = cluster.bandwidth_matrix_gbps
        firsts = np.searchsorted(self.node, np.arange(len(cluster.nodes)))  # each node's first GPU
        kinds_of_nodes: dict[tuple[object, ...], int] = {}
        self.node_kind = np.array([kinds_of_nodes.setdefault(
            (node.gpu.name, node.num_gpus, node.intra_bandwidth_gbps, cluster.node_inter_gbps(i), node.zone,
             capacity[first], overhead[first], host[first]), len(kinds_of_nodes))
            for i, (node, first) in enumerate(zip(cluster.nodes, firsts.tolist()))], dtype=np.int64)
        self._node_first = firsts.tolist()
        self._node_kind_list = self.node_kind.tolist()
        self.gpus = list({d.gpu.name: d.gpu for d in devices}.values())  # distinct GPU types
        index = {gpu.name: i for i, gpu in enumerate(self.gpus)}
        self.gpu = np.fromiter((index[d.gpu.name] for d in devices), np.int64, len(devices))
        self.capacity = np.asarray(capacity, dtype=np.int64)
        self.overhead = np.asarray(overhead, dtype=np.int64)
        kinds: dict[tuple[int, int, float], int] = {}
        # (capacity, overhead, host share for offloaded activations) of each memory kind
        self.memory_kinds: list[tuple[int, int, float]] = []
        for triple in zip(capacity, overhead, host):
            if triple not in kinds:
                kinds[triple] = len(kinds)
                self.memory_kinds.append(triple)
        self.memory_kind = np.fromiter((kinds[t] for t in zip(capacity, overhead, host)), np.int64, len(devices))
        self.memory_bandwidth = np.fromiter((d.gpu.memory_bandwidth_bytes_per_s for d in devices), np.float64,
                                            len(devices))

    def shape(self, group: Sequence[int] | np.ndarray) -> Hashable:
        """What a collective over ``group`` depends on (see the module docstring)."""
        if self.matrix:
            return tuple(np.asarray(group).tolist())
        if len(group) <= SMALL_GROUP:  # a TP group: cheaper without numpy's per-call overhead
            per_node: dict[int, int] = {}
            for d in group:
                n = self._node_list[d]
                per_node[n] = per_node.get(n, 0) + 1
            return _shape_of_codes(len(group), [self._link_list[n] * (len(group) + 1) + c
                                                for n, c in per_node.items()])
        return self.nodes_shape(self.node[np.asarray(group, dtype=np.int64)])

    def nodes_shape(self, nodes: np.ndarray) -> Hashable:
        """The shape of a group whose GPUs sit on ``nodes`` (one entry per GPU):
        its size and the multiset of (node links, GPUs on the node), coded."""
        present, counts = np.unique(nodes, return_counts=True)
        code = self.node_links[present] * (len(nodes) + 1) + counts
        kinds, multiplicity = np.unique(code, return_counts=True)
        return (len(nodes), tuple(kinds.tolist()), tuple(multiplicity.tolist()))

    def column_classes(self, grid: np.ndarray) -> tuple[np.ndarray, list[Hashable]]:
        """The columns of a device grid (a stage's data-parallel groups; the
        rows of its transpose are its TP groups) up to symmetry: each column's
        class, numbered in order of first appearance, and each class's shape.
        Two sorts over the whole grid, not two per column."""
        if self.matrix:
            found: dict[Hashable, int] = {}
            ids = np.array([found.setdefault(tuple(c), len(found)) for c in grid.T.tolist()], dtype=np.int64)
            return ids, list(found)
        rows, columns = grid.shape
        num_nodes = len(self.node_links)
        column = np.repeat(np.arange(columns)[None, :], rows, axis=0).reshape(-1)
        pairs, counts = np.unique(column * num_nodes + self.node[grid].reshape(-1), return_counts=True)
        codes = self.node_links[pairs % num_nodes] * (rows + 1) + counts  # as nodes_shape codes them
        span = (int(self.node_links.max()) + 1) * (rows + 1)  # every code is below it
        keyed, multiplicity = np.unique((pairs // num_nodes) * span + codes, return_counts=True)
        lengths = np.bincount(keyed // span, minlength=columns)
        if bool((lengths == lengths[0]).all()):  # as many distinct codes in every column: one table
            table = np.concatenate([(keyed % span).reshape(columns, -1), multiplicity.reshape(columns, -1)], axis=1)
            firsts, ids = first_appearance(table)
            half = table.shape[1] // 2
            return ids, [(rows, tuple(table[i, :half].tolist()), tuple(table[i, half:].tolist()))
                         for i in firsts.tolist()]
        cuts = np.cumsum(lengths)[:-1]
        found = {}
        ids = np.array([found.setdefault((rows, tuple(k.tolist()), tuple(m.tolist())), len(found))
                        for k, m in zip(np.split(keyed % span, cuts), np.split(multiplicity, cuts))], dtype=np.int64)
        return ids, list(found)

    def link_bytes_per_s(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        """``ClusterSpec.bandwidth_bytes_per_s`` of each pair ``(a[i], b[i])``,
        elementwise (the same operations, so the same numbers)."""
        if self._matrix_gbps is not None:
            gbps = np.array([self._matrix_gbps[x][y] for x, y in zip(a.reshape(-1).tolist(), b.reshape(-1).tolist())],
                            dtype=np.float64).reshape(a.shape)
        else:
            na, nb = self.node[a], self.node[b]
            network = np.minimum(self.inter_gbps[na], self.inter_gbps[nb])
            if len(self.zone) and bool((self.zone != self.zone[0]).any()):  # the inter-zone link between zones
                network = np.where(self.zone[na] == self.zone[nb], network,
                                   np.minimum(network, self.inter_zone_gbps))
            gbps = np.where(na == nb, self.intra_gbps[na], network)
        return np.where(a == b, np.inf, gbps) * 1e9 / 8.0

    def group_class(self, group: Sequence[int]) -> Hashable:
        """Groups equal up to renaming interchangeable nodes (same GPUs, count,
        links, zone and memory) get equal keys: per GPU, its node's kind and its node
        numbered in order of first appearance. Everything the kernel computes
        for one group alone (its stages' costs and memory, its collectives) is
        the same for every group of a class. On a bandwidth-matrix cluster
        every group is its own class."""
        ids = np.asarray(group, dtype=np.int64)
        if self.matrix:
            return ("devices", ids.tobytes())
        nodes = self.node[ids]
        return ("nodes", np.stack([self.node_kind[nodes], first_appearance(nodes)[1]]).tobytes())

    def range_class(self, devices: np.ndarray) -> Hashable | None:
        """For a run of consecutive device ids on a node-model cluster, a key
        shared by every run of the same length that starts at the same place
        in a node and covers nodes of the same kinds (so ``group_class`` is
        the same, without a pass over the devices); None for other groups."""
        n = len(devices)
        first, last = int(devices[0]), int(devices[-1])
        if self.matrix or last - first != n - 1 or (n > 2 and not bool((np.diff(devices) == 1).all())):
            return None
        start, end = self._node_list[first], self._node_list[last]
        return ("run", n, first - self._node_first[start], tuple(self._node_kind_list[start:end + 1]))

    def p2p_seconds_per_byte(self, sender: Sequence[int], receiver: Sequence[int]) -> float:
        """``comm.p2p_time`` of one byte on a node-model cluster, elementwise
        over the streams: stream i pairs the i-th GPUs of the two groups,
        streams leaving one node for another share its NIC, the slowest sets
        the time (the same operations, so the same number)."""
        streams = max(1, min(len(sender), len(receiver)))
        a = np.asarray(sender, dtype=np.int64)[:streams]
        b = np.asarray(receiver, dtype=np.int64)[:streams]
        na, nb = self.node[a], self.node[b]
        crossing = na != nb
        share = np.ones(streams)
        if crossing.any():
            _, which, counts = np.unique((na * len(self.node_links) + nb)[crossing], return_inverse=True,
                                         return_counts=True)
            share[crossing] = counts[which.reshape(-1)]
        times = (1.0 / streams) * share / self.link_bytes_per_s(a, b)  # 0 where a GPU sends to itself
        return max(0.0, float(times.max()))

    def rows_in_one_node(self, grid: np.ndarray) -> bool:
        """Every row of a device grid (a TP group) lies inside one node."""
        nodes = self.node[grid]
        return bool((nodes == nodes[:, :1]).all())

    def row_nodes(self, grid: np.ndarray) -> np.ndarray | None:
        """The node of each row of a device grid when every row lies inside one
        node of a node-model cluster (the usual TP group); else None."""
        if self.matrix or not self.rows_in_one_node(grid):
            return None
        return self.node[grid[:, 0]]


def _shape_of_codes(size: int, codes: list[int]) -> Hashable:
    """``nodes_shape``'s form from the per-node codes (any order)."""
    multiplicity: dict[int, int] = {}
    for code in sorted(codes):
        multiplicity[code] = multiplicity.get(code, 0) + 1
    return (size, tuple(multiplicity), tuple(multiplicity.values()))


def first_appearance(codes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Distinct values of ``codes`` (or distinct rows, for a 2-D array) in
    order of first appearance: (index of each one's first occurrence, class of
    every entry in that numbering). Python dicts number keys this way; this
    does it without a Python loop."""
    if bool((codes == codes[0]).all()):  # the usual case (alike replicas, even split), without a sort
        return np.zeros(1, dtype=np.int64), np.zeros(len(codes), dtype=np.int64)
    if codes.ndim == 1 and len(codes) <= SMALL_GROUP:  # a few values: a dict is cheaper than numpy's sort
        numbering: dict[object, int] = {}
        classes = [numbering.setdefault(c, len(numbering)) for c in codes.tolist()]
        firsts: list[int] = []
        for i, c in enumerate(classes):
            if c == len(firsts):  # class c appears for the first time
                firsts.append(i)
        return np.array(firsts, dtype=np.int64), np.array(classes, dtype=np.int64)
    _, first, inverse = np.unique(codes, return_index=True, return_inverse=True,
                                  axis=0 if codes.ndim > 1 else None)
    order = np.argsort(first, kind="stable")
    rank = np.empty(len(order), dtype=np.int64)
    rank[order] = np.arange(len(order))
    return first[order], rank[inverse.reshape(-1)]
