"""GPU catalog: peak throughput, memory and memory bandwidth from datasheets.

``peak_flops`` is the dense (no sparsity) 16-bit tensor-core rate with fp32
accumulation — what mixed-precision training uses; ``peak_flops_fp32`` is the
plain fp32 (non-tensor-core) rate used for fp32 training. Memory is the usable
capacity in bytes (a "16 GB" card holds 16 GiB).
"""

from __future__ import annotations

from dataclasses import dataclass

from hetplan.errors import HetplanError
from hetplan.units import GIB

TERA = 1e12


@dataclass(frozen=True)
class GPUSpec:
    """One accelerator model.

    Attributes:
        name: canonical catalog name, e.g. "A100-80GB".
        memory_bytes: device memory.
        peak_flops: dense fp16/bf16 tensor-core FLOP/s (fp32 accumulate).
        peak_flops_fp32: dense fp32 FLOP/s without tensor cores (no TF32).
        memory_bandwidth_bytes_per_s: DRAM/HBM bandwidth.
        source: datasheet the numbers come from.
    """

    name: str
    memory_bytes: int
    peak_flops: float
    peak_flops_fp32: float
    memory_bandwidth_bytes_per_s: float
    source: str

    def peak_flops_for(self, dtype_bytes: int) -> float:
        """Peak rate for training with elements of ``dtype_bytes`` (2 or 4)."""
        return self.peak_flops if dtype_bytes <= 2 else self.peak_flops_fp32


def _gpu(name: str, mem_gib: float, tf16: float, tf32: float, bw_gbs: float, source: str) -> GPUSpec:
    return GPUSpec(name, int(mem_gib * GIB), tf16 * TERA, tf32 * TERA, bw_gbs * 1e9, source)


_V100_SXM = "NVIDIA Tesla V100 datasheet (2020): SXM2 125 TF tensor, 15.7 TF fp32, 900 GB/s"
_A100 = "NVIDIA A100 datasheet (2021): 312 TF bf16 dense, 19.5 TF fp32"

GPU_CATALOG: dict[str, GPUSpec] = {
    g.name: g
    for g in [
        _gpu("V100-16GB", 16, 125, 15.7, 900, _V100_SXM),
        _gpu("V100-32GB", 32, 125, 15.7, 900, _V100_SXM),
        _gpu("P100", 16, 18.7, 9.3, 732,
             "NVIDIA Tesla P100 PCIe datasheet (2016): 18.7 TF fp16, 9.3 TF fp32, 732 GB/s"),
        _gpu("T4", 16, 65, 8.1, 320,
             "NVIDIA T4 datasheet (2019): 65 TF fp16 mixed, 8.1 TF fp32, 320 GB/s"),
        _gpu("A100-40GB", 40, 312, 19.5, 1555, _A100 + ", 1,555 GB/s (40GB SXM)"),
        _gpu("A100-80GB", 80, 312, 19.5, 2039, _A100 + ", 2,039 GB/s (80GB SXM)"),
        _gpu("H100", 80, 989, 67, 3350,
             "NVIDIA H100 datasheet (2023), SXM: 989 TF bf16 dense, 67 TF fp32, 3.35 TB/s"),
        _gpu("H200", 141, 989, 67, 4800,
             "NVIDIA H200 datasheet (2024), SXM: 989 TF bf16 dense, 67 TF fp32, 4.8 TB/s"),
        _gpu("A10", 24, 125, 31.2, 600,
             "NVIDIA A10 datasheet (2021): 125 TF bf16 dense, 31.2 TF fp32, 600 GB/s"),
        _gpu("L4", 24, 121, 30.3, 300,
             "NVIDIA L4 datasheet (2023): 121 TF bf16 dense (242 sparse), 30.3 TF fp32, 300 GB/s"),
        _gpu("RTX-TITAN", 24, 130, 16.3, 672,
             "NVIDIA Turing architecture whitepaper (2018), Titan RTX: 130 TF fp16 tensor "
             "(fp32 accumulate), 16.3 TF fp32, 672 GB/s"),
        _gpu("RTX-3090", 24, 71, 35.6, 936,
             "NVIDIA Ampere GA102 whitepaper (2020), RTX 3090: 71 TF fp16 tensor (fp32 "
             "accumulate) dense, 35.6 TF fp32, 936 GB/s"),
        _gpu("RTX-4090", 24, 165.2, 82.6, 1008,
             "NVIDIA Ada Lovelace architecture whitepaper (2022), RTX 4090: 165.2 TF fp16 "
             "tensor (fp32 accumulate) dense, 82.6 TF fp32, 1,008 GB/s"),
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


def _normalise(name: str) -> str:
    return name.strip().upper().replace(" ", "-").replace("_", "-")


def get_gpu(name: str) -> GPUSpec:
    """Look up a GPU by catalog name or alias (case-insensitive)."""
    key = _normalise(name)
    for canonical in GPU_CATALOG:
        if _normalise(canonical) == key:
            return GPU_CATALOG[canonical]
    for alias, canonical in _ALIASES.items():
        if _normalise(alias) == key:
            return GPU_CATALOG[canonical]
    raise HetplanError(
        f"unknown GPU type {name!r}; known types: {', '.join(GPU_CATALOG)}"
    )
