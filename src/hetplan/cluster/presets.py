"""Built-in clusters: every cluster of the AMP, Galvatron-BMW and Metis papers,
generic homogeneous clusters (``64xA100-80GB``) and local CPU "clusters" for
running the runtime's tests with gloo (``local-cpu-4``).
"""

from __future__ import annotations

import re
from typing import Callable

from hetplan.cluster.catalog import get_gpu
from hetplan.cluster.spec import ClusterSpec, NodeSpec
from hetplan.errors import HetplanError, did_you_mean
from hetplan.limits import MAX_GPUS, MAX_LOCAL_PROCESSES, check_at_most

# Link speeds per direction, Gbit/s.
PCIE3_X16_GBPS = 126.0  # PCI-SIG PCIe 3.0: 8 GT/s x16 lanes, 128b/130b = 15.75 GB/s
PCIE4_X16_GBPS = 252.0  # PCI-SIG PCIe 4.0: 16 GT/s x16 = 31.5 GB/s
NVLINK2_V100_GBPS = 1200.0  # NVIDIA V100 datasheet: NVLink 300 GB/s bidirectional
NVLINK3_A100_GBPS = 2400.0  # NVIDIA A100 datasheet: NVLink 600 GB/s bidirectional
NVLINK4_H100_GBPS = 3600.0  # NVIDIA H100 datasheet: NVLink 900 GB/s bidirectional
IB_HDR_GBPS = 200.0  # InfiniBand HDR, one 200 Gb/s HCA per GPU (NVIDIA DGX A100 user guide)
IB_NDR_GBPS = 400.0  # InfiniBand NDR, one 400 Gb/s HCA per GPU (NVIDIA DGX H100 user guide)
PCIE5_X16_GBPS = 504.0  # PCI-SIG PCIe 5.0: 32 GT/s x16 = 63 GB/s (H100 PCIe / NVL datasheets: PCIe Gen5 x16)
NVLINK5_B200_GBPS = 7200.0  # NVIDIA HGX B200 / GB200 NVL72 specs: NVLink 5, 1.8 TB/s per GPU bidirectional
NVLINK_H800_GBPS = 1600.0  # NVIDIA H800 SXM5: NVLink 400 GB/s bidirectional (H100's cut for export)
# AMD Instinct MI300X/MI325X platform: 7 Infinity Fabric links of 128 GB/s
# bidirectional to the other 7 GPUs (AMD MI300X datasheet: 896 GB/s aggregate).
INFINITY_FABRIC_MI300_GBPS = 3584.0
# AMD Instinct MI250X datasheet: 8 Infinity Fabric links, 800 GB/s peak
# aggregate per OAM module of two GCDs: 400 GB/s per GCD (one device here).
INFINITY_FABRIC_MI250X_GCD_GBPS = 1600.0
# Intel Gaudi 2 / Gaudi 3 white papers: 24 on-chip RoCE ports of 100 / 200 GbE,
# 21 wired all-to-all inside the 8-card server, 3 for scale-out.
GAUDI2_INTRA_GBPS, GAUDI2_SCALE_OUT_GBPS = 21 * 100.0, 3 * 100.0
GAUDI3_INTRA_GBPS, GAUDI3_SCALE_OUT_GBPS = 21 * 200.0, 3 * 200.0

