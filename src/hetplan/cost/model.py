"""CostModel: the one place that says how long a Plan takes and how much memory
it needs. Every planner ranks its final plans with it and the runtime reports
against it, so plans from different planners compare fairly.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from hetplan.cluster.catalog import GPUSpec
from hetplan.cost import comm
from hetplan.cost.compute import LayerTime, layer_time
from hetplan.cost.constants import OPTIMIZER_STEP_BYTES_PER_PARAM, MEMORY_BANDWIDTH_EFFICIENCY, OVERLAP_SLOWDOWN
from hetplan.cost.memory import device_memory, in_flight_micro_batches, layer_params_per_device
from hetplan.cost.pipeline import pipeline_time
from hetplan.cost.workload import Workload
from hetplan.plan import Estimate, Plan, Stage, StageEstimate


@dataclass(frozen=True)
class _StageTiming:
    per_micro_batch_s: float  # forward + backward + recompute + TP comm + exposed ZeRO-3 comm
    fwd_s: float
    bwd_s: float
    compute_s: float
    recompute_s: float
    tp_comm_s: float
    zero3_exposed_s: float
    grad_sync_s: float  # end-of-step gradient reduction, before overlap
    post_step_gather_s: float  # ZeRO-1/2 parameter all-gather after the optimizer step


def overlapped_exposure(comm_s: float, compute_s: float) -> float:
    """Extra time when ``comm_s`` runs under ``compute_s``.

    Galvatron-BMW §V (and its code's ``bct_dp_overlap``): the overlapped part
    runs OVERLAP_SLOWDOWN times slower, so the pair takes
    ``max(c, p) + (slowdown − 1)·min(c, p)`` instead of ``p``.
    """
    if comm_s <= 0:
        return 0.0
    return max(comm_s, compute_s) + (OVERLAP_SLOWDOWN - 1.0) * min(comm_s, compute_s) - compute_s


class CostModel:
    """Predicts time and memory of Plans for one Workload."""

    def __init__(self, workload: Workload) -> None:
        self.workload = workload
        self.model = workload.model
        self.cluster = workload.cluster
        self._layer_time = lru_cache(maxsize=None)(self._layer_time_uncached)

    # --- building blocks (also used directly by planners) ---------------------
    def _layer_time_uncached(self, index: int, gpu: GPUSpec, batch: float, tp: int, recompute: str,
                             sequence_parallel: bool) -> LayerTime:
        return layer_time(self.model.layers[index], gpu, batch, tp, recompute, self.model.dtype_bytes,
                          sequence_parallel, self.workload.profile)

    def layer_time(self, index: int, gpu: GPUSpec, batch: float, tp: int = 1, recompute: str = "none",
                   sequence_parallel: bool = False) -> LayerTime:
        """Compute time (no communication) of layer ``index`` on ``batch`` samples."""
        return self._layer_time(index, gpu, float(batch), tp, recompute, sequence_parallel)

    def slowest_gpu(self, devices: tuple[int, ...] | list[int]) -> GPUSpec:
        """The GPU that sets the pace of a TP group (the lowest peak rate)."""
        dtype = self.model.dtype_bytes
        return min((self.cluster.devices[d].gpu for d in devices), key=lambda g: g.peak_flops_for(dtype))

    def tp_comm_time(self, index: int, batch: float, group: tuple[int, ...]) -> float:
        """TP all-reduce time of one forward pass of layer ``index`` (the backward
        all-reduces the same volume)."""
        if len(group) < 2:
            return 0.0
        return comm.allreduce_time(self.cluster, group, self.model.layers[index].tp_comm_bytes * batch)

    # --- stages -----------------------------------------------------------------
    def layer_replicas(self, stage: Stage, position: int, micro_batch_size: int) -> list[tuple[tuple[int, ...], float]]:
        """(TP group devices, samples) of each replica running the ``position``-th
        layer of ``stage``: the stage's own replicas and dp_split, or — for a
        layer with its own tp — runs of ``tp`` devices sharing the micro-batch evenly."""
        dp, tp = stage.layer_degrees(position)
        if tp == stage.tp:
            return [(stage.replica_devices(r), float(stage.dp_split[r])) for r in range(stage.dp)]
        return [(stage.devices[r * tp:(r + 1) * tp], micro_batch_size / dp) for r in range(dp)]

    def _segments(self, stage: Stage) -> list[list[int]]:
        """Runs of consecutive layer positions that share a tp degree."""
        segments: list[list[int]] = []
        previous = None
        for pos in range(stage.num_layers):
            tp = stage.layer_degrees(pos)[1]
            if tp != previous:
                segments.append([])
                previous = tp
            segments[-1].append(pos)
        return segments

    def transform_time(self, stage: Stage, before: int, after: int, micro_batch_size: int) -> float:
        """Galvatron-BMW's transformation cost R between adjacent layers with
        different (dp, tp): the activation entering ``after`` is gathered over
        the larger TP group (slicing to a smaller group is local)."""
        dp_a, tp_a = stage.layer_degrees(before)
        dp_b, tp_b = stage.layer_degrees(after)
        if tp_a == tp_b:
            return 0.0
        big = max(tp_a, tp_b)
        layer = self.model.layers[stage.layers[after]]
        num_bytes = layer.input_bytes * micro_batch_size / min(dp_a, dp_b)
        return max(comm.allgather_time(self.cluster, stage.devices[r * big:(r + 1) * big], num_bytes)
                   for r in range(len(stage.devices) // big))

    def _stage_timing(self, stage: Stage, micro_batch_size: int) -> _StageTiming:
        weight_b, grad_b, _ = self.workload.state_bytes
        fwd = bwd = rec = tpc = 0.0
        segments = self._segments(stage)
        for s_index, segment in enumerate(segments):
            # within a segment every replica runs on its own; the slowest sets the pace
            worst: tuple[float, float, float, float, float] | None = None
            for r, (group, batch) in enumerate(self.layer_replicas(stage, segment[0], micro_batch_size)):
                gpu = self.slowest_gpu(group)
                f = b = rc = c = 0.0
                for pos in segment:
                    index, strategy = stage.layers[pos], stage.strategies[pos]
                    tp = len(group)
                    t = self.layer_time(index, gpu, batch, tp, strategy.recompute, stage.sequence_parallel)
                    f, b, rc = f + t.fwd_s, b + t.bwd_s, rc + t.recompute_s
                    if tp > 1 and batch > 0:
                        c += self.tp_comm_time(index, batch, group) * (3.0 if strategy.recompute == "full" else 2.0)
                total = f + b + rc + c
                if worst is None or total > worst[0]:
                    worst = (total, f, b, rc, c)
            assert worst is not None
            fwd, bwd, rec, tpc = fwd + worst[1], bwd + worst[2], rec + worst[3], tpc + worst[4]
            if s_index > 0:
                tpc += 2.0 * self.transform_time(stage, segments[s_index - 1][-1], segment[0], micro_batch_size)

        # data-parallel communication, per (dp, tp) shape of the layers
        zero3: dict[int, float] = {}
        other: dict[int, float] = {}
        sharded_12: dict[int, float] = {}
        for pos, (index, strategy) in enumerate(zip(stage.layers, stage.strategies)):
            dp, tp = stage.layer_degrees(pos)
            if dp < 2:
                continue
            params = layer_params_per_device(self.model.layers[index], tp)
            bucket = zero3 if strategy.zero >= 3 else other
            bucket[tp] = bucket.get(tp, 0.0) + params
            if strategy.zero in (1, 2):
                sharded_12[tp] = sharded_12.get(tp, 0.0) + params

        def dp_groups(tp: int) -> list[tuple[int, ...]]:
            dp = len(stage.devices) // tp
            return [tuple(stage.devices[r * tp + t] for r in range(dp)) for t in range(tp)]

        def worst_time(fn, tp: int, num_bytes: float) -> float:  # type: ignore[no-untyped-def]
            return max(fn(self.cluster, g, num_bytes, tp) for g in dp_groups(tp))

        gather = sum(worst_time(comm.allgather_time, tp, p * weight_b) for tp, p in zero3.items())
        scatter = sum(worst_time(comm.reduce_scatter_time, tp, p * grad_b) for tp, p in zero3.items())
        zero3_exposed = 0.0
        if zero3:
            zero3_exposed = overlapped_exposure(gather, fwd) + overlapped_exposure(gather + scatter, bwd + rec)
        grad_sync = sum(worst_time(comm.allreduce_time, tp, p * grad_b) for tp, p in other.items())
        gather_after = 0.0
        if sharded_12:
            # the all-reduce becomes reduce-scatter now + all-gather after the step
            gather_after = sum(worst_time(comm.allgather_time, tp, p * weight_b) for tp, p in sharded_12.items())
            grad_sync -= sum(worst_time(comm.allgather_time, tp, p * grad_b) for tp, p in sharded_12.items())
            grad_sync = max(grad_sync, 0.0)
        total = fwd + bwd + rec + tpc
        return _StageTiming(total + zero3_exposed, fwd, bwd, fwd + bwd, rec, tpc, zero3_exposed,
                            grad_sync, gather_after)

    def p2p_time(self, sender: Stage, receiver: Stage, micro_batch_size: int) -> float:
        """One-way time to pass one micro-batch's activations between two stages."""
        layer = self.model.layers[sender.layers[-1]]
        return comm.p2p_time(self.cluster, sender.devices, receiver.devices, layer.output_bytes * micro_batch_size)

    def stage_memory(self, plan: Plan, stage_index: int) -> list[int]:
        """Peak bytes on each device of stage ``stage_index`` (in its device order)."""
        stage = plan.stages[stage_index]
        in_flight = in_flight_micro_batches(plan.schedule, stage_index, plan.pp, plan.num_micro_batches,
                                            plan.virtual_stages)
        n = len(stage.devices)
        per_layer = []
        for pos in range(stage.num_layers):
            dp, tp = stage.layer_degrees(pos)
            replicas = self.layer_replicas(stage, pos, plan.micro_batch_size)
            per_layer.append((stage.layers[pos], stage.strategies[pos], tp, dp, replicas))
        result = []
        cache: dict[tuple[float, ...], int] = {}
        for i in range(n):
            layers = [(index, strategy, tp, dp, replicas[i // tp][1])
                      for index, strategy, tp, dp, replicas in per_layer]
            key = tuple(layer[4] for layer in layers)
            if key not in cache:
                is_cpu = self.cluster.devices[stage.devices[i]].gpu.name == "CPU"
                cache[key] = int(device_memory(self.model, layers, in_flight, self.workload.state_bytes,
                                               stage.sequence_parallel, is_cpu))
            result.append(cache[key])
        return result

    # --- whole plan ---------------------------------------------------------------
    def estimate(self, plan: Plan) -> Estimate:
        """Iteration time, its parts, throughput, MFU and per-GPU peak memory."""
        timings = [self._stage_timing(s, plan.micro_batch_size) for s in plan.stages]
        p2p = [self.p2p_time(plan.stages[j], plan.stages[j + 1], plan.micro_batch_size)
               for j in range(plan.pp - 1)]
        m, v = plan.num_micro_batches, max(1, plan.virtual_stages)
        stage_times = [t.per_micro_batch_s for t in timings]
        t_pipe = pipeline_time(stage_times, p2p, m, v)

        # gradient sync: stage j's last backward ends earlier than stage 0's by
        # the backward passes and links in front of it (Galvatron-BMW eq. 8).
        finish = t_pipe
        ahead = 0.0
        for j, t in enumerate(timings):
            if j > 0:
                ahead += timings[j - 1].bwd_s + timings[j - 1].recompute_s + p2p[j - 1]
            if t.grad_sync_s > 0:
                if self.workload.overlap_grad_sync:
                    exposed = overlapped_exposure(t.grad_sync_s, t.bwd_s + t.recompute_s)
                else:
                    exposed = t.grad_sync_s
            else:
                exposed = 0.0
            finish = max(finish, t_pipe - ahead + exposed + t.post_step_gather_s)
        dp_sync = finish - t_pipe

        optimizer = self._optimizer_time(plan)
        iteration = finish + optimizer

        k = max(range(len(timings)), key=lambda j: stage_times[j])
        slow = timings[k]
        compute = m * slow.compute_s
        recompute = m * slow.recompute_s
        tp_comm = m * slow.tp_comm_s
        zero3 = m * slow.zero3_exposed_s
        p2p_total = 2.0 * v * sum(p2p)
        bubble = t_pipe - compute - recompute - tp_comm - zero3 - p2p_total

        peak: dict[int, int] = {}
        capacity: dict[int, int] = {}
        stage_estimates = []
        for j, stage in enumerate(plan.stages):
            mems = self.stage_memory(plan, j)
            caps = [self.workload.device_capacity_bytes(d) for d in stage.devices]
            for d, mem, cap in zip(stage.devices, mems, caps):
                peak[d] = mem
                capacity[d] = cap
            t = timings[j]
            stage_estimates.append(StageEstimate(
                fwd_s=t.fwd_s, bwd_s=t.bwd_s, recompute_s=t.recompute_s, tp_comm_s=t.tp_comm_s,
                p2p_s=p2p[j] if j < len(p2p) else 0.0, dp_sync_s=t.grad_sync_s + t.zero3_exposed_s,
                memory_bytes=tuple(mems), memory_capacity_bytes=tuple(caps),
            ))
        fits = all(peak[d] <= capacity[d] for d in peak)
        samples_per_s = plan.global_batch_size / iteration
        dtype = self.model.dtype_bytes
        peak_flops = sum(self.cluster.devices[d].gpu.peak_flops_for(dtype) for d in peak)
        mfu = self.model.train_flops_per_sample * samples_per_s / peak_flops
        return Estimate(
            iteration_time_s=iteration,
            compute_s=compute,
            bubble_s=bubble,
            p2p_s=p2p_total,
            dp_sync_s=dp_sync + zero3,
            tp_comm_s=tp_comm,
            recompute_s=recompute,
            optimizer_s=optimizer,
            samples_per_s=samples_per_s,
            tokens_per_s=samples_per_s * self.model.seq_len,
            mfu=mfu,
            peak_memory_bytes=peak,
            memory_capacity_bytes=capacity,
            fits=fits,
            stages=tuple(stage_estimates),
        )

    def _optimizer_time(self, plan: Plan) -> float:
        """The optimizer step is memory-bound: bytes touched per parameter held."""
        worst = 0.0
        for stage in plan.stages:
            gpu = self.slowest_gpu(stage.devices)
            params = 0.0
            for pos, (index, strategy) in enumerate(zip(stage.layers, stage.strategies)):
                dp, tp = stage.layer_degrees(pos)
                p = layer_params_per_device(self.model.layers[index], tp)
                params += p / dp if strategy.zero >= 1 else p
            t = params * OPTIMIZER_STEP_BYTES_PER_PARAM / (gpu.memory_bandwidth_bytes_per_s
                                                          * MEMORY_BANDWIDTH_EFFICIENCY)
            worst = max(worst, t)
        return worst
