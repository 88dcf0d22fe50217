"""What a pipelined step of hetplan's runtime holds beyond its stage's layers
(``hetplan.cost.pipeline_memory``), against torch's own schedule."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest

from hetplan.app.estimate import UniformSetting, estimate
from hetplan.cost.memory import in_flight_micro_batches
from hetplan.cost.model import CostModel
from hetplan.cost.stage import StageOption
from hetplan.cost.pipeline_memory import interleaved_in_flight, interleaved_order

schedules = pytest.importorskip("torch.distributed.pipelining.schedules")


@pytest.mark.parametrize("pp, virtual, micro_batches", [(2, 2, 8), (2, 2, 4), (4, 2, 8), (4, 3, 12), (2, 3, 2),
                                                        (3, 2, 6)])
def test_interleaved_order_is_torchs(pp: int, virtual: int, micro_batches: int) -> None:
    """Each rank's forwards and backwards, chunk by chunk, as torch 2.13's
    ``ScheduleInterleaved1F1B`` lists them (its no-op slots dropped)."""
    rounds = max(1, micro_batches // pp)
    schedule = SimpleNamespace(n_local_stages=virtual, microbatches_per_round=micro_batches // rounds,
                               pp_group_size=pp, _n_microbatches=micro_batches)
    for rank in range(pp):
        actions = schedules.ScheduleInterleaved1F1B._calculate_single_rank_operations(schedule, rank)
        theirs = [(a.computation_type.name == "FORWARD", a.stage_index // pp) for a in actions if a is not None]
        assert theirs == interleaved_order(pp, rank, micro_batches, virtual), rank


def test_interleaved_chunks_pile_up() -> None:
    """pp 2 x 2 chunks, 8 micro-batches: the last rank holds 3 micro-batches of its
    first chunk at once (Narayanan et al.'s average: 1.25 of the stage); the first
    rank 3 of its first and 2 of its second."""
    assert interleaved_in_flight(2, 1, 8, [1.0, 0.0]) == 3.0
    assert interleaved_in_flight(2, 0, 8, [1.0, 1.0]) == 2.5


def test_the_reduce_buffer_is_not_counted_beside_the_loss() -> None:
    """tiny-gpt pp2 x dp2 ZeRO-0, 4 micro-batches: the last stage's backward peak holds
    the head weight's new fp32 gradient beside the loss's buffers, and no reduce buffer
    (replayed: it is made after the head's backward freed them); counting both put
    the stage 4.3% over its replay, now 1.8%."""
    result = estimate(UniformSetting(dp=2, tp=1, pp=2, micro_batch=1), model="tiny-gpt", cluster="local-cpu-4",
                      global_batch=8, replay=False)
    last = CostModel(result.workload).stage_terms(result.ranked.plan, 1)[0]
    head_weight = 256 * 64 * 4  # tiny-gpt's tied vocabulary x hidden weight, its largest, in fp32
    assert last.loss > 0
    assert last.reduce_buffer == head_weight


@pytest.mark.parametrize("setting", [UniformSetting(dp=1, tp=2, pp=2, micro_batch=1),
                                     UniformSetting(dp=2, tp=1, pp=2, zero=2, micro_batch=1)])
def test_the_searches_range_tables_hold_what_the_estimate_holds(setting: UniformSetting) -> None:
    """A pipelined stage's receive buffers and new gradient: the searches' range tables
    (``StageCosts.class_memory``, ``tables`` for the step's micro-batches) give each stage
    of a tiny-llama pp2 plan the estimate's peak (``CostModel.stage_memory``), and at a
    memory limit one byte under it call the stage out of memory as the estimate does
    (before, they left both terms out and called it fitting)."""
    result = estimate(setting, model="tiny-llama-bf16", cluster="local-cpu-4", global_batch=8, replay=False)
    plan, m = result.ranked.plan, result.ranked.plan.num_micro_batches
    for j, stage in enumerate(plan.stages):
        peak = max(CostModel(result.workload).stage_memory(plan, j))
        tight = CostModel(replace(result.workload, memory_limit_bytes=peak - 1))
        option = StageOption.of_stage(stage)
        assert option is not None
        costs = tight.kernel.stage(option)
        a, b = stage.layers[0], stage.layers[-1] + 1
        in_flight = in_flight_micro_batches(plan.schedule, j, plan.pp, m)
        assert in_flight < m  # the searches' moment (gradients at every backward) is the estimate's
        assert max(costs.class_memory(a, b, in_flight, micro_batches=m)) == pytest.approx(peak, rel=1e-12), j
        table = costs.tables(in_flight, (j, tight.kernel.num_layers - plan.pp + 1), m)
        assert not tight.stage_fits(plan, j) and not table.fits[a - j, b - j - 1], j