_INTRA_BY_GPU = {
    "V100-16GB": NVLINK2_V100_GBPS, "V100-32GB": NVLINK2_V100_GBPS,
    "A100-40GB": NVLINK3_A100_GBPS, "A100-80GB": NVLINK3_A100_GBPS,
    "H100": NVLINK4_H100_GBPS, "H200": NVLINK4_H100_GBPS,
    "A10": PCIE4_X16_GBPS, "L4": PCIE4_X16_GBPS, "RTX-3090": PCIE4_X16_GBPS, "RTX-4090": PCIE4_X16_GBPS,
    "T4": PCIE3_X16_GBPS, "P100": PCIE3_X16_GBPS, "RTX-TITAN": PCIE3_X16_GBPS,
    "B200": NVLINK5_B200_GBPS, "GB200": NVLINK5_B200_GBPS, "H800": NVLINK_H800_GBPS,
    "H20": NVLINK4_H100_GBPS,  # NVIDIA H20: NVLink 900 GB/s, as the H100
    "H100-PCIe": PCIE5_X16_GBPS, "H100-NVL": PCIE5_X16_GBPS,  # NVLink bridges join pairs only
    "L40S": PCIE4_X16_GBPS, "RTX-A6000": PCIE4_X16_GBPS, "RTX-6000-Ada": PCIE4_X16_GBPS,
    "MI250X": INFINITY_FABRIC_MI250X_GCD_GBPS, "MI300X": INFINITY_FABRIC_MI300_GBPS, "MI325X": INFINITY_FABRIC_MI300_GBPS,
    "Gaudi2": GAUDI2_INTRA_GBPS, "Gaudi3": GAUDI3_INTRA_GBPS,
}
# One NIC per GPU (DGX B200 user guide: 8 ConnectX-7 400 Gb/s; Gaudi: its own scale-out ports).
_NIC_PER_GPU_BY_GPU = {"A100-40GB": IB_HDR_GBPS, "A100-80GB": IB_HDR_GBPS, "H100": IB_NDR_GBPS, "H200": IB_NDR_GBPS,
                       "B200": IB_NDR_GBPS, "GB200": IB_NDR_GBPS,
                       "Gaudi2": GAUDI2_SCALE_OUT_GBPS, "Gaudi3": GAUDI3_SCALE_OUT_GBPS}
DEFAULT_INTER_GBPS = 100.0  # a 100 Gb/s InfiniBand EDR / Ethernet NIC per node

_Factory = Callable[[], ClusterSpec]
_PRESETS: dict[str, tuple[_Factory, str]] = {}


def _register(name: str, description: str, factory: _Factory) -> None:
    _PRESETS[name] = (factory, description)


def _nodes(gpu: str, count: int, per_node: int, intra_gbps: float, prefix: str) -> list[NodeSpec]:
    return [NodeSpec(gpu, per_node, intra_gbps, name=f"{prefix}{i}") for i in range(count)]


# --- AMP (§4.1) -----------------------------------------------------------
# g4dn.12xlarge: 4 T4, 50 Gbps PCIe inside and 50 Gbps between instances;
# p3.8xlarge: 4 V100-16GB, ~170 Gbps NVLink inside, 10 Gbps between instances.
AMP_G4DN_GBPS = 50.0
AMP_P3_NVLINK_GBPS = 170.0
AMP_P3_INTER_GBPS = 10.0


def _amp_homogeneous() -> ClusterSpec:
    return ClusterSpec(
        "amp-homogeneous", tuple(_nodes("T4", 4, 4, AMP_G4DN_GBPS, "g4dn-")), AMP_G4DN_GBPS,
        description="AMP §4.1: 4x g4dn.12xlarge (4 T4 each), 50 Gbps inside and between nodes",
    )


def _amp_heterogeneous() -> ClusterSpec:
    p3 = [NodeSpec("V100-16GB", 4, AMP_P3_NVLINK_GBPS, AMP_P3_INTER_GBPS, name=f"p3-{i}") for i in range(3)]
    g4 = [NodeSpec("T4", 4, AMP_G4DN_GBPS, AMP_G4DN_GBPS, name="g4dn-0")]
    return ClusterSpec(
        "amp-heterogeneous", tuple(p3 + g4), AMP_P3_INTER_GBPS,
        description="AMP §4.1: 3x p3.8xlarge (4 V100, ~170 Gbps NVLink, 10 Gbps network) "
        "+ 1x g4dn.12xlarge (4 T4, 50 Gbps)",
    )


