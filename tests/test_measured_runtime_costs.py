"""What a profile measures of the runtime beyond layer times, and how the cost
model uses it: layers chained in one micro-batch (their measured times
scaled), the data-parallel wrappers' extra time (in place of the alpha-beta
collectives) and processes sharing fewer cores than they are (a pipeline
replayed with processor sharing)."""

from __future__ import annotations

import random

import pytest

from hetplan.cluster.io import load_cluster
from hetplan.cost.model import CostModel
from hetplan.plan.workload import Workload
from hetplan.cost import shared_cores
from hetplan.model.presets import get_model
from hetplan.cost.compute import layer_times
from hetplan.cost.layers import layer_arrays
from hetplan.profile.db import ChainPoint, DataParallelPoint, ProfileDB, ProfileEntry
from hetplan.search.baselines.uniform import uniform_plan
from hetplan.simulate.events import makespan, simulate
from hetplan.simulate.schedule import build_schedule

MODEL = "tiny-gpt"
FWD, BWD = 1e-8, 3e-8  # seconds per parameter the wrapper adds (synthetic: far above the alpha-beta estimate)


def _dp_profile(zero: int) -> ProfileDB:
    spec = get_model(MODEL)
    points = [DataParallelPoint(layer.profile_key, "CPU", 1, 2, zero, 1000, 1000 * FWD, 1000 * BWD)
              for layer in spec.layers if layer.params > 0]
    return ProfileDB([], data_parallel=points)


def _estimate(cluster: str, profile: ProfileDB | None, **plan: int) -> tuple[CostModel, object]:
    workload = Workload(get_model(MODEL), load_cluster(cluster), 8, profile=profile)
    model = CostModel(workload)
    args = dict(dp=1, tp=1, pp=1, mbs=2, zero=0)
    args.update(plan)
    return model, model.estimate(uniform_plan(workload, args["dp"], args["tp"], args["pp"], args["mbs"], args["zero"]))


def _held(model: CostModel) -> float:
    return model.kernel.held_params(1, 0, get_model(MODEL).num_layers)


def test_measured_layer_times_are_scaled_by_the_chain_factor() -> None:
    spec = get_model(MODEL)
    gpu = load_cluster("local-cpu-2").devices[0].gpu
    keys = list(dict.fromkeys(layer.profile_key for layer in spec.layers))
    entries = [ProfileEntry(key, "CPU", 1, 2, 0.001 * (i + 1), 0.002 * (i + 1)) for i, key in enumerate(keys)]
    alone = ProfileDB(entries)
    chained = ProfileDB(entries, chains=[ChainPoint("CPU", 1, 2, tuple(keys), 0.009, 0.018)])  # 1.5x the sum
    plain = layer_times(layer_arrays(spec), gpu, 2, 1, "none", spec.dtype_bytes, profile=alone)
    scaled = layer_times(layer_arrays(spec), gpu, 2, 1, "none", spec.dtype_bytes, profile=chained)
    assert list(scaled.fwd_s) == pytest.approx([1.5 * t for t in plain.fwd_s])
    assert list(scaled.bwd_s) == pytest.approx([1.5 * t for t in plain.bwd_s])


def test_measured_gradient_sync_replaces_the_all_reduce_estimate() -> None:
    model, estimate = _estimate("local-cpu-2", _dp_profile(0), dp=2)
    # CPU processes overlap nothing: the sync is the wrapper's extra, whole, once a step
    assert estimate.dp_sync_s == pytest.approx(_held(model) * (FWD + BWD))
    _, analytic = _estimate("local-cpu-2", None, dp=2)
    assert analytic.dp_sync_s != pytest.approx(estimate.dp_sync_s)


def test_measured_zero3_extra_is_paid_on_every_micro_batch() -> None:
    model, estimate = _estimate("local-cpu-2", _dp_profile(3), dp=2, zero=3)
    micro_batches = 8 // 2 // 2
    # forward: the gather; backward: the gather again and the reduce-scatter (the rest of the extra)
    assert estimate.dp_sync_s == pytest.approx(micro_batches * _held(model) * (FWD + BWD))


def test_measured_zero2_gathers_and_reduces_once_a_step() -> None:
    model, estimate = _estimate("local-cpu-2", _dp_profile(2), dp=2, zero=2)
    # the forward's extra is the step's one gather, the backward's the reduce-scatter: whatever the micro-batches
    assert estimate.dp_sync_s == pytest.approx(_held(model) * (FWD + BWD))


def test_a_profile_of_another_degree_or_stage_leaves_the_analytic_model() -> None:
    _, analytic = _estimate("local-cpu-4", None, dp=4)
    _, other_degree = _estimate("local-cpu-4", _dp_profile(0), dp=4)  # measured over 2, not 4
    assert other_degree.dp_sync_s == analytic.dp_sync_s
    _, zero3 = _estimate("local-cpu-2", None, dp=2, zero=3)
    _, zero0_measured = _estimate("local-cpu-2", _dp_profile(0), dp=2, zero=3)
    assert zero0_measured.dp_sync_s == zero3.dp_sync_s


# --- processes sharing cores ------------------------------------------------------------------------------
@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_enough_cores_replays_the_event_simulator(schedule: str) -> None:
    rng = random.Random(3)
    for stages, micro in [(2, 1), (3, 4), (4, 7)]:
        fwd = [rng.uniform(0.5, 2) for _ in range(stages)]
        bwd = [rng.uniform(1, 4) for _ in range(stages)]
        p2p = [rng.uniform(0, 0.3) for _ in range(stages - 1)]
        expected = makespan(simulate(build_schedule(schedule, stages, micro), fwd, bwd, p2p))
        got = shared_cores.pipeline_time(schedule, fwd, bwd, p2p, micro, [1] * stages, cores=stages,
                                         profiled_processes=stages)
        assert got == pytest.approx(expected)


def test_one_core_runs_a_lone_action_at_the_speed_of_all_processes() -> None:
    # profiled with 2 processes on 1 core (half a core each); with one micro-batch
    # only one stage is ever busy, so each action runs twice as fast as profiled
    got = shared_cores.pipeline_time("1f1b", [1.0, 2.0], [3.0, 4.0], [0.0], 1, [1, 1], cores=1,
                                     profiled_processes=2)
    assert got == pytest.approx((1 + 2 + 4 + 3) / 2)


def test_fewer_cores_never_speed_a_pipeline_up() -> None:
    fwd, bwd, p2p = [1.0, 1.5, 1.0, 2.0], [2.0, 3.0, 2.0, 4.0], [0.1] * 3
    profiled = [shared_cores.pipeline_time("1f1b", [f * 4 / c for f in fwd], [b * 4 / c for b in bwd], p2p, 6,
                                           [1] * 4, cores=c, profiled_processes=4) for c in (1, 2, 4)]
    assert profiled[0] >= profiled[1] >= profiled[2]


def test_a_profile_taken_on_shared_cores_speeds_up_only_pipelines() -> None:
    shared = ProfileDB([], machine={"cores": 2, "processes": 4})
    for plan in (dict(pp=4, mbs=1), dict(pp=2, dp=2, mbs=1)):
        _, alone = _estimate("local-cpu-4", None, **plan)
        _, sharing = _estimate("local-cpu-4", shared, **plan)
        assert sharing.iteration_time_s < alone.iteration_time_s
        assert min(sharing.compute_s, sharing.bubble_s) >= 0
    _, alone = _estimate("local-cpu-4", None, dp=4)
    _, sharing = _estimate("local-cpu-4", shared, dp=4)
    assert sharing.iteration_time_s == alone.iteration_time_s  # every process busy: the profiled speed
