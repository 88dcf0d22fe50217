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

from hetplan.cost import comm
from hetplan.cost.memory import device_memory
from hetplan.cost.model import CostModel
from hetplan.cost.workload import Workload
from hetplan.errors import HetplanError
from hetplan.plan import LayerStrategy, Plan, RankedPlan
from hetplan.search.base import no_fit_error, rank_key, register_planner
from hetplan.search.uniform import uniform_configs, uniform_plan


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


class HeteroAvgPlanner:
    """Uniform 3D plans chosen as if every GPU were the cluster's average GPU."""

    name = "hetero-avg"

    def __init__(self, keep: int = 8) -> None:
        self.keep = keep

    def plan(self, workload: Workload, top_k: int = 5) -> list[RankedPlan]:
        cm = CostModel(workload)
        cluster = workload.cluster
        model = workload.model
        gpus = [d.gpu for d in cluster.devices]
        capacity_avg = sum(workload.device_capacity_bytes(d.id) for d in cluster.devices) / len(gpus)
        avg_cache: dict[tuple[int, int, int], float] = {}

        def avg_time(index: int, batch: int, tp: int) -> float:
            key = (index, batch, tp)
            value = avg_cache.get(key)
            if value is None:
                total = 0.0
                for g in gpus:
                    t = cm.layer_time(index, g, batch, tp)
                    total += t.fwd_s + t.bwd_s
                value = avg_cache[key] = total / len(gpus)
            return value

        best: list[tuple[float, int, Plan]] = []
        counter = 0
        for dp, tp, pp, u in uniform_configs(workload):
            per_layer = [avg_time(i, u, tp) for i in range(model.num_layers)]
            split = balanced_split(per_layer, pp)
            plan = uniform_plan(workload, dp, tp, pp, u, planner=self.name, layer_split=split)
            cost = self._own_cost(cm, plan, per_layer, capacity_avg)
            if cost is None:
                continue
            counter += 1
            item = (-cost, -counter, plan)
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

    @staticmethod
    def _own_cost(cm: CostModel, plan: Plan, per_layer: list[float], capacity_avg: float) -> float | None:
        """Metis eq. 1 with every GPU taken as the average GPU; None when a
        stage does not fit the average GPU's memory."""
        workload = cm.workload
        cluster = cm.cluster
        model = cm.model
        times = []
        sync = 0.0
        for j, stage in enumerate(plan.stages):
            batch = stage.dp_split[0]
            t = sum(per_layer[i] for i in stage.layers)
            if stage.tp > 1:
                t += sum(cm.tp_comm_time(i, batch, stage.replica_devices(0)) * 2.0 for i in stage.layers)
            if j + 1 < plan.pp:
                t += 2.0 * cm.p2p_time(stage, plan.stages[j + 1], plan.micro_batch_size)
            times.append(t)
            in_flight = float(min(plan.pp - j, plan.num_micro_batches))
            layers = [(i, LayerStrategy(), stage.tp, stage.dp, float(batch)) for i in stage.layers]
            memory = device_memory(model, layers, in_flight, workload.state_bytes)
            if memory > capacity_avg:
                return None
            if stage.dp > 1:
                _, grad_b, _ = workload.state_bytes
                params = sum(model.layers[i].params_tp_sharded / stage.tp + model.layers[i].params_tp_replicated
                             for i in stage.layers)
                sync = max(sync, max(comm.allreduce_time(cluster, g, params * grad_b, stage.tp)
                                     for g in stage.dp_groups()))
        return sum(times) + (plan.num_micro_batches - 1) * max(times) + sync


def register() -> None:
    register_planner("hetero-avg", "AMP/Alpa homogeneous abstraction: uniform 3D plans chosen as if every GPU "
                     "were the cluster's average GPU (Metis §3 baseline)", HeteroAvgPlanner)