def _amp_hetero_model() -> ClusterSpec:
    p3 = [NodeSpec("V100-16GB", 4, AMP_P3_NVLINK_GBPS, AMP_P3_INTER_GBPS, name=f"p3-{i}") for i in range(4)]
    return ClusterSpec(
        "amp-hetero-model", tuple(p3), AMP_P3_INTER_GBPS,
        description="AMP §4.1 heterogeneous-model setting: 4x p3.8xlarge (4 V100 each)",
    )


_register("amp-homogeneous", "AMP: 4x g4dn.12xlarge, 16 T4, 50 Gbps", _amp_homogeneous)
_register("amp-heterogeneous", "AMP: 3x p3.8xlarge (V100) + 1x g4dn.12xlarge (T4), 10 Gbps", _amp_heterogeneous)
_register("amp-hetero-model", "AMP: 4x p3.8xlarge, 16 V100", _amp_hetero_model)

# --- Galvatron-BMW (§VII-A, §VII-E) ----------------------------------------
GALVATRON_IB_GBPS = 100.0  # "100 Gb InfiniBand network" (Galvatron-BMW §VII-E)


def _galvatron(name: str, gpu: str, num_nodes: int, description: str) -> _Factory:
    return lambda: ClusterSpec(
        name, tuple(_nodes(gpu, num_nodes, 8, _INTRA_BY_GPU[get_gpu(gpu).name], "node-")),
        GALVATRON_IB_GBPS, description=description,
    )


_register("galvatron-8x-titan", "Galvatron: 8 RTX TITAN 24GB on PCIe 3.0",
          _galvatron("galvatron-8x-titan", "RTX-TITAN", 1, "Galvatron-BMW §VII-A: 8 RTX TITAN, PCIe 3.0"))
_register("galvatron-16x-titan", "Galvatron: 2x8 RTX TITAN, 100 Gb InfiniBand",
          _galvatron("galvatron-16x-titan", "RTX-TITAN", 2, "Galvatron-BMW §VII-E low-performance cluster"))
_register("galvatron-16x-a100", "Galvatron: 2x8 A100 NVLink, 100 Gb InfiniBand",
          _galvatron("galvatron-16x-a100", "A100-40GB", 2, "Galvatron-BMW §VII-E high-performance cluster"))
_register("galvatron-64x-a100", "Galvatron: 8x8 A100 NVLink, 100 Gb InfiniBand",
          _galvatron("galvatron-64x-a100", "A100-40GB", 8, "Galvatron-BMW §VII-E industrial cluster"))

# --- Metis (§5, Table 3, Fig. 5) -------------------------------------------
# GCP n1 machines, "the interconnect network bandwidth between nodes is 16 Gbps";
# GPUs attach over PCIe 3.0 (the paper names no NVLink).
METIS_INTER_GBPS = 16.0
_METIS_TYPES = {"p100": "P100", "t4": "T4", "v100": "V100-16GB"}
_METIS_SHAPES = {4: (1, 2), 8: (1, 4), 16: (2, 4), 32: (4, 4)}  # Table 3: nodes x GPUs per type


def _metis_mix(types: tuple[str, str], total: int) -> _Factory:
    num_nodes, per_node = _METIS_SHAPES[total]
    name = f"metis-{types[0]}-{types[1]}-{total}"

    def build() -> ClusterSpec:
        nodes: list[NodeSpec] = []
        for t in types:
            nodes += _nodes(_METIS_TYPES[t], num_nodes, per_node, PCIE3_X16_GBPS, f"{t}-")
        return ClusterSpec(name, tuple(nodes), METIS_INTER_GBPS,
                           description=f"Metis Table 3: {num_nodes}x{per_node} {types[0]} + "
                           f"{num_nodes}x{per_node} {types[1]}, 16 Gbps between nodes")

    return build


