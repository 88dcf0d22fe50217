"""GPU catalog: peak throughput, memory and memory bandwidth from datasheets.

``peak_flops`` is the dense (no sparsity) 16-bit tensor-core rate with fp32
accumulation — what mixed-precision training uses; ``peak_flops_fp32`` is the
plain fp32 (non-tensor-core) rate used for fp32 training. Memory is the usable
capacity in bytes (a "16 GB" card holds 16 GiB).

Measured numbers (``matmul_efficiency``) and board power (``tdp_w``) come from
``shared/calibration/hardware_specs.json``, which collects them with their
sources; each entry's ``source`` names where its numbers come from.

A cluster file may describe GPUs the catalog lacks, or change any number of a
catalog GPU (``hetplan.cluster.io``); ``power_capped`` models a board power cap.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import Mapping

from hetplan.errors import HetplanError
from hetplan.units import GIB

TERA = 1e12

# Power capping (nvidia-smi -pl) makes the GPU lower its graphics/SM clock until
# the board draws no more than the cap (NVIDIA nvidia-smi manual,
# clocks_throttle_reasons.sw_power_cap: "SW Power Scaling algorithm is reducing
# the clocks below requested clocks because the GPU is consuming too much
# power"). Dynamic CMOS power is P ~ C·V²·f (Hennessy & Patterson, Computer
# Architecture, 6th ed., §1.5), and across the DVFS range the voltage rises
# about linearly with the clock, so P ~ f³ and the clock — hence every compute
# peak, which is clock × work per cycle — scales as (cap / TDP)^(1/3).
# Check against a measured pair: NVIDIA rates the 250 W A100 PCIe (same GA100,
# same clocks and peak numbers as the 400 W SXM4) at 90% of the SXM4's
# application performance (NVIDIA's A100 PCIe launch specifications, as
# tabulated by AnandTech, "NVIDIA Announces PCIe A100 Accelerator: 250 Watt
# Ampere In A Standard Form Factor", 2020-06-22). The rule gives
# (250/400)^(1/3) = 0.855: slightly slower, as it should be for compute peaks,
# since part of an application's time (memory-bound kernels, communication)
# does not follow the SM clock. Memory bandwidth is left unscaled: the memory
# clock is a separate domain the power-scaling algorithm leaves alone in this
# model.
POWER_CAP_CLOCK_EXPONENT = 1.0 / 3.0


@dataclass(frozen=True)
class GPUSpec:
    """One accelerator model.

    Attributes:
        name: catalog name, e.g. "A100-80GB", or the name a cluster file gives.
        memory_bytes: device memory.
        peak_flops: dense fp16/bf16 tensor-core FLOP/s (fp32 accumulate).
        peak_flops_fp32: dense fp32 FLOP/s without tensor cores (no TF32);
            0: not given (training in fp32 is then an error, not a guess).
        memory_bandwidth_bytes_per_s: DRAM/HBM bandwidth.
        source: datasheet the numbers come from.
        peak_flops_fp8: dense FP8 tensor-core FLOP/s (0: the GPU has no FP8).
        matmul_efficiency: measured best-shape matmul FLOP/s over ``peak_flops``
            (0: not measured; the cost model then uses its generation default).
        peak_flops_tf32: dense TF32 tensor-core FLOP/s (0: the GPU has no TF32).
        tdp_w: board power limit at which the peaks above hold: the TDP, or the
            cap for a power-capped type (0: unknown).
        derived_from: the catalog GPU this type was made from (a cluster file's
            ``base``, a per-node override, a power cap); "" for catalog entries
            and types described from scratch. See ``catalog_name``.
    """

    name: str
    memory_bytes: int
    peak_flops: float
    peak_flops_fp32: float
    memory_bandwidth_bytes_per_s: float
    source: str
    peak_flops_fp8: float = 0.0
    matmul_efficiency: float = 0.0
    peak_flops_tf32: float = 0.0
    tdp_w: float = 0.0
    derived_from: str = ""

    def __post_init__(self) -> None:
        _check_spec(self)

    @property
    def catalog_name(self) -> str:
        """The catalog GPU this type is or was made from ("" for a GPU described
        from scratch): the key for tables of per-GPU measurements, which a
        capped or retuned H100 should still find under "H100"."""
        return self.derived_from or (self.name if self.name in GPU_CATALOG else "")

    def peak_flops_for(self, dtype_bytes: int) -> float:
        """Peak rate for training with elements of ``dtype_bytes`` (2 or 4)."""
        if dtype_bytes <= 2:
            return self.peak_flops
        if self.peak_flops_fp32 <= 0:
            raise HetplanError(f"GPU type {self.name!r} has no fp32 peak: add peak_tflops_fp32 to its "
                               "gpu_types entry to train in fp32")
        return self.peak_flops_fp32


_REQUIRED = ("memory_bytes", "peak_flops", "memory_bandwidth_bytes_per_s")


def _check_spec(spec: GPUSpec) -> None:
    """Every number finite; the ones a cost needs positive, the optional ones >= 0."""
    if not isinstance(spec.name, str) or not spec.name.strip():
        raise HetplanError("a GPU type needs a non-empty name")
    for f in fields(spec):
        if f.name in ("name", "source", "derived_from"):
            continue
        value = getattr(spec, f.name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise HetplanError(f"GPU type {spec.name!r}: {f.name} must be a finite number, got {value!r}")
        if value < 0 or (value == 0 and f.name in _REQUIRED):
            raise HetplanError(f"GPU type {spec.name!r}: {f.name} must be positive, got {value}")
    if spec.derived_from and spec.derived_from not in GPU_CATALOG:
        raise HetplanError(f"GPU type {spec.name!r}: derived_from must be a catalog name, got {spec.derived_from!r}")
    if spec.matmul_efficiency > 1:
        raise HetplanError(f"GPU type {spec.name!r}: matmul_efficiency is a fraction of the peak, "
                           f"at most 1, got {spec.matmul_efficiency}")


def _gpu(name: str, mem_gib: float, tf16: float, tf32: float, bw_gbs: float, source: str, *,
         tf32_tensor: float = 0.0, fp8: float = 0.0, matmul_efficiency: float = 0.0,
         tdp_w: float = 0.0) -> GPUSpec:
    return GPUSpec(name, int(mem_gib * GIB), tf16 * TERA, tf32 * TERA, bw_gbs * 1e9, source,
                   peak_flops_fp8=fp8 * TERA, matmul_efficiency=matmul_efficiency,
                   peak_flops_tf32=tf32_tensor * TERA, tdp_w=tdp_w)


_V100_SXM = "NVIDIA Tesla V100 datasheet (2020): SXM2 125 TF tensor, 15.7 TF fp32, 900 GB/s"
_A100 = "NVIDIA A100 datasheet (2021): 312 TF bf16 dense, 156 TF TF32 dense, 19.5 TF fp32"
# Board power (TDP) and measured best-shape bf16 matmul rates (MAMF):
_HW = "shared/calibration/hardware_specs.json"
_MAMF = f"stas00/ml-engineering MAMF table via {_HW}"

GPU_CATALOG: dict[str, GPUSpec] = {
    g.name: g
    for g in [
        _gpu("V100-16GB", 16, 125, 15.7, 900, _V100_SXM + f"; 300 W TDP ({_HW})", tdp_w=300),
        _gpu("V100-32GB", 32, 125, 15.7, 900, _V100_SXM + f"; 300 W TDP ({_HW})", tdp_w=300),
        _gpu("P100", 16, 18.7, 9.3, 732,
             "NVIDIA Tesla P100 PCIe datasheet (2016): 18.7 TF fp16, 9.3 TF fp32, 732 GB/s; "
             f"250 W TDP ({_HW})", tdp_w=250),
        _gpu("T4", 16, 65, 8.1, 320,
             f"NVIDIA T4 datasheet (2019): 65 TF fp16 mixed, 8.1 TF fp32, 320 GB/s, 70 W ({_HW})", tdp_w=70),
        _gpu("A100-40GB", 40, 312, 19.5, 1555,
             _A100 + f", 1,555 GB/s (40GB SXM), 400 W ({_HW}); matmul rate as measured on the 80GB part, "
             f"the same GA100 die and clocks ({_MAMF})", tf32_tensor=156, matmul_efficiency=271.2 / 312, tdp_w=400),
        _gpu("A100-80GB", 80, 312, 19.5, 2039,
             _A100 + f", 2,039 GB/s (80GB SXM), 400 W ({_HW}); measured bf16 matmul 271.2 TF ({_MAMF})",
             tf32_tensor=156, matmul_efficiency=271.2 / 312, tdp_w=400),
        _gpu("H100", 80, 989, 67, 3350,
             "NVIDIA H100 datasheet (2023), SXM: 989 TF bf16 dense, 1,979 TF fp8 dense, 494.5 TF TF32 "
             f"dense, 67 TF fp32, 3.35 TB/s, 700 W ({_HW}); measured bf16 matmul 794.5 TF ({_MAMF})",
             tf32_tensor=494.5, fp8=1979, matmul_efficiency=794.5 / 989, tdp_w=700),
        _gpu("H200", 141, 989, 67, 4800,
             "NVIDIA H200 datasheet (2024), SXM: 989 TF bf16 dense, 1,979 TF fp8 dense, 494.5 TF TF32 "
             f"dense ({_HW}), 67 TF fp32, 4.8 TB/s, up to 700 W TDP",
             tf32_tensor=494.5, fp8=1979, tdp_w=700),
        _gpu("A10", 24, 125, 31.2, 600,
             "NVIDIA A10 datasheet (2021): 125 TF bf16 dense, 62.5 TF TF32 dense, 31.2 TF fp32, "
             f"600 GB/s, 150 W ({_HW})", tf32_tensor=62.5, tdp_w=150),
        _gpu("L4", 24, 121, 30.3, 300,
             "NVIDIA L4 datasheet (2023): 121 TF bf16 dense (242 sparse), 242.5 TF fp8 dense (485 "
             f"sparse), 60 TF TF32 dense (120 sparse), 30.3 TF fp32, 300 GB/s, 72 W ({_HW})",
             tf32_tensor=60, fp8=242.5, tdp_w=72),
        _gpu("RTX-TITAN", 24, 130, 16.3, 672,
             "NVIDIA Turing architecture whitepaper (2018), Titan RTX: 130 TF fp16 tensor "
             f"(fp32 accumulate), 16.3 TF fp32, 672 GB/s, 280 W ({_HW})", tdp_w=280),
        _gpu("RTX-3090", 24, 71, 35.6, 936,
             "NVIDIA Ampere GA102 whitepaper (2020), RTX 3090: 71 TF fp16 tensor (fp32 "
             f"accumulate) dense, 35.6 TF TF32 tensor dense, 35.6 TF fp32, 936 GB/s, 350 W ({_HW})",
             tf32_tensor=35.6, tdp_w=350),
        _gpu("RTX-4090", 24, 165.2, 82.6, 1008,
             "NVIDIA Ada Lovelace architecture whitepaper (2022), RTX 4090: 165.2 TF fp16 "
             "tensor (fp32 accumulate) dense, 330.3 TF fp8 tensor (fp32 accumulate) dense, 82.6 TF "
             f"TF32 tensor dense, 82.6 TF fp32, 1,008 GB/s, 450 W ({_HW})",
             tf32_tensor=82.6, fp8=330.3, tdp_w=450),
        # A CPU "device" for local runs with gloo (the runtime's tests). Throughput
        # is only used to rank plans for tiny test models; measured with
        # benchmarks/measure_cpu.py on this 2-core machine class (~50 GFLOP/s fp32).
        _gpu("CPU", 4, 0.05, 0.05, 10, "benchmarks/measure_cpu.py on the 2-core CI machine"),
    ]
}

_ALIASES = {
    "V100": "V100-16GB", "V100-16": "V100-16GB", "V100-32": "V100-32GB", "V100-SXM2-16GB": "V100-16GB",
    "P100-16GB": "P100", "T4-16GB": "T4",
    "A100": "A100-40GB", "A100-40": "A100-40GB", "A100-80": "A100-80GB",
    "H100-80GB": "H100", "H100-SXM": "H100", "H200-141GB": "H200",
    "A10-24GB": "A10", "L4-24GB": "L4",
    "TITAN-RTX": "RTX-TITAN", "RTXTITAN": "RTX-TITAN", "TITAN": "RTX-TITAN",
    "3090": "RTX-3090", "4090": "RTX-4090",
}


def normalise_gpu_name(name: str) -> str:
    """The form names are compared in: case, spaces and underscores do not matter."""
    return name.strip().upper().replace(" ", "-").replace("_", "-")


def find_catalog_gpu(name: str) -> GPUSpec | None:
    """The catalog entry a name or alias means, or None."""
    key = normalise_gpu_name(name)
    for canonical in GPU_CATALOG:
        if normalise_gpu_name(canonical) == key:
            return GPU_CATALOG[canonical]
    for alias, canonical in _ALIASES.items():
        if normalise_gpu_name(alias) == key:
            return GPU_CATALOG[canonical]
    return None


def get_gpu(name: str, custom: Mapping[str, GPUSpec] | None = None) -> GPUSpec:
    """Look up a GPU by name (case-insensitive): first the ``custom`` types a
    cluster file defines, then the catalog's names and aliases."""
    key = normalise_gpu_name(name)
    for custom_name, spec in (custom or {}).items():
        if normalise_gpu_name(custom_name) == key:
            return spec
    found = find_catalog_gpu(name)
    if found is None:
        known = [*GPU_CATALOG, *(custom or {})]
        raise HetplanError(f"unknown GPU type {name!r}; known types: {', '.join(known)}")
    return found


