"""Device placement: which physical GPUs run which (stage, replica, TP rank).

A placement is returned as each stage's device ids, ``dp·tp`` of them with TP
innermost (replica ``r`` owns ``devices[r*tp:(r+1)*tp]``), the layout of
:class:`hetplan.plan.spec.Stage`. Every placement here keeps a TP group inside one
node.

* :func:`heuristic_placement` — AMP §3.6 / Megatron-LM: fill TP groups first,
  then the DP replicas of a stage, then the stages, in device-id order.
* :func:`canonical_placements` — every placement up to symmetry, for the
  exhaustive planner. On a cluster described by nodes (no device matrix) the
  GPUs of one node are interchangeable (same type, same links), and so are
  identical nodes; a placement is then determined by which node each TP group
  comes from, and we enumerate each orbit once.
* :func:`random_placement` — uniform over valid placements (AMP's RS).
"""

from __future__ import annotations

import bisect
import math
import random
from collections import Counter
from typing import TYPE_CHECKING, Iterator

from hetplan.cluster.spec import ClusterSpec
from hetplan.errors import HetplanError

if TYPE_CHECKING:  # pragma: no cover
    from hetplan.plan.workload import Workload
    from hetplan.plan.spec import Plan

Placement = tuple[tuple[int, ...], ...]


def _check(cluster: ClusterSpec, pp: int, dp: int, tp: int) -> None:
    if pp * dp * tp != cluster.num_devices:
        raise HetplanError(f"pp x dp x tp = {pp * dp * tp}, but cluster {cluster.name!r} has "
                           f"{cluster.num_devices} GPUs")
    if any(node.num_gpus % tp for node in cluster.nodes):
        raise HetplanError(f"tp={tp} does not divide every node's GPU count, so a TP group would cross nodes")


def heuristic_placement(num_devices: int, pp: int, dp: int, tp: int) -> Placement:
    """AMP §3.6 (Megatron's heuristic): device ids fill TP groups first (so a
    TP group sits in one node when nodes hold a multiple of ``tp`` GPUs), then
    the DP replicas of a stage, then the stages."""
    if pp * dp * tp != num_devices:
        raise HetplanError(f"pp x dp x tp = {pp * dp * tp}, but the cluster has {num_devices} GPUs")
    size = dp * tp
    return tuple(tuple(range(j * size, (j + 1) * size)) for j in range(pp))


def node_first_devices(cluster: ClusterSpec) -> list[int]:
    """The first device id of every node (ids are handed out node by node),
    without ``ClusterSpec.node_devices``, which scans every device."""
    firsts, first = [], 0
    for node in cluster.nodes:
        firsts.append(first)
        first += node.num_gpus
    return firsts


def _node_classes(cluster: ClusterSpec) -> list[tuple[object, ...]]:
    """What makes two nodes interchangeable: GPU type, count, links, zone and memory."""
    return [(node.gpu.name, node.num_gpus, node.intra_bandwidth_gbps, cluster.node_inter_gbps(q), node.zone,
             cluster.devices[first].memory_bytes)
            for q, (node, first) in enumerate(zip(cluster.nodes, node_first_devices(cluster)))]


