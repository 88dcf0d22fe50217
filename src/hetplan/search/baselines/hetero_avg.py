"""The ``hetero-avg`` planner: the homogeneous abstraction of AMP and Alpa.

Metis §3 ("Current limitations"): AMP and Alpa profile heterogeneous GPUs but
"take an average of the computing power across GPUs and operate on the premise
that all GPUs have this averaged compute capacity". This planner does exactly
that, as the baseline Metis is measured against:

* every GPU is an average GPU R: a layer's time on R is the mean, over the
  cluster's GPUs, of its time on each (same micro-batch share and TP degree);
  R's memory is the mean GPU memory;
* plans are uniform (dp, tp, pp) grids over the GPUs in id order (the M x N
  device-mesh view), TP inside nodes, every micro-batch size;
* layers are split so that the stages are balanced *on R* — which, all stages
  being equal on R, balances per-layer average time, not what each stage's
  real GPUs can do;
* the micro-batch is split evenly over the dp replicas;
* its own objective is Metis eq. 1 on R (real links for communication), and
  its memory check uses R's memory.

It returns its own best plans (by its objective, among those that fit on R);
the shared cost model then says how they really do on the heterogeneous GPUs.
"""

from __future__ import annotations

import heapq
from typing import Sequence

import numpy as np

from hetplan.cost.constants import P2P_PASSES
from hetplan.cost.kernel import CostKernel
from hetplan.cost.stage import StageOption
from hetplan.cost.model import CostModel
from hetplan.plan.workload import Workload
from hetplan.errors import HetplanError
from hetplan.plan.spec import Plan, RankedPlan
from hetplan.search.base import cost_model_for, no_fit_error, rank_key
from hetplan.search.baselines.uniform import uniform_configs, uniform_plan


def balanced_split(times: Sequence[float], parts: int) -> list[range]:
    """Contiguous split of ``times`` into exactly ``parts`` non-empty ranges
    minimising the largest sum: binary search on the bound with a greedy
    fill, then the largest ranges are halved until there are ``parts``."""
    n = len(times)
    if not 1 <= parts <= n:
        raise HetplanError(f"cannot split {n} layers into {parts} stages")

    def greedy(limit: float) -> list[range] | None:
        ranges, start, total = [], 0, 0.0
        for i, t in enumerate(times):
            if t > limit:
                return None
            if total + t > limit and i > start:
                ranges.append(range(start, i))
                start, total = i, 0.0
            total += t
        ranges.append(range(start, n))
        return ranges if len(ranges) <= parts else None

    lo, hi = max(times), sum(times)
    for _ in range(64):
        mid = (lo + hi) / 2.0
        if greedy(mid) is None:
            lo = mid
        else:
            hi = mid
    ranges = greedy(hi) or [range(0, n)]
    def weight(j: int) -> tuple[float, int]:
        r = ranges[j]
        return (sum(times[i] for i in r) if len(r) > 1 else -1.0, -j)

    while len(ranges) < parts:
        k = max(range(len(ranges)), key=weight)
        r = ranges[k]
        cut = r.start + max(1, len(r) // 2)
        ranges[k:k + 1] = [range(r.start, cut), range(cut, r.stop)]
    return ranges


def average_gpu_times(kernel: CostKernel, batch: int, tp: int) -> np.ndarray:
    """Per layer: forward + backward time averaged over every GPU of the cluster."""
    counts: dict[str, int] = {}
    gpus = {}
    for device in kernel.cluster.devices:
        counts[device.gpu.name] = counts.get(device.gpu.name, 0) + 1
        gpus[device.gpu.name] = device.gpu
    total = np.zeros(kernel.num_layers)
    for name in sorted(counts):
        t = kernel.layer_times(gpus[name], batch, tp)
        total += (t.fwd_s + t.bwd_s) * counts[name]
    return total / kernel.cluster.num_devices


class HeteroAvgPlanner:
    """Uniform 3D plans chosen as if every GPU were the cluster's average GPU."""

    name = "hetero-avg"

    def __init__(self, keep: int = 8) -> None:
        self.keep = keep

    def plan(self, workload: Workload, top_k: int = 5, cost: CostModel | None = None) -> list[RankedPlan]:
        cm = cost_model_for(workload, cost)
        capacity_avg = sum(workload.device_capacity_bytes(d.id) for d in workload.cluster.devices) \
            / workload.cluster.num_devices
        best: list[tuple[float, int, Plan]] = []
        counter = 0
        for dp, tp, pp, u in uniform_configs(workload):
            per_layer = average_gpu_times(cm.kernel, u, tp)
            plan = uniform_plan(workload, dp, tp, pp, u, planner=self.name,
                                layer_split=balanced_split(list(per_layer), pp))
            cost_s = own_cost(cm.kernel, plan, per_layer, capacity_avg)
            if cost_s is None:
                continue
            counter += 1
            item = (-cost_s, -counter, plan)
            if len(best) < max(self.keep, top_k):
                heapq.heappush(best, item)
            elif item > best[0]:
                heapq.heapreplace(best, item)
        if not best:
            raise HetplanError(
                f"hetero-avg found no uniform plan that fits the average GPU's memory for global batch "
                f"{workload.global_batch_size}; use a smaller global batch or more GPUs"
            )
        chosen = sorted(best, key=lambda item: (-item[0], -item[1]))
        ranked = [RankedPlan(p, cm.estimate(p), planner_cost_s=-c) for c, _, p in chosen]
        ranked.sort(key=rank_key)
        if not ranked[0].estimate.fits:
            raise no_fit_error(workload, ranked)
        return ranked[:top_k]


def own_cost(kernel: CostKernel, plan: Plan, per_layer: np.ndarray, capacity_avg: float) -> float | None:
    """hetero-avg's private objective: Metis eq. 1 with every GPU taken as the
    average GPU (compute from ``per_layer``; TP, pipeline and gradient traffic
    on the real links); None when a stage does not fit the average GPU's memory."""
    prefix = np.concatenate([[0.0], np.cumsum(per_layer)])
    times = []
    sync = 0.0
    for j, stage in enumerate(plan.stages):
        a, b = stage.layers[0], stage.layers[-1] + 1
        option = StageOption.of_stage(stage)
        assert option is not None  # a uniform plan: one strategy per stage
        costs = kernel.stage(option)
        timing = costs.timing(a, b)
        t = float(prefix[b] - prefix[a]) + timing.tp_comm_s
        if j + 1 < plan.pp:
            t += P2P_PASSES * kernel.p2p_time(stage.devices, plan.stages[j + 1].devices, b - 1,
                                              plan.micro_batch_size)
        times.append(t)
        if max(costs.class_memory(a, b, float(min(plan.pp - j, plan.num_micro_batches)),
                                micro_batches=plan.num_micro_batches)) > capacity_avg:
            return None
        sync = max(sync, timing.grad_sync_s)
    return sum(times) + (plan.num_micro_batches - 1) * max(times) + sync
