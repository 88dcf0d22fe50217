"""Cluster files that describe GPUs: ``gpu_types``, ``base``, per-node
``overrides``, power caps, validation, round trips, and the CLI on them."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from hetplan.cluster.catalog import get_gpu
from hetplan.cluster.io import load_cluster
from hetplan.cluster.catalog import POWER_CAP_CLOCK_EXPONENT, GPUSpec, power_cap_factor, power_capped
from hetplan.cluster.io import cluster_from_dict, cluster_to_dict, dump_cluster_yaml, load_cluster_yaml
from hetplan.cluster.spec import ClusterSpec, NodeSpec
from hetplan.errors import HetplanError
from hetplan.units import GIB

HETPLAN = [sys.executable, "-m", "hetplan.cli"]

MIXED = """\
name: mixed-lab
inter_node_bandwidth_gbps: 400
gpu_types:
  H100-PCIe-capped:
    base: H100
    peak_tflops: 756
    peak_tflops_fp32: 51
    memory_bandwidth_gbps: 2000
    tdp_w: 350
    power_cap_w: 300
  Accel-X:
    peak_tflops: 600
    peak_tflops_fp32: 40
    memory_gb: 96
    memory_bandwidth_gbps: 3000
    matmul_efficiency: 0.75
    peak_tflops_fp8: 1200
  Accel-X-slow:
    base: Accel-X
    power_cap_w: 200
    tdp_w: 400
nodes:
  - {gpu: H100-PCIe-capped, gpus: 8, intra_node_bandwidth_gbps: 2400}
  - {gpu: H100, gpus: 8, count: 2, intra_node_bandwidth_gbps: 3600, overrides: {memory_bandwidth_gbps: 2000}}
  - {gpu: h100, gpus: 4, intra_node_bandwidth_gbps: 3600}
  - {gpu: accel x, gpus: 4, intra_node_bandwidth_gbps: 1600}
  - {gpu: Accel-X-slow, gpus: 4, intra_node_bandwidth_gbps: 1600, memory_gb: 64}
