"""The parallel degrees a plan may use: one rule for every planner.

* ``tp`` keeps every TP group inside a node (devices are numbered node by
  node and TP groups are runs of consecutive ids, so ``tp`` must divide every
  node's GPU count) and every layer must support it (``LayerSpec.supports_tp``);
* ``pp`` is at most the number of layers;
* ``dp`` takes the remaining GPUs and must divide the global batch.
"""

from __future__ import annotations

from hetplan.cost.workload import Workload


def divisors(n: int) -> list[int]:
    """Positive divisors of ``n`` in increasing order."""
    small = [d for d in range(1, int(n ** 0.5) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def tp_fits_nodes(workload: Workload, tp: int) -> bool:
    """Every run of ``tp`` consecutive device ids lies inside one node."""
    return all(node.num_gpus % tp == 0 for node in workload.cluster.nodes)


def model_supports_tp(workload: Workload, tp: int) -> bool:
    return all(layer.supports_tp(tp) for layer in workload.model.layers)


def tp_degrees(workload: Workload) -> list[int]:
    """TP degrees of uniform plans: inside nodes, supported by every layer."""
    n = workload.cluster.num_devices
    return [tp for tp in divisors(n) if tp_fits_nodes(workload, tp) and model_supports_tp(workload, tp)]


def enumerate_degrees(workload: Workload) -> list[tuple[int, int, int]]:
    """``(pp, dp, tp)`` with pp·dp·tp = GPUs, TP inside nodes, pp ≤ layers, dp | global batch."""
    n = workload.cluster.num_devices
    degrees = []
    for tp in tp_degrees(workload):
        for pp in divisors(n // tp):
            dp = n // (tp * pp)
            if pp <= workload.model.num_layers and workload.global_batch_size % dp == 0:
                degrees.append((pp, dp, tp))
    return degrees


def micro_batch_sizes(global_batch_size: int, dp: int) -> list[int]:
    """Per-replica micro-batch sizes for ``dp`` (AMP's ``enumerate_(d.dp)``)."""
    if global_batch_size % dp:
        return []
    return divisors(global_batch_size // dp)
