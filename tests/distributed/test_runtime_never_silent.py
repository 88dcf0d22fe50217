"""Runtime cases that trained a different model without saying so: gradient
accumulation across ``train_step`` calls, the pipeline chain check, PyTorch's own clipping.

Accumulation: two ``train_step`` calls before ``opt.step()`` must give the
gradients of two backward passes in one process, also for the embedding weight
tied to the LM head across pipeline stages (whose copies are synchronised by
the runtime: only this call's gradient may be added, not the whole ``.grad``).

Chain check: a model whose forward is not a chain of its layers (a long skip)
is refused under pipelining on every rank with one line, before training.
"""

from __future__ import annotations

import pytest

from hetplan.runtime.reference import compare
from rt_helpers import (
    accumulate_reference,
    accumulate_worker,
    hetero_plan,
    long_skip_worker,
    make_plan,
    run,
    run_raw,
    torch_clip_worker,
    write_plan,
)

PLANS = {
    "pp2": lambda: make_plan(pp=2, micro=2),
    "pp2xtp2": lambda: make_plan(pp=2, tp=2, micro=2),
    "metis-dp2-uneven-then-tp2": lambda: hetero_plan([(range(0, 3), 2, 1, (3, 1), 0), (range(3, 6), 1, 2, (4,), 0)],
                                                     4, "1f1b"),
}


@pytest.mark.parametrize("name", sorted(PLANS))
def test_two_train_steps_accumulate_like_two_backward_passes(name: str, tmp_path) -> None:
    plan = PLANS[name]()
    results = run(accumulate_worker, plan.num_devices, write_plan(tmp_path, plan))
    ref_losses, ref_state = accumulate_reference()
    cmp = compare(results[0]["losses"], ref_losses, results[0]["state"], ref_state)
    assert not cmp["missing"], cmp
    assert cmp["loss_rel_diff"] <= 1e-5 and cmp["param_rel_diff"] <= 1e-5, cmp


@pytest.mark.parametrize("kwargs", [dict(pp=2, micro=2), dict(pp=2, tp=2, micro=2)], ids=["pp2", "pp2xtp2"])
def test_long_skip_model_is_refused_under_pipelining(kwargs, tmp_path) -> None:
    plan = make_plan(**kwargs)
    results = run_raw(long_skip_worker, plan.num_devices, write_plan(tmp_path, plan), timeout_s=90)
    for r in results:
        assert r.exitcode not in (0, None), [(x.rank, x.exitcode, x.error) for x in results]
        assert "the input of layer 'head' is not exactly the output of layer 'layers.3'" in r.error, r.error


def test_long_skip_model_trains_with_one_stage(tmp_path) -> None:
    """With one pipeline stage the model's own forward runs: nothing to refuse."""
    plan = make_plan(dp=2, micro=2)
    losses = run(long_skip_worker, 2, write_plan(tmp_path, plan))
    assert losses[0] == pytest.approx(losses[1])


@pytest.mark.parametrize("kwargs, why", [(dict(pp=2, micro=2), "each pipeline stage would be clipped"),
                                         (dict(tp=2, micro=2), "tensor-parallel shards")], ids=["pp2", "tp2"])
def test_torch_clip_grad_norm_is_refused_where_it_would_be_wrong(kwargs, why, tmp_path) -> None:
    plan = make_plan(**kwargs)
    results = run(torch_clip_worker, plan.num_devices, write_plan(tmp_path, plan))
    for r in results:
        assert why in r["torch_clip"] and "ctx.clip_grad_norm_(model, max_norm)" in r["torch_clip"], r
        assert r["norm"] == pytest.approx(results[0]["norm"], rel=1e-6)  # one global norm on every rank


def test_torch_clip_grad_norm_runs_under_plain_data_parallelism(tmp_path) -> None:
    plan = make_plan(dp=2, micro=2, zero=3)
    results = run(torch_clip_worker, 2, write_plan(tmp_path, plan))
    assert [r["torch_clip"] for r in results] == ["ran", "ran"]


@pytest.mark.slow
def test_user_compiled_model_trains_with_one_stage_and_is_refused_with_several(tmp_path) -> None:
    """torch.compile(model) of the returned model: train_step uses it with one
    stage (same first loss as the reference; names without _orig_mod); with
    several stages it would not run, so it is refused with the way to compile."""
    from rt_helpers import compiled_whole_worker, reference

    one = run(compiled_whole_worker, 2, write_plan(tmp_path, make_plan(dp=2, micro=2), "one.json"), timeout_s=500)
    assert one[0]["loss"] == pytest.approx(reference()[0][0], rel=1e-5)
    assert one[0]["state"] and not any("_orig_mod" in k for k in one[0]["state"])
    two = run(compiled_whole_worker, 2, write_plan(tmp_path, make_plan(pp=2, micro=2), "two.json"))
    assert all("compile each layer with ctx.parallelize(build_model, compile=True)" in r["error"] for r in two)
