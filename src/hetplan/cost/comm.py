"""Collective and point-to-point communication times over a ClusterSpec.

Ring all-reduce of M bytes over n devices moves 2(n−1)M/n bytes through each
device's slowest link (AMP eq. 3; Patarasuk & Yuan 2009). All-gather and
reduce-scatter move half of that. A group that spans several nodes is costed
hierarchically — reduce-scatter inside each node, all-reduce of the shards
between nodes over the nodes' shared NICs, all-gather inside each node — which
is how NCCL's tree/ring algorithms behave on multi-GPU nodes; the flat ring over
the slowest link (AMP's formula) is kept as ``flat_ring_allreduce_time``.

Zones (``ClusterSpec.network_gbps``): a group whose nodes lie in one zone runs
its network phase at their NICs; a group spanning zones runs its ring over nodes
at the inter-zone link too, since a ring moves the same bytes over every link at
once and its slowest link sets its pace (the ring crosses the zone boundary
twice, on two node pairs, in parallel). A pipeline p2p between two zones runs
at the inter-zone link (``ClusterSpec.link_gbps``), one inside a zone at the
NICs. The per-collective latency does not change with zones: no source gives
an inter-zone hop latency apart from the network hop's.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from hetplan.cluster.spec import ClusterSpec
from hetplan.cost.constants import (
    COLLECTIVE_BANDWIDTH_EFFICIENCY,
    NCCL_BASE_LATENCY_S,
    NCCL_RING_HOP_LATENCY_S,
    NCCL_TREE_HOP_LATENCY_S,
    NVLINK_MIN_GBPS,
)
from hetplan.units import gbps_to_bytes_per_s


def flat_ring_allreduce_time(cluster: ClusterSpec, group: Sequence[int], num_bytes: float,
                             efficiency: float = 1.0) -> float:
    """AMP eq. 3: 2(n−1)M / (n·B_min) with B_min the slowest link in the group."""
    n = len(group)
    if n < 2 or num_bytes <= 0:
        return 0.0
    bandwidth = cluster.min_bandwidth_bytes_per_s(group) * efficiency
    return 2.0 * (n - 1) * num_bytes / (n * bandwidth)


def _ring_time(cluster: ClusterSpec, group: Sequence[int], num_bytes: float, factor: float) -> float:
    """factor·(n−1)/n·M / B_min for a ring inside one node (or a matrix cluster)."""
    n = len(group)
    if n < 2 or num_bytes <= 0:
        return 0.0
    bandwidth = cluster.min_bandwidth_bytes_per_s(group) * COLLECTIVE_BANDWIDTH_EFFICIENCY
    return factor * (n - 1) * num_bytes / (n * bandwidth)


def node_counts(cluster: ClusterSpec, group: Sequence[int]) -> dict[int, int]:
    """How many of the group's GPUs sit on each node it touches (what the
    node model's collectives read). Large groups are counted with numpy:
    device ids run node by node, so a GPU's node is found by bisection."""
    if len(group) <= 64:
        counts: dict[int, int] = {}
        for d in group:
            node = cluster.devices[d].node
            counts[node] = counts.get(node, 0) + 1
        return counts
    firsts = np.cumsum([0] + [node.num_gpus for node in cluster.nodes[:-1]])
    nodes, sizes = np.unique(np.searchsorted(firsts, np.asarray(group), side="right") - 1, return_counts=True)
    return dict(zip(nodes.tolist(), sizes.tolist()))


def _node_ring_time(cluster: ClusterSpec, node: int, n: int, num_bytes: float, factor: float) -> float:
    """``_ring_time`` of ``n`` GPUs of one node (its fabric is their slowest link)."""
    if n < 2 or num_bytes <= 0:
        return 0.0
    bandwidth = gbps_to_bytes_per_s(cluster.nodes[node].intra_bandwidth_gbps) * COLLECTIVE_BANDWIDTH_EFFICIENCY
    return factor * (n - 1) * num_bytes / (n * bandwidth)


