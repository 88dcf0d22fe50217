"""Helpers for the dropout tests: the single-process reference with dropout, and
a user's model whose dropout is torch's own ``nn.Dropout`` (module-level so the
forked workers of hetplan.runtime.launch.run_local can import them)."""

from __future__ import annotations

import functools
from typing import Any

from rt_helpers import GBS, MODEL, STEPS, TOL

P = 0.1  # GPT-2's dropout


def reference(dropout: float = P, seed: int = 0, steps: int = STEPS, gbs: int = GBS, user_model: bool = False
              ) -> tuple[list[float], dict[str, Any]]:
    """Losses and final parameters of the single-process run with dropout."""
    return _reference(dropout, seed, steps, gbs, user_model)


@functools.lru_cache(maxsize=8)
def _reference(dropout: float, seed: int, steps: int, gbs: int, user_model: bool
               ) -> tuple[list[float], dict[str, Any]]:
    from hetplan.model.presets import get_model
    from hetplan.runtime.build import model_build
    from hetplan.runtime.models import cross_entropy_loss
    from hetplan.runtime.reference import build_reference, make_optimizer, synthetic_batch, train_reference

    spec = get_model(MODEL)
    build = user_dropout_model if user_model else model_build(spec, dropout).build
    model = build_reference(build, seed)
    opt = make_optimizer(model.parameters())
    batches = [synthetic_batch(spec.vocab_size, spec.seq_len, gbs, s, seed) for s in range(steps)]
    losses = train_reference(model, batches, cross_entropy_loss, opt, clip=1.0, seed=seed)
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_matches(result: dict[str, Any], dropout: float = P, seed: int = 0, user_model: bool = False) -> None:
    from hetplan.runtime.reference import compare

    ref_losses, ref_state = reference(dropout, seed, user_model=user_model)
    cmp = compare(result["losses"], ref_losses, result["state"], ref_state)
    assert not cmp["missing"], f"parameters missing from the run: {cmp['missing']}"
    assert cmp["loss_rel_diff"] <= TOL, f"losses {result['losses']} vs reference {ref_losses}: {cmp}"
    assert cmp["param_rel_diff"] <= TOL, f"parameter {cmp['worst_param']} differs: {cmp}"


def user_dropout_model() -> Any:
    """tiny-gpt with torch ``nn.Dropout(P)`` after the embedding and every MLP:
    a user's model the runtime makes plan-independent (batch-first, whole
    samples on every rank)."""
    from torch import nn

    from hetplan.model.presets import get_model
    from hetplan.runtime.models import build_preset_model

    model = build_preset_model(get_model(MODEL))
    model.embed.drop = nn.Dropout(P)
    for block in model.layers.values():
        block.mlp.drop = nn.Dropout(P)
    return model


def user_worker(plan_path: str, steps: int = STEPS) -> dict[str, Any]:
    """Train ``user_dropout_model`` under the plan as a user's script would."""
    from hetplan.runtime.context import init
    from hetplan.runtime.models import cross_entropy_loss
    from hetplan.runtime.reference import make_optimizer, synthetic_batch

    ctx = init(plan_path)
    model = ctx.parallelize(user_dropout_model, seed=0)
    opt = make_optimizer(model.parameters())
    losses = []
    for step in range(steps):
        x, y = synthetic_batch(ctx.spec.vocab_size, ctx.spec.seq_len, ctx.plan.global_batch_size, step, 0)
        losses.append(float(ctx.train_step(model, (x, y), cross_entropy_loss, return_outputs=False)))
        ctx.clip_grad_norm_(model, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    state = ctx.full_state_dict(model)
    notes = list(ctx.notes)
    ctx.close()
    return {"losses": losses, "state": state, "notes": notes}