for _pair in (("p100", "t4"), ("t4", "v100"), ("p100", "v100")):
    for _total in _METIS_SHAPES:
        _register(f"metis-{_pair[0]}-{_pair[1]}-{_total}",
                  f"Metis Table 3: {_pair[0].upper()} + {_pair[1].upper()}, {_total} GPUs", _metis_mix(_pair, _total))


def _metis_uneven(name: str, shape: list[tuple[str, int]], description: str) -> _Factory:
    def build() -> ClusterSpec:
        nodes = [NodeSpec(_METIS_TYPES[t], n, PCIE3_X16_GBPS, name=f"{t}-{i}") for i, (t, n) in enumerate(shape)]
        return ClusterSpec(name, tuple(nodes), METIS_INTER_GBPS, description=description)

    return build


_register("metis-uneven-a", "Metis Fig. 5(a): 1x1 V100 + 1x1 P100 + 1x2 P100 (weak GPUs dominant)",
          _metis_uneven("metis-uneven-a", [("v100", 1), ("p100", 1), ("p100", 2)], "Metis Fig. 5(a)"))
_register("metis-uneven-b", "Metis Fig. 5(b): 1x1 P100 + 1x1 V100 + 1x2 V100 (strong GPUs dominant)",
          _metis_uneven("metis-uneven-b", [("p100", 1), ("v100", 1), ("v100", 2)], "Metis Fig. 5(b)"))
_register("metis-uneven-c", "Metis Fig. 5(c): 1x1 V100 + 1x1 P100 + 1x2 P100 + 1x4 P100",
          _metis_uneven("metis-uneven-c", [("v100", 1), ("p100", 1), ("p100", 2), ("p100", 4)], "Metis Fig. 5(c)"))
_register("metis-uneven-d", "Metis Fig. 5(d): 1x1 P100 + 1x1 V100 + 1x2 V100 + 1x4 V100",
          _metis_uneven("metis-uneven-d", [("p100", 1), ("v100", 1), ("v100", 2), ("v100", 4)], "Metis Fig. 5(d)"))


# Three GPU types in nodes of 1 to 8 GPUs: what a shared cluster hands out when
# some GPUs of each node are taken (Metis §3, §5.2.2). Links as Metis's GCP
# setup: PCIe 3.0 inside a node, 16 Gbps between nodes.
METIS_MIXED_64_NODES: tuple[tuple[str, int], ...] = (
    ("V100-16GB", 8), ("V100-16GB", 4), ("V100-16GB", 2), ("V100-16GB", 1), ("V100-16GB", 1),
    ("T4", 8), ("T4", 8), ("T4", 4), ("T4", 2), ("T4", 2),
    ("P100", 8), ("P100", 8), ("P100", 4), ("P100", 2), ("P100", 1), ("P100", 1),
)


def _metis_mixed_64() -> ClusterSpec:
    nodes = []
    seen: dict[str, int] = {}
    for gpu, count in METIS_MIXED_64_NODES:
        index = seen.get(gpu, 0)
        seen[gpu] = index + 1
        nodes.append(NodeSpec(gpu, count, PCIE3_X16_GBPS, name=f"{gpu.split('-')[0].lower()}-{index}"))
    return ClusterSpec("metis-mixed-64", tuple(nodes), METIS_INTER_GBPS,
                       description="64 GPUs (16 V100, 24 T4, 24 P100) in 16 uneven nodes of 1-8 GPUs, "
                                   "PCIe inside nodes, 16 Gbps between (Metis §5 links)")


_register("metis-mixed-64", "64 GPUs of P100, T4 and V100 in uneven nodes of 1-8 GPUs (Metis-style)",
          _metis_mixed_64)


# --- generic forms ----------------------------------------------------------
_GENERIC = re.compile(r"^(\d+)x([A-Za-z0-9-]+)$")
_LOCAL_CPU = re.compile(r"^local-cpu-(\d+)$")
LOCAL_LOOPBACK_GBPS = 10.0  # gloo over loopback TCP; order of magnitude measured in the runtime tests


