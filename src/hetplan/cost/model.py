"""CostModel: how long a Plan takes and how much memory it needs.

Every planner ranks its final plans with :meth:`CostModel.estimate` and reads
its search costs from the same :class:`hetplan.cost.kernel.CostKernel`, so
plans from different planners compare fairly and a planner's own number for a
plan is the estimate's.
"""

from __future__ import annotations

import math
from dataclasses import replace

from hetplan.cost import shared_cores
from hetplan.cost.bounds import iteration_lower_bound
from hetplan.cost.constants import P2P_PASSES
from hetplan.cost.kernel import CostKernel
from hetplan.cost.stage import SegmentTiming, StageOption
from hetplan.cost.memory import in_flight_micro_batches
from hetplan.cost.mixed import (
    mixed_stage_memory, mixed_stage_timing, stage_host_bytes, stage_peak_terms, stage_resident_parts,
)
from hetplan.cost.memory import PeakTerms
from hetplan.cost.pipeline_memory import pipelined_terms, stage_in_flight
from hetplan.cost.pipeline import IterationTime, StageTail, iteration_time, pipeline_time
from hetplan.plan.workload import Workload
from hetplan.cost.replica_tp import (
    replica_tp_host_bytes, replica_tp_peak_terms, replica_tp_resident_parts, replica_tp_timing,
)
from hetplan.plan.spec import Estimate, Plan, Stage, StageEstimate


