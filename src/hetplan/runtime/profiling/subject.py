"""The model ``hetplan profile`` measures, built as ``hetplan train`` builds it.

Every model the runtime trains is measured layer by layer: hetplan's presets
(the built-in GPT), HF configs (that transformers class) and ``pkg.mod:build``
models, each from the runtime's own :func:`hetplan.runtime.build.model_build`.
A layer runs as a pipeline stage of that one layer runs it
(:class:`~hetplan.runtime.parallelize.PipelinePart`): an HF layer through its
family's staged forward (``runtime/hf_stages.py``: the embedding, a decoder
layer with the stage's rotary table and 4-D mask, the final norm and LM head),
a chain model's layer on the previous layer's output with the keyword inputs
the model passes it (``hetplan.model.chain``).

Each layer's input is what the previous distinct layer gives on one batch of
the data ``hetplan train`` feeds the model (``reference.training_batch``):
layers sharing a ``profile_key`` take and give tensors of the same shapes, so
the input of a layer kind's first instance is the output of the kind before it.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import nn

from hetplan.errors import HetplanError
from hetplan.model.chain import check_chain, example_call
from hetplan.model.origin import HFSource, ModuleSource
from hetplan.model.spec import ModelSpec
from hetplan.runtime import hf_stages, reference
from hetplan.runtime.build import ModelBuild, model_build
from hetplan.runtime.parallelize import InitialValues, PipelinePart, apply_tp, materialize, spec_layer_modules
from hetplan.runtime.precision import autocast
from hetplan.runtime.preflight import model_tp_plan
from hetplan.runtime.profiling.job import distinct_layers
from hetplan.runtime.spine import build_whole, move_to

# Staged forwards that pass more than the hidden state between layers (T5's
# encoder output and position bias), which a layer measured alone cannot be given
_TUPLE_FAMILIES = ("t5",)


@dataclass
class ProfiledModel:
    """A plan's model as the runtime builds it, for measuring one layer at a time.

    ``staged``: the HF family's staged forward (None for chain models);
    ``routes``: layer -> {its keyword: the model's keyword input} (chain models)."""

    spec: ModelSpec
    how: ModelBuild
    staged: Any
    routes: dict[str, dict[str, str]]

    @property
    def source(self) -> str:
        """What builds the model, for messages: 'built-in', 'HF' or 'pkg.mod:build'."""
        if isinstance(self.spec.source, HFSource):
            return "HF"
        return "pkg.mod:build" if isinstance(self.spec.source, ModuleSource) else "built-in"

    def part(self, names: str | Sequence[str], tp_mesh: Any, device: torch.device, seed: int) -> nn.Module:
        """The layers ``names`` as one pipeline part, TP-sharded over ``tp_mesh``
        when given, on ``device`` with the runtime's initial values (the order of
        ``RuntimeContext.parallelize``: build, split, move or shard, materialise)."""
        names = [names] if isinstance(names, str) else list(names)
        torch.manual_seed(seed)
        full = build_whole(self.how.build, self.how.meta_init)
        values = (InitialValues(copy.deepcopy(full), seed, getattr(full, "init_parameter", None))
                  if self.how.meta_init else None)
        part = PipelinePart(full, names, spec_layer_modules(self.spec), self.staged, self.routes)
        if values is None:
            move_to(part, device)
        if tp_mesh is not None:
            apply_tp(part, names, tp_mesh, False, [], model_tp_plan(full))
        if values is not None:
            materialize(part, device, values)
        return part

    def batch(self, batch: int, device: torch.device, seed: int) -> tuple[Any, torch.Tensor, dict[str, Any]]:
        """(x, targets, keyword inputs) of one batch of ``batch`` samples, as ``hetplan train`` draws them."""
        x, y, inputs = reference.training_batch(self.spec, self.how, batch, 0, seed)
        return _to(x, device), _to(y, device), {k: _to(v, device) for k, v in inputs.items()}

    def layer_inputs(self, batch: int, device: torch.device, seed: int, precision: str) -> dict[str, Any]:
        """Each distinct layer's input (keyed by layer name) on one batch, and the
        head's output under ``LOSS_INPUT``: each layer on the previous distinct
        one's output, under the runtime's autocast for ``precision``."""
        layers = [layer.name for layer in distinct_layers(self.spec)]
        chain = self.part(layers, None, device, seed)
        x, _, inputs = self.batch(batch, device, seed)
        found: dict[str, Any] = {}
        with torch.no_grad(), autocast(device, precision):
            for name in layers:
                found[name] = x
                x = PipelinePart(chain, [name], spec_layer_modules(self.spec), self.staged, self.routes)(
                    *(x if isinstance(x, tuple) else (x,)), **inputs)
        found[LOSS_INPUT] = x
        return found


LOSS_INPUT = ""  # layer_inputs' key of the head's output (no layer name is empty)


def _to(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, tuple):
        return tuple(_to(v, device) for v in value)
    return value


def profiled_model(spec: ModelSpec) -> ProfiledModel:
    """The model ``spec`` names, as the runtime builds it; one line saying why
    where its layers cannot be measured one at a time."""
    how = model_build(spec)
    names = [layer.name for layer in spec.layers]
    with torch.device("meta"):
        probe = how.build()
    try:
        staged = hf_stages.staged_forward(probe, names)
    except HetplanError as exc:
        raise HetplanError(f"cannot profile {spec.name!r} layer by layer: {_reason(exc)}") from None
    if staged is not None and staged.family in _TUPLE_FAMILIES:
        raise HetplanError(f"cannot profile {spec.name!r} layer by layer: its {type(probe).__name__} layers pass "
                           "more than one tensor on; plan it without --profile")
    routes: dict[str, dict[str, str]] = {}
    if staged is None and how.example_inputs is not None:
        args, kwargs = example_call(probe, how.example_inputs, f"model {spec.name!r}")
        try:
            routes = check_chain(probe, names, args, kwargs)
        except HetplanError as exc:
            raise HetplanError(f"cannot profile {spec.name!r} layer by layer: {_reason(exc)}") from None
    return ProfiledModel(spec, how, staged, routes)


def _reason(exc: HetplanError) -> str:
    """A pipeline refusal without its advice about pipeline stages (profiling has none)."""
    text = str(exc)
    for advice in ("; use a plan with one pipeline stage", ", so a pipeline of its layers would train a different model"):
        text = text.split(advice)[0]
    return text
