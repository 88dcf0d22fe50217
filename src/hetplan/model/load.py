"""Loading a model by preset name, HF config, ModelSpec file or ``pkg.mod:build`` reference."""

from __future__ import annotations

import os

from hetplan.errors import HetplanError
from hetplan.io.userfiles import read_json
from hetplan.model.presets import get_model, model_descriptions, model_names
from hetplan.model.hf import model_from_hf_config
from hetplan.model.origin import is_reference
from hetplan.model.source import model_from_reference
from hetplan.model.spec import LayerSpec, ModelSpec


def load_model(name_or_path: str, seq_len: int | None = None, dtype_bytes: int | None = None) -> ModelSpec:
    """A preset name, a HF ``config.json`` (or a directory holding one), a
    ModelSpec JSON written by hetplan (it has a "layers" list), or Python code
    as ``pkg.mod:function`` (``hetplan.model.source``). ``dtype_bytes``
    builds a HF config in that precision (default 2); presets and ModelSpec
    files keep theirs."""
    if ":" in name_or_path and not os.path.exists(name_or_path):
        if is_reference(name_or_path):  # pkg.mod:function (hetplan.model.source)
            return model_from_reference(name_or_path, dtype_bytes)
    if os.path.isdir(name_or_path) or name_or_path.endswith(".json") or os.path.sep in name_or_path:
        path = os.path.join(name_or_path, "config.json") if os.path.isdir(name_or_path) else name_or_path
        if not os.path.isfile(path):  # refused there: hub names cannot be downloaded
            return model_from_hf_config(name_or_path, seq_len=seq_len, dtype_bytes=dtype_bytes or 2)
        data = _read_model_file(path)
        if not isinstance(data, dict):
            raise HetplanError(
                f"model file {path} holds a JSON {_json_type(data)}, not an object; a model file is a ModelSpec "
                "JSON (an object with a \"layers\" list) or a HF config.json (an object with a \"model_type\")"
            )
        if "layers" in data:
            if seq_len is not None:
                raise HetplanError(f"--seq-len applies to HF configs; the ModelSpec file {path} was built for "
                                   f"sequence length {data.get('seq_len')}: drop --seq-len or rebuild it")
            return ModelSpec.from_dict(data, f"model file {path}")
        return model_from_hf_config(data, seq_len=seq_len, dtype_bytes=dtype_bytes or 2, where=path)
    if seq_len is not None:
        raise HetplanError("--seq-len applies to HF configs; presets have their papers' sequence length")
    return get_model(name_or_path)


def _read_model_file(path: str) -> object:
    """The file's JSON, read by the one reader of user files (``hetplan.io.userfiles``)."""
    return read_json(path, "model file", "fix the syntax")


def _json_type(data: object) -> str:
    names = {list: "list", str: "string", bool: "boolean", type(None): "null", int: "number", float: "number"}
    return names.get(type(data), type(data).__name__)


__all__ = ["LayerSpec", "ModelSpec", "get_model", "load_model", "model_names", "model_descriptions"]
