"""GPU catalog: peak throughput, memory and memory bandwidth from datasheets.

``peak_flops`` is the dense (no sparsity) 16-bit tensor-core rate with fp32
accumulation — what mixed-precision training uses; ``peak_flops_fp32`` is the
plain fp32 (non-tensor-core) rate used for fp32 training. Memory is the usable
capacity in bytes (a "16 GB" card holds 16 GiB).

Datasheets often print tensor rates "with sparsity" (2:4 structured sparsity,
2x the dense rate); those are halved here, and each ``source`` says which
printed figure was halved. One entry is one device that one process drives:
one GPU of a GB200 superchip (1 Grace CPU + 2 Blackwell GPUs) or of an H100
NVL pair, and one GCD of an MI250X (an MI250X OAM module carries two GCDs that
ROCm shows as two devices, so its module numbers are halved). A number no
source gives stays 0 (an optional field) and the source says so. ``A100``
alone is refused: the 40 GB and 80 GB parts differ in memory and bandwidth.

Measured numbers (``matmul_efficiency``) and board power (``tdp_w``) come from
``shared/calibration/hardware_specs.json``, which collects them with their
sources, where it has the GPU; otherwise board power comes from the datasheet
and ``matmul_efficiency`` from the table that file quotes (stas00/ml-engineering's
"Maximum Achievable Matmul FLOPS comparison table"), read directly: the measured
rate over the catalog's ``peak_flops`` (not the table's own "Theory" column, where
the two differ), and 0 (not measured) for a GPU the table has no row for. Each
entry's ``source`` names where its numbers come from; ``tests/data/gpu_datasheets.json``
keeps the printed datasheet figures and table rows of the GPUs added in 2026, and
``tests/test_gpu_catalog.py`` checks the entries against them.

A cluster file may describe GPUs the catalog lacks, or change any number of a
catalog GPU (``hetplan.cluster.io``); ``power_capped`` models a board power cap.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import Any, Mapping

from hetplan.errors import HetplanError, did_you_mean
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
        peak_flops_tf32: dense TF32 tensor-core FLOP/s (0: the GPU has no TF32,
            or its datasheet prints no TF32 rate).
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
_H100_SHEET = ("NVIDIA H100 datasheet (nvidia.com/en-us/data-center/h100/; spec table as copied at "
               "archive-lib.hpctech.co.jp/gpuproduct/nvidia-h100.html and thundercompute.com's H100 guide)")
_HGX_BLACKWELL = ("NVIDIA HGX / GB200 NVL72 platform specifications, 'Individual Blackwell GPU Specifications' "
                  "(nvidia.com/en-us/data-center/hgx/; table as copied at "
                  "zdszero.github.io/Computer/Artificial_Intelligence/Hardware.html; the halved tensor figures agree "
                  "with the dense ones of glennklockwood.com/garden/processors/B200 and stas00/ml-engineering "
                  "compute/accelerator, which print FP32 80 TF (B200) / 90 TF (GB200), NVIDIA's earlier figures)")
_POWER_TABLE = "stas00/ml-engineering compute/accelerator power table"
_AMD_MI300 = ("AMD Instinct MI300 series specifications (as tabulated by stas00/ml-engineering "
              "compute/accelerator, notes 17-18)")
_GAUDI_HC = ("Intel, 'Intel Gaudi 3 AI Accelerator: Architected for Gen AI Training and Inference', Hot Chips "
             "2024 (R. Kaplan; copy at sgpjbg.com/baogao/465025.html)")
# Board power (TDP) and measured best-shape bf16 matmul rates (MAMF):
_HW = "shared/calibration/hardware_specs.json"
_MAMF = f"stas00/ml-engineering MAMF table via {_HW}"
# ... and read from the table itself for GPUs the file lacks (each entry quotes its row):
_MAMF_TABLE = ("stas00/ml-engineering compute/accelerator/README.md at commit 744d01e (2026-08-22), 'Maximum "
               "Achievable Matmul FLOPS comparison table', BF16")
_NO_MAMF = "matmul_efficiency 0 (not measured: no {} row in the ml-engineering MAMF table)"

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
        # --- added 2026: Blackwell, Hopper variants, Ada/Ampere workstation, AMD, Intel ---
        # Sparse ("with sparsity") tensor figures halved; see each source.
        _gpu("B200", 180, 2250, 75, 7700,
             f"{_HGX_BLACKWELL}, HGX B200 column: FP16/BF16 tensor 4.5 PF, FP8 9 PF, TF32 2.2 PF (with "
             "sparsity; halved to 2,250 / 4,500 / 1,100 TF dense), FP32 75 TF, 180 GB HBM3E, 7.7 TB/s, TDP "
             f"configurable up to 1,000 W (also {_POWER_TABLE}: 1,000 W maximum TGP); the DGX B200 datasheet's "
             "64 TB/s per 8 GPUs would be 8 TB/s, and a B200 reads back a 7,680-bit bus at 3,996 MHz = 7.67 TB/s "
             f"(pytorch/ao PR 4002), so 7.7 is kept; not in {_HW}; measured bf16 matmul 1745.0 TF ({_MAMF_TABLE}, row "
             "'NVIDIA B200 SXM | 1745.0 | 2250 | 77.6% | 1792x16128x3072 | 2.7.1+cu128': the table's peak is the "
             "catalog's 2,250 TF)",
             tf32_tensor=1100, fp8=4500, matmul_efficiency=1745.0 / 2250, tdp_w=1000),
        _gpu("GB200", 186, 2500, 80, 8000,
             f"{_HGX_BLACKWELL}, GB200 NVL72 column (nvidia.com/en-us/data-center/gb200-nvl72/), per GPU: "
             "FP16/BF16 tensor 5 PF, FP8 10 PF, TF32 2.5 PF (with sparsity; halved to 2,500 / 5,000 / 1,250 TF "
             "dense), FP32 80 TF, 186 GB HBM3E, 8 TB/s, TDP configurable up to 1,200 W; one entry is one "
             "Blackwell GPU (a GB200 superchip is 1 Grace CPU + 2 GPUs); measured bf16 matmul 1822.0 TF on one GPU "
             f"({_MAMF_TABLE}, row 'NVIDIA GB200 SXM | 1822.0 | 2500 | 72.9% | 4096x9728x2048 | "
             "2.10.0.dev20250916+cu130': the table's peak is the catalog's per-GPU 2,500 TF)",
             tf32_tensor=1250, fp8=5000, matmul_efficiency=1822.0 / 2500, tdp_w=1200),
        _gpu("H100-PCIe", 80, 756.5, 51, 2000,
             f"{_H100_SHEET}, PCIe column: BF16 1,513, FP8 3,026, TF32 756 TF with sparsity (halved to "
             "756.5 / 1,513 / 378 TF dense), FP32 51 TF, 80 GB HBM2e, 2,000 GB/s; TDP 350 W (NVIDIA H100 "
             f"PCIe product brief PB-11133-001_v02: 'maximum thermal design power (TDP) level of 350 W'); {_HW} "
             f"has the same peaks and no measured matmul rate; {_NO_MAMF.format('H100 PCIe')}",
             tf32_tensor=378, fp8=1513, tdp_w=350),
        _gpu("H100-NVL", 94, 835.5, 60, 3900,
             "NVIDIA H100 datasheet (nvidia.com/en-us/data-center/h100/), NVL column: BF16 1,671, FP8 3,341, "
             "TF32 835 TF with sparsity (halved to 835.5 / 1,670.5 / 417.5 TF dense), FP32 60 TF, 94 GB HBM3, "
             "3.9 TB/s, TDP 350-400 W configurable (400 W: the peaks hold at the top of the range; 94 GB, 3.9 TB/s "
             f"also in thundercompute.com's H100 guide, 350-400 W in {_POWER_TABLE}); one entry is one GPU of the "
             f"NVLink-bridged pair; not in {_HW}; {_NO_MAMF.format('H100 NVL')}",
             tf32_tensor=417.5, fp8=1670.5, tdp_w=400),
        _gpu("H800", 80, 989, 67, 3350,
             "NVIDIA H800 SXM5: the H100 SXM's GH100 die with NVLink cut to 400 GB/s and FP64 to 1 TF, the "
             "same FP8/FP16/BF16/TF32/FP32 rates, 80 GB HBM3 and 3.35 TB/s (philisun.com 'NVIDIA H800 vs H100: "
             "a technical deep dive' spec table; aiwiki.ai/wiki/nvidia_h800); so the H100 SXM datasheet's "
             f"dense 989 TF bf16, 1,979 TF fp8, 494.5 TF TF32, 67 TF fp32 ({_HW}); TDP not found in the "
             f"retrieved sources: tdp_w 0; {_NO_MAMF.format('H800')}: its H100 SXM row is another SKU, not "
             "carried over while the H800's power limit is unknown", tf32_tensor=494.5, fp8=1979),
        _gpu("H20", 96, 148, 44, 4000,
             "NVIDIA HGX H20 specifications as reported (NVIDIA publishes no datasheet page; "
             "1cnz.cn/d/2353773.html, zangshuxian.com/new/674733024499207168, willitrunai.com/gpus/h20-96gb): "
             "dense FP16/BF16 148 TF, FP8 296 TF, TF32 74 TF, FP32 44 TF, FP64 1 TF, 96 GB HBM3, 4.0 TB/s, "
             f"NVLink 900 GB/s, 400 W TDP; {_NO_MAMF.format('H20')}", tf32_tensor=74, fp8=296, tdp_w=400),
        _gpu("L40S", 48, 362.05, 91.6, 864,
             "NVIDIA L40S datasheet (nvidia.com/en-us/data-center/l40s/; spec table as copied at "
             "mullet.se/product.html?product_id=355414): BF16 362.05 | 733*, FP8 733 | 1,466*, TF32 183 | 366* "
             "TF (dense | *with sparsity), FP32 91.6 TF, 48 GB GDDR6, 864 GB/s, 350 W max power, PCIe Gen4, no "
             f"NVLink; {_HW} has the same peaks and no measured matmul rate; {_NO_MAMF.format('L40S')}",
             tf32_tensor=183, fp8=733, tdp_w=350),
        _gpu("RTX-A6000", 48, 154.85, 38.7, 768,
             "NVIDIA RTX A6000 datasheet (nvidia.com/en-us/design-visualization/rtx-a6000/): 'Tensor "
             "performance 309.7 TFLOPS' (FP16 with sparsity; halved to 154.85 TF dense FP16/BF16 with FP32 "
             "accumulate, Microway's Ampere comparison lists 154.8 dense), FP32 38.7 TF, 48 GB GDDR6, 768 GB/s, "
             "300 W max power, NVLink bridge 112.5 GB/s (servethehome.com spec table); Ampere: no FP8; TF32 not "
             f"printed on the datasheet: 0; {_NO_MAMF.format('RTX A6000')}", tdp_w=300),
        _gpu("RTX-6000-Ada", 48, 364.25, 91.1, 960,
             "NVIDIA RTX 6000 Ada Generation datasheet (nvidia.com/en-us/design-visualization/rtx-6000/): "
             "FP32 91.1 TF, 48 GB GDDR6, 960 GB/s, 300 W max power (as tabulated by heise.de and "
             "grafikkarten.com from NVIDIA/PNY/Leadtek specs); 'Tensor performance 1,457 TFLOPS' is FP8 with "
             "sparsity: 728.5 TF FP8 dense, 364.25 TF FP16/BF16 (FP32 accumulate) dense, matching 568 tensor "
             "cores x 2,505 MHz boost x 256 FLOP/clock = 364.2 TF; TF32 not printed on the datasheet: 0; "
             f"{_NO_MAMF.format('RTX 6000 Ada')}", fp8=728.5, tdp_w=300),
        _gpu("MI250X", 64, 191.5, 23.95, 1600,
             "AMD Instinct MI250X specifications (amd.com/en/products/accelerators/instinct/mi200/mi250x.html; "
             "table as copied at zexron.com and yobitel.com/knowledge-base/amd-mi250), whole OAM module: "
             "FP16/BF16 matrix 383.0 TF, FP32 vector 47.9 TF (matrix 95.7), 128 GB HBM2e, 3.2 TB/s, 560 W "
             "board power; no FP8, no TF32. One entry is one GCD: the module carries two GCDs that ROCm shows "
             "as two devices, each driven by its own process (stas00/ml-engineering compute/accelerator: "
             "'MI250X has 2 GCDs ... a single matmul uses only 1 of them'), so every number is halved: "
             "191.5 / 23.95 TF, 64 GB, 1.6 TB/s, 280 W (half the module's 560 W peak board power; AMD also lists "
             f"a 500 W TDP, and the peak TBP is kept as for MI300X and MI325X, {_POWER_TABLE}); "
             f"{_NO_MAMF.format('MI250X')}: its per-GCD 147.0 TF was in the older 'v1' table, which did not reset "
             "the cache between runs ('in theory should have given higher scores', the README said) and was removed "
             "in commit e695968 without a new MI250X row", tdp_w=280),
        _gpu("MI300X", 192, 1307.4, 163.4, 5300,
             f"{_AMD_MI300}, MI300X (amd.com/en/products/accelerators/instinct/mi300/mi300x.html): FP16/BF16 "
             "matrix 1,307.4 TF, FP8 2,614.9 TF, TF32 653.7 TF (dense; AMD prints the sparse figures "
             "separately at 2x), FP32 vector 163.4 TF, 192 GB HBM3, 5.3 TB/s, 750 W; Infinity Fabric 896 GB/s "
             f"aggregate; measured bf16 matmul 668.4 TF ({_MAMF_TABLE}, row 'AMD MI300X | 668.4 | 1300 | 51.4% | "
             "10240x15360x8192 | 2.5.1+6.3.42131 | PYTORCH_TUNABLEOP_ENABLED=1': its 1300 is AMD's 1,307.4 TF "
             "rounded, and the efficiency is taken against 1,307.4)",
             tf32_tensor=653.7, fp8=2614.9, matmul_efficiency=668.4 / 1307.4, tdp_w=750),
        _gpu("MI325X", 256, 1307.4, 163.4, 6000,
             f"{_AMD_MI300}, MI325X (amd.com/en/products/accelerators/instinct/mi300/mi325x.html; "
             "awesomeagents.ai/hardware/amd-mi325x): the MI300X's CDNA3 compute, FP16/BF16 1,307.4 TF, FP8 "
             "2,614.9 TF, TF32 653.7 TF (dense), FP32 163.4 TF, with 256 GB HBM3E, 6 TB/s, 1,000 W; measured bf16 "
             f"matmul 784.9 TF ({_MAMF_TABLE}, row 'AMD MI325X | 784.9 | 1300 | 60.4% | 13312x10240x8192 | "
             "2.6.0+6.2.4 | PYTORCH_TUNABLEOP_ENABLED=1, 1000W': at the catalog's 1,000 W; its 1300 is AMD's "
             "1,307.4 TF rounded, and the efficiency is taken against 1,307.4)",
             tf32_tensor=653.7, fp8=2614.9, matmul_efficiency=784.9 / 1307.4, tdp_w=1000),
        _gpu("Gaudi2", 96, 432, 0, 2460,
             f"{_GAUDI_HC}, Gaudi 2 column: 432 TF peak BF16, 96 GB HBM2e, 2.46 TB/s, 600 W (OAM); FP8 865 TF "
             "(Intel Gaudi 2 AI accelerators white paper 839363, as tabulated by stas00/ml-engineering); Gaudi "
             "publishes no sparse rates; FP32 and TF32 rates not published: 0 (fp32 training refused); measured bf16 "
             f"matmul 418.7 TF ({_MAMF_TABLE}, row 'Intel Gaudi 2 | 418.7 | 432 | 96.9% | 14336x15360x2048 | "
             "2.6.0+hpu_1.21.2-76.gitabf798b | PT_HPU_LAZY_MODE=1': the table's peak is the catalog's 432 TF)",
             fp8=865, matmul_efficiency=418.7 / 432, tdp_w=600),
        _gpu("Gaudi3", 128, 1835, 0, 3670,
             f"{_GAUDI_HC}, Gaudi 3 spec table: BF16 matrix 1,835 TF, FP8 matrix 1,835 TF, BF16 vector 28.7 TF, "
             "128 GB HBM2e, 3.67 TB/s, 900 W air-cooled OAM (1,200 W liquid-cooled); TF32 (MME) 459 TF "
             "(Intel Gaudi 3 AI accelerator white paper 817486, via stas00/ml-engineering); plain (vector) FP32 "
             "not published: 0 (the MME's FP32 rate is 229 TF); ml-engineering notes shipping parts clock the "
             "MME at 1,600 MHz, not 1,750, i.e. 1,677 TF BF16 in practice; measured bf16 matmul 1243.0 TF "
             f"({_MAMF_TABLE}, row 'Intel Gaudi 3 | 1243.0 | 1677 | 74.1% | 16384x4096x768 | "
             "2.6.0+hpu_1.21.4-3.gitabf798b | PT_HPU_LAZY_MODE=1': its 74.1% is of the 1,677 TF of the 1,600 MHz "
             "clock, so against the catalog's 1,835 TF the efficiency is 1243.0 / 1835, which gives back the "
             "measured 1,243 TF)",
             tf32_tensor=459, fp8=1835, matmul_efficiency=1243.0 / 1835, tdp_w=900),
        # A CPU "device" for local runs with gloo (the runtime's tests). Throughput
        # is only used to rank plans for tiny test models; measured with
        # benchmarks/measure_cpu.py on this 2-core machine class (~50 GFLOP/s fp32).
        _gpu("CPU", 4, 0.05, 0.05, 10, "benchmarks/measure_cpu.py on the 2-core CI machine"),
    ]
}

_ALIASES = {
    "V100": "V100-16GB", "V100-16": "V100-16GB", "V100-32": "V100-32GB", "V100-SXM2-16GB": "V100-16GB",
    "P100-16GB": "P100", "T4-16GB": "T4",
    "A100-40": "A100-40GB", "A100-80": "A100-80GB", "A100-SXM4-40GB": "A100-40GB", "A100-SXM4-80GB": "A100-80GB",
    "H100-80GB": "H100", "H100-SXM": "H100", "H100-SXM5": "H100", "H200-141GB": "H200", "H200-SXM": "H200",
    "A10-24GB": "A10", "L4-24GB": "L4",
    "TITAN-RTX": "RTX-TITAN", "RTXTITAN": "RTX-TITAN", "TITAN": "RTX-TITAN",
    "3090": "RTX-3090", "4090": "RTX-4090",
    "B200-180GB": "B200", "B200-SXM": "B200", "B200-SXM-180GB": "B200",
    "GB200-186GB": "GB200", "GB200-NVL72": "GB200",
    "H100-PCIe-80GB": "H100-PCIe", "H100-NVL-94GB": "H100-NVL", "H100NVL": "H100-NVL",
    "H800-80GB": "H800", "H800-SXM": "H800", "H800-SXM5": "H800", "H20-96GB": "H20",
    "L40S-48GB": "L40S", "A6000": "RTX-A6000", "RTXA6000": "RTX-A6000",
    "RTX-6000-Ada-Generation": "RTX-6000-Ada", "RTX6000-Ada": "RTX-6000-Ada", "6000-Ada": "RTX-6000-Ada",
    "MI250X-GCD": "MI250X", "MI300X-192GB": "MI300X", "MI325X-256GB": "MI325X",
    "Gaudi-2": "Gaudi2", "Gaudi2-96GB": "Gaudi2", "HL-225H": "Gaudi2",
    "Gaudi-3": "Gaudi3", "Gaudi3-128GB": "Gaudi3", "HL-325L": "Gaudi3",
}

# Names that mean more than one catalog GPU: looking one up is an error that
# names the choices, never a silent pick (plain "A100" once meant the 40 GB part).
_AMBIGUOUS = {
    "A100": ("A100-40GB", "A100-80GB"),
}


def normalise_gpu_name(name: str) -> str:
    """The form names are compared in: case, spaces and underscores do not matter."""
    return name.strip().upper().replace(" ", "-").replace("_", "-")


def find_catalog_gpu(name: str) -> GPUSpec | None:
    """The catalog entry a name or alias means, or None. A name that means
    several entries (``A100``) raises HetplanError naming them."""
    key = normalise_gpu_name(name)
    for canonical in GPU_CATALOG:
        if normalise_gpu_name(canonical) == key:
            return GPU_CATALOG[canonical]
    for ambiguous, choices in _AMBIGUOUS.items():
        if normalise_gpu_name(ambiguous) == key:
            raise HetplanError(f"GPU type {name.strip()!r} is ambiguous: the catalog has "
                               f"{' and '.join(choices)} (different memory and bandwidth); pick one: "
                               f"{' or '.join(choices)}")
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
        raise HetplanError(f"unknown GPU type {name!r}{did_you_mean(name, known)}; known types: {', '.join(known)}")
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
    scaled: dict[str, Any] = {attr: in_si(in_units(getattr(spec, attr), TERA) * factor, TERA) for attr in _COMPUTE_PEAKS}
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