def is_catalog_gpu(spec: GPUSpec) -> bool:
    """Whether ``spec`` is a catalog entry exactly (its name alone describes it)."""
    return GPU_CATALOG.get(spec.name) == spec


def power_cap_factor(power_cap_w: float, tdp_w: float) -> float:
    """How much a cap of ``power_cap_w`` on a board rated ``tdp_w`` lowers every
    compute peak (see POWER_CAP_CLOCK_EXPONENT for the rule and its sources)."""
    if not (math.isfinite(power_cap_w) and power_cap_w > 0):
        raise HetplanError(f"power_cap_w must be a positive number, got {power_cap_w}")
    if not (math.isfinite(tdp_w) and tdp_w > 0):
        raise HetplanError("power_cap_w needs the GPU's tdp_w (the board power its peaks hold at)")
    if power_cap_w > tdp_w:
        raise HetplanError(f"power_cap_w {power_cap_w:g} W is above tdp_w {tdp_w:g} W: a cap can only lower "
                           "the power; leave it out or correct tdp_w")
    return float((power_cap_w / tdp_w) ** POWER_CAP_CLOCK_EXPONENT)


_COMPUTE_PEAKS = ("peak_flops", "peak_flops_fp32", "peak_flops_fp8", "peak_flops_tf32")


