"""Tensor-parallel plans: which submodule is split how, per module class.

Like SageMaker's ``smp.tp_register``, a module class is mapped to a function
that returns a ``parallelize_module`` plan (submodule name -> ParallelStyle)
for one instance::

    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    import hetplan.runtime as hr

    @hr.register_tp_plan(MyBlock)
    def my_block_plan(block, settings):
        if block.n_heads % settings.tp:
            raise hr.HetplanError(f"tp={settings.tp} does not divide {block.n_heads} heads")
        return {"attn.wq": ColwiseParallel(), "attn.wo": RowwiseParallel(), ...}

When a stage has ``tp > 1`` the runtime walks each layer of the stage from the
top and applies the plan of the first registered class it meets on every
branch (subclasses match too; a match stops the walk below it). hetplan's own
GPT/Llama decoder registers its plans the same way, where it is defined
(hetplan.runtime.models: Megatron's layout; with sequence parallelism,
Korthikanti et al.'s), so this registry imports no model. HF transformers
models can use their config's ``base_model_tp_plan`` via :func:`hf_tp_plan`;
GPT-2, BERT, T5 and ViT, whose configs have none, get hetplan's plans
(:mod:`hetplan.runtime.hf_tp`).

A layer with parameters and no registered plan runs replicated on its TP
group (correct, just not split); the runtime says so in its notes. With
sequence parallelism such a layer is an error, because it would see only a
slice of the sequence.

Also here: the registry of submodules that *selective* recomputation
checkpoints (the attention core, Korthikanti §5). HF layers need none (their
attention function is checkpointed: hetplan.runtime.hf_recompute); another
layer the cost model charges a core for but without one registered falls back
to full recomputation, and the runtime says so (parallelize.apply_recompute).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from hetplan.errors import HetplanError


@dataclass(frozen=True)
class TPSettings:
    """What a TP plan function is told about where its module runs.

    Attributes:
        tp: tensor-parallel degree of the stage.
        sequence_parallel: shard norms/residuals along the sequence too.
        name: the module's name in the model (e.g. ``layers.3``).
    """

    tp: int
    sequence_parallel: bool
    name: str


TPPlanFn = Callable[[Any, TPSettings], "dict[str, Any]"]
_TP_PLANS: dict[type, TPPlanFn] = {}
_SELECTIVE: set[type] = set()


def register_tp_plan(module_cls: type, fn: TPPlanFn | None = None) -> Any:
    """Map ``module_cls`` to a TP plan function ``fn(module, settings) -> {name: ParallelStyle}``.

    Names are relative to the module; ``""`` applies a style to the module
    itself. Usable as a decorator: ``@register_tp_plan(MyBlock)``.
    """
    def register(f: TPPlanFn) -> TPPlanFn:
        _TP_PLANS[module_cls] = f
        return f

    if fn is not None:
        return register(fn)
    return register


def unregister_tp_plan(module_cls: type) -> None:
    _TP_PLANS.pop(module_cls, None)


def register_selective_recompute(module_cls: type) -> type:
    """Mark a (parameter-free) submodule class as what ``recompute="selective"``
    checkpoints, e.g. the attention core softmax(QK^T)V."""
    _SELECTIVE.add(module_cls)
    return module_cls


def tp_plan_for(module: Any) -> TPPlanFn | None:
    for cls in type(module).__mro__:
        if cls in _TP_PLANS:
            return _TP_PLANS[cls]
    return None


def is_selective_target(module: Any) -> bool:
    return any(cls in _SELECTIVE for cls in type(module).__mro__)


def registered_plan_in(module: Any) -> bool:
    """Whether ``apply_tp`` finds a registered plan for ``module`` or a module below it."""
    return tp_plan_for(module) is not None or any(registered_plan_in(c) for c in module.children())


def dry_run(module: Any, name: str, tp: int, sequence_parallel: bool) -> None:
    """Call the registered plan functions ``apply_tp`` would call for ``module``
    (named ``name``), so that what they refuse (heads ``tp`` does not divide,
    sequence parallelism they cannot run) raises here, before any process starts."""
    fn = tp_plan_for(module)
    if fn is not None:
        fn(module, TPSettings(tp=tp, sequence_parallel=sequence_parallel, name=name))
        return
    for child_name, child in module.named_children():
        dry_run(child, f"{name}.{child_name}", tp, sequence_parallel)


# --- HF transformers --------------------------------------------------------------
_HF_STYLES = ("colwise", "rowwise", "colwise_rep", "colwise_gather_output", "rowwise_rep",
              "rowwise_split_input", "embedding_rowwise", "sequence_parallel")


def hf_tp_plan(model: Any) -> dict[str, Any]:
    """A ``parallelize_module`` plan for an HF transformers model from its
    config's ``base_model_tp_plan`` (keys relative to the base model, with
    ``*`` for layer indices) plus the model's own ``_tp_plan`` (e.g. the LM
    head). Styles: colwise, rowwise, colwise_rep / colwise_gather_output
    (output gathered), rowwise_rep / rowwise_split_input, embedding_rowwise,
    sequence_parallel; others raise a clear error. A module styled
    ``moe_tp_experts`` (HF's fused experts) is left out with its parameters'
    entries (``packed_colwise`` ``gate_up_proj``, ``down_proj``): expert
    parallelism splits experts (``parallelize.apply_ep``), and preflight
    refuses tp > 1 for HF's packed ones (``hetplan.runtime.ep.hf_tp_refusal``)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    config = getattr(model, "config", None)
    base = dict(getattr(config, "base_model_tp_plan", None) or {})
    if not base:
        raise HetplanError(
            f"{type(model).__name__}'s config has no base_model_tp_plan; register a TP plan with "
            "hetplan.runtime.register_tp_plan"
        )
    prefix = getattr(model, "base_model_prefix", "")
    if prefix and hasattr(model, prefix):
        base = {f"{prefix}.{k}": v for k, v in base.items()}
    for k, v in (getattr(model, "_tp_plan", None) or {}).items():
        if not k.startswith(prefix + ".") or k not in base:
            base.setdefault(k, v)

    def style(name: str, kind: str) -> Any:
        if kind == "colwise":
            return ColwiseParallel()
        if kind == "rowwise":
            return RowwiseParallel()
        if kind in ("colwise_rep", "colwise_gather_output"):
            return ColwiseParallel(output_layouts=Replicate())
        if kind in ("rowwise_rep", "rowwise_split_input"):
            return RowwiseParallel(input_layouts=Shard(-1), output_layouts=Replicate())
        if kind == "embedding_rowwise":  # vocabulary-parallel embedding, output all-reduced
            return RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
        if kind == "sequence_parallel":
            return SequenceParallel()
        raise HetplanError(
            f"HF TP style {kind!r} for {name!r} is not supported by hetplan (supported: {', '.join(_HF_STYLES)})"
        )

    experts = [k for k, v in base.items() if v == "moe_tp_experts"]
    return {k: style(k, v) for k, v in base.items()
            if not any(k == e or k.startswith(e + ".") for e in experts)}
