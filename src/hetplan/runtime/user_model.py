"""Models given as Python code (``--model pkg.mod:build``) in ``hetplan train`` and ``ctx.parallelize()``.

A plan made from ``pkg.mod:build`` records the reference and a hash of the
module's parameter names and shapes (``ModelSpec.source``, a
``hetplan.model.origin.ModuleSource``; hetplan.model.source describes the
model, this module builds it for training). The runtime imports the function
only if the user named it or trusted the plan file (``refuse_untrusted``),
rebuilds the model from it, refuses a build function that now builds another model, and makes the
data and loss ``hetplan train`` trains it with (docs/runtime.md, "Models given
as Python code"):

* **inputs**: shaped like the build function's example inputs, dim 0 the
  plan's global batch, the same dtype. Floating-point inputs are drawn from a
  seeded normal; integer inputs uniformly in their observed range [min, max]
  when the example tensors hold values (made with an explicit device, e.g.
  ``device="cpu"``: the build function runs under ``torch.device("meta")``),
  else in [0, n) with n the vocabulary of the smallest embedding its values
  reach (``nn.Embedding`` / ``F.embedding``, through slicing, concatenation or
  any other integer op); bool inputs are fair coin flips. An
  integer input with neither is refused (its indices could be out of range).
* the first positional input is the batch's ``x``; later ones are passed by
  the names of ``forward``'s parameters (``train_step``'s keyword inputs).
* **targets**: ``example_targets`` (a third element of what build returns),
  drawn the same way, else the first input itself (self-supervised losses:
  next token, reconstruction).
* **loss**: ``module.hetplan_loss(output, targets)`` (the mean over a
  micro-batch), else :func:`default_loss`, the mean of the output squared in
  fp32 -- a loss for checking a plan (``--verify``), not for learning anything.

Every draw depends only on (seed, step, input index), so every rank and the
single-process reference see the same batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from hetplan.errors import HetplanError
from hetplan.model.origin import ModuleSource, refuse_untrusted
from hetplan.model.source import call_build, module_fingerprint, split_built
from hetplan.model.chain import keyword_input_names
from hetplan.runtime.parallelize import stable_seed


@dataclass(frozen=True)
class TensorDraw:
    """How to draw one synthetic input: its shape past dim 0, dtype and distribution."""

    shape: tuple[int, ...]  # without dim 0 (the batch)
    dtype: torch.dtype
    kind: str  # "normal", "integer" or "bool"
    low: int = 0
    high: int = 0  # inclusive

    def draw(self, batch_size: int, generator: torch.Generator) -> torch.Tensor:
        shape = (batch_size, *self.shape)
        if self.kind == "normal":
            return torch.randn(shape, generator=generator, dtype=torch.float32).to(self.dtype)
        if self.kind == "bool":
            return torch.randint(0, 2, shape, generator=generator).bool()
        return torch.randint(self.low, self.high + 1, shape, generator=generator, dtype=self.dtype)

    def describe(self) -> str:
        what = {"normal": "N(0, 1)", "bool": "{False, True}"}.get(self.kind, f"[{self.low}, {self.high}]")
        return f"{tuple(self.shape)} {str(self.dtype).replace('torch.', '')} {what}"


@dataclass(frozen=True)
class UserModel:
    """A ``pkg.mod:build`` model as ``hetplan train`` trains it."""

    reference: str
    inputs: tuple[TensorDraw, ...]
    input_names: tuple[str, ...]  # keyword names of the inputs after the first
    targets: TensorDraw | None  # None: the first input is the target
    loss: Callable[[Any, torch.Tensor], torch.Tensor]
    meta_init: bool
    example_inputs: tuple[torch.Tensor, ...]  # on the meta device, batch as the build function gave it

    def build(self) -> nn.Module:
        """The full model (on the current default device; ``parallelize`` builds it on meta)."""
        return split_built(call_build(self.reference, meta=False), self.reference)[0]

    def batch(self, batch_size: int, step: int, seed: int = 0
              ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """(x, targets, keyword inputs) of one global batch, the same for (step, seed) on every rank."""
        drawn = [d.draw(batch_size, _generator(seed, step, f"in{k}")) for k, d in enumerate(self.inputs)]
        targets = self.targets.draw(batch_size, _generator(seed, step, "targets")) if self.targets else drawn[0]
        return drawn[0], targets, dict(zip(self.input_names, drawn[1:]))


def _generator(seed: int, step: int, what: str) -> torch.Generator:
    return torch.Generator().manual_seed(stable_seed(seed, f"user-data:{step}:{what}"))


def default_loss(output: Any, targets: torch.Tensor) -> torch.Tensor:
    """The mean of the output squared, in fp32 (the first tensor of a tuple output)."""
    out = _first_tensor(output)
    if out is None or not out.is_floating_point():
        raise HetplanError("the model's output is no floating-point tensor, so hetplan train has no loss for it; "
                           "define hetplan_loss(output, targets) on the module (docs/runtime.md)")
    return out.float().pow(2).mean()


def _first_tensor(value: Any) -> torch.Tensor | None:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (tuple, list)) and value:
        return _first_tensor(value[0])
    return _first_tensor(getattr(value, "logits", None)) if hasattr(value, "logits") else None


def user_model(spec: Any) -> UserModel:
    """The model ``spec.source`` (a ModuleSource) builds, checked against the plan's
    (``spec``); refused before any import unless the user named or trusted it."""
    source: ModuleSource = spec.source
    refuse_untrusted(source)
    reference = source.reference
    made = call_build(reference)
    targets = made[2] if isinstance(made, tuple) and len(made) == 3 else None
    module, inputs = split_built(made, reference)
    check_same_module(reference, module, spec)
    if targets is None and callable(getattr(module, "example_targets", None)):
        targets = module.example_targets()
    names = keyword_input_names(module, len(inputs), f"model {reference!r}")
    bounds = _embedding_bounds(module, inputs, names)
    draws = tuple(_draw_of(x, f"example input {k}", bounds.get(k), reference) for k, x in enumerate(inputs))
    target_draw = _draw_of(targets, "example targets", None, reference) if targets is not None else None
    rows = {int(t.shape[0]) for t in (*inputs, *(() if targets is None else (targets,)))}
    if len(rows) != 1:
        raise HetplanError(f"model {reference!r}: the example inputs and targets differ in dim 0 ({sorted(rows)}); "
                           "dim 0 is the batch, the same for each")
    loss = getattr(module, "hetplan_loss", None)
    return UserModel(reference, draws, names, target_draw,
                     loss if callable(loss) else default_loss, not any(True for _ in module.buffers()),
                     tuple(torch.empty(x.shape, dtype=x.dtype, device="meta") for x in inputs))


def check_same_module(reference: str, module: nn.Module, spec: Any) -> None:
    """Refuse a model that is not the one the plan was made for (one line saying how it differs)."""
    want = spec.source.module_hash if isinstance(spec.source, ModuleSource) else ""
    got = module_fingerprint(module)
    count = sum(p.numel() for p in module.parameters())
    missing = [n for n in (layer.name for layer in spec.layers) if not _has_module(module, n)]
    if (not want or got == want) and count == spec.total_params and not missing:
        return
    if count != spec.total_params:
        detail = f"{count:,} parameters, the plan's model {spec.total_params:,}"
    elif missing:
        detail = f"it has no module {missing[0]!r} (a layer of the plan)"
    else:
        detail = f"its parameter names or shapes changed (hash {got}, the plan's {want})"
    raise HetplanError(f"the model built by {reference} differs from the one the plan was made for: {detail}; "
                       f"make the plan again ('hetplan plan --model {reference} ...') or restore the function")


def _has_module(module: nn.Module, path: str) -> bool:
    try:
        module.get_submodule(path)
    except AttributeError:
        return False
    return True


def _draw_of(example: Any, what: str, embedding_bound: int | None, reference: str) -> TensorDraw:
    """How to draw tensors like ``example`` (module docstring)."""
    if not isinstance(example, torch.Tensor) or example.dim() == 0:
        raise HetplanError(f"model {reference!r}: {what} is {type(example).__name__}, not a tensor with the batch "
                           "as dim 0; hetplan train draws tensors only")
    shape, dtype = tuple(example.shape[1:]), example.dtype
    if dtype == torch.bool:
        return TensorDraw(shape, dtype, "bool", 0, 1)
    if dtype.is_floating_point or dtype.is_complex:
        return TensorDraw(shape, dtype, "normal")
    if example.device.type != "meta" and example.numel():
        return TensorDraw(shape, dtype, "integer", int(example.min()), int(example.max()))
    if embedding_bound:
        return TensorDraw(shape, dtype, "integer", 0, embedding_bound - 1)
    raise HetplanError(f"model {reference!r}: {what} holds integers of unknown range (made on the meta device and "
                       "reaching no embedding); make it with device='cpu' and values spanning the range to draw")


def _embedding_bounds(module: nn.Module, inputs: tuple[Any, ...], names: tuple[str, ...]) -> dict[int, int]:
    """Input index -> the smallest ``num_embeddings`` of an embedding whose
    indices derive from that input (through slicing, concatenation or any other
    integer op), from one forward on the meta device, called as ``train_step``
    calls it (the inputs after the first by their ``names``)."""
    if not any(isinstance(x, torch.Tensor) and not x.is_floating_point() for x in inputs):
        return {}
    metas = [torch.empty(x.shape, dtype=x.dtype, device="meta") if isinstance(x, torch.Tensor) else x
             for x in inputs]
    tracer = _IndexOrigins({id(x): (x, frozenset([k])) for k, x in enumerate(metas) if isinstance(x, torch.Tensor)})
    try:
        with torch.no_grad(), tracer:
            module.to("meta")(metas[0], **dict(zip(names, metas[1:])))
    except Exception:  # noqa: BLE001 - user code; the chain check and training report real failures
        pass
    return tracer.bounds


class _IndexOrigins(torch.overrides.TorchFunctionMode):
    """Follows which inputs each integer tensor derives from, and the vocabulary
    of every ``F.embedding`` (``nn.Embedding`` included) its indices go into."""

    def __init__(self, origins: dict[int, tuple[torch.Tensor, frozenset[int]]]) -> None:
        super().__init__()
        self.origins = origins  # id -> (tensor kept alive so its id stays its own, input indices)
        self.bounds: dict[int, int] = {}

    def _of(self, value: Any) -> frozenset[int]:
        if isinstance(value, torch.Tensor):
            found = self.origins.get(id(value))
            return found[1] if found is not None and found[0] is value else frozenset()
        if isinstance(value, (tuple, list)):
            return frozenset().union(*(self._of(v) for v in value))
        return frozenset()

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func is torch.nn.functional.embedding:
            weight = args[1] if len(args) > 1 else kwargs.get("weight")
            for k in self._of(args[0] if args else kwargs.get("input")):
                self.bounds[k] = min(self.bounds.get(k, int(weight.shape[0])), int(weight.shape[0]))
            return out
        source = self._of(list(args) + list(kwargs.values()))
        if source:
            for t in (out if isinstance(out, (tuple, list)) else (out,)):
                if isinstance(t, torch.Tensor) and not t.is_floating_point():
                    self.origins[id(t)] = (t, source)
        return out
