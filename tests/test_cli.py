"""The command line: default run, JSON output, and one-line errors for bad input."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from hetplan.model.presets import gpt_decoder

HETPLAN = [sys.executable, "-m", "hetplan.cli"]


def run(*args: str, cwd: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*HETPLAN, *args], capture_output=True, text=True, timeout=120, cwd=cwd)


# How much longer the default plan may take than starting Python and importing hetplan, measured side
# by side (a ratio, as these machines are loaded unevenly): about 2-7x on 2 cores, quiet or loaded.
PLAN_OVER_STARTUP = 15


def test_default_plan_prints_ranked_table_quickly() -> None:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import hetplan.cli"], check=True, timeout=120)
    startup = time.perf_counter() - start
    start = time.perf_counter()
    result = run()
    elapsed = time.perf_counter() - start
    assert result.returncode == 0, result.stderr
    assert elapsed < PLAN_OVER_STARTUP * startup, f"plan took {elapsed:.1f} s, starting hetplan {startup:.1f} s"
    out = result.stdout
    assert "amp-heterogeneous" in out and "gpt2-amp" in out
    for column in ("iter time", "samples/s", "tokens/s", "MFU", "max mem/GPU", "fits"):
        assert column in out
    assert "time goes to" in out and "peak mem/GPU" in out


def test_plan_json(tmp_path) -> None:
    out = tmp_path / "plans.json"
    result = run("plan", "--top", "3", "--json", str(out), "--quiet")
    assert result.returncode == 0, result.stderr
    data = json.loads(out.read_text())
    assert len(data["plans"]) == 3
    est = data["plans"][0]["estimate"]
    for key in ("iteration_time_s", "samples_per_s", "tokens_per_s", "mfu", "peak_memory_bytes", "fits"):
        assert key in est
    times = [p["estimate"]["iteration_time_s"] for p in data["plans"]]
    assert times == sorted(times)
    # the written plan can be costed again and gives the same time
    again = run("estimate", str(out), "--json", str(tmp_path / "e.json"))
    assert again.returncode == 0, again.stderr
    est2 = json.loads((tmp_path / "e.json").read_text())["plans"][0]["estimate"]
    assert est2["iteration_time_s"] == pytest.approx(est["iteration_time_s"])


def test_estimate_uniform_setting(tmp_path) -> None:
    out = tmp_path / "e.json"
    result = run("estimate", "--model", "gpt2-amp", "--cluster", "amp-homogeneous", "--global-batch", "32",
                 "--tp", "2", "--pp", "2", "--dp", "4", "--micro-batch", "2", "--zero", "1",
                 "--recompute", "full", "--json", str(out))
    assert result.returncode == 0, result.stderr
    plan = json.loads(out.read_text())["plans"][0]["plan"]
    assert [(s["dp"], s["tp"]) for s in plan["stages"]] == [(4, 2), (4, 2)]
    assert plan["num_micro_batches"] == 4


def test_list_commands(tmp_path) -> None:
    assert "gpt2-amp" in run("models").stdout
    clusters = run("clusters", "--json", str(tmp_path / "c.json"))
    assert "amp-heterogeneous" in clusters.stdout and "H100" in clusters.stdout
    assert any(g["name"] == "T4" for g in json.loads((tmp_path / "c.json").read_text())["gpus"])
    assert "uniform" in run("planners").stdout


def _model_file(tmp_path, layers: int, hidden: int, heads: int, name: str) -> str:
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(gpt_decoder(name, layers, hidden, heads, 2048).to_dict()))
    return str(path)


def _bad(tmp_path, *args: str) -> str:
    result = run(*args)
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hetplan: error: ")
    return lines[0]


def test_bad_inputs_give_one_line(tmp_path) -> None:
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("nodes: [")
    assert "not valid YAML" in _bad(tmp_path, "plan", "--cluster", str(bad_yaml))
    zero_bw = tmp_path / "zero.yaml"
    zero_bw.write_text("nodes:\n  - {gpu: T4, gpus: 4, intra_node_bandwidth_gbps: 0}\n")
    assert "must be positive" in _bad(tmp_path, "plan", "--cluster", str(zero_bw))
    unknown_gpu = tmp_path / "gpu.yaml"
    unknown_gpu.write_text("nodes:\n  - {gpu: Z80, gpus: 4, intra_node_bandwidth_gbps: 10}\n")
    assert "unknown GPU type 'Z80'" in _bad(tmp_path, "plan", "--cluster", str(unknown_gpu))
    assert "unknown cluster preset" in _bad(tmp_path, "plan", "--cluster", "moon-base")
    assert "unknown model preset" in _bad(tmp_path, "plan", "--model", "gpt-9")
    bad_json = tmp_path / "broken.json"
    bad_json.write_text("{\"layers\": [")
    assert "not valid JSON" in _bad(tmp_path, "plan", "--model", str(bad_json))
    assert "not valid JSON" in _bad(tmp_path, "estimate", str(bad_json))
    assert "unknown planner" in _bad(tmp_path, "plan", "--planner", "oracle")
    assert "memory size" in _bad(tmp_path, "plan", "--memory-limit", "lots")
    # a 3-layer model on 64 GPUs needs dp >= 4, so a batch of 2 cannot be divided
    tiny = _model_file(tmp_path, 1, 256, 4, "tiny")
    assert "cannot be divided" in _bad(tmp_path, "plan", "--model", tiny, "--cluster", "64xA100-80GB",
                                       "--global-batch", "2")
    # 175B parameters cannot fit 16 T4s
    huge = _model_file(tmp_path, 96, 12288, 96, "huge")
    assert "more than the" in _bad(tmp_path, "plan", "--model", huge, "--cluster", "amp-homogeneous")
    # fits overall but not on any plan at this batch on tiny memory
    assert "no plan fits in memory" in _bad(tmp_path, "plan", "--memory-limit", "1.2GB")
    assert "missing --micro-batch" in _bad(tmp_path, "estimate", "--tp", "1", "--pp", "1", "--dp", "16")
    assert "not a multiple" in _bad(tmp_path, "estimate", "--tp", "1", "--pp", "1", "--dp", "16",
                                    "--micro-batch", "3")
    assert "does not search the batch size" in _bad(tmp_path, "plan", "--global-batch", "auto",
                                                      "--planner", "uniform")


def test_argparse_errors_exit_2() -> None:
    result = run("plan", "--global-batch", "-4")
    assert result.returncode == 2 and "must be positive" in result.stderr


def test_fp8_on_a_gpu_without_it_is_one_line_error() -> None:
    result = run("estimate", "--model", "tiny-gpt", "--cluster", "8xV100-16GB", "--tp", "1", "--pp", "1",
                 "--dp", "8", "--micro-batch", "1", "--global-batch", "8", "--fp8")
    assert result.returncode == 2
    assert result.stderr.strip().startswith("hetplan: error:") and "FP8" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_version_module_entry_and_planners_json(tmp_path) -> None:
    from hetplan import __version__

    version = subprocess.run([sys.executable, "-m", "hetplan", "--version"], capture_output=True, text=True,
                             timeout=120)
    assert version.returncode == 0 and version.stdout.strip() == f"hetplan {__version__}"
    listed = run("planners", "--json", str(tmp_path / "p.json"))
    assert listed.returncode == 0, listed.stderr
    data = json.loads((tmp_path / "p.json").read_text())
    assert {"name": "uniform"}.items() <= next(p for p in data["planners"] if p["name"] == "uniform").items()
    assert all(p["description"] for p in data["planners"])


def _offload_inputs(tmp_path) -> list[str]:
    """A long-sequence model on one slow-compute H100 (its PCIe 5 host link)
    with 8.5 GiB usable: only offloading or recomputation fits, and offloading
    ranks first (tests/test_offload_search.py)."""
    model = tmp_path / "long.json"
    model.write_text(json.dumps(gpt_decoder("long-seq", 8, 2048, 16, 2048, vocab=8000).to_dict()))
    cluster = tmp_path / "slow.yaml"
    cluster.write_text("name: slow\ngpu_types:\n  H100-slow: {base: H100, peak_tflops: 10}\n"
                       "nodes:\n  - {gpu: H100-slow, gpus: 1, intra_node_bandwidth_gbps: 600}\n")
    return ["--model", str(model), "--cluster", str(cluster), "--global-batch", "8", "--memory-limit", "8.5GB"]


def _strategies(path) -> set[tuple[str, bool]]:
    plan = json.loads(path.read_text())["plans"][0]["plan"]
    return {(s.get("recompute", "none"), s.get("offload", False)) for st in plan["stages"] for s in st["strategies"]}


def test_plan_offload_auto_and_never(tmp_path) -> None:
    """`hetplan plan` offloads where memory is short by default, and
    `--offload never` keeps activations on the GPU (recomputing instead), slower."""
    inputs = _offload_inputs(tmp_path)
    times = {}
    for how in ("auto", "never"):
        out = tmp_path / f"{how}.json"
        result = run("plan", *inputs, "--offload", how, "--quiet", "--json", str(out))
        assert result.returncode == 0, result.stderr
        offloads = any(off for _, off in _strategies(out))
        assert offloads == (how == "auto"), _strategies(out)
        times[how] = json.loads(out.read_text())["plans"][0]["estimate"]["iteration_time_s"]
    assert "offload" in run("plan", *inputs, "--quiet").stdout  # the default is auto
    assert times["auto"] < times["never"]
    # the planned file costs the same again, offload included
    again = run("estimate", str(tmp_path / "auto.json"), "--json", str(tmp_path / "e.json"))
    assert again.returncode == 0, again.stderr
    assert json.loads((tmp_path / "e.json").read_text())["plans"][0]["estimate"]["iteration_time_s"] == \
        pytest.approx(times["auto"])


def test_estimate_offload_and_bad_offload_combinations(tmp_path) -> None:
    """`hetplan estimate --offload` offloads every layer of the uniform plan
    (it fits where the plain plan does not); bad combinations are one line."""
    inputs = _offload_inputs(tmp_path)
    degrees = ["--tp", "1", "--pp", "1", "--dp", "1", "--micro-batch", "1"]
    fits = {}
    for flags in ([], ["--offload"]):
        out = tmp_path / f"e{len(flags)}.json"
        result = run("estimate", *inputs, *degrees, *flags, "--json", str(out))
        assert result.returncode == 0, result.stderr
        assert _strategies(out) == {("none", bool(flags))}
        fits[bool(flags)] = json.loads(out.read_text())["plans"][0]["estimate"]["fits"]
    assert fits == {False: False, True: True}
    assert "drop --offload or the plan file" in _bad(tmp_path, "estimate", str(tmp_path / "e1.json"), "--offload")
    assert "invalid choice" in _bad(tmp_path, "plan", *inputs, "--offload", "always")
    assert "takes no value" in _bad(tmp_path, "estimate", *inputs, *degrees, "--offload", "never")
    # nothing fits without offloading or recomputing, and the batch-1 plan does not fit even so at 7 GB
    assert "no plan fits in memory" in _bad(tmp_path, "plan", *inputs[:-1], "7GB", "--offload", "never")


def test_train_refuses_a_plan_costed_with_fp8(tmp_path) -> None:
    """The runtime does not run FP8 matmuls, and an FP8 plan's memory counts
    one-byte saved linear inputs: ``hetplan train`` refuses it in one line."""
    plan = tmp_path / "fp8.json"
    made = run("estimate", "--model", "gpt3-1.3b", "--cluster", "8xH100", "--tp", "1", "--pp", "1",
               "--dp", "8", "--micro-batch", "1", "--global-batch", "8", "--fp8", "--json", str(plan))
    assert made.returncode == 0, made.stderr
    result = run("train", "--plan", str(plan), "--steps", "1")
    assert result.returncode == 2
    assert result.stderr.strip().startswith("hetplan: error:") and "--fp8" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
