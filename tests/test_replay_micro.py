"""A pipelined plan's replay check from fewer micro-batches (runtime/replay_micro.py): the
extrapolated device and host peaks of every replayed rank equal a full replay's to the byte."""

from __future__ import annotations

import pytest

from hetplan.app.estimate import UniformSetting, estimate
from hetplan.runtime.replay import replay_plan
from hetplan.runtime.replay_micro import extrapolates, fast_replay, micro_batch_samples

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
    full, fast = replay_plan(plan, spec), fast_replay(plan, spec)
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
