"""Preflight: what the runtime checks of a model before anything is split.

Every rank runs these checks on the whole (meta) model before the first
collective, so a bad plan fails the same way everywhere and no rank is left
waiting; ``hetplan train`` runs :func:`preflight` before it starts any process.
Each check refuses in one line what the runtime would otherwise run
differently from the plan: layer names that are no modules, parameters outside
every layer, TP plans that cannot split a layer ``tp`` ways, dropout that
cannot be plan-independent, what context and expert parallelism need of the
model (what they need of the plan: ``layout._check_plan_cp_ep``), HF split
points and the pipeline chain (hetplan.model.chain).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch import nn

from hetplan.errors import HetplanError
from hetplan.plan.support import tied_span_refusal
from hetplan.runtime import dropout as rng
from hetplan.runtime import ep, hf_stages
from hetplan.runtime import parallelize as par
from hetplan.runtime import tp as tpr
from hetplan.model.chain import check_chain, example_call
from hetplan.model.chain import example_inputs as known_example_inputs
from hetplan.runtime.cp import check_sequence
from hetplan.plan.layout import PlanLayout


def preflight(layout: PlanLayout, spec: Any, full: nn.Module, example_inputs: Sequence[Any] | None = None,
              chain: bool = True) -> None:
    """Checks every rank runs on the whole (meta) model before anything is split,
    so a bad plan fails the same way everywhere (no rank left waiting); also
    what ``hetplan train`` runs before it starts any process (with
    ``example_inputs``, also the pipeline chain check)."""
    names = list(layout.layer_names)
    par.check_layer_names(full, names, layout.plan.model)
    check_plan_independent_dropout(layout, full)
    check_model_cp_ep(layout, spec, full)
    if chain and layout.num_chunks > 1:
        check_chain_early(full, names, spec, example_inputs)
    if layout.num_chunks > 1:
        check_hf_split(layout, full)
    if layout.pp > 1:
        check_tied_span(layout, spec)
        stray = par.uncovered_state(full, par.layer_paths(names, par.spec_layer_modules(spec)))
        if stray:
            raise HetplanError(
                f"{stray[0]!r} is not inside any layer of the plan, so no pipeline stage would hold it; "
                "make the ModelSpec's layers cover every parameter"
            )
    if layout.max_tp > 1:
        check_tensor_parallel(layout, spec, full)


def check_before_split(layout: PlanLayout, spec: Any, full: nn.Module, build_model: Callable[[], nn.Module],
                       example_inputs: Sequence[Any] | None) -> tuple[Any, nn.Module | None]:
    """``parallelize``'s checks of the built model: with several pipeline chunks
    an HF model's staged forward (checked against its own) or, for another
    model, the chain check on a meta copy; then :func:`preflight`. Returns
    (the staged forward or None, the meta copy the first ``train_step`` checks
    again with its micro-batch and keyword inputs, or None)."""
    names = list(layout.layer_names)
    staged = checked_staged_forward(full, names, spec) if layout.num_chunks > 1 else None
    probe = None
    if layout.num_chunks > 1 and staged is None:
        with torch.device("meta"):
            probe = build_model()
        check_chain_early(probe, names, spec, example_inputs)
    preflight(layout, spec, full, chain=False)  # the chain is checked on the meta probe above
    return staged, probe


def checked_staged_forward(full: nn.Module, names: list[str], spec: Any) -> Any:
    """An HF model's forward split at layer boundaries (hetplan.runtime.hf_stages),
    checked against the model's own forward on a padded batch before anything is
    split, on every rank alike; None for other models (they must be chains)."""
    staged = hf_stages.staged_forward(full, names)
    if staged is None:
        return None
    if any(p.device.type == "meta" for p in full.parameters()):
        raise HetplanError(f"pipelining {type(full).__name__} checks its staged forward on the real model; "
                           "use ctx.parallelize(build_model, meta_init=False) (HF models need it for their "
                           "buffers anyway)")
    par.check_layer_names(full, names, getattr(spec, "name", ""))
    ids, inputs = hf_stages.example_model_inputs(full, spec.seq_len, spec.vocab_size)
    hf_stages.check_staged_forward(full, staged, names, ids, inputs)
    return staged


def check_tensor_parallel(layout: PlanLayout, spec: Any, full: nn.Module) -> None:
    """Every TP plan can be built for its stage's tp (heads, key/value heads,
    MLP width and vocabulary divisible by tp; styles hetplan can apply); with
    sequence parallelism the sequence divisible by tp."""
    from hetplan.runtime.hf_tp import check_family_tp  # lazy: imports torch.distributed.tensor

    names = list(layout.layer_names)
    model_plan = model_tp_plan(full)  # raises on styles hetplan cannot apply
    layer_tp = {name: layout.stage_tp(layout.pp_index_of_layer(name)) for name in names}
    for name, tp in layer_tp.items():
        if tp > 1:
            tpr.dry_run(full.get_submodule(name), name, tp, layout.sequence_parallel)
    if not callable(getattr(full, "hetplan_tp_plan", None)):
        check_family_tp(full, layer_tp, layout.sequence_parallel)
    config = getattr(full, "config", None)
    heads = getattr(config, "num_attention_heads", 0)
    kv = getattr(config, "num_key_value_heads", 0) or heads
    for what, count in (("attention heads", heads), ("key/value heads", kv)):
        if model_plan and isinstance(count, int) and count and count % layout.max_tp:
            raise HetplanError(f"tp={layout.max_tp} does not divide the {count} {what} of the model; "
                               f"use a tp that divides {count}")
    if layout.sequence_parallel and spec.seq_len % layout.tp:
        raise HetplanError(
            f"sequence parallelism splits the sequence of {spec.seq_len} over tp={layout.tp}; "
            "use a tp that divides the sequence length"
        )


def check_hf_split(layout: PlanLayout, full: nn.Module) -> None:
    """An HF model's split points: what its staged forward cannot pass between
    these stages is refused (hetplan.runtime.hf_stages.StagedForward.split_refusal)."""
    names = list(layout.layer_names)
    staged = hf_stages.staged_forward(full, names)
    if staged is None:
        return
    why = staged.split_refusal([layout.chunk_names(c) for c in range(layout.num_chunks)], layout.heterogeneous)
    if why:
        raise HetplanError(why)


def check_model_cp_ep(layout: PlanLayout, spec: Any, full: nn.Module) -> None:
    """What context and expert parallelism need of the model (one line each).
    HF's fused experts count as MoE layers before ``apply_ep`` adapts them."""
    if layout.cp > 1:
        if not callable(getattr(full, "set_context_parallel", None)):
            raise HetplanError(
                f"the plan has cp={layout.cp}, but {type(full).__name__} does not declare context-parallel support "
                "(a set_context_parallel(shard) method; hetplan's GPT has one, see docs/runtime.md); "
                "use a plan with cp=1")
        check_sequence(spec.seq_len, layout.cp)
    hf = ep.hf_fused_experts(full)
    if layout.ep > 1:
        for fqn, module in hf:
            why = ep.hf_experts_refusal(fqn, module)
            if why:
                raise HetplanError(why)
        counts = [int(getattr(m, "num_experts", 0)) for m in [*par.moe_modules(full), *(m for _, m in hf)]]
        if not counts:
            raise HetplanError(f"the plan has ep={layout.ep}, but model {spec.name!r} has no mixture-of-experts "
                               "layers to split; use a plan with ep=1")
        for experts in counts:
            if experts % layout.ep:
                raise HetplanError(f"ep={layout.ep} does not divide the {experts} experts of the model's MoE layers; "
                                   f"use an ep that divides {experts}")
    for fqn, module in hf:  # expert TP = the stage's tp
        layer = par.owner_layer(fqn, layout.layer_names)
        tp = layout.stage_tp(layout.pp_index_of_layer(layer)) if layer else 1
        if tp > 1:
            raise HetplanError(ep.hf_tp_refusal(layer, type(module).__name__, tp))
    for fqn, module in full.named_modules():
        layer = par.owner_layer(fqn, layout.layer_names) if hasattr(module, "ep_group") else None
        tp = layout.stage_tp(layout.pp_index_of_layer(layer)) if layer and hasattr(module, "experts") else 1
        if tp > 1:
            par.check_expert_tp(module.experts, layer, tp)


