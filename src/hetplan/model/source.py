"""Models given as Python code: ``--model pkg.mod:build`` or an ``nn.Module`` object.

``build()`` (called with no arguments, under ``torch.device("meta")`` so a
large model costs no memory) returns either an ``nn.Module`` or a pair
``(module, example_inputs)``; ``example_inputs`` is one batch of the forward's
positional inputs (a tensor or a tuple of them; dim 0 the batch), and a module
returned alone may say it with an ``example_inputs()`` method. A third element,
``example_targets``, is for ``hetplan train`` (``hetplan.runtime.user_model``).

The ModelSpec's layers are the units the runtime can cut a pipeline between
(:func:`pipeline_units`): the runtime runs a pipeline stage as a chain of
modules, each taking the previous one's output (``hetplan.model.chain``), so
the layers are the finest such chain found by expanding the model's modules
into the modules they call, kept only where the runtime's own chain check
passes and every unit holds parameters. If the model's forward is no chain at
all (two inputs used apart, a skip around every module), the layers are the
tracer's default (block stacks) and ``ModelSpec.runtime.pipeline`` says why the
model trains in one pipeline stage (``hetplan.runtime.support``). The ModelSpec's name is the reference, and
its ``source`` (:class:`~hetplan.model.origin.ModuleSource`) records the reference
and a hash of the parameter names and shapes it built (:func:`module_fingerprint`),
so the runtime refuses a build function that has changed since the plan was made.
The source made here is ``trusted``: the user named the function.

This module describes such a model (torch on demand); the runtime's side --
rebuilding it for a plan, its synthetic data and loss -- is
``hetplan.runtime.user_model``.
"""

from __future__ import annotations

import importlib
from dataclasses import replace
from typing import Any, Callable, Sequence

from hetplan.errors import HetplanError
from hetplan.model.origin import ModuleSource, is_reference
from hetplan.model.spec import ModelSpec
from hetplan.runtime.support import inspect_model
from hetplan.model.trace import model_from_module

# Chain checks (one meta forward each) spent looking for finer pipeline units: a work budget, not seconds.
MAX_CHAIN_CHECKS = 64


def resolve(reference: str) -> Callable[[], Any]:
    """The function a ``pkg.mod:function`` reference names."""
    if not is_reference(reference):
        raise HetplanError(f"model reference {reference!r} is not of the form package.module:function")
    module_name, _, attr = reference.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise HetplanError(f"model {reference!r}: cannot import {module_name!r} ({exc}); "
                           "put it on PYTHONPATH or give another module") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise HetplanError(f"model {reference!r}: module {module_name!r} has no function {attr!r}")
    return fn


def build(reference: str) -> tuple[Any, tuple[Any, ...]]:
    """The model (on the meta device) and its example inputs, from ``reference``'s function."""
    return split_built(call_build(reference), reference)


def call_build(reference: str, meta: bool = True) -> Any:
    """What ``reference``'s function returns, called under ``torch.device("meta")`` unless ``meta`` is False."""
    import contextlib

    import torch

    fn = resolve(reference)
    try:
        with torch.device("meta") if meta else contextlib.nullcontext():
            return fn()
    except HetplanError:
        raise
    except Exception as exc:  # the user's function failed: one line, not a traceback
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise HetplanError(f"model {reference!r}: the function raised {type(exc).__name__}: {first}") from exc


def split_built(made: Any, where: str) -> tuple[Any, tuple[Any, ...]]:
    """``(module, example_inputs)`` from what a build function returned."""
    from torch import nn

    if isinstance(made, tuple) and len(made) == 3:  # (module, example_inputs, example_targets): hetplan train
        made = made[:2]
    module, inputs = (made if isinstance(made, tuple) and len(made) == 2 else (made, None))
    if not isinstance(module, nn.Module):
        raise HetplanError(f"model {where!r} returned {type(module).__name__}; return an nn.Module "
                           "or (nn.Module, example_inputs)")
    if inputs is None and callable(getattr(module, "example_inputs", None)):
        inputs = module.example_inputs()
    if inputs is None:
        raise HetplanError(f"model {where!r}: give example inputs: return (module, example_inputs) "
                           "or define module.example_inputs()")
    return module, (tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,))


