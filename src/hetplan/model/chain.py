"""Is a model's ``forward`` a chain of the plan's layers?

With more than one pipeline stage the runtime runs each stage's layers one
after another, each taking the previous layer's output
(:class:`~hetplan.runtime.parallelize.PipelinePart`); the model's own
``forward`` is not called. That is the same computation only when the model's
``forward`` is exactly such a chain, where a layer may also take keyword
inputs of the model passed to it unchanged (every stage gets those from
``train_step(..., inputs=)``; :func:`check_chain` returns which layer takes
which). A skip connection around a layer, a module called twice, a keyword
input the forward derives (a mask it builds), an operation between two layers,
or an output that is not the last layer's would all be lost, and the pipeline
would train a different model without saying so. (HF models are no chains;
they pipeline through hetplan.runtime.hf_stages.)

:func:`check_chain` runs the model's ``forward`` once on meta tensors (no
memory, no compute) with hooks on the plan's layers and refuses, with one line
naming the layer and the input, anything that is not a chain. It runs before
any pipeline communication, on every rank alike, so all ranks fail the same way.

It lives below the runtime, in ``hetplan.model``, because the model layer uses
it too: ``hetplan.model.source`` finds a ``pkg.mod:build`` model's pipeline
units with it. It needs torch (imported at the top: planner-side modules never
import this one; ``tests/test_imports.py``).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from torch import nn

from hetplan.errors import HetplanError

_ADVICE = "so a pipeline of its layers would train a different model; make that computation part of a layer, or use a plan with one pipeline stage"


class _NotAChain(Exception):
    """Raised from a hook to end the forward as soon as the answer is known."""


@dataclass
class _Call:
    name: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    output: Any = None
    versions: list[int] = field(default_factory=list)
    inside: str | None = None  # the plan layer that was running when this one was called
    routes: dict[str, str] = field(default_factory=dict)  # layer keyword -> the model keyword input passed as is


def _tensors(value: Any) -> list[Any]:
    """The flat list of positional values a layer passes on (a tuple is unpacked, as PipelinePart does)."""
    return list(value) if isinstance(value, tuple) else [value]


def on_meta(value: Any) -> Any:
    """A copy of ``value`` whose tensors (also inside tuples, lists and dicts) are
    empty ones of the same shape and dtype on the meta device."""
    if isinstance(value, torch.Tensor):
        return torch.empty(value.shape, dtype=value.dtype, device="meta")
    if isinstance(value, (tuple, list)):
        return type(value)(on_meta(v) for v in value)
    if isinstance(value, dict):
        return {k: on_meta(v) for k, v in value.items()}
    return value


def _non_default_kwargs(module: nn.Module, kwargs: dict[str, Any]) -> list[str]:
    """Keyword arguments a chained call would drop: those not at the forward's default value."""
    try:
        params = inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return sorted(kwargs)
    lost = []
    for key, value in kwargs.items():
        default = params[key].default if key in params else inspect.Parameter.empty
        if isinstance(value, torch.Tensor) or default is inspect.Parameter.empty:
            lost.append(key)
        elif not (value is default or (isinstance(value, (bool, int, float, str)) and value == default)):
            lost.append(key)
    return lost


def _version(value: Any) -> int:
    return value._version if isinstance(value, torch.Tensor) else 0


def record_calls(model: nn.Module, names: Sequence[str], args: Sequence[Any],
                 kwargs: dict[str, Any] | None = None) -> tuple[list[_Call], Any, tuple[Any, ...], dict[str, Any]]:
    """Run ``model`` (built on the meta device) once on meta copies of the
    inputs; every call into a plan layer with its inputs and output.
    Returns (calls, model output, meta args, meta kwargs)."""
    if any(p.device.type != "meta" for p in model.parameters()):
        raise ValueError("check_chain needs the model built on the meta device (with torch.device('meta'): ...)")
    margs = tuple(on_meta(a) for a in args)
    mkwargs = {k: on_meta(v) for k, v in (kwargs or {}).items()}
    calls: list[_Call] = []
    running: list[_Call] = []
    handles = []
    model_inputs = {id(v): k for k, v in mkwargs.items() if isinstance(v, torch.Tensor)}

    def pre_hook(name: str) -> Any:
        def hook(module: nn.Module, hargs: tuple[Any, ...], hkwargs: dict[str, Any]) -> None:
            lost = _non_default_kwargs(module, hkwargs)
            routes = {k: model_inputs[id(hkwargs[k])] for k in lost if id(hkwargs[k]) in model_inputs}
            lost = [k for k in lost if k not in routes]  # a model keyword input passed on unchanged is kept
            if lost:  # decided here: stop the forward (a large model's meta forward takes seconds)
                raise _NotAChain(
                    f"layer {name!r} is called with keyword input(s) {', '.join(lost)}, which a pipeline does not "
                    f"pass on, {_ADVICE}"
                )
            call = _Call(name, tuple(hargs), dict(hkwargs), inside=running[-1].name if running else None,
                         routes=routes)
            calls.append(call)
            running.append(call)
        return hook

    def post_hook(_module: nn.Module, _args: Any, output: Any) -> None:
        call = running.pop()
        call.output = output
        call.versions = [_version(t) for t in _tensors(output)]

    for name in names:
        module = model.get_submodule(name)
        handles.append(module.register_forward_pre_hook(pre_hook(name), with_kwargs=True))
        handles.append(module.register_forward_hook(post_hook))
    try:
        with torch.no_grad():
            output = model(*margs, **mkwargs)
    except _NotAChain as e:
        raise HetplanError(str(e)) from None
    except HetplanError:
        raise
    except Exception as e:  # noqa: BLE001 - any failure of user code on the meta device
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise HetplanError(
            f"cannot check that the model's forward is a chain of the plan's layers: running it on the meta "
            f"device failed ({type(e).__name__}: {first}); make the forward run on meta tensors, or use a plan "
            "with one pipeline stage"
        ) from None
    finally:
        for h in handles:
            h.remove()
    return calls, output, margs, mkwargs


