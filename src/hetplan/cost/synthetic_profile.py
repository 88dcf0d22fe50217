"""A Metis profile (``hetplan.profile.metis``) made from the analytic cost
model, as if measured: the shipped example and the tests' profiles.

It lives with the cost model because it is computed from it (the profile
format itself knows nothing of the cost model).
"""

from __future__ import annotations

import hashlib
import os
from typing import Sequence

import numpy as np

from hetplan.cluster.catalog import get_gpu
from hetplan.cost.compute import layer_times
from hetplan.cost.constants import OPTIMIZER_STATE_BYTES
from hetplan.cost.layers import LayerArrays, layer_arrays
from hetplan.cost.memory import activation_bytes
from hetplan.model.spec import ModelSpec
from hetplan.profile.db import ProfileEntry
from hetplan.profile.metis import DEFAULT_K, EXAMPLE_PATH, PROFILED_MBS, PROFILED_TP, MetisMemoryProfile, \
    MetisProfileDB
from hetplan.model.presets import get_model


def _jitter(text: str, amplitude: float) -> float:
    """Deterministic measurement noise in [−amplitude, +amplitude] (hashlib,
    not hash(): the same on every run and PYTHONHASHSEED)."""
    digest = hashlib.sha256(text.encode()).digest()
    unit = int.from_bytes(digest[:8], "big") / float(1 << 64)
    return (2.0 * unit - 1.0) * amplitude


def synthesize(model: ModelSpec, gpu_types: Sequence[str], tps: Sequence[int] = PROFILED_TP,
               mbs: Sequence[int] = PROFILED_MBS, k: int = DEFAULT_K, memory_gpu: str = "",
               noise: float = 0.03, buffer_reuse: float = 1.0) -> MetisProfileDB:
    """A Metis profile made from the analytic model, as if measured.

    Times are the cost model's analytic layer times with ±``noise`` relative
    deterministic jitter; memory windows are the analytic states and
    activations of the window minus the activation buffers the runtime reuses
    between adjacent layers (``buffer_reuse`` × the bytes each internal layer
    passes on), which is what makes memory non-additive (Metis §4.3).
    """
    arrays = layer_arrays(model)
    return MetisProfileDB(_time_entries(model, arrays, gpu_types, tps, mbs, noise),
                          _memory_windows(model, arrays, tps, mbs, k, memory_gpu or gpu_types[0], buffer_reuse),
                          model.name)


def _time_entries(model: ModelSpec, arrays: LayerArrays, gpu_types: Sequence[str], tps: Sequence[int],
                  mbs: Sequence[int], noise: float) -> list[ProfileEntry]:
    """One entry per layer kind, GPU type, supported tp and micro-batch size."""
    firsts: dict[str, int] = {}
    for index, layer in enumerate(model.layers):
        firsts.setdefault(layer.profile_key, index)
    entries = []
    for key, index in firsts.items():
        for gpu_name in gpu_types:
            gpu = get_gpu(gpu_name)
            for tp in tps:
                if not model.layers[index].supports_tp(tp):
                    continue
                for b in mbs:
                    t = layer_times(arrays, gpu, b, tp, "none", model.dtype_bytes)
                    tag = f"{key}|{gpu.name}|{tp}|{b}"
                    entries.append(ProfileEntry(key, gpu.name, tp, b,
                                                float(t.fwd_s[index]) * (1 + _jitter(tag + "f", noise)),
                                                float(t.bwd_s[index]) * (1 + _jitter(tag + "b", noise))))
    return entries


def _memory_windows(model: ModelSpec, arrays: LayerArrays, tps: Sequence[int], mbs: Sequence[int], k: int,
                    memory_gpu: str, buffer_reuse: float) -> MetisMemoryProfile:
    """Analytic memory of every window of up to k + 1 layers, less the reused buffers."""
    optimizer = "adam-mixed" if model.dtype_bytes == 2 else "adam-fp32"
    per_param = sum(OPTIMIZER_STATE_BYTES[optimizer])
    windows: dict[tuple[int, int], dict[tuple[int, int], float]] = {}
    n = model.num_layers
    output = np.array([layer.output_bytes for layer in model.layers])
    for tp in tps:
        if not all(layer.supports_tp(tp) for layer in model.layers):
            continue
        states = arrays.params_per_device(tp) * per_param
        act = activation_bytes(arrays, tp, "none", False)
        for b in mbs:
            table = {}
            for i in range(n):
                for j in range(i, min(n - 1, i + k) + 1):
                    total = states[i:j + 1].sum() + b * act[i:j + 1].sum() - buffer_reuse * b * output[i:j].sum() / tp
                    table[(i, j)] = max(float(total), 0.0)
            windows[(tp, b)] = table
    return MetisMemoryProfile(get_gpu(memory_gpu).name, k, n, windows)


def write_example() -> None:  # pragma: no cover - maintenance helper
    """Regenerate the shipped example profile (GPT-3 1.3B on P100, T4 and V100)."""
    db = synthesize(get_model("gpt3-1.3b"), ["P100", "T4", "V100-16GB"], memory_gpu="V100-16GB")
    os.makedirs(os.path.dirname(EXAMPLE_PATH), exist_ok=True)
    with open(EXAMPLE_PATH, "w", encoding="utf-8") as f:
        f.write(db.to_json())
    print(f"wrote {EXAMPLE_PATH} ({len(db)} time entries)")


if __name__ == "__main__":  # pragma: no cover
    write_example()
