"""Device placement: which physical GPUs run which (stage, replica, TP rank).

A placement is returned as each stage's device ids, ``dp·tp`` of them with TP
innermost (replica ``r`` owns ``devices[r*tp:(r+1)*tp]``), the layout of
:class:`hetplan.plan.Stage`. Every placement here keeps a TP group inside one
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

import math
import random
from typing import TYPE_CHECKING, Iterator

from hetplan.cluster.spec import ClusterSpec
from hetplan.errors import HetplanError

if TYPE_CHECKING:  # pragma: no cover
    from hetplan.cost.workload import Workload
    from hetplan.plan import Plan

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


def _node_class(cluster: ClusterSpec, index: int) -> tuple[object, ...]:
    node = cluster.nodes[index]
    device = cluster.node_devices(index)[0]
    return (node.gpu.name, node.num_gpus, node.intra_bandwidth_gbps, cluster.node_inter_gbps(index),
            cluster.devices[device].memory_bytes)


def count_canonical_placements(cluster: ClusterSpec, pp: int, dp: int, tp: int) -> int:
    """How many placements :func:`canonical_placements` yields, without listing them.

    The label sequences are the multiset permutations of the nodes' TP-group
    counts; permuting identical nodes acts freely on them (every node appears),
    so the orbits number multinomial / Π (identical nodes)!."""
    _check(cluster, pp, dp, tp)
    counts = [node.num_gpus // tp for node in cluster.nodes]
    total = math.factorial(sum(counts))
    for c in counts:
        total //= math.factorial(c)
    classes: dict[tuple[object, ...], int] = {}
    for q in range(cluster.num_nodes):
        key = _node_class(cluster, q)
        classes[key] = classes.get(key, 0) + 1
    for m in classes.values():
        total //= math.factorial(m)
    return total


def canonical_placements(cluster: ClusterSpec, pp: int, dp: int, tp: int) -> Iterator[Placement]:
    """One placement per symmetry class, deterministic order.

    Slots ``(stage j, replica i)`` in order each take a TP group from some
    node; a sequence of node labels is kept only if, within each class of
    identical nodes, nodes first appear in index order. Devices of a node are
    handed out in increasing id order.
    """
    _check(cluster, pp, dp, tp)
    if cluster.bandwidth_matrix_gbps is not None:
        raise HetplanError("enumerating placements up to symmetry needs a cluster described by nodes, "
                           "not a device-to-device bandwidth matrix")
    num_nodes = cluster.num_nodes
    remaining = [node.num_gpus // tp for node in cluster.nodes]
    classes = [_node_class(cluster, q) for q in range(num_nodes)]
    earlier_same = [[p for p in range(q) if classes[p] == classes[q]] for q in range(num_nodes)]
    used = [False] * num_nodes
    labels: list[int] = []
    slots = pp * dp
    node_devices = [cluster.node_devices(q) for q in range(num_nodes)]

    def build() -> Placement:
        taken = [0] * num_nodes
        groups = []
        for q in labels:
            start = taken[q] * tp
            groups.append(tuple(node_devices[q][start:start + tp]))
            taken[q] += 1
        return tuple(tuple(d for g in groups[j * dp:(j + 1) * dp] for d in g) for j in range(pp))

    def extend() -> Iterator[Placement]:
        if len(labels) == slots:
            yield build()
            return
        for q in range(num_nodes):
            if not remaining[q]:
                continue
            if not used[q] and any(not used[p] for p in earlier_same[q]):
                continue
            first = not used[q]
            remaining[q] -= 1
            used[q] = True
            labels.append(q)
            yield from extend()
            labels.pop()
            remaining[q] += 1
            if first:
                used[q] = False

    yield from extend()


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

