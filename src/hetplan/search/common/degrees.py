"""The parallel degrees a plan may use: one rule for every planner.

* ``tp`` keeps every TP group inside a node (devices are numbered node by
  node and TP groups are runs of consecutive ids, so ``tp`` must divide every
  node's GPU count) and every layer must support it (``LayerSpec.supports_tp``);
* ``pp`` is at most the number of layers (one, and no CP, EP or whatever else
  the workload's target cannot run: ``hetplan.plan.support.search_limits``);
* ``dp`` takes the remaining GPUs and must divide the global batch;
* ``cp`` (context parallelism) is tried for long sequences only and ``ep``
  (expert parallelism, taken from the dp·cp GPUs) for MoE models only
  (``enumerate_parallel_degrees``; the model's own rules in ``cost.cp_ep.degree_problem``).
"""

from __future__ import annotations

import math

from hetplan.cost.cp_ep import degree_problem
from hetplan.plan.workload import Workload
from hetplan.plan.support import search_limits


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


def max_stages(workload: Workload) -> int:
    """Pipeline stages a plan may have: at most one per layer, and one where the
    workload's target cannot pipeline the model (``plan.support.search_limits``)."""
    return workload.model.num_layers if search_limits(workload).pipeline else 1


def enumerate_degrees(workload: Workload) -> list[tuple[int, int, int]]:
    """``(pp, dp, tp)`` with pp·dp·tp = GPUs, TP inside nodes, pp ≤ ``max_stages``, dp | global batch."""
    n = workload.cluster.num_devices
    degrees = []
    for tp in tp_degrees(workload):
        for pp in divisors(n // tp):
            dp = n // (tp * pp)
            if pp <= max_stages(workload) and workload.global_batch_size % dp == 0:
                degrees.append((pp, dp, tp))
    return degrees


def micro_batch_sizes(global_batch_size: int, dp: int) -> list[int]:
    """Per-replica micro-batch sizes for ``dp`` (AMP's ``enumerate_(d.dp)``)."""
    if global_batch_size % dp:
        return []
    return divisors(global_batch_size // dp)


# Context parallelism is searched for workloads whose sequences are long enough
# that one sample's activations (no TP, no recomputation) fill this share of
# the smallest GPU: there a replica must split each sample (TP, CP) or
# recompute it. Shorter sequences keep the search space (and its cost) as it
# was. Llama-3-8B: 38 GiB per 8k-token sample (no CP on 80 GB GPUs), 305 GiB
# per 64k-token sample (CP searched).
CP_SEARCH_ACTIVATION_SHARE = 1.0


def context_degrees(workload: Workload) -> list[int]:
    """CP degrees a search tries: 1, and for long sequences
    (``CP_SEARCH_ACTIVATION_SHARE``) every cp up to a node's GPUs whose
    chunks divide the sequence (``cost.cp_ep.degree_problem``)."""
    model, cluster = workload.model, workload.cluster
    tps = tp_degrees(workload)
    if not tps or not any(layer.kv_bytes > 0 for layer in model.layers) or not search_limits(workload).context_parallel:
        return [1]
    per_sample = model.act_bytes_per_sample
    smallest = min(workload.device_capacity_bytes(d.id) for d in cluster.devices)
    if per_sample < CP_SEARCH_ACTIVATION_SHARE * smallest:
        return [1]
    most = max(node.num_gpus for node in cluster.nodes)
    return [cp for cp in divisors(cluster.num_devices) if cp <= most and degree_problem(model, cp, cp, 1) is None]


def expert_degrees(workload: Workload, group: int) -> list[int]:
    """EP degrees over ``group`` = dp·cp devices: 1, and for MoE models every
    divisor of ``group`` that divides every MoE layer's experts."""
    experts = {layer.num_experts for layer in workload.model.layers if layer.is_moe}
    if not experts or not search_limits(workload).expert_parallel:
        return [1]
    common = math.gcd(group, *experts)
    return divisors(common)


def enumerate_parallel_degrees(workload: Workload) -> list[tuple[int, int, int, int, int]]:
    """``(pp, dp, cp, tp, ep)`` with pp·dp·cp·tp = GPUs, TP inside nodes, CP
    only for long sequences (``context_degrees``), EP only for MoE models
    (``expert_degrees``), pp ≤ layers, dp | global batch. With cp = ep = 1
    these are ``enumerate_degrees``."""
    n, model = workload.cluster.num_devices, workload.model
    cps = context_degrees(workload)
    degrees = []
    for tp in tp_degrees(workload):
        for pp in divisors(n // tp):
            if pp > max_stages(workload):
                continue
            rest = n // (tp * pp)
            for cp in cps:
                if rest % cp or workload.global_batch_size % (rest // cp):
                    continue
                dp = rest // cp
                degrees += [(pp, dp, cp, tp, ep) for ep in expert_degrees(workload, rest)
                            if degree_problem(model, dp, cp, ep) is None]
    return degrees
