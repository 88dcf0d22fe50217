"""Where a model came from, typed: what the runtime needs to build the same model again.

A ModelSpec's ``source`` is one of

* ``None``: hetplan's own description (a preset, a ModelSpec file, a traced
  ``nn.Module`` object): the runtime builds its built-in decoder from the
  layers (``hetplan.plan.support.builtin_refusal`` says when it cannot);
* :class:`HFSource`: a transformers class built from the config values
  recorded at import (``hetplan.model.hf``), so the config file may be gone;
* :class:`ModuleSource`: a ``pkg.mod:build`` function and a hash of the
  parameters it built (``hetplan.model.source``).

A plan file embeds its model, source included, but a plan file never makes
hetplan import code by itself (docs/inputs.md, "What a plan file can do"): a
:class:`ModuleSource` read from a file is not ``trusted`` until the user names
the function (``--model pkg.mod:build``) or says so (``--trust-plan-code``);
:func:`refuse_untrusted` is the one check, made before any import.

Plan files of format 3 and older, and ModelSpec files written before this
type, kept these facts in ``meta`` (``hf_class``, ``model_type``,
``hf_config``, ``module_source``, ``module_hash``): :func:`source_from_meta`
reads them. Torch-free.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Union

from hetplan.errors import HetplanError

REFERENCE = re.compile(r"[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*:[A-Za-z_][\w]*")
# module_fingerprint's length: 16 hex digits of a sha256 (hetplan.model.source)
MODULE_HASH = re.compile(r"[0-9a-f]{16}")
PYTHON_NAME = re.compile(r"[A-Za-z_]\w*")
# the meta keys that said how to build the model before ModelSpec.source (plan file format <= 3)
LEGACY_META_KEYS = ("hf_class", "model_type", "hf_config", "module_source", "module_hash")


def is_reference(text: str) -> bool:
    """``pkg.mod:function`` (a preset, a path or a HF name never has this form)."""
    return isinstance(text, str) and bool(REFERENCE.fullmatch(text))


@dataclass(frozen=True)
class HFSource:
    """A transformers model class (``hf_class``, e.g. ``LlamaForCausalLM``) and the
    config values it is built from (None: the config object could not be written as JSON)."""

    hf_class: str
    model_type: str
    config: dict[str, Any] | None = field(default=None, hash=False)

    def to_dict(self) -> dict[str, Any]:
        return {"kind": "hf", "hf_class": self.hf_class, "model_type": self.model_type, "config": self.config}


@dataclass(frozen=True)
class ModuleSource:
    """A ``pkg.mod:build`` function and the hash of the parameter names and shapes it
    built (``module_fingerprint``; "" unknown). ``trusted``: the user named the
    function or trusted the plan file in this process; never written, never read."""

    reference: str
    module_hash: str = ""
    trusted: bool = field(default=False, compare=False)

    def to_dict(self) -> dict[str, Any]:
        return {"kind": "module", "reference": self.reference, "module_hash": self.module_hash}


ModelSource = Union[HFSource, ModuleSource]


def source_from_dict(data: Any, where: str) -> ModelSource | None:
    """The source ``to_dict`` wrote (None: ``null``), every field checked; never trusted."""
    if data is None:
        return None
    if not isinstance(data, dict):
        raise HetplanError(f"{where}: source must be a JSON object or null")
    kind = data.get("kind")
    keys = {"hf": ("kind", "hf_class", "model_type", "config"), "module": ("kind", "reference", "module_hash")}
    if kind not in keys:
        raise HetplanError(f"{where}: source.kind must be \"hf\" or \"module\", got {kind!r}")
    unknown = sorted(str(k) for k in data if k not in keys[kind])
    if unknown:
        raise HetplanError(f"{where}: source has unknown key(s) {unknown}; allowed: {list(keys[kind])}")
    if kind == "hf":
        return _hf_source(data.get("hf_class"), data.get("model_type"), data.get("config"), where)
    return _module_source(data.get("reference"), data.get("module_hash", ""), where)


def source_from_meta(meta: dict[str, Any], where: str) -> tuple[ModelSource | None, dict[str, Any]]:
    """(the source, the rest of ``meta``) of a ModelSpec written before ``source``
    existed (plan file format <= 3), which kept it in ``meta``."""
    rest = {k: v for k, v in meta.items() if k not in LEGACY_META_KEYS}
    if meta.get("module_source"):
        return _module_source(meta["module_source"], meta.get("module_hash") or "", f"{where}: meta"), rest
    if meta.get("hf_class"):
        return _hf_source(meta["hf_class"], meta.get("model_type", ""), meta.get("hf_config"), f"{where}: meta"), rest
    return None, rest


def _hf_source(hf_class: Any, model_type: Any, config: Any, where: str) -> HFSource:
    if not isinstance(hf_class, str) or not PYTHON_NAME.fullmatch(hf_class):
        raise HetplanError(f"{where}: hf_class must name a transformers class (e.g. \"LlamaForCausalLM\"), "
                           f"got {hf_class!r}")
    if not isinstance(model_type, str):
        raise HetplanError(f"{where}: model_type must be a string, got {model_type!r}")
    if config is not None and not isinstance(config, dict):
        raise HetplanError(f"{where}: the HF config values must be a JSON object or null")
    return HFSource(hf_class, model_type, config)


def _module_source(reference: Any, module_hash: Any, where: str) -> ModuleSource:
    if not is_reference(reference):
        raise HetplanError(f"{where}: the model's build function must be package.module:function, got "
                           f"{str(reference)[:60]!r}")
    if not isinstance(module_hash, str) or (module_hash and not MODULE_HASH.fullmatch(module_hash)):
        raise HetplanError(f"{where}: module_hash must be 16 hex digits (hetplan.model.source.module_fingerprint)")
    return ModuleSource(reference, module_hash)


def refuse_untrusted(source: ModelSource | None) -> None:
    """Raise unless ``source`` may be imported: no code (a preset, a HF class), or
    a ``pkg.mod:build`` the user named or trusted (module doc). Called before any import."""
    if isinstance(source, ModuleSource) and not source.trusted:
        raise HetplanError(untrusted_message(source.reference))


def untrusted_message(reference: str) -> str:
    """What to pass to let hetplan import the plan's model code ``reference`` (one line)."""
    return (f"the plan's model is Python code ({reference}), which hetplan imports only when you name it: give "
            f"--model {reference} (hetplan.runtime.init(plan, model={reference!r})), or --trust-plan-code "
            "(trust_plan_code=True) if you trust the plan file")


def trusted(source: ModelSource | None) -> ModelSource | None:
    """``source`` marked as imported with the user's consent (``--trust-plan-code``)."""
    if isinstance(source, ModuleSource):
        return ModuleSource(source.reference, source.module_hash, trusted=True)
    return source
