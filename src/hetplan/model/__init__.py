"""Models as ordered layer lists (ModelSpec), presets and importers."""

from __future__ import annotations

import os

from hetplan.errors import HetplanError
from hetplan.jsonfile import read_json
from hetplan.model.presets import get_model, model_descriptions, model_names
from hetplan.model.spec import LayerSpec, ModelSpec


def load_model(name_or_path: str, seq_len: int | None = None, dtype_bytes: int | None = None) -> ModelSpec:
    """A preset name, a HF ``config.json`` (or a directory holding one), or a
    ModelSpec JSON written by hetplan (it has a "layers" list). ``dtype_bytes``
    builds a HF config in that precision (default 2); presets and ModelSpec
    files keep theirs."""
    if os.path.isdir(name_or_path) or name_or_path.endswith(".json") or os.path.sep in name_or_path:
        path = os.path.join(name_or_path, "config.json") if os.path.isdir(name_or_path) else name_or_path
        if os.path.isfile(path):
            data = read_json(path, "model file", "fix the syntax")
            if isinstance(data, dict) and "layers" in data:
                return ModelSpec.from_dict(data)
        from hetplan.model.hf import model_from_hf_config

        return model_from_hf_config(name_or_path, seq_len=seq_len, dtype_bytes=dtype_bytes or 2)
    if seq_len is not None:
        raise HetplanError("--seq-len applies to HF configs; presets have their papers' sequence length")
    return get_model(name_or_path)


__all__ = ["LayerSpec", "ModelSpec", "get_model", "load_model", "model_names", "model_descriptions"]