def check_chain(model: nn.Module, names: Sequence[str], args: Sequence[Any],
                kwargs: dict[str, Any] | None = None) -> dict[str, dict[str, str]]:
    """Raise HetplanError unless ``model(*args, **kwargs)`` is exactly
    ``names[-1](...(names[1](names[0](*args))))`` (module docstring), where a
    layer may also take keyword inputs of the model passed to it unchanged
    (a mask): every pipeline stage gets those (``train_step(..., inputs=)``).
    Returns those routes: layer -> {its keyword: the model's keyword input}."""
    calls, output, margs, _mkwargs = record_calls(model, names, args, kwargs)
    _check_calls(calls, names)
    expected: list[Any] = list(margs)
    previous = "the model's inputs"
    versions = [_version(t) for t in expected]
    for call in calls:  # keyword inputs were refused while the forward ran (record_calls)
        got = list(call.args)
        if len(got) != len(expected) or not all(a is b for a, b in zip(got, expected)):
            raise HetplanError(
                f"the input of layer {call.name!r} is not exactly {previous} (the forward computes it otherwise: "
                f"a skip connection, an extra input or an operation between layers), {_ADVICE}"
            )
        if [_version(t) for t in got] != versions:
            raise HetplanError(
                f"{previous} is modified in place before layer {call.name!r} runs, {_ADVICE}"
            )
        expected, versions = _tensors(call.output), call.versions
        previous = f"the output of layer {call.name!r}"
    final = _tensors(output)
    if len(final) != len(expected) or not all(a is b for a, b in zip(final, expected)) \
            or [_version(t) for t in final] != versions:
        raise HetplanError(
            f"the model's output is not exactly {previous} (the forward changes it after the last layer), {_ADVICE}"
        )
    return {call.name: call.routes for call in calls if call.routes}


def _check_calls(calls: list[_Call], names: Sequence[str]) -> None:
    """Each layer once, none inside another, in the plan's order."""
    for call in calls:
        if call.inside is not None:
            raise HetplanError(f"layer {call.name!r} is called from inside layer {call.inside!r}, {_ADVICE}")
    counts = {n: 0 for n in names}
    for call in calls:
        counts[call.name] += 1
    for name in names:
        if counts[name] != 1:
            how = "never called" if counts[name] == 0 else f"called {counts[name]} times"
            raise HetplanError(f"layer {name!r} is {how} by the model's forward, {_ADVICE}")
    order = [c.name for c in calls]
    if order != list(names):
        k = next(i for i, (a, b) in enumerate(zip(order, names)) if a != b)
        raise HetplanError(
            f"the model's forward calls layer {order[k]!r} where the plan has {names[k]!r}: its layer order "
            f"differs from the plan's, {_ADVICE}"
        )


def keyword_input_names(module: nn.Module, count: int, where: str) -> tuple[str, ...]:
    """The names a model's example inputs after the first are passed by: the
    names of ``forward``'s parameters after the first, in order. ``train_step``
    takes one positional input (the batch's ``x``) and the rest as keyword
    inputs, so a check or a trace that passed them positionally would run
    another call than training does (a mask passed on to each layer would look
    derived). ``where`` names the model in the error."""
    if count <= 1:
        return ()
    params = list(inspect.signature(module.forward).parameters.values())
    named = [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    if len(named) < count:
        raise HetplanError(f"{where}: forward takes {count} example inputs but names only {len(named)} "
                           "parameters; the runtime passes every input after the first by its name (train_step's "
                           "keyword inputs), so give forward a named parameter for each")
    return tuple(named[1:count])


def example_call(module: nn.Module, inputs: Sequence[Any], where: str = "the model"
                 ) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """(args, kwargs) of the call ``train_step`` makes with these example inputs:
    the first positional, the rest by name (:func:`keyword_input_names`)."""
    inputs = tuple(inputs)
    return inputs[:1], dict(zip(keyword_input_names(module, len(inputs), where), inputs[1:]))


def example_inputs(spec: Any, config: Any = None) -> tuple[Any, ...] | None:
    """One sample's positional inputs for a model, where hetplan knows them:
    token ids for a model with a vocabulary, an image for an HF vision config."""
    if getattr(spec, "vocab_size", 0):
        return (torch.zeros(1, min(spec.seq_len, 8), dtype=torch.long),)
    size = getattr(config, "image_size", 0)
    if isinstance(size, int) and size > 0:
        return (torch.zeros(1, getattr(config, "num_channels", 3), size, size),)
    return None
