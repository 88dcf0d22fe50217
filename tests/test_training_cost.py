"""Time and money to train: --tokens and --price-per-gpu-hour."""

from __future__ import annotations

import argparse
import json

import pytest

from hetplan.io.argtypes import gpu_prices, token_count
from hetplan.cli import main
from hetplan.errors import HetplanError


def test_token_counts_and_prices_parse():
    assert token_count("300B") == 3e11 and token_count("1.5T") == 1.5e12 and token_count("2e6") == 2e6
    assert gpu_prices("2.5") == {"*": 2.5}
    assert gpu_prices("H100=4.9,A100-80GB=1.8") == {"H100": 4.9, "A100-80GB": 1.8}
    for bad in ("-3B", "lots", "0"):
        with pytest.raises(argparse.ArgumentTypeError):
            token_count(bad)
    with pytest.raises(argparse.ArgumentTypeError):
        gpu_prices("H100=cheap")


def _plan(tmp_path, *extra):
    path = tmp_path / "p.json"
    code = main(["estimate", "--model", "gpt3-1.3b", "--cluster", "metis-t4-v100-16", "--global-batch", "64",
                 "--tp", "1", "--pp", "2", "--dp", "8", "--micro-batch", "1", "--json", str(path), *extra])
    return code, path


def test_days_gpu_hours_and_cost_follow_from_the_step_time(tmp_path, capsys):
    code, path = _plan(tmp_path, "--tokens", "10B", "--price-per-gpu-hour", "T4=0.5,V100-16GB=2")
    assert code == 0
    out = capsys.readouterr().out
    entry = json.loads(path.read_text())["plans"][0]
    t, n = entry["estimate"]["iteration_time_s"], entry["training"]
    from hetplan.model.presets import get_model

    tokens_per_step = 64 * get_model("gpt3-1.3b").seq_len
    assert n["tokens_per_step"] == tokens_per_step
    assert n["steps"] == pytest.approx(1e10 / tokens_per_step)
    assert n["days"] == pytest.approx(n["steps"] * t / 86400)
    assert n["gpu_hours"] == pytest.approx(16 * n["steps"] * t / 3600)
    assert n["usd_per_hour"] == pytest.approx(8 * 0.5 + 8 * 2.0)  # 8 T4 + 8 V100
    assert n["usd"] == pytest.approx(n["usd_per_hour"] * n["steps"] * t / 3600)
    assert "GPU-hours per billion tokens" in out and "10B tokens:" in out and "per billion tokens (prices from --price-per-gpu-hour)." in out


def test_a_gpu_without_a_price_is_an_error(tmp_path, capsys):
    code, _ = _plan(tmp_path, "--price-per-gpu-hour", "T4=0.5")
    assert code == 2
    err = capsys.readouterr().err
    assert "no price for GPU type V100-16GB" in err and err.count("\n") == 1


def test_whatif_rows_per_variant(tmp_path, capsys):
    path = tmp_path / "w.json"
    assert main(["whatif", "--model", "gpt3-1.3b", "--cluster", "8xA100-80GB", "--global-batch", "64",
                 "--vary", "gpus=8,16", "--price-per-gpu-hour", "2", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "gpus=8 " in out and "gpus=16 " in out
    rows = json.loads(path.read_text())["variants"]
    assert [r["cluster"] for r in rows] == ["8xA100-80GB", "16xA100-80GB"]
    t8, t16 = (r["estimate"]["iteration_time_s"] for r in rows)
    assert t16 < t8  # twice the GPUs: a faster step
    assert all(r["training"]["usd_per_hour"] == 2 * len(r["estimate"]["peak_memory_bytes"]) for r in rows)
    assert main(["whatif", "--model", "gpt3-1.3b", "--cluster", "8xA100-80GB", "--global-batch", "64",
                 "--vary", "gpu=H100,A100-40GB", "--json", str(path)]) == 0
    assert [r["cluster"] for r in json.loads(path.read_text())["variants"]] == ["8xH100", "8xA100-40GB"]
    capsys.readouterr()


@pytest.mark.parametrize("vary, needle", [("gpus", "takes WHAT=V1,V2"), ("speed=1,2", "takes WHAT=V1,V2"),
                                          ("gpus=8,x", "'x' is not a positive whole number")])
def test_whatif_bad_vary_is_one_line(vary, needle, capsys):
    assert main(["whatif", "--model", "gpt3-1.3b", "--cluster", "8xA100-80GB", "--vary", vary]) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1


def test_whatif_refuses_to_resize_a_mixed_cluster(capsys):
    assert main(["whatif", "--model", "gpt3-1.3b", "--cluster", "metis-t4-v100-16", "--vary", "gpus=8"]) == 2
    assert "mixes GPU types" in capsys.readouterr().err


def _numbers(cluster, prices=None):
    from hetplan.cost.model import CostModel
    from hetplan.plan.workload import Workload
    from hetplan.model.presets import get_model
    from hetplan.app.training import training_numbers
    from hetplan.search.baselines.uniform import uniform_plan

    workload = Workload(get_model("gpt3-1.3b"), cluster, 64)
    plan = uniform_plan(workload, cluster.num_devices, 1, 1, 1)
    return training_numbers(plan, CostModel(workload).estimate(plan), cluster, 1024, None, prices)


def test_default_prices_are_named_and_used_only_for_their_gpus() -> None:
    from hetplan.cluster.io import load_cluster
    from hetplan.app.training import DEFAULT_PRICES_PER_GPU_HOUR, DEFAULT_PRICE_SOURCE
    from hetplan.report.training import training_lines

    n = _numbers(load_cluster("8xH100"))
    assert n["usd_per_hour"] == pytest.approx(8 * DEFAULT_PRICES_PER_GPU_HOUR["H100"])
    assert n["price_source"] == DEFAULT_PRICE_SOURCE and "Mercatus" in training_lines(n)[1]
    t4 = _numbers(load_cluster("8xT4"))
    assert "usd_per_hour" not in t4 and t4["unpriced_gpus"] == "T4"
    assert "no cost: no price for T4" in training_lines(t4)[1]
    assert _numbers(load_cluster("8xT4"), {"*": 0.5})["usd_per_hour"] == pytest.approx(4.0)


def test_cluster_file_prices_its_nodes(tmp_path) -> None:
    from hetplan.cluster.io import cluster_from_dict, cluster_to_dict, load_cluster_yaml

    path = tmp_path / "c.yaml"
    path.write_text("nodes:\n  - {gpu: T4, gpus: 4, intra_node_bandwidth_gbps: 50, price_per_gpu_hour: 0.35}\n"
                    "  - {gpu: H100, gpus: 4, intra_node_bandwidth_gbps: 7200}\ninter_node_bandwidth_gbps: 100\n")
    cluster = load_cluster_yaml(path)
    assert cluster_from_dict(cluster_to_dict(cluster), "copy") == cluster  # a plan file keeps the prices
    n = _numbers(cluster)
    assert n["usd_per_hour"] == pytest.approx(4 * 0.35 + 4 * 3.00)  # the file's T4 price, H100 by default
    assert "the cluster file" in n["price_source"] and "default prices" in n["price_source"]
    with pytest.raises(HetplanError, match="no price for GPU type H100"):
        _numbers(cluster, {"T4": 1.0})  # given prices must cover what the file does not