def homogeneous_cluster(num_gpus: int, gpu_type: str, gpus_per_node: int = 8) -> ClusterSpec:
    """``num_gpus`` GPUs of one type, 8 per node with the type's usual links:
    NVLink inside DGX-class nodes (else PCIe) and one InfiniBand HCA per GPU
    (else a 100 Gb/s NIC per node)."""
    gpu = get_gpu(gpu_type)
    if num_gpus <= 0:
        raise HetplanError(f"cluster size must be positive, got {num_gpus}")
    check_at_most("GPUs in the cluster", num_gpus, MAX_GPUS, "is the number right?")
    per_node = min(gpus_per_node, num_gpus)
    if num_gpus % per_node:
        raise HetplanError(f"{num_gpus} GPUs do not fill nodes of {per_node}; use a multiple of {per_node}")
    intra = _INTRA_BY_GPU.get(gpu.name, PCIE3_X16_GBPS)
    inter = _NIC_PER_GPU_BY_GPU.get(gpu.name, DEFAULT_INTER_GBPS / per_node) * per_node
    nodes = _nodes(gpu.name, num_gpus // per_node, per_node, intra, "node-")
    return ClusterSpec(f"{num_gpus}x{gpu.name}", tuple(nodes), inter,
                       description=f"{num_gpus} {gpu.name}, {per_node} per node")


def local_cpu_cluster(num_processes: int) -> ClusterSpec:
    """N CPU processes on this machine (gloo): for the runtime's tests."""
    if num_processes <= 0:
        raise HetplanError("local-cpu-N needs N >= 1")
    check_at_most("local-cpu-N processes", num_processes, MAX_LOCAL_PROCESSES,
                  "they all run on this machine: use fewer")
    node = NodeSpec("CPU", num_processes, LOCAL_LOOPBACK_GBPS, name="localhost")
    return ClusterSpec(f"local-cpu-{num_processes}", (node,), LOCAL_LOOPBACK_GBPS,
                       description=f"{num_processes} CPU processes on this machine (gloo)")


def _whole(digits: str, what: str, limit: int) -> int:
    """The count a name spells, refused past ``limit`` before it is even parsed
    (Python refuses to parse integers of more than 4,300 digits)."""
    if len(digits) > len(str(limit)):
        raise HetplanError(f"{what} = {digits[:12]}{'...' if len(digits) > 12 else ''} is above hetplan's "
                           f"limit of {limit:,}; is the number right?")
    return int(digits)


def cluster_names() -> list[str]:
    return sorted(_PRESETS)


def cluster_descriptions() -> dict[str, str]:
    descriptions = {name: desc for name, (_, desc) in sorted(_PRESETS.items())}
    descriptions["<N>x<GPU>"] = "homogeneous: e.g. 64xA100-80GB (8 per node, NVLink + InfiniBand)"
    descriptions["local-cpu-<N>"] = "N CPU processes on this machine (gloo), for runtime tests"
    return descriptions


def get_cluster(name: str) -> ClusterSpec:
    """A preset, the generic ``<N>x<GPU>`` form, or ``local-cpu-N``."""
    if name in _PRESETS:
        return _PRESETS[name][0]()
    if m := _LOCAL_CPU.match(name):
        return local_cpu_cluster(_whole(m.group(1), "local-cpu-N processes", MAX_LOCAL_PROCESSES))
    if m := _GENERIC.match(name):
        return homogeneous_cluster(_whole(m.group(1), "GPUs in the cluster", MAX_GPUS), m.group(2))
    raise HetplanError(
        f"unknown cluster preset {name!r}{did_you_mean(name, _PRESETS)}; run 'hetplan clusters' to list presets, "
        "use the form 64xA100-80GB, or pass a cluster .yaml path"
    )
