"""Mixed precision with several micro-batches trains the single-process model.

bf16/fp16 runs each micro-batch's forward in an autocast region of its own
(hetplan.runtime.microbatch). With one region around the whole step, autocast
kept the first micro-batch's low-precision weight copies while FSDP2
resharded and regathered the weights: every data-parallel plan with 2+
micro-batches trained wrong gradients (parameters ~1e-2 off after two steps,
well above the 16-bit bounds). Here every precision x ZeRO stage x (dp, pp,
tp) with 4 micro-batches per replica is held to the reference in the same
precision, within ``hetplan train --verify``'s bound.
"""

from __future__ import annotations

import functools
import json
import os
from typing import Any

import pytest

from hetplan.plan.spec import LayerStrategy
from hetplan.runtime.cli import VERIFY_TOLERANCE
from rt_helpers import make_plan, run, train_worker

MODEL = "tiny-llama-bf16"  # embed, 4 blocks, head
STEPS = 2
MIXED_ZERO = {0: LayerStrategy(0), 1: LayerStrategy(1), 2: LayerStrategy(2), 3: LayerStrategy(3),
              4: LayerStrategy(1), 5: LayerStrategy(3)}
LAYOUTS = {
    "dp2-zero0": dict(dp=2, micro=2),
    "dp2-zero1": dict(dp=2, micro=2, zero=1),
    "dp2-zero2": dict(dp=2, micro=2, zero=2),
    "dp2-zero3": dict(dp=2, micro=2, zero=3),
    "pp2xdp2-zero0123": dict(pp=2, dp=2, micro=2, strategies=MIXED_ZERO),
    "dp2xtp2-zero0123": dict(dp=2, tp=2, micro=2, strategies=MIXED_ZERO),
}


def _write(tmp_path: Any, layout: str, precision: str) -> str:
    plan = make_plan(model=MODEL, **LAYOUTS[layout])
    assert plan.num_micro_batches == 4
    path = os.path.join(str(tmp_path), "plan.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump({"plans": [{"plan": plan.to_dict()}], "settings": {"precision": precision}}, f)
    return path


@functools.lru_cache(maxsize=2)
def _reference(precision: str) -> tuple[list[float], dict[str, Any]]:
    from hetplan.model.presets import get_model
    from hetplan.runtime.models import build_preset_model, cross_entropy_loss
    from hetplan.runtime.reference import build_reference, make_optimizer, synthetic_batch, train_reference

    spec = get_model(MODEL)
    model = build_reference(lambda: build_preset_model(spec), 0)
    batches = [synthetic_batch(spec.vocab_size, spec.seq_len, 8, s, 0) for s in range(STEPS)]
    losses = train_reference(model, batches, cross_entropy_loss, make_optimizer(model.parameters()), clip=1.0,
                             precision=precision)
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_mixed_precision_with_micro_batches_matches_the_reference(layout: str, precision: str, tmp_path) -> None:
    from hetplan.runtime.reference import compare

    plan_path = _write(tmp_path, layout, precision)
    world = make_plan(model=MODEL, **LAYOUTS[layout]).num_devices
    result = run(train_worker, world, plan_path, STEPS)[0]
    ref_losses, ref_state = _reference(precision)
    cmp = compare(result["losses"], ref_losses, result["state"], ref_state)
    assert not cmp["missing"], cmp
    worst = max(cmp["loss_rel_diff"], cmp["param_rel_diff"])
    assert worst <= VERIFY_TOLERANCE[precision], f"{precision} {layout}: {cmp}"
