"""Cluster presets, YAML files and the GPU catalog."""

from __future__ import annotations

import glob
import os

import pytest

from hetplan.cluster.catalog import GPU_CATALOG, get_gpu
from hetplan.cluster.presets import cluster_names, get_cluster
from hetplan.cluster.io import load_cluster
from hetplan.cluster.io import cluster_from_dict, dump_cluster_yaml, load_cluster_yaml
from hetplan.errors import HetplanError

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "examples", "clusters")
REQUIRED_GPUS = ["V100-16GB", "V100-32GB", "P100", "T4", "A100-40GB", "A100-80GB", "H100", "H200", "A10", "L4",
                 "RTX-TITAN", "RTX-3090", "RTX-4090"]


@pytest.mark.parametrize("name", REQUIRED_GPUS)
def test_catalog_has_cited_specs(name: str) -> None:
    gpu = get_gpu(name)
    assert gpu.memory_bytes >= 16 * 2**30 and gpu.peak_flops > gpu.peak_flops_fp32 > 0
    assert gpu.memory_bandwidth_bytes_per_s > 1e11 and "datasheet" in gpu.source.lower() or "whitepaper" in gpu.source


def test_catalog_measured_and_power_numbers() -> None:
    # shared/calibration/hardware_specs.json: best-shape bf16 matmuls reach 271.2 of 312 TF on an
    # A100-80GB and 794.5 of 989 on an H100 (MAMF); FP8 only from Hopper and Ada; board power (TDP)
    assert get_gpu("A100-80GB").matmul_efficiency == pytest.approx(0.8692, abs=1e-4)
    assert get_gpu("H100").matmul_efficiency == pytest.approx(0.8033, abs=1e-4)
    assert get_gpu("T4").matmul_efficiency == 0  # not measured: the cost model's default
    assert get_gpu("H100").peak_flops_fp8 == get_gpu("H200").peak_flops_fp8 == 1979e12
    assert get_gpu("L4").peak_flops_fp8 == 242.5e12 and get_gpu("RTX-4090").peak_flops_fp8 == 330.3e12
    assert all(get_gpu(g).peak_flops_fp8 == 0 for g in ("V100-16GB", "T4", "A100-80GB", "A10", "RTX-3090"))
    assert get_gpu("A100-80GB").peak_flops_tf32 == 156e12 and get_gpu("T4").peak_flops_tf32 == 0
    assert [get_gpu(g).tdp_w for g in ("V100-16GB", "T4", "A100-80GB", "H100", "L4", "RTX-4090")] == \
        [300, 70, 400, 700, 72, 450]
    for name in REQUIRED_GPUS:
        gpu = get_gpu(name)
        assert gpu.tdp_w > 0 and gpu.catalog_name == name and 0 <= gpu.matmul_efficiency < 1
        assert gpu.peak_flops_fp8 in (0, pytest.approx(2 * gpu.peak_flops, rel=0.01))


def test_gpu_aliases() -> None:
    assert get_gpu("a100-40").name == "A100-40GB" and get_gpu("a100-80").name == "A100-80GB"
    with pytest.raises(HetplanError, match="ambiguous.*A100-40GB and A100-80GB.*pick one"):
        get_gpu("a100")  # the 40 GB and 80 GB parts differ: no silent pick
    assert get_gpu("titan rtx").name == "RTX-TITAN"
    with pytest.raises(HetplanError, match="unknown GPU type 'B300'"):
        get_gpu("B300")


@pytest.mark.parametrize("name", cluster_names() + ["64xA100-80GB", "16xH100", "local-cpu-4"])
def test_every_preset_loads(name: str) -> None:
    cluster = get_cluster(name)
    assert cluster.num_devices == len(cluster.devices) > 0
    assert all(cluster.link_gbps(0, d.id) > 0 for d in cluster.devices[1:])


def test_paper_clusters() -> None:
    amp = get_cluster("amp-heterogeneous")
    assert amp.num_devices == 16 and amp.gpu_types == ("V100-16GB", "T4")
    assert amp.link_gbps(0, 1) == 170 and amp.link_gbps(0, 4) == 10 and amp.link_gbps(12, 13) == 50
    assert amp.link_gbps(0, 12) == 10  # p3 <-> g4dn limited by the p3's 10 Gbps
    assert get_cluster("amp-homogeneous").is_homogeneous
    uneven = get_cluster("metis-uneven-a")
    assert [n.num_gpus for n in uneven.nodes] == [1, 1, 2] and len(uneven.gpu_types) == 2
    assert get_cluster("metis-t4-v100-16").summary() == "2x4 T4 + 2x4 V100-16GB (16 GPUs)"
    assert get_cluster("galvatron-64x-a100").num_nodes == 8


