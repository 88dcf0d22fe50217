"""A pipelined plan's replay check from fewer micro-batches (runtime/replay_micro.py): the
extrapolated device and host peaks of every replayed rank equal a full two-step replay's to
the byte, with the growth per micro-batch taken from the plan or from its copy with fewer
decoder blocks."""

from __future__ import annotations

import json

import pytest

from hetplan.app.estimate import UniformSetting, estimate
from hetplan.model.presets import gpt_decoder, llama_decoder
from hetplan.runtime.replay import replay_plan
from hetplan.runtime.replay_micro import COPY_BLOCKS, extrapolated, extrapolates, fast_replay, micro_batch_samples, \
    slope_copy

# (setting, model, cluster, micro-batches): one per schedule the check extrapolates, each at a count past
# its samples (1F1B/GPipe pp2: 3 and 4; interleaved pp2: 6 and 8), with dp, ZeRO-3, recompute and bf16 in
# one of them. The dp2 ZeRO-3 plan is the slow one (about 3x the others: four ranks' FSDP2 hooks).
EXACT = {
    "1f1b-fp32": (UniformSetting(dp=1, tp=1, pp=2, micro_batch=1), "tiny-gpt", "local-cpu-2", 5),
    "gpipe-bf16-dp2-zero3-full": (UniformSetting(dp=2, tp=1, pp=2, zero=3, recompute="full", micro_batch=1,
                                                  schedule="gpipe"), "tiny-llama-bf16", "local-cpu-4", 5),
    "interleaved-fp32": (UniformSetting(dp=1, tp=1, pp=2, micro_batch=1, schedule="interleaved-1f1b",
                                        virtual_stages=2), "tiny-gpt", "local-cpu-2", 10),
}


@pytest.mark.parametrize("kind", sorted(EXACT))
def test_extrapolated_peaks_are_the_full_replays_to_the_byte(kind: str) -> None:
    """Each phase's peak is affine in the micro-batch count from the first sample on, so the
    peaks from two short replays are those of the whole step's replay, device and host."""
    setting, model, cluster, micro_batches = EXACT[kind]
    result = estimate(setting, model=model, cluster=cluster, global_batch=micro_batches * setting.dp, replay=False)
    plan, spec = result.ranked.plan, result.workload.model
    assert plan.num_micro_batches == micro_batches and extrapolates(plan)
    full, fast = replay_plan(plan, spec, states_first=False), fast_replay(plan, spec)
    assert [(s.stage, s.rank, s.peak_bytes, s.host_peak_bytes) for s in fast.stages] == \
        [(s.stage, s.rank, s.peak_bytes, s.host_peak_bytes) for s in full.stages]


def test_plans_the_samples_would_not_shorten_are_replayed_in_full() -> None:
    """One stage (already one step), or no more micro-batches than the second sample: the full replay."""
    pipelined = estimate(UniformSetting(dp=1, tp=1, pp=2, micro_batch=1), model="tiny-gpt", cluster="local-cpu-2",
                         global_batch=4, replay=False).ranked.plan
    assert micro_batch_samples(pipelined) == (3, 4) and not extrapolates(pipelined)
    single = estimate(UniformSetting(dp=1, tp=1, pp=1, micro_batch=1), model="tiny-gpt", cluster="local-cpu-2",
                      global_batch=9, replay=False).ranked.plan
    assert not extrapolates(single)


# 1F1B plans of ten identical decoder blocks (five a stage, the copy keeps COPY_BLOCKS): the kinds of the
# best pipelined Llama-3-70B plan on 64 H100 (bf16, dp, ZeRO-3, full recompute) and three stages.
COPIED = {
    "pp2-dp2-zero3-full-bf16": (UniformSetting(dp=2, tp=1, pp=2, zero=3, recompute="full", micro_batch=1),
                                "llama", "local-cpu-4", 5),
    "pp3-selective-fp32": (UniformSetting(dp=1, tp=1, pp=3, recompute="selective", micro_batch=1), "gpt",
                           "local-cpu-4", 6),
}


@pytest.mark.parametrize("kind", sorted(COPIED))
def test_a_copy_with_fewer_blocks_grows_per_micro_batch_as_the_plan_does(kind: str, tmp_path) -> None:
    """What a 1F1B stage holds per micro-batch (its batch rows, torch pipelining's buffers per
    micro-batch, the losses) does not depend on its blocks: the peaks at the first sample from
    the plan, grown as the copy's grow, are the full two-step replay's to the byte."""
    setting, family, cluster, micro_batches = COPIED[kind]
    build = gpt_decoder("gpt10", num_layers=10, hidden=64, heads=4, seq=32, vocab=256, dtype_bytes=4) \
        if family == "gpt" else llama_decoder("llama10", 10, 64, 4, 2, 128, 256, 32, dtype_bytes=2)
    path = tmp_path / "model.json"
    path.write_text(json.dumps(build.to_dict()))
    result = estimate(setting, model=str(path), cluster=cluster, global_batch=micro_batches * setting.dp, replay=False)
    plan, spec = result.ranked.plan, result.workload.model
    copy = slope_copy(plan, spec)
    assert copy is not None and all(len(s.layers) <= COPY_BLOCKS + 1 for s in copy[0].stages)
    fast = extrapolated(plan, spec, copy)
    full = replay_plan(plan, spec, states_first=False)
    assert [(s.stage, s.rank, s.peak_bytes, s.host_peak_bytes) for s in fast] == \
        [(s.stage, s.rank, s.peak_bytes, s.host_peak_bytes) for s in full.stages]


def test_the_copy_is_refused_where_growth_depends_on_the_blocks() -> None:
    """GPipe holds every micro-batch's activations (its growth is per block), an interleaved
    schedule cuts chunks from the blocks, and a plan of few blocks has nothing to cut."""
    for schedule, extra in (("1f1b", {}), ("gpipe", {}), ("interleaved-1f1b", {"virtual_stages": 2})):
        setting = UniformSetting(dp=1, tp=1, pp=2, micro_batch=1, schedule=schedule, **extra)
        result = estimate(setting, model="gpt3-1.3b", cluster="local-cpu-2", global_batch=8, replay=False)
        assert (slope_copy(result.ranked.plan, result.workload.model) is None) == (schedule != "1f1b")
    small = estimate(UniformSetting(dp=1, tp=1, pp=2, micro_batch=1), model="tiny-gpt", cluster="local-cpu-2",
                     global_batch=8, replay=False)
    assert slope_copy(small.ranked.plan, small.workload.model) is None