def power_capped(spec: GPUSpec, power_cap_w: float, name: str = "") -> GPUSpec:
    """``spec`` under a board power cap: compute peaks scaled by
    ``power_cap_factor``; memory, bandwidth and the measured matmul efficiency
    (a ratio to the peak) kept. ``tdp_w`` becomes the cap, so capping a capped
    type again composes: (a/b)^k · (b/c)^k = (a/c)^k."""
    factor = power_cap_factor(power_cap_w, spec.tdp_w)
    scaled = {attr: in_si(in_units(getattr(spec, attr), TERA) * factor, TERA) for attr in _COMPUTE_PEAKS}
    note = (f"power-capped at {power_cap_w:g} W of {spec.tdp_w:g} W: compute peaks x{factor:.4f} "
            f"= (cap/TDP)^(1/3), hetplan.cluster.catalog.POWER_CAP_CLOCK_EXPONENT")
    return replace(spec, name=name or spec.name, tdp_w=float(power_cap_w), source=f"{spec.source}; {note}",
                   derived_from=spec.catalog_name, **scaled)


def in_si(value: float, scale: float) -> float:
    """A number in the units a file writes (TFLOP/s, GB/s, GiB) in SI units."""
    return value * scale


def in_units(si_value: float, scale: float) -> float:
    """The inverse of ``in_si``, chosen so that ``in_si(in_units(x, s), s) == x``
    exactly whenever some float maps to ``x``: a written cluster reads back equal."""
    guess = si_value / scale
    for steps in range(4):
        for direction in (math.inf, -math.inf):
            candidate = guess
            for _ in range(steps):
                candidate = math.nextafter(candidate, direction)
            if candidate * scale == si_value:
                return candidate
    return guess