def _hierarchical(cluster: ClusterSpec, group: Sequence[int], num_bytes: float, factor: float,
                  concurrent_groups: int = 1) -> float:
    """Collective over a multi-node group: intra-node part on NVLink/PCIe,
    inter-node part on the nodes' NICs (each node's GPUs share its NIC, so the
    inter-node phase moves the node's whole share through one NIC, and
    ``concurrent_groups`` groups running at once — the TP ranks of a stage
    each syncing their own shard — split it)."""
    if cluster.bandwidth_matrix_gbps is not None:
        return _ring_time(cluster, group, num_bytes, factor)
    by_node = node_counts(cluster, group)
    if len(by_node) == 1:
        return _node_ring_time(cluster, next(iter(by_node)), len(group), num_bytes, factor)
    # intra phase: the slowest node, on its slice of the group
    intra = max(_node_ring_time(cluster, node, n, num_bytes, factor / 2.0) for node, n in by_node.items())
    nodes = list(by_node)
    num_nodes = len(nodes)
    nic = (cluster.network_gbps(nodes) * 1e9 / 8.0 * COLLECTIVE_BANDWIDTH_EFFICIENCY
           / max(1, concurrent_groups))
    # each node pushes its data across the network once per collective phase
    inter = factor * (num_nodes - 1) * num_bytes / (num_nodes * nic)
    # all-reduce = reduce-scatter + all-gather inside nodes around the inter part
    return inter + (2.0 * intra if factor == 2.0 else intra)


def allreduce_time(cluster: ClusterSpec, group: Sequence[int], num_bytes: float,
                   concurrent_groups: int = 1) -> float:
    """All-reduce of ``num_bytes`` (each device's buffer size) across ``group``."""
    return _hierarchical(cluster, group, num_bytes, 2.0, concurrent_groups)


def allgather_time(cluster: ClusterSpec, group: Sequence[int], num_bytes: float,
                   concurrent_groups: int = 1) -> float:
    """All-gather producing ``num_bytes`` on every device (each contributes 1/n)."""
    return _hierarchical(cluster, group, num_bytes, 1.0, concurrent_groups)


def reduce_scatter_time(cluster: ClusterSpec, group: Sequence[int], num_bytes: float,
                        concurrent_groups: int = 1) -> float:
    """Reduce-scatter of a ``num_bytes`` buffer (each device keeps 1/n)."""
    return _hierarchical(cluster, group, num_bytes, 1.0, concurrent_groups)


def alltoall_time(cluster: ClusterSpec, group: Sequence[int], num_bytes: float,
                  concurrent_groups: int = 1) -> float:
    """All-to-all of a ``num_bytes`` send buffer per device over ``group``
    (each device keeps 1/n and sends (n−1)/n of it, one slice to each peer):
    NCCL runs it as n−1 concurrent send/recv pairs, so the time is that of
    the busiest link class. Inside a node: (n−1)/n·M over the node's fabric.
    Across nodes, a node with k of the group's GPUs sends k·M·(n−k)/n bytes
    through its NICs (shared by ``concurrent_groups`` groups running at once,
    the TP ranks' expert-parallel groups) while its in-node part runs on
    NVLink at the same time: the slower of the two. Across zones, each pair
    of nodes in two zones also has its inter-zone link, which carries the
    k·k_q·M/n bytes between them (k_q: the peer node's GPUs of the group)."""
    n = len(group)
    if n < 2 or num_bytes <= 0:
        return 0.0
    if cluster.bandwidth_matrix_gbps is not None:
        return _ring_time(cluster, group, num_bytes, 1.0)
    by_node = node_counts(cluster, group)
    zone_link = (gbps_to_bytes_per_s(cluster.inter_zone_bandwidth_gbps) * COLLECTIVE_BANDWIDTH_EFFICIENCY
                 / max(1, concurrent_groups))
    worst = 0.0
    for node, k in by_node.items():
        intra = 0.0
        if k > 1:
            bandwidth = gbps_to_bytes_per_s(cluster.nodes[node].intra_bandwidth_gbps) * COLLECTIVE_BANDWIDTH_EFFICIENCY
            intra = (k - 1) * num_bytes / (n * bandwidth)
        inter = 0.0
        if k < n:
            nic = (cluster.node_inter_gbps(node) * 1e9 / 8.0 * COLLECTIVE_BANDWIDTH_EFFICIENCY
                   / max(1, concurrent_groups))
            inter = k * num_bytes * (n - k) / (n * nic)
        zone = cluster.nodes[node].zone
        peer = max((k_q for q, k_q in by_node.items() if cluster.nodes[q].zone != zone), default=0)
        across = k * peer * num_bytes / (n * zone_link) if peer else 0.0
        worst = max(worst, intra, inter, across)
    return worst