def check_plan_independent_dropout(layout: PlanLayout, full: nn.Module) -> None:
    """Dropout hetplan cannot make plan-independent is refused, never run
    differently: torch dropout modules under TP, any dropout under context
    parallelism (hetplan.runtime.dropout)."""
    if not rng.has_dropout(full):
        return
    rng.check_tensor_parallel(full, {n: layout.stage_tp(layout.pp_index_of_layer(n)) for n in layout.layer_names})
    cp = max((getattr(stage, "cp", 1) for stage in layout.plan.stages), default=1)
    if cp > 1:
        raise HetplanError(f"dropout under context parallelism (cp={cp}) is not plan-independent yet; "
                           "set the model's dropout to 0 or use a plan with cp=1")


def check_chain_early(full: nn.Module, names: list[str], spec: Any, inputs: Sequence[Any] | None) -> None:
    """The pipeline chain check before anything is split. Without the user's
    inputs, try the ones hetplan knows (token ids, an HF image); if the model
    cannot run on those, the first ``train_step`` checks with the real batch.
    The user's ``inputs`` are passed as ``train_step`` passes them: the first
    positionally, the rest by the names of ``forward``'s parameters."""
    if hf_stages.staged_forward(full, names) is not None:
        return  # an HF model: runs its staged forward (raises if hetplan has none for it)
    if any(p.device.type != "meta" for p in full.parameters()):
        return  # a real model: parallelize checks its meta copy instead
    par.check_layer_names(full, names, getattr(spec, "name", ""))
    if inputs is not None:  # called as train_step calls the model: the first positional, the rest by name
        args, kwargs = example_call(full, inputs, f"model {getattr(spec, 'name', '')!r}")
        check_chain(full, names, args, kwargs)
        return
    guess = known_example_inputs(spec, getattr(full, "config", None))
    if guess is None:
        return
    try:
        check_chain(full, names, guess)
    except HetplanError as e:
        if not str(e).startswith("cannot check"):
            raise


def check_tied_span(layout: PlanLayout, spec: Any) -> None:
    """The gradient of a tied weight is summed between two stages; one on three
    or more stages (T5's shared embedding at pp >= 3) is refused."""
    why = tied_span_refusal(spec, {n: layout.pp_index_of_layer(n) for n in layout.layer_names})
    if why:
        raise HetplanError(why)


def model_tp_plan(model: nn.Module) -> dict[str, Any] | None:
    """A whole-model TP plan: the model's ``hetplan_tp_plan()`` if it has one,
    else hetplan's plan for the HF families whose configs have none (GPT-2,
    BERT, T5, ViT: hetplan.runtime.hf_tp), else its HF config's
    ``base_model_tp_plan`` (transformers models: Llama, Mistral, Qwen, ...)."""
    fn = getattr(model, "hetplan_tp_plan", None)
    if callable(fn):
        return fn()
    from hetplan.runtime.hf_tp import family_tp_plan  # lazy: imports torch.distributed.tensor

    family = family_tp_plan(model)
    if family is not None:
        return family
    config = getattr(model, "config", None)
    if getattr(config, "base_model_tp_plan", None):
        return tpr.hf_tp_plan(model)
    return None
