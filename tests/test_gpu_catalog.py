"""The GPU catalog against vendor datasheets (``tests/data/gpu_datasheets.json``),
its invariants, the refused bare ``A100``, and clusters and plans on the GPUs
added with the datasheet file."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from hetplan.cli import main
from hetplan.cluster.catalog import GPU_CATALOG, get_gpu
from hetplan.cluster.presets import get_cluster
from hetplan.cluster.catalog import TERA, find_catalog_gpu
from hetplan.cluster.io import gpu_types_from_dict
from hetplan.errors import HetplanError
from hetplan.units import GIB

DATASHEETS = Path(__file__).parent / "data" / "gpu_datasheets.json"
SHEETS: dict[str, dict[str, Any]] = {k: v for k, v in json.loads(DATASHEETS.read_text()).items()
                                     if not k.startswith("_")}

# The GPUs the datasheet file was written for: every one must be in both.
NEW_GPUS = ["B200", "GB200", "H100-PCIe", "H100-NVL", "H800", "H20", "L40S", "RTX-A6000", "RTX-6000-Ada",
            "MI250X", "MI300X", "MI325X", "Gaudi2", "Gaudi3"]

# datasheet key -> (catalog attribute, scale from the datasheet's unit to the catalog's SI unit)
FIELDS = {
    "peak_tflops": ("peak_flops", TERA),
    "peak_tflops_fp8": ("peak_flops_fp8", TERA),
    "peak_tflops_tf32": ("peak_flops_tf32", TERA),
    "peak_tflops_fp32": ("peak_flops_fp32", TERA),
    "memory_gb": ("memory_bytes", GIB),  # a "16 GB" card holds 16 GiB (catalog convention)
    "memory_bandwidth_gbps": ("memory_bandwidth_bytes_per_s", 1e9),
    "tdp_w": ("tdp_w", 1.0),
}
# How a catalog source names a field it has no number for.
LABELS = {"peak_tflops_fp8": "FP8", "peak_tflops_tf32": "TF32", "peak_tflops_fp32": "FP32", "tdp_w": "TDP"}


def dense_value(printed: Any, divisor: float) -> float:
    """The catalog's number for a datasheet entry: sparse figures halved, a
    16-bit rate given only as its FP8 figure halved again (FP8 dense = 2x
    16-bit dense), then divided among the devices of a package."""
    if isinstance(printed, dict):
        value = float(printed["printed"])
        if printed.get("sparse"):
            value /= 2
        if printed.get("from_fp8"):
            value /= 2
    else:
        value = float(printed)
    return value / divisor


def test_datasheet_file_covers_exactly_the_new_gpus() -> None:
    assert sorted(SHEETS) == sorted(NEW_GPUS)
    for name, sheet in SHEETS.items():
        assert sheet["source"].strip(), name
        given, missing = set(sheet["values"]), set(sheet.get("not_given", []))
        assert not given & missing, name
        assert given | missing == set(FIELDS), f"{name}: every catalog number is either given or not_given"
        assert {"peak_tflops", "memory_gb", "memory_bandwidth_gbps"} <= given, name
        for value in sheet["values"].values():
            assert not isinstance(value, dict) or set(value) <= {"printed", "sparse", "from_fp8"}, name


@pytest.mark.parametrize("name", NEW_GPUS)
def test_new_gpu_matches_its_datasheet(name: str) -> None:
    gpu = GPU_CATALOG[name]
    sheet = SHEETS[name]
    divisor = float(sheet.get("per_device_divisor", 1))
    for key, printed in sheet["values"].items():
        attr, scale = FIELDS[key]
        expected = dense_value(printed, divisor) * scale
        if attr == "memory_bytes":
            assert gpu.memory_bytes == int(expected), f"{name}.{key}"
        else:
            assert getattr(gpu, attr) == pytest.approx(expected, rel=1e-9), f"{name}.{key}: datasheet {printed}"
    for key in sheet.get("not_given", []):
        attr, _ = FIELDS[key]
        assert getattr(gpu, attr) == 0, f"{name}.{key} has no source: it stays 0"
        label = LABELS[key]
        # the entry's source says that the number is missing (or that the hardware lacks it)
        assert re.search(rf"\b(no|not)\b[^;]*\b{label}\b|\b{label}\b[^;]*\bnot\b", gpu.source), \
            f"{name}: source does not say why {key} is 0"


@pytest.mark.parametrize("name", NEW_GPUS)
def test_new_gpu_is_a_dense_16_bit_rate(name: str) -> None:
    """A sparse figure taken as dense would double the peak: FP8 is at most
    twice the 16-bit rate, TF32 at most half of it, and fp32 below it (5%
    slack: vendors round each column on its own, e.g. the L40S's 733 FP8 TF
    beside 362.05 BF16 TF)."""
    gpu = GPU_CATALOG[name]
    assert gpu.peak_flops_fp8 <= 2 * gpu.peak_flops * 1.05
    assert gpu.peak_flops_tf32 <= gpu.peak_flops / 2 * 1.05
    assert gpu.peak_flops_fp32 < gpu.peak_flops
    assert gpu.catalog_name == name


# Where the measured matmul rates come from (each record in the datasheet file quotes its row).
MAMF_TABLE = "stas00/ml-engineering compute/accelerator/README.md"
MAMF_KEYS = {"tflops", "table_theory_tflops", "table_efficiency_pct", "row", "source", "theory_differs"}


def test_mamf_records_quote_their_table_rows() -> None:
    """Every new GPU has a MAMF record: a measured rate with the table row it
    was read from (MAMF, Theory and Efficiency cells as printed, Efficiency =
    MAMF / Theory as the table defines it), or no rate and why not."""
    for name in NEW_GPUS:
        record = SHEETS[name]["mamf_bf16"]
        if record["tflops"] is None:
            assert set(record) == {"tflops", "why"} and record["why"].strip(), name
            continue
        assert MAMF_KEYS - {"theory_differs"} <= set(record) <= MAMF_KEYS, name
        assert MAMF_TABLE in record["source"] and "Maximum Achievable Matmul FLOPS" in record["source"], name
        cells = [cell.strip() for cell in record["row"].strip().strip("|").split("|")]
        assert float(cells[1]) == record["tflops"], name
        assert float(cells[2]) == record["table_theory_tflops"], name
        assert cells[3] == f"{record['table_efficiency_pct']}%", name
        assert round(100 * record["tflops"] / record["table_theory_tflops"], 1) == record["table_efficiency_pct"], name


@pytest.mark.parametrize("name", NEW_GPUS)
def test_new_gpu_matmul_efficiency_is_measured_over_the_catalog_peak(name: str) -> None:
    """matmul_efficiency = measured MAMF / the catalog's dense bf16 peak (as
    for H100 and A100-80GB), so peak x efficiency is the measured rate even
    where the table's Theory column is another peak (Gaudi 3's 1,600 MHz
    clock); 0 where nothing is measured, and the source says so."""
    gpu = GPU_CATALOG[name]
    sheet = SHEETS[name]
    record = sheet["mamf_bf16"]
    if record["tflops"] is None:
        assert gpu.matmul_efficiency == 0
        assert "matmul_efficiency 0 (not measured" in gpu.source
        return
    peak = dense_value(sheet["values"]["peak_tflops"], float(sheet.get("per_device_divisor", 1)))
    assert gpu.matmul_efficiency == pytest.approx(record["tflops"] / peak, rel=1e-12)
    assert gpu.peak_flops * gpu.matmul_efficiency == pytest.approx(record["tflops"] * TERA, rel=1e-12)
    assert 0 < gpu.matmul_efficiency < 1
    # The table's peak is the catalog's (up to rounding: AMD's 1,307.4 TF printed as 1300), or the record says why not.
    same_peak = record["table_theory_tflops"] == pytest.approx(peak, rel=0.01)
    assert same_peak != ("theory_differs" in record), f"{name}: table Theory {record['table_theory_tflops']} vs {peak}"
    # The source cites the measured rate and the table row it was read from.
    assert f"measured bf16 matmul {record['tflops']} TF" in gpu.source
    assert MAMF_TABLE in gpu.source
    cells = [cell.strip() for cell in record["row"].strip().strip("|").split("|")]
    assert " | ".join(cells[:6]) in gpu.source, f"{name}: source does not quote the row"


@pytest.mark.parametrize("name", list(GPU_CATALOG))
def test_every_catalog_entry_is_complete(name: str) -> None:
    gpu = GPU_CATALOG[name]
    assert gpu.name == name
    assert gpu.peak_flops > 0 and gpu.memory_bytes > 0 and gpu.memory_bandwidth_bytes_per_s > 0
    assert gpu.source.strip()
    assert min(gpu.peak_flops_fp32, gpu.peak_flops_fp8, gpu.peak_flops_tf32, gpu.tdp_w) >= 0
    assert find_catalog_gpu(name) is gpu and get_gpu(name.lower()) is gpu


@pytest.mark.parametrize("alias, name", [
    ("h100 pcie", "H100-PCIe"), ("H100 NVL", "H100-NVL"), ("RTX A6000", "RTX-A6000"), ("A6000", "RTX-A6000"),
    ("RTX 6000 Ada", "RTX-6000-Ada"), ("Gaudi 3", "Gaudi3"), ("gaudi-2", "Gaudi2"), ("mi300x", "MI300X"),
    ("B200-SXM-180GB", "B200"), ("GB200 NVL72", "GB200"), ("H800-SXM5", "H800"), ("l40s", "L40S"),
    ("A100-40", "A100-40GB"), ("A100-SXM4-80GB", "A100-80GB"),
])
def test_aliases(alias: str, name: str) -> None:
    assert get_gpu(alias).name == name


@pytest.mark.parametrize("spelling", ["A100", "a100", " A100 "])
def test_bare_a100_is_refused_naming_both_parts(spelling: str) -> None:
    with pytest.raises(HetplanError) as info:
        get_gpu(spelling)
    message = str(info.value)
    assert "\n" not in message
    assert "A100-40GB" in message and "A100-80GB" in message and "pick one" in message


def test_bare_a100_is_refused_in_clusters_and_cluster_files() -> None:
    with pytest.raises(HetplanError, match=r"A100-40GB and A100-80GB.*pick one"):
        get_cluster("8xA100")
    with pytest.raises(HetplanError, match=r"A100-40GB and A100-80GB.*pick one"):
        gpu_types_from_dict({"X": {"base": "A100"}})
    with pytest.raises(HetplanError, match=r"A100-40GB and A100-80GB.*pick one"):
        gpu_types_from_dict({"A100": {"base": "A100-80GB"}})  # would shadow both parts
    assert get_cluster("8xA100-80GB").gpu_types == ("A100-80GB",)


@pytest.mark.parametrize("name", NEW_GPUS)
def test_homogeneous_clusters_of_new_gpus_load(name: str) -> None:
    cluster = get_cluster(f"8x{name}")
    assert cluster.num_devices == 8 and cluster.gpu_types == (name,)
    assert all(cluster.link_gbps(0, d.id) > 0 for d in cluster.devices[1:])


def test_plan_on_b200(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--model", "gpt3-1.3b", "--cluster", "8xB200", "--global-batch", "64", "--quiet"]) == 0
    assert "8xB200" in capsys.readouterr().out


def test_plan_on_mi300x(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--model", "gpt3-1.3b", "--cluster", "8xMI300X", "--global-batch", "64", "--quiet"]) == 0
    assert "8xMI300X" in capsys.readouterr().out