def count_canonical_placements(cluster: ClusterSpec, pp: int, dp: int, tp: int) -> int:
    """How many placements :func:`canonical_placements` yields, without listing them.

    The label sequences are the multiset permutations of the nodes' TP-group
    counts; permuting identical nodes acts freely on them (every node appears),
    so the orbits number multinomial / Π (identical nodes)!."""
    _check(cluster, pp, dp, tp)
    counts = [node.num_gpus // tp for node in cluster.nodes]
    total = math.factorial(sum(counts))
    for c, repeat in Counter(counts).items():
        total //= math.factorial(c) ** repeat
    for m in Counter(_node_classes(cluster)).values():
        total //= math.factorial(m)
    return total


def canonical_placements(cluster: ClusterSpec, pp: int, dp: int, tp: int) -> Iterator[Placement]:
    """One placement per symmetry class, deterministic order.

    Slots ``(stage j, replica i)`` in order each take a TP group from some
    node; a sequence of node labels is kept only if, within each class of
    identical nodes, nodes first appear in index order. Devices of a node are
    handed out in increasing id order.

    So the used nodes of a class are always its first few: at each slot the
    candidates are the used nodes with TP groups left (``open_nodes``) and each
    class's first unused node, tried in index order — no scan over every node,
    which on 512 identical nodes made one placement cost 512³ steps.
    """
    _check(cluster, pp, dp, tp)
    if cluster.bandwidth_matrix_gbps is not None:
        raise HetplanError("enumerating placements up to symmetry needs a cluster described by nodes, "
                           "not a device-to-device bandwidth matrix")
    num_nodes = cluster.num_nodes
    remaining = [node.num_gpus // tp for node in cluster.nodes]
    class_ids: dict[tuple[object, ...], int] = {}
    class_of = [class_ids.setdefault(c, len(class_ids)) for c in _node_classes(cluster)]
    members: list[list[int]] = [[] for _ in class_ids]
    for q in range(num_nodes):
        members[class_of[q]].append(q)
    next_unused = [0] * len(members)  # how many nodes of each class are in use
    open_nodes: list[int] = []  # in-use nodes with TP groups left, ascending
    labels: list[int] = []
    slots = pp * dp
    firsts = node_first_devices(cluster)

    def build() -> Placement:
        taken = [0] * num_nodes
        groups = []
        for q in labels:
            start = firsts[q] + taken[q] * tp
            groups.append(tuple(range(start, start + tp)))
            taken[q] += 1
        return tuple(tuple(d for g in groups[j * dp:(j + 1) * dp] for d in g) for j in range(pp))

    def candidates() -> list[int]:
        heads = [m[n] for m, n in zip(members, next_unused) if n < len(m)]
        return sorted(open_nodes + heads)

    def take(q: int) -> bool:
        """Use one TP group of node q; True if q was not in use before."""
        first = q not in open_nodes
        if first:
            next_unused[class_of[q]] += 1
        else:
            open_nodes.remove(q)
        remaining[q] -= 1
        if remaining[q]:
            bisect.insort(open_nodes, q)
        labels.append(q)
        return first

    def give_back(q: int, first: bool) -> None:
        labels.pop()
        if remaining[q]:
            open_nodes.remove(q)
        remaining[q] += 1
        if first:
            next_unused[class_of[q]] -= 1
        else:
            bisect.insort(open_nodes, q)

    # depth first with an explicit stack: pp·dp slots can be deeper than Python's recursion limit
    stack = [iter(candidates())]  # per open slot: the nodes still to try there
    undo: list[tuple[int, bool]] = []  # per filled slot: its node and whether it came into use there
    while stack:
        node = next(stack[-1], None)
        if node is None:  # every node tried at this slot: back to the previous one
            stack.pop()
            if undo:
                give_back(*undo.pop())
            continue
        undo.append((node, take(node)))
        if len(labels) == slots:
            yield build()
            give_back(*undo.pop())
        else:
            stack.append(iter(candidates()))


def random_placement(cluster: ClusterSpec, pp: int, dp: int, tp: int, rng: random.Random) -> Placement:
    """A uniformly random placement whose TP groups each sit in one node."""
    _check(cluster, pp, dp, tp)
    groups = []
    for q in range(cluster.num_nodes):
        devices = cluster.node_devices(q)
        rng.shuffle(devices)
        groups += [tuple(devices[g:g + tp]) for g in range(0, len(devices), tp)]
    rng.shuffle(groups)
    return tuple(tuple(d for g in groups[j * dp:(j + 1) * dp] for d in g) for j in range(pp))


def describe_placement(workload: Workload, plan: Plan) -> str:
    """'placement: stage 0 on GPUs 0,1 (V100-16GB) | stage 1 on 2,3 (P100)'."""
    parts = []
    for j, stage in enumerate(plan.stages):
        types = "/".join(dict.fromkeys(workload.cluster.devices[d].gpu.name for d in stage.devices))
        parts.append(f"stage {j} on GPUs {','.join(map(str, stage.devices))} ({types})")
    return "placement: " + " | ".join(parts)