class CostModel:
    """Predicts time and memory of Plans for one Workload (one shared kernel)."""

    def __init__(self, workload: Workload, kernel: CostKernel | None = None) -> None:
        """``kernel``: share the tables of another CostModel of the same model,
        cluster and settings (the global batch may differ: no table depends on it)."""
        self.workload = workload
        self.model = workload.model
        self.cluster = workload.cluster
        if kernel is not None and replace(kernel.workload, global_batch_size=workload.global_batch_size) != workload:
            raise ValueError("a shared kernel must be for the same model, cluster and settings")
        self.kernel = kernel if kernel is not None else CostKernel(workload)
        self._lower_bound: float | None = None

    # --- stages -------------------------------------------------------------------------
    def stage_timing(self, stage: Stage, micro_batch_size: int) -> SegmentTiming:
        """What ``stage`` charges per micro-batch and per step."""
        if stage.replica_tp is not None:
            return replica_tp_timing(self.kernel, stage, micro_batch_size)
        option = StageOption.of_stage(stage)
        if option is None:
            return mixed_stage_timing(self.kernel, stage, micro_batch_size)
        return self.kernel.stage(option).timing(stage.layers[0], stage.layers[-1] + 1)

    def stage_memory(self, plan: Plan, stage_index: int) -> list[int]:
        """Peak bytes on each device of stage ``stage_index`` (in its device order)."""
        if self._holds_pipeline(plan):
            return [int(t.peak) for t in self.stage_terms(plan, stage_index)]
        in_flight = in_flight_micro_batches(plan.schedule, stage_index, plan.pp, plan.num_micro_batches,
                                            plan.virtual_stages)
        return self.device_memory(plan.stages[stage_index], plan.micro_batch_size, in_flight,
                                  in_flight >= plan.num_micro_batches)

    def _holds_pipeline(self, plan: Plan) -> bool:
        """A pipelined plan of hetplan's runtime: its stages hold what the pipeline
        does beyond their layers (``cost/pipeline_memory.py``)."""
        return self.kernel.runtime and plan.pp > 1 and self.kernel.memory_profile is None

    def stage_terms(self, plan: Plan, stage_index: int) -> list[PeakTerms]:
        """Each device's memory terms of stage ``stage_index`` (``memory.PeakTerms``),
        with what a pipelined step of hetplan's runtime holds (``pipeline_memory``)."""
        in_flight = stage_in_flight(self.kernel, plan, stage_index) if self._holds_pipeline(plan) else None
        if in_flight is None:
            in_flight = in_flight_micro_batches(plan.schedule, stage_index, plan.pp, plan.num_micro_batches,
                                                plan.virtual_stages)
        stage, first_backward = plan.stages[stage_index], in_flight >= plan.num_micro_batches
        peak_terms = replica_tp_peak_terms if stage.replica_tp is not None else stage_peak_terms
        terms = peak_terms(self.kernel, stage, plan.micro_batch_size, in_flight, first_backward)
        return pipelined_terms(self.kernel, plan, stage_index, terms)

    def device_memory(self, stage: Stage, micro_batch_size: int, in_flight: float,
                      first_backward: bool = False) -> list[int]:
        """Peak bytes on each device of ``stage`` holding ``in_flight`` micro-batches
        (``first_backward``: all of the step's, before its first backward:
        ``memory.PeakTerms``; without it gradients count at every backward, never less)."""
        if stage.replica_tp is not None:
            return [int(t.peak) for t in replica_tp_peak_terms(self.kernel, stage, micro_batch_size, in_flight,
                                                               first_backward)]
        option = StageOption.of_stage(stage)
        if option is None:
            return mixed_stage_memory(self.kernel, stage, micro_batch_size, in_flight, first_backward)
        return self.kernel.stage(option).device_memory(stage.layers[0], stage.layers[-1] + 1, in_flight,
                                                       first_backward)

    def device_host_bytes(self, stage: Stage, micro_batch_size: int, in_flight: float) -> list[int]:
        """Offloaded activations each device of ``stage`` keeps in host memory
        (0 where its layers are not offloaded)."""
        if not any(s.offload for s in stage.strategies):
            return [0] * len(stage.devices)
        if stage.replica_tp is not None:
            return [int(b) for b in replica_tp_host_bytes(self.kernel, stage, micro_batch_size, in_flight)]
        option = StageOption.of_stage(stage)
        if option is None:
            return [int(b) for b in stage_host_bytes(self.kernel, stage, micro_batch_size, in_flight)]
        return self.kernel.stage(option).device_host_bytes(stage.layers[0], stage.layers[-1] + 1, in_flight)

    def host_offload_bytes(self, plan: Plan) -> dict[int, int]:
        """Each device of an offloading stage: its offloaded activations in host memory."""
        out: dict[int, int] = {}
        for j, stage in enumerate(plan.stages):
            if any(s.offload for s in stage.strategies):
                in_flight = in_flight_micro_batches(plan.schedule, j, plan.pp, plan.num_micro_batches,
                                                    plan.virtual_stages)
                out.update(zip(stage.devices, self.device_host_bytes(stage, plan.micro_batch_size, in_flight)))
        return out

    def memory_breakdown(self, plan: Plan) -> dict[int, dict[str, int]]:
        """Each device's peak by category (``memory.MEMORY_CATEGORIES``: params,
        grads, optimizer, activations, loss, buffers; ``memory.PeakTerms.parts``);
        the categories add up to the peak of ``estimate``. Empty where a profile
        gives measured memory (not split)."""
        if self.kernel.memory_profile is not None:
            return {}
        out: dict[int, dict[str, int]] = {}
        for j, stage in enumerate(plan.stages):
            for device, terms in zip(stage.devices, self.stage_terms(plan, j)):
                out[device] = {k: int(v) for k, v in terms.parts().items()}
        return out

    def resident_state_bytes(self, plan: Plan) -> dict[int, dict[str, int]]:
        """Each device's parameters, gradients and optimizer states kept between
        steps (``mixed.stage_resident_parts``): the bytes of the runtime's local
        tensors after a step, which ``tests/distributed/test_zero_bytes.py`` checks."""
        out: dict[int, dict[str, int]] = {}
        for stage in plan.stages:
            per_device = replica_tp_resident_parts(self.kernel, stage) if stage.replica_tp is not None \
                else [stage_resident_parts(self.kernel, stage)] * len(stage.devices)
            out.update({device: {k: int(v) for k, v in parts.items()}
                        for device, parts in zip(stage.devices, per_device)})
        return out

    def p2p_times(self, plan: Plan) -> list[float]:
        """One-way activation transfer of one micro-batch across each stage boundary."""
        return [self.kernel.p2p_time(plan.stages[j].devices, plan.stages[j + 1].devices, plan.stages[j].layers[-1],
                                     plan.micro_batch_size) for j in range(plan.pp - 1)]

    def lower_bound_s(self) -> float:
        """A time no plan of this workload can beat (``cost/bounds.py``)."""
        if self._lower_bound is None:
            self._lower_bound = iteration_lower_bound(self.kernel, self.workload.global_batch_size)
        return self._lower_bound

    def stage_fits(self, plan: Plan, stage_index: int) -> bool:
        """Every GPU of the stage within its capacity (cheaper than ``stage_memory``)."""
        stage = plan.stages[stage_index]
        option = StageOption.of_stage(stage)
        in_flight = in_flight_micro_batches(plan.schedule, stage_index, plan.pp, plan.num_micro_batches,
                                            plan.virtual_stages)
        if option is None or self._holds_pipeline(plan):
            host = self.device_host_bytes(stage, plan.micro_batch_size, in_flight)
            return all(m <= self.workload.device_capacity_bytes(d) and h <= self.kernel.host_capacity_bytes(d)
                       for d, m, h in zip(stage.devices, self.stage_memory(plan, stage_index), host))
        return self.kernel.stage(option).fits(stage.layers[0], stage.layers[-1] + 1, in_flight,
                                              in_flight >= plan.num_micro_batches)

    # --- whole plan ---------------------------------------------------------------
    def _step(self, plan: Plan) -> tuple[list[SegmentTiming], list[float], IterationTime]:
        timings = [self.stage_timing(s, plan.micro_batch_size) for s in plan.stages]
        p2p = self.p2p_times(plan)
        tails = [StageTail(t.back_s, t.grad_sync_s, t.post_step_s, t.optimizer_s) for t in timings]
        step = iteration_time([t.per_micro_batch_s for t in timings], p2p, tails, plan.num_micro_batches,
                              self.workload.overlap_grad_sync, max(1, plan.virtual_stages),
                              self.kernel.overlap_slowdown, self._shared_core_pipeline(plan, timings, p2p),
                              plan.schedule)
        return timings, p2p, step

    def _shared_core_pipeline(self, plan: Plan, timings: list[SegmentTiming], p2p: list[float]) -> float | None:
        """The pipeline's time when its processes share fewer cores than they
        are (``cost/shared_cores.py``; None otherwise, and for interleaved
        schedules, which keep the closed form)."""
        sharing = self.kernel.core_sharing
        if sharing is None or plan.pp == 1 or plan.virtual_stages > 1:
            return None
        fwd = [t.per_micro_batch_s * t.fwd_s / max(t.fwd_s + t.back_s, 1e-30) for t in timings]
        bwd = [t.per_micro_batch_s - f for t, f in zip(timings, fwd)]
        return shared_cores.pipeline_time(plan.schedule, fwd, bwd, p2p, plan.num_micro_batches,
                                          [len(s.devices) for s in plan.stages], *sharing)

    def quick(self, plan: Plan) -> tuple[float, bool]:
        """(iteration time, fits) — what ``estimate`` says, without the per-GPU
        details: what searches rank thousands of candidates by."""
        _, _, step = self._step(plan)
        return step.total_s, all(self.stage_fits(plan, j) for j in range(plan.pp))

    def estimate(self, plan: Plan) -> Estimate:
        """Iteration time, its parts, throughput, MFU and per-GPU peak memory."""
        timings, p2p, step = self._step(plan)
        m, v = plan.num_micro_batches, max(1, plan.virtual_stages)
        stage_times = [t.per_micro_batch_s for t in timings]

        slowest = max(range(len(timings)), key=lambda j: stage_times[j])
        slow = timings[slowest]
        compute = m * (slow.fwd_s + slow.bwd_s)
        recompute, tp_comm, zero3 = m * slow.recompute_s, m * slow.tp_comm_s, m * slow.zero3_exposed_s
        offload = m * slow.offload_s  # part of recompute until the breakdown splits it off
        p2p_total = P2P_PASSES * v * sum(p2p)
        # processes sharing cores (cost/shared_cores.py) run the pipeline faster than
        # its closed form: its parts shrink by that speed-up, as they ran
        closed = pipeline_time(stage_times, p2p, m, v, plan.schedule)
        speedup = step.pipeline_s / closed if closed > 0 else 1.0
        compute, recompute, tp_comm, zero3, p2p_total, offload = (
            x * min(1.0, speedup) for x in (compute, recompute, tp_comm, zero3, p2p_total, offload))
        bubble = max(0.0, step.pipeline_s - compute - recompute - tp_comm - zero3 - p2p_total)  # recompute holds offload
        host_dispatch, loss = self._run_detail(plan, slowest, m * min(1.0, speedup), compute)

        peak: dict[int, int] = {}
        capacity: dict[int, int] = {}
        stage_estimates = []
        for j, (stage, t) in enumerate(zip(plan.stages, timings)):
            mems = self.stage_memory(plan, j)
            caps = [self.workload.device_capacity_bytes(d) for d in stage.devices]
            peak.update(zip(stage.devices, mems))
            capacity.update(zip(stage.devices, caps))
            stage_estimates.append(StageEstimate(
                fwd_s=t.fwd_s, bwd_s=t.bwd_s, recompute_s=t.recompute_s, tp_comm_s=t.tp_comm_s,
                p2p_s=p2p[j] if j < len(p2p) else 0.0, dp_sync_s=t.grad_sync_s + t.zero3_exposed_s,
                memory_bytes=tuple(mems), memory_capacity_bytes=tuple(caps),
            ))
        host = self.host_offload_bytes(plan)
        # devices with a host limit (a CPU "device" has none: ``memory.host_offload_capacity_bytes``)
        host_capacity = {d: int(c) for d in host if math.isfinite(c := self.kernel.host_capacity_bytes(d))}
        samples_per_s = plan.global_batch_size / step.total_s
        dtype = self.model.dtype_bytes
        peak_flops = sum(self.cluster.devices[d].gpu.peak_flops_for(dtype) for d in peak)
        return Estimate(
            iteration_time_s=step.total_s,
            compute_s=compute,
            bubble_s=bubble,
            p2p_s=p2p_total,
            dp_sync_s=step.sync_tail_s + zero3 + step.post_step_s,
            tp_comm_s=tp_comm,
            recompute_s=recompute - offload,
            offload_s=offload,
            optimizer_s=step.optimizer_s,
            samples_per_s=samples_per_s,
            tokens_per_s=samples_per_s * self.model.seq_len,
            mfu=self.model.train_flops_per_sample * samples_per_s / peak_flops,
            peak_memory_bytes=peak,
            memory_capacity_bytes=capacity,
            fits=all(peak[d] <= capacity[d] for d in peak) and all(host[d] <= c for d, c in host_capacity.items()),
            stages=tuple(stage_estimates),
            lower_bound_s=self.lower_bound_s(),
            host_offload_bytes=host,
            host_capacity_bytes=host_capacity,
            host_dispatch_s=host_dispatch,
            loss_s=loss,
        ).checked()

    def _run_detail(self, plan: Plan, j: int, micro_batches: float, compute: float) -> tuple[float, float]:
        """The host-dispatch wait and the loss's part of stage ``j``'s compute
        (``CostKernel.run_detail``), for its first replica's share of a
        micro-batch over ``micro_batches``, each at most ``compute``."""
        stage = plan.stages[j]
        gpu = self.kernel.cluster.devices[stage.devices[0]].gpu
        host, loss = self.kernel.run_detail(gpu, stage.dp_split[0] / stage.cp, stage.replica_degree(0),
                                            stage.layers[0], stage.layers[-1] + 1)
        return min(compute, host * micro_batches), min(compute, loss * micro_batches)