def test_generic_form_needs_full_nodes() -> None:
    with pytest.raises(HetplanError, match="multiple of 8"):
        get_cluster("12xA100-80GB")


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(EXAMPLES, "*.yaml"))))
def test_example_files_load(path: str) -> None:
    cluster = load_cluster(path)
    name = os.path.splitext(os.path.basename(path))[0]
    if name in cluster_names():  # a generated copy of a preset must equal it
        preset = get_cluster(name)
        assert [(n.gpu.name, n.num_gpus, n.intra_bandwidth_gbps) for n in cluster.nodes] == \
            [(n.gpu.name, n.num_gpus, n.intra_bandwidth_gbps) for n in preset.nodes]
        assert all(cluster.link_gbps(a.id, b.id) == preset.link_gbps(a.id, b.id)
                   for a in cluster.devices for b in cluster.devices)


def test_yaml_round_trip_with_matrix(tmp_path) -> None:
    data = {"name": "m", "nodes": [{"gpu": "T4", "gpus": 2, "intra_node_bandwidth_gbps": 50}],
            "bandwidth_matrix_gbps": [[0, 7], [7, 0]]}
    cluster = cluster_from_dict(data)
    assert cluster.link_gbps(0, 1) == 7
    path = tmp_path / "m.yaml"
    path.write_text(dump_cluster_yaml(cluster))
    assert load_cluster_yaml(path).link_gbps(1, 0) == 7


# two nodes in zones a and b (no inter-zone link: a test adds one)
ZONED = ("inter_node_bandwidth_gbps: 48\nnodes:\n  - {gpu: T4, gpus: 1, intra_node_bandwidth_gbps: 5, zone: a}\n"
         "  - {gpu: T4, gpus: 1, intra_node_bandwidth_gbps: 5, zone: b}\n")


@pytest.mark.parametrize("text, message", [
    ("nodes: [", r"not valid YAML: .*\(line 2\)"),
    ("- 1\n- 2", "expected a mapping"),
    ("nodes: []", "non-empty list"),
    ("nodes:\n  - gpu: T4\n    gpus: 4", "missing 'intra_node_bandwidth_gbps'"),
    ("nodes:\n  - gpu: X9\n    gpus: 4\n    intra_node_bandwidth_gbps: 10", "unknown GPU type 'X9'"),
    ("nodes:\n  - gpu: T4\n    gpus: 4\n    intra_node_bandwidth_gbps: -5", "must be positive"),
    ("nodes:\n  - gpu: T4\n    gpus: 4\n    intra_node_bandwidth_gbps: 5\n    colour: red", "unknown key"),
    ("inter_node_bandwidth_gbps: 0\nnodes:\n  - {gpu: T4, gpus: 1, intra_node_bandwidth_gbps: 5, count: 2}",
     "must be positive"),
    ("nodes:\n  - {gpu: T4, gpus: 1, intra_node_bandwidth_gbps: 5, count: 2}", "no 'inter_node_bandwidth_gbps'"),
    ("nodes:\n  - {gpu: T4, gpus: 2.5, intra_node_bandwidth_gbps: 5}", "whole numbers"),
    ("nodes:\n  - {gpu: T4, gpus: .nan, intra_node_bandwidth_gbps: 5}", "gpus must be a finite number"),
    ("inter_node_bandwidth_gbps: .inf\nnodes:\n  - {gpu: T4, gpus: 1, intra_node_bandwidth_gbps: 5, count: 2}",
     "inter_node_bandwidth_gbps must be a finite number, got inf"),
    ("nodes:\n  - {gpu: T4, gpus: 1, intra_node_bandwidth_gbps: 5, memory_gb: .nan}", "memory_gb must be a finite"),
    ("nodes:\n  - {gpu: T4, gpus: 2, intra_node_bandwidth_gbps: 5}\nbandwidth_matrix_gbps: [[0, 1]]", "2x2"),
    (f"{ZONED.replace('zone: b', 'zone: [b]')}inter_zone_bandwidth_gbps: 8.7", r"nodes\[1\]\.zone must be text, got list"),
    (ZONED, "nodes in 2 zones but no inter_zone_bandwidth_gbps; give the bandwidth between zones in Gbit/s"),
    (f"{ZONED}inter_zone_bandwidth_gbps: 0", "inter_zone_bandwidth_gbps must be positive, got 0"),
    (f"{ZONED.replace('zone: b', 'zone: ' + chr(39) * 2)}inter_zone_bandwidth_gbps: 8.7",
     r"nodes\[1\]\.zone must be one line"),
    (f"{ZONED.replace('zone: a', 'name: x')}inter_zone_bandwidth_gbps: 8.7",
     "node 'x' has no zone but others do; give every node a 'zone' or none"),
    ("inter_zone_bandwidth_gbps: 8.7\nnodes:\n  - {gpu: T4, gpus: 1, intra_node_bandwidth_gbps: 5}",
     "inter_zone_bandwidth_gbps is given but no node has a zone; give the nodes their 'zone' or drop it"),
])
def test_bad_yaml_gives_one_clear_line(tmp_path, text: str, message: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(HetplanError, match=message) as info:
        load_cluster_yaml(path)
    assert "\n" not in str(info.value)


def test_catalog_is_complete() -> None:
    assert set(REQUIRED_GPUS) <= set(GPU_CATALOG)