"""


def _write(tmp_path: Path, text: str, name: str = "c.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def _gpu_of(cluster: ClusterSpec, node: int) -> GPUSpec:
    return cluster.devices[cluster.node_devices(node)[0]].gpu


@pytest.fixture()
def mixed(tmp_path: Path) -> ClusterSpec:
    return load_cluster_yaml(_write(tmp_path, MIXED))


def test_custom_gpu_without_base_has_the_files_numbers(mixed: ClusterSpec) -> None:
    device = mixed.devices[mixed.node_devices(4)[0]]
    gpu = device.gpu
    assert gpu.name == "Accel-X"  # looked up ignoring case and spaces ("accel x")
    assert gpu.peak_flops == 600e12 and gpu.peak_flops_fp32 == 40e12 and gpu.peak_flops_fp8 == 1200e12
    assert gpu.memory_bytes == 96 * GIB and device.memory_bytes == 96 * GIB
    assert gpu.memory_bandwidth_bytes_per_s == 3000e9  # GB/s, not Gbit/s
    assert gpu.matmul_efficiency == 0.75 and gpu.peak_flops_tf32 == 0 and gpu.tdp_w == 0
    assert gpu.peak_flops_for(2) == 600e12 and gpu.peak_flops_for(4) == 40e12


def test_base_keeps_what_is_not_given_and_scales_the_other_peaks(mixed: ClusterSpec) -> None:
    h100 = get_gpu("H100")
    capped = _gpu_of(mixed, 0)
    factor = (300 / 350) ** (1 / 3)
    assert capped.memory_bytes == h100.memory_bytes and capped.matmul_efficiency == h100.matmul_efficiency
    assert capped.memory_bandwidth_bytes_per_s == 2000e9  # the cap leaves memory bandwidth alone
    assert capped.peak_flops == pytest.approx(756e12 * factor, rel=1e-12)
    assert capped.peak_flops_fp32 == pytest.approx(51e12 * factor, rel=1e-12)
    # not given: the base's tensor peaks scale with the new 16-bit peak (same chip, fewer SMs/clock)
    assert capped.peak_flops_fp8 == pytest.approx(1979e12 * 756 / 989 * factor, rel=1e-12)
    assert capped.peak_flops_tf32 == pytest.approx(494.5e12 * 756 / 989 * factor, rel=1e-12)
    assert capped.tdp_w == 300  # the peaks now hold at the cap
    assert "power-capped at 300 W of 350 W" in capped.source


def test_per_node_overrides_change_only_that_node(mixed: ClusterSpec) -> None:
    tuned, twin, plain = _gpu_of(mixed, 1), _gpu_of(mixed, 2), _gpu_of(mixed, 3)
    assert plain == get_gpu("H100")
    assert tuned is not plain and tuned.name == "H100[memory_bandwidth_gbps=2000]"
    assert tuned.memory_bandwidth_bytes_per_s == 2000e9
    assert dataclasses.replace(tuned, name="H100", source=plain.source, memory_bandwidth_bytes_per_s=3350e9,
                               derived_from="") == plain
    # per-GPU measurements (keyed by catalog name) still apply to the derived types
    assert tuned.catalog_name == _gpu_of(mixed, 0).catalog_name == plain.catalog_name == "H100"
    assert _gpu_of(mixed, 4).catalog_name == _gpu_of(mixed, 5).catalog_name == ""
    assert twin == tuned  # count: 2 -> two nodes of one GPU type
    assert mixed.gpu_types == ("H100-PCIe-capped", "H100[memory_bandwidth_gbps=2000]", "H100", "Accel-X",
                               "Accel-X-slow")


def test_power_cap_follows_the_cube_root_rule() -> None:
    h100 = get_gpu("H100")
    assert POWER_CAP_CLOCK_EXPONENT == pytest.approx(1 / 3)
    half = power_capped(h100, 350)
    assert half.peak_flops == pytest.approx(989e12 * 0.5 ** (1 / 3), rel=1e-12)  # 785 TF, not 494.5
    assert half.peak_flops_fp8 == pytest.approx(1979e12 * 0.5 ** (1 / 3), rel=1e-12)
    assert half.memory_bandwidth_bytes_per_s == h100.memory_bandwidth_bytes_per_s
    assert power_cap_factor(700, 700) == 1.0
    # capping twice is capping once at the lower power: (a/b)^k (b/c)^k = (a/c)^k
    twice = power_capped(power_capped(h100, 500), 350)
    assert twice.peak_flops == pytest.approx(half.peak_flops, rel=1e-12)


def test_power_cap_in_a_file_matches_the_rule(mixed: ClusterSpec) -> None:
    slow = _gpu_of(mixed, 5)
    assert slow.peak_flops == pytest.approx(600e12 * 0.5 ** (1 / 3), rel=1e-12)
    assert slow.peak_flops_fp8 == pytest.approx(1200e12 * 0.5 ** (1 / 3), rel=1e-12)
    assert slow.memory_bandwidth_bytes_per_s == 3000e9 and slow.matmul_efficiency == 0.75
    assert mixed.devices[mixed.node_devices(5)[0]].memory_bytes == 64 * GIB  # the node's own memory_gb


def test_round_trip_gives_an_equal_cluster(tmp_path: Path, mixed: ClusterSpec) -> None:
    text = dump_cluster_yaml(mixed)
    data = yaml.safe_load(text)
    # written in full: a base only records the lineage, every number is given (the cap already applied)
    types = data["gpu_types"]
    assert set(types) == {"H100-PCIe-capped", "H100[memory_bandwidth_gbps=2000]", "Accel-X", "Accel-X-slow"}
    assert types["H100-PCIe-capped"]["base"] == "H100" and "base" not in types["Accel-X-slow"]
    assert all("power_cap_w" not in entry for entry in types.values())
    assert len(types["H100-PCIe-capped"]) == 10 and types["H100-PCIe-capped"]["tdp_w"] == 300
    again = load_cluster_yaml(_write(tmp_path, text, "again.yaml"))
    assert again == mixed and hash(again) == hash(mixed)
    assert [d.gpu for d in again.devices] == [d.gpu for d in mixed.devices]
    assert dump_cluster_yaml(again) == text


def test_round_trip_of_catalog_clusters_is_unchanged() -> None:
    cluster = load_cluster("amp-heterogeneous")
    assert "gpu_types" not in cluster_to_dict(cluster)
    assert cluster_from_dict(yaml.safe_load(dump_cluster_yaml(cluster))) == cluster


def test_capped_and_uncapped_clusters_differ(tmp_path: Path) -> None:
    base = ("gpu_types:\n  H100-x:\n    base: H100\n{cap}"
            "nodes:\n  - {{gpu: H100-x, gpus: 8, intra_node_bandwidth_gbps: 3600}}\n")
    plain = load_cluster_yaml(_write(tmp_path, base.format(cap=""), "a.yaml"))
    capped = load_cluster_yaml(_write(tmp_path, base.format(cap="    power_cap_w: 500\n"), "a2.yaml"))
    renamed = dataclasses.replace(capped, name=plain.name, description=plain.description)
    assert renamed != plain and hash(renamed) != hash(plain)
    assert capped.devices[0].gpu.peak_flops < plain.devices[0].gpu.peak_flops


def test_node_spec_takes_a_gpu_spec_and_survives_replace() -> None:
    gpu = power_capped(get_gpu("A100-80GB"), 300, name="A100-300W")
    node = NodeSpec(gpu, 8, 2400.0, name="n0")
    assert node.gpu is gpu and node.gpu_type == "A100-300W"
    assert dataclasses.replace(node, num_gpus=4).gpu == gpu
    cluster = ClusterSpec("c", (node,), 200.0)
    assert cluster.devices[7].gpu == gpu
    assert NodeSpec("h100", 8, 3600.0).gpu == get_gpu("H100")


def test_one_name_means_one_gpu_in_a_cluster() -> None:
    a = NodeSpec(GPUSpec("X1", GIB, 1e14, 1e13, 1e12, "a"), 1, 100.0)
    b = NodeSpec(GPUSpec("X1", GIB, 2e14, 1e13, 1e12, "b"), 1, 100.0)
    with pytest.raises(HetplanError, match="two different GPU types are both named 'X1'"):
        ClusterSpec("c", (a, b), 100.0)


def test_a_catalog_name_on_other_numbers_is_not_written() -> None:
    fake = dataclasses.replace(get_gpu("T4"), peak_flops=1e14)
    cluster = ClusterSpec("c", (NodeSpec(fake, 1, 100.0),), 100.0)
    with pytest.raises(HetplanError, match="differs from the catalog's entry"):
        cluster_to_dict(cluster)


NODE = "nodes:\n  - {gpu: G, gpus: 2, intra_node_bandwidth_gbps: 100}\n"
NUMBERS = "    peak_tflops: 100\n    memory_gb: 16\n    memory_bandwidth_gbps: 900\n"


@pytest.mark.parametrize("text, message", [
    ("gpu_types:\n  G:\n" + NUMBERS + "    peak_tflops_fp32: .nan\n" + NODE,
     r"gpu_types\.G\.peak_tflops_fp32 must be a finite number, got nan"),
    ("gpu_types:\n  G:\n    peak_tflops: .inf\n    memory_gb: 16\n    memory_bandwidth_gbps: 900\n" + NODE,
     r"gpu_types\.G\.peak_tflops must be a finite number"),
    ("gpu_types:\n  G:\n    peak_tflops: 100\n    memory_gb: -16\n    memory_bandwidth_gbps: 900\n" + NODE,
     r"gpu_types\.G\.memory_gb must be positive, got -16"),
    ("gpu_types:\n  G:\n" + NUMBERS + "    tdp_w: -1\n" + NODE,
     r"gpu_types\.G\.tdp_w must be zero or positive, got -1"),
    ("gpu_types:\n  G:\n" + NUMBERS.replace("900", "0") + NODE, r"memory_bandwidth_gbps must be positive, got 0"),
    ("gpu_types:\n  G:\n" + NUMBERS + "    power_cap_w: fast\n" + NODE,
     r"gpu_types\.G\.power_cap_w must be a number, got 'fast'"),
    ("gpu_types:\n  G:\n" + NUMBERS + "    matmul_efficiency: 1.5\n" + NODE, r"matmul_efficiency .* at most 1"),
    ("gpu_types:\n  G:\n" + NUMBERS + "    clock_mhz: 1800\n" + NODE,
     r"gpu_types\.G: unknown key\(s\) \['clock_mhz'\]; allowed: \['base', 'matmul_efficiency', "
     r"'memory_bandwidth_gbps'"),
    ("gpu_types:\n  G:\n    peak_tflops: 100\n    memory_gb: 16\n" + NODE,
     r"gpu_types\.G: missing 'memory_bandwidth_gbps' \(needed without 'base'"),
    ("gpu_types:\n  G:\n    memory_gb: 16\n" + NODE, r"missing 'peak_tflops', 'memory_bandwidth_gbps'"),
    ("gpu_types:\n  G:\n" + NUMBERS + "    power_cap_w: 100\n" + NODE,
     r"gpu_types\.G: power_cap_w needs the GPU's tdp_w"),
    ("gpu_types:\n  G:\n" + NUMBERS + "    tdp_w: 300\n    power_cap_w: 400\n" + NODE,
     r"power_cap_w 400 W is above tdp_w 300 W"),
    ("gpu_types:\n  H100:\n" + NUMBERS + NODE, r"gpu_types\.H100 has the name of the catalog's H100: give it its own"),
    ("gpu_types:\n  a100-40:\n    base: A100-80GB\n" + NODE,
     r"gpu_types\.a100-40 has the name of the catalog's A100-40GB"),
    ("gpu_types:\n  a100:\n    base: A100-80GB\n" + NODE, r"GPU type 'a100' is ambiguous: .*A100-40GB and A100-80GB"),
    ("gpu_types:\n  G:\n    base: Z80\n" + NODE,
     r"gpu_types\.G\.base: unknown GPU type 'Z80'; known types: V100-16GB.*, G"),
    ("gpu_types:\n  G:\n    base: F\n  F:\n    base: G\n" + NODE, r"'base' goes round in a circle: G -> F -> G"),
    ("gpu_types:\n  G:\n" + NUMBERS + "  g:\n" + NUMBERS + NODE, r"gpu_types\.g: defined twice"),
    ("gpu_types: [G]\n" + NODE, r"gpu_types must be a mapping"),
    ("gpu_types:\n  G: 5\n" + NODE, r"gpu_types\.G must be a mapping of GPU numbers"),
    ("gpu_types:\n  G:\n" + NUMBERS + "nodes:\n  - {gpu: Q, gpus: 2, intra_node_bandwidth_gbps: 100}\n",
     r"nodes\[0\]\.gpu: unknown GPU type 'Q'; known types: V100-16GB, .*, CPU, G$"),
    ("nodes:\n  - {gpu: T4, gpus: 2, intra_node_bandwidth_gbps: 100, overrides: {memory_bandwidth_gbps: -1}}\n",
     r"nodes\[0\]\.overrides\.memory_bandwidth_gbps must be positive"),
    ("nodes:\n  - {gpu: T4, gpus: 2, intra_node_bandwidth_gbps: 100, overrides: {base: H100}}\n",
     r"nodes\[0\]\.overrides: unknown key\(s\) \['base'\]"),
    ("nodes:\n  - {gpu: T4, gpus: 2, intra_node_bandwidth_gbps: 100, memory_gb: 8, overrides: {memory_gb: 8}}\n",
     r"memory_gb given both on the node and in its overrides"),
    ("nodes:\n  - {gpu: T4, gpus: 2, intra_node_bandwidth_gbps: .nan}\n", r"must be a finite number, got nan"),
    ("name: 8xH100\ngpu_types:\n  H:\n    base: H100\n    power_cap_w: 400\n"
     "nodes:\n  - {gpu: H, gpus: 8, intra_node_bandwidth_gbps: 3600}\n", r"named '8xH100' like a preset"),
])
def test_bad_gpu_types_give_one_clear_line(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(HetplanError, match=message) as info:
        load_cluster_yaml(_write(tmp_path, text))
    assert "\n" not in str(info.value)


def test_zero_means_none_for_optional_numbers(tmp_path: Path) -> None:
    text = "gpu_types:\n  G:\n    base: H100\n    peak_tflops_fp8: 0\n    matmul_efficiency: 0\n" + NODE
    gpu = load_cluster_yaml(_write(tmp_path, text)).devices[0].gpu
    assert gpu.peak_flops_fp8 == 0 and gpu.matmul_efficiency == 0 and gpu.peak_flops_tf32 == 494.5e12
    again = cluster_from_dict(yaml.safe_load(dump_cluster_yaml(load_cluster_yaml(_write(tmp_path, text)))))
    assert again.devices[0].gpu == gpu  # the written base does not bring the H100's fp8 back


def test_fp32_training_needs_an_fp32_peak(tmp_path: Path) -> None:
    cluster = load_cluster_yaml(_write(tmp_path, "gpu_types:\n  G:\n" + NUMBERS + NODE))
    with pytest.raises(HetplanError, match="add peak_tflops_fp32 to its gpu_types entry"):
        cluster.devices[0].gpu.peak_flops_for(4)


# --- through the command line ------------------------------------------------------
def _hetplan(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*HETPLAN, *args], capture_output=True, text=True, timeout=120)


def _estimate_s(tmp_path: Path, cluster: Path) -> float:
    out = tmp_path / f"{cluster.stem}.json"
    result = _hetplan("estimate", "--model", "gpt3-1.3b", "--cluster", str(cluster), "--global-batch", "64",
                      "--tp", "1", "--pp", "1", "--dp", "8", "--micro-batch", "8", "--json", str(out))
    assert result.returncode == 0, result.stderr
    return float(json.loads(out.read_text())["plans"][0]["estimate"]["iteration_time_s"])


def test_cli_estimate_is_slower_on_a_capped_gpu(tmp_path: Path) -> None:
    text = ("name: {name}\ngpu_types:\n  H100-{name}:\n    base: H100\n{cap}"
            "nodes:\n  - {{gpu: H100-{name}, gpus: 8, intra_node_bandwidth_gbps: 3600}}\n")
    free = _write(tmp_path, text.format(name="free", cap=""), "free.yaml")
    capped = _write(tmp_path, text.format(name="capped", cap="    power_cap_w: 350\n"), "capped.yaml")
    t_free, t_capped = _estimate_s(tmp_path, free), _estimate_s(tmp_path, capped)
    # half the power: compute peaks x 0.5^(1/3) = 0.794. Matmuls are most of this step (8 samples a GPU: not
    # host-bound, hetplan's runtime dispatches them faster than the GPU runs them), so it gets
    # clearly slower, but never by more than 1/0.794 (memory-bound work and communication keep their speed)
    assert 1.03 < t_capped / t_free <= 1 / 0.5 ** (1 / 3) + 1e-9


def test_cli_bad_gpu_type_exits_2_with_one_line(tmp_path: Path) -> None:
    bad = _write(tmp_path, "gpu_types:\n  G:\n" + NUMBERS + "    peak_tflops_fp8: .nan\n" + NODE)
    result = _hetplan("estimate", "--cluster", str(bad), "--tp", "1", "--pp", "1", "--dp", "2",
                      "--micro-batch", "1", "--global-batch", "2")
    assert result.returncode == 2, (result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hetplan: error: ")
    assert "gpu_types.G.peak_tflops_fp8 must be a finite number, got nan" in lines[0]
    fp32 = _write(tmp_path, "gpu_types:\n  G:\n" + NUMBERS + NODE, "fp32.yaml")
    result = _hetplan("estimate", "--model", "bert-huge-32", "--cluster", str(fp32), "--tp", "1", "--pp", "1",
                      "--dp", "2", "--micro-batch", "1", "--global-batch", "2")
    assert result.returncode == 2 and result.stderr.startswith("hetplan: error: GPU type 'G' has no fp32 peak")