def model_from_reference(reference: str, dtype_bytes: int | None = None) -> ModelSpec:
    """The ModelSpec of the model ``reference`` builds, its layers the runtime's pipeline units."""
    module, inputs = build(reference)
    return module_spec(module, inputs, name=reference, dtype_bytes=dtype_bytes, source=reference)


def module_spec(module: Any, example_inputs: Sequence[Any], name: str = "custom", dtype_bytes: int | None = None,
                source: str = "") -> ModelSpec:
    """Trace ``module`` with the runtime's pipeline units as layers (module docstring)."""
    inputs = tuple(example_inputs)
    units, blocker = pipeline_units(module, inputs)
    spec = model_from_module(module, inputs, name=name, layer_names=units or None, dtype_bytes=dtype_bytes)

    meta = {**spec.meta, "pipeline_units": units is not None}
    origin = ModuleSource(source, module_fingerprint(module), trusted=True) if source else None
    return inspect_model(module, replace(spec, meta=meta, source=origin), pipeline=blocker)


def module_fingerprint(module: Any) -> str:
    """A hash of the module's parameter and buffer names, shapes and dtypes (ties
    included), so a plan file can tell that ``pkg.mod:build`` now builds another model."""
    import hashlib

    h = hashlib.sha256()
    for kind, items in (("p", module.named_parameters(remove_duplicate=False)),
                        ("b", module.named_buffers(remove_duplicate=False))):
        for name, t in items:
            h.update(f"{kind} {name} {tuple(t.shape)} {t.dtype}\n".encode())
    return h.hexdigest()[:16]


def pipeline_units(model: Any, inputs: tuple[Any, ...]) -> tuple[list[str] | None, str]:
    """The finest chain of modules the runtime can pipeline, or (None, why not)."""
    import copy

    import torch

    from hetplan.model.chain import check_chain, example_call

    with torch.device("meta"):
        probe = copy.deepcopy(model).to("meta")
    try:  # called as the runtime's train_step calls it: the first input positionally, the rest by name
        args, kwargs = example_call(probe, inputs)
    except HetplanError as exc:
        return None, str(exc)
    callees = _call_tree(probe, args, kwargs)
    units = callees.get("", [])
    if not units:
        return None, "its forward calls no submodule"
    budget = [MAX_CHAIN_CHECKS]

    def chain_ok(names: list[str]) -> str:
        budget[0] -= 1
        if not all(_owns_params(probe.get_submodule(n)) for n in names):
            return "a module it calls between its layers holds no parameters"
        try:
            check_chain(probe, names, args, kwargs)
        except HetplanError as exc:
            return str(exc)
        return ""

    why = chain_ok(units)
    if why:
        return None, why
    i = 0
    while i < len(units) and budget[0] > 0:
        inner = callees.get(units[i], [])
        trial = units[:i] + inner + units[i + 1:]
        if inner and not _owns_own_params(probe.get_submodule(units[i])) and not chain_ok(trial):
            units = trial  # look again at the first new unit
        else:
            i += 1
    return units, ""


def _call_tree(model: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, list[str]]:
    """Module path -> the submodules its forward calls directly, in call order (one meta forward)."""
    import torch

    from hetplan.model.chain import on_meta

    callees: dict[str, list[str]] = {}
    stack = [""]
    handles = []

    def enter(path: str) -> Callable[..., None]:
        def hook(*_: Any) -> None:
            callees.setdefault(stack[-1], []).append(path)
            stack.append(path)
        return hook

    def leave(*_: Any) -> None:
        stack.pop()

    for path, sub in model.named_modules():
        if path:
            handles.append(sub.register_forward_pre_hook(enter(path)))
            handles.append(sub.register_forward_hook(leave))
    try:
        with torch.no_grad():
            model(*on_meta(args), **on_meta(kwargs))
    except Exception as exc:  # noqa: BLE001 - user code on the meta device
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise HetplanError(f"running the model's forward on the meta device failed ({type(exc).__name__}: "
                           f"{first}); make it run on meta tensors") from None
    finally:
        for h in handles:
            h.remove()
    return callees


def _owns_params(module: Any) -> bool:
    return any(True for _ in module.parameters())


def _owns_own_params(module: Any) -> bool:
    """Parameters held by the module itself, not by a submodule: they would be left outside every layer."""
    return any(True for _ in module.parameters(recurse=False))
