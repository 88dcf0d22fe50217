"""How ``hetplan train`` builds a plan's model: the model-source resolver.

A plan names its model one of three ways, and :func:`model_build` turns each
into a :class:`ModelBuild` (the build function, the loss, how to initialise it
and, where the model is no next-token model, its synthetic batches):

* a hetplan preset: the built-in GPT/Llama/MoE decoder (hetplan.runtime.models),
  optionally with dropout at GPT-2's sites (``hetplan train --dropout``);
* a HF config: that transformers class, built from the config values the plan
  file embeds;
* ``pkg.mod:build``: that function's model, checked against the one the plan
  was made for (hetplan.runtime.user_model).

``RuntimeContext.model_build`` is this for the context's plan.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable

import torch
from torch import nn

from hetplan.errors import HetplanError
from hetplan.model.origin import HFSource, ModuleSource
from hetplan.model.spec import ModelSpec
from hetplan.runtime import reference
from hetplan.runtime.models import GPT, build_preset_model, config_from_spec, cross_entropy_loss
from hetplan.runtime.user_model import user_model


@dataclass(frozen=True)
class ModelBuild:
    """How ``hetplan train`` builds a plan's model: ``build()`` returns the full
    model; ``loss(output, targets)`` its training loss; ``meta_init``: built on
    the meta device and initialised by hetplan (the built-in model), or built
    for real under ``torch.manual_seed(seed)`` (HF models: their rotary and
    other buffers are computed at construction). ``batch(batch_size, step,
    seed)``: the model's own synthetic (x, targets, keyword inputs), None for
    next-token batches (``reference.training_batch``); ``example_inputs``: one
    batch of positional inputs on meta for the pipeline chain check, if known."""

    build: Callable[[], nn.Module]
    loss: Callable[[Any, torch.Tensor], torch.Tensor]
    meta_init: bool
    batch: Callable[[int, int, int], tuple[Any, Any, dict[str, Any]]] | None = None
    example_inputs: tuple[Any, ...] | None = None


def model_build(spec: ModelSpec, dropout: float = 0.0) -> ModelBuild:
    """The built-in model for hetplan's presets (with ``dropout`` at GPT-2's
    sites); for a model imported from a HF config, that HF class built from the
    config values the plan file embeds (its dropout is the config's); for a
    model given as ``pkg.mod:build``, that function's model, checked against
    the plan's (hetplan.runtime.user_model)."""
    if dropout:
        check_dropout(spec, dropout)
    if isinstance(spec.source, HFSource):
        return _hf_build(spec, spec.source)
    if isinstance(spec.source, ModuleSource):
        user = user_model(spec)
        return ModelBuild(user.build, user.loss, user.meta_init, user.batch, user.example_inputs)
    if dropout:
        return ModelBuild(lambda: GPT(replace(config_from_spec(spec), dropout=dropout)), cross_entropy_loss, True)
    return ModelBuild(lambda: build_preset_model(spec), cross_entropy_loss, True)


def check_dropout(spec: ModelSpec, dropout: float) -> None:
    """``hetplan train --dropout P``: a probability in [0, 1), for a built-in
    model whose ModelSpec counts dropout masks (so the plan's memory estimate
    holds them: 1 byte per element, docs/models.md)."""
    if not 0.0 <= dropout < 1.0:
        raise HetplanError(f"--dropout {dropout}: give a probability at least 0 and below 1 (GPT-2 uses 0.1)")
    if isinstance(spec.source, HFSource):
        raise HetplanError(f"--dropout is for hetplan's built-in models; model {spec.name!r} is a HF model: set "
                           "the dropout fields of its config.json instead")
    if not spec.meta.get("architecture", {}).get("dropout"):
        raise HetplanError(f"model {spec.name!r} is costed without dropout (its layers count no dropout masks), so "
                           "its plan's memory would not hold them; drop --dropout or use a GPT preset such as tiny-gpt")


def _hf_build(spec: ModelSpec, source: HFSource) -> ModelBuild:
    values, name = source.config, source.hf_class
    if not isinstance(values, dict):
        raise HetplanError(f"model {spec.name!r} came from a HF config, but its plan file does not hold the config "
                           "values; make the plan again with this hetplan ('hetplan plan --model config.json')")
    import transformers  # lazy: seconds to load, and only HF plans need it

    cls = getattr(transformers, name, None)
    if cls is None:
        raise HetplanError(f"transformers {transformers.__version__} has no class {name}; install the version "
                           "the plan was made with")
    if not (isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel)):
        raise HetplanError(f"the plan's hf_class {name!r} is no transformers model class; make the plan again "
                           "('hetplan plan --model config.json')")
    config = transformers.AutoConfig.for_model(**values)

    def loss(output: Any, targets: torch.Tensor) -> torch.Tensor:
        return cross_entropy_loss(getattr(output, "logits", output), targets)

    return ModelBuild(lambda: cls(config), loss, False, _hf_batch(spec, cls, config))


def _hf_batch(spec: ModelSpec, cls: Any, config: Any) -> Callable[[int, int, int], Any] | None:
    """The synthetic batches of a HF model that is no next-token model: an
    encoder-decoder's (T5) or an image classifier's (ViT); None for the others
    (hetplan.runtime.reference.training_batch)."""
    if getattr(config, "is_encoder_decoder", False):
        return lambda b, step, seed: reference.seq2seq_batch(spec, config, b, step, seed)
    if getattr(cls, "main_input_name", "") == "pixel_values" and getattr(config, "num_labels", 0):
        return lambda b, step, seed: reference.image_batch(config, b, step, seed)
    return None
