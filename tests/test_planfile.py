"""Plan files stand alone: made from a config.json and a cluster YAML, they are
estimated, exported and checked by the runtime with both files gone; an
override that is a different model or cluster is refused; old files load."""

from __future__ import annotations

import json
import re

import pytest

from hetplan.cli import main
from hetplan.errors import HetplanError
from hetplan.plan.file import PLAN_FILE_VERSION, read_plan_file

CLUSTER = """name: two-kinds
inter_node_bandwidth_gbps: 10.0
nodes:
- {name: a, gpu: A100-40GB, gpus: 2, intra_node_bandwidth_gbps: 300.0, inter_node_bandwidth_gbps: 10.0}
- {name: b, gpu: V100-16GB, gpus: 2, intra_node_bandwidth_gbps: 150.0, inter_node_bandwidth_gbps: 10.0}
"""
LLAMA = {"model_type": "llama", "vocab_size": 512, "hidden_size": 128, "intermediate_size": 256,
         "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256}


def _iter_time(out: str) -> str:
    return re.search(r"^1\s+\S.*?\s(\d+\.\d+ [mu]?s)\s", out, re.M).group(1)


@pytest.fixture()
def made(tmp_path, capsys):
    """A plan from files that are deleted afterwards; returns (plan path, plan output)."""
    pytest.importorskip("transformers")
    cfg, yaml = tmp_path / "config.json", tmp_path / "cluster.yaml"
    cfg.write_text(json.dumps(LLAMA))
    yaml.write_text(CLUSTER)
    path = tmp_path / "plan.json"
    assert main(["plan", "--model", str(cfg), "--cluster", str(yaml), "--global-batch", "16", "--seq-len", "128",
                 "--optimizer", "adam-mixed-fp32-grads", "--memory-limit", "12GB", "--json", str(path),
                 "--quiet"]) == 0
    out = capsys.readouterr().out
    cfg.unlink()
    yaml.unlink()
    return path, out


def test_plan_file_embeds_model_cluster_and_settings(made):
    path, _ = made
    pf = read_plan_file(path)
    assert pf.version == PLAN_FILE_VERSION
    assert pf.model.num_layers == 6 and pf.model.seq_len == 128
    assert [d.gpu.name for d in pf.cluster.devices] == ["A100-40GB"] * 2 + ["V100-16GB"] * 2
    assert pf.settings["optimizer"] == "adam-mixed-fp32-grads"
    assert pf.settings["memory_limit_bytes"] == 12 << 30  # hetplan's GB are GiB (hetplan.units)


def test_estimate_and_export_work_from_the_file_alone(made, capsys):
    path, planned = made
    assert main(["estimate", str(path)]) == 0
    out = capsys.readouterr().out
    assert _iter_time(out) == _iter_time(planned)  # same model, cluster and settings: same number
    assert "optimizer adam-mixed-fp32-grads" in out and "memory limit" in out
    for fmt in ("modules", "megatron", "deepspeed", "torchtitan"):
        code = main(["export", str(path), "--format", fmt])
        captured = capsys.readouterr()
        assert code in (0, 2), captured.err
        assert "unknown model preset" not in captured.err  # refusals are about the plan, never the file


def test_runtime_check_plan_from_the_file_alone(made):
    pytest.importorskip("torch")
    from hetplan.runtime.setup import check_plan

    path, _ = made
    plan, spec, cluster, layout = check_plan(str(path))
    assert spec.num_layers == 6 and cluster.num_devices == 4 and layout.world_size == plan.num_devices


def test_a_different_model_or_cluster_is_refused(made, capsys):
    path, _ = made
    assert main(["estimate", str(path), "--cluster", "4xA100-80GB"]) == 2
    assert "differs from the cluster the plan was made for" in capsys.readouterr().err
    assert main(["export", str(path), "--format", "modules", "--model", "tiny-gpt"]) == 2
    err = capsys.readouterr().err
    assert "differs from the model the plan was made for" in err and err.count("\n") == 1
    assert main(["estimate", str(path), "--seq-len", "64"]) == 2
    assert "made for sequence length 128" in capsys.readouterr().err


def test_index_picks_a_ranked_plan(made, capsys):
    path, _ = made
    pf = read_plan_file(path)
    assert main(["export", str(path), "--format", "modules", "--index", str(len(pf.plans) + 1)]) == 2
    assert f"use --index 1..{len(pf.plans)}" in capsys.readouterr().err
    if len(pf.plans) > 1:
        assert main(["estimate", str(path), "--index", "2"]) == 0
        assert pf.plan(2).describe() in capsys.readouterr().out


def test_old_plan_files_still_load_by_name(tmp_path, capsys):
    path = tmp_path / "p.json"
    assert main(["estimate", "--model", "tiny-gpt", "--cluster", "local-cpu-2", "--global-batch", "8", "--tp", "1",
                 "--pp", "2", "--dp", "1", "--micro-batch", "2", "--json", str(path)]) == 0
    first = _iter_time(capsys.readouterr().out)
    data = json.loads(path.read_text())
    old = {"plans": data["plans"]}  # format 1: names only
    path.write_text(json.dumps(old))
    pf = read_plan_file(path)
    assert pf.version == 1 and pf.model is None
    assert main(["estimate", str(path)]) == 0
    assert _iter_time(capsys.readouterr().out) == first


def test_a_newer_format_is_refused(tmp_path):
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"format_version": PLAN_FILE_VERSION + 1, "plans": []}))
    with pytest.raises(HetplanError, match="newer than this hetplan reads"):
        read_plan_file(path)
