"""Time and money to train: --tokens and --price-per-gpu-hour."""

from __future__ import annotations

import argparse
import json

import pytest

from hetplan.argtypes import gpu_prices, token_count
from hetplan.cli import main


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
    from hetplan.model import get_model

    tokens_per_step = 64 * get_model("gpt3-1.3b").seq_len
    assert n["tokens_per_step"] == tokens_per_step
    assert n["steps"] == pytest.approx(1e10 / tokens_per_step)
    assert n["days"] == pytest.approx(n["steps"] * t / 86400)
    assert n["gpu_hours"] == pytest.approx(16 * n["steps"] * t / 3600)
    assert n["usd_per_hour"] == pytest.approx(8 * 0.5 + 8 * 2.0)  # 8 T4 + 8 V100
    assert n["usd"] == pytest.approx(n["usd_per_hour"] * n["steps"] * t / 3600)
    assert "GPU-hours per billion tokens" in out and "1e+10 tokens:" in out and "per billion tokens." in out


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