def p2p_time(cluster: ClusterSpec, src: Sequence[int], dst: Sequence[int], num_bytes: float) -> float:
    """Send ``num_bytes`` from one device group to the next (pipeline p2p: v/b).

    The data is split evenly over min(|src|, |dst|) parallel streams, paired in
    order; the time is that of the slowest pair. Streams leaving one node for
    another share that node's NIC.
    """
    if num_bytes <= 0:
        return 0.0
    streams = max(1, min(len(src), len(dst)))
    per_stream = num_bytes / streams
    worst = 0.0
    crossing: dict[tuple[int, int], int] = {}
    pairs = [(src[i % len(src)], dst[i % len(dst)]) for i in range(streams)]
    for a, b in pairs:
        na, nb = cluster.devices[a].node, cluster.devices[b].node
        if na != nb and cluster.bandwidth_matrix_gbps is None:
            crossing[(na, nb)] = crossing.get((na, nb), 0) + 1
    for a, b in pairs:
        if a == b:
            continue
        bandwidth = cluster.bandwidth_bytes_per_s(a, b)
        na, nb = cluster.devices[a].node, cluster.devices[b].node
        share = crossing.get((na, nb), 1) if na != nb else 1
        worst = max(worst, per_stream * share / bandwidth)
    return worst


def collective_latency(cluster: ClusterSpec, group: Sequence[int], kind: str) -> float:
    """Fixed time of one collective over ``group``, whatever its size: NCCL's
    own cost model (``src/graph/tuning.cc``, Simple protocol). A ring takes
    ``n - 1`` steps (all-gather, reduce-scatter) or ``2(n - 1)`` (all-reduce),
    each paying a hop latency, the network's for the steps that cross nodes;
    an all-reduce may instead run as a tree, ``2 (log2 N)`` network hops plus
    the in-node chain, whichever is faster. This is what makes gradient sync
    and ZeRO-3 gathers grow with the number of GPUs and nodes."""
    n = len(group)
    if n < 2:
        return 0.0
    by_node = node_counts(cluster, group)
    nodes = 1 if cluster.bandwidth_matrix_gbps is not None else len(by_node)
    link = "nvlink" if min(cluster.nodes[i].intra_bandwidth_gbps for i in by_node) >= NVLINK_MIN_GBPS else "pci"
    factor = 2 if kind == "allreduce" else 1
    steps, inter = factor * (n - 1), factor * (nodes - 1)
    ring_hops = NCCL_RING_HOP_LATENCY_S
    ring = NCCL_BASE_LATENCY_S + (steps - inter) * ring_hops[link] + inter * ring_hops["net"]
    if kind != "allreduce" or nodes < 2:
        return ring
    tree_hops = NCCL_TREE_HOP_LATENCY_S
    per_node = max(by_node.values())
    tree = 2 * ((per_node - 1) * tree_hops[link] + math.log2(nodes) * tree_hops["net"])
    return min(ring, tree)
