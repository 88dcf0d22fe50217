"""One regression test per class of bad input found by fuzzing (the hardening
issue): each is one line ``hetplan: error: ...`` and exit 2, at once.

Models (ModelSpec and HF config fields, limits) are in
tests/test_model_validation.py, ``hetplan train`` flags in
tests/test_train_flags.py, generated inputs in tests/test_fuzz_inputs.py.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, Callable

import pytest

from hetplan.cli import main

CPU_ESTIMATE = ["--dp", "1", "--tp", "1", "--pp", "1", "--micro-batch", "1", "--global-batch", "1"]
GOOD_CLUSTER = """name: lab
inter_node_bandwidth_gbps: 10
nodes:
  - {gpu: T4, gpus: 2, intra_node_bandwidth_gbps: 50, count: 2}
"""


def _one_line_error(argv: list[str], capsys: pytest.CaptureFixture[str], *fragments: str) -> str:
    start = time.perf_counter()
    code = _run(argv)
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert code == 2, err
    assert len(lines) == 1 and lines[0].startswith("hetplan: error: "), err
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    assert time.perf_counter() - start < 10.0, argv
    return lines[0]


def _run(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as exc:  # argparse
        return int(exc.code or 0)


def _file(tmp_path: Path, name: str, content: str | bytes) -> str:
    path = tmp_path / name
    path.write_bytes(content.encode() if isinstance(content, str) else content)
    return str(path)


# --- cluster files ----------------------------------------------------------------------------------
CLUSTER_CASES: dict[str, tuple[str | bytes, list[str]]] = {
    "nan inter-node bandwidth": (GOOD_CLUSTER.replace("10", ".nan", 1), ["inter_node_bandwidth_gbps", "finite"]),
    "nan in bandwidth matrix": ("nodes:\n  - {gpu: T4, gpus: 2, intra_node_bandwidth_gbps: 50}\n"
                                "bandwidth_matrix_gbps: [[0, .nan], [1, 0]]\n", ["bandwidth_matrix_gbps", "finite"]),
    "nan gpus": (GOOD_CLUSTER.replace("gpus: 2", "gpus: .nan"), ["gpus", "finite"]),
    "inf gpus": (GOOD_CLUSTER.replace("gpus: 2", "gpus: .inf"), ["gpus", "finite"]),
    "true as a number": (GOOD_CLUSTER.replace("gpus: 2", "gpus: true"), ["gpus", "must be a number"]),
    "duplicate key": (GOOD_CLUSTER + "name: other\n", ["'name' is given twice"]),
    "not utf-8": (GOOD_CLUSTER.encode().replace(b"lab", b"l\xffb"), ["not UTF-8", "line 1"]),
    "alias bomb": ("a: &a [" + ",".join(["x"] * 90) + "]\nb: &b [" + ",".join(["*a"] * 90) + "]\nc: &c ["
                   + ",".join(["*b"] * 90) + "]\n" + GOOD_CLUSTER, ["expands to more than"]),
    "alias as name": ("x: &x [a, b]\n" + GOOD_CLUSTER.replace("name: lab", "name: *x"), ["unknown key"]),
    "list as name": (GOOD_CLUSTER.replace("name: lab", "name: [a, b]"), ["name must be text"]),
    "60k nodes": ("name: big\ninter_node_bandwidth_gbps: 10\nnodes:\n"
                  "  - {gpu: T4, gpus: 8, intra_node_bandwidth_gbps: 50, count: 10000000}\n",
                  ["count", "limit of 131,072"]),
    "too many GPUs in a node": (GOOD_CLUSTER.replace("gpus: 2", "gpus: 100000"), ["gpus", "limit of 4,096"]),
    "negative host memory": (GOOD_CLUSTER.replace("count: 2", "count: 2, host_memory_gb: -64"),
                             ["nodes[0].host_memory_gb", "positive"]),
    "zero host memory": (GOOD_CLUSTER.replace("count: 2", "count: 2, host_memory_gb: 0"),
                         ["nodes[0].host_memory_gb", "positive"]),
    "nan host memory": (GOOD_CLUSTER.replace("count: 2", "count: 2, host_memory_gb: .nan"),
                        ["host_memory_gb", "finite"]),
    "text host memory": (GOOD_CLUSTER.replace("count: 2", "count: 2, host_memory_gb: 2TB"),
                         ["host_memory_gb", "must be a number"]),
    "huge host memory": (GOOD_CLUSTER.replace("count: 2", "count: 2, host_memory_gb: 1.0e+300"),
                         ["host_memory_gb", "limit of 1,048,576"]),
}


@pytest.mark.parametrize("case", list(CLUSTER_CASES))
def test_bad_cluster_file(case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    content, fragments = CLUSTER_CASES[case]
    path = _file(tmp_path, "c.yaml", content)
    _one_line_error(["estimate", "--cluster", path, "--model", "tiny-gpt", *CPU_ESTIMATE], capsys, *fragments)


def test_the_good_cluster_file_is_accepted(tmp_path: Path) -> None:
    path = _file(tmp_path, "c.yaml", GOOD_CLUSTER)
    assert _run(["estimate", "--cluster", path, "--model", "tiny-gpt", *CPU_ESTIMATE]) == 0


def test_a_10mb_cluster_file_is_refused_before_parsing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    nodes = "".join(f"  - {{gpu: T4, gpus: 1, intra_node_bandwidth_gbps: 50, name: n{i}}}\n" for i in range(150_000))
    path = _file(tmp_path, "big.yaml", "name: big\ninter_node_bandwidth_gbps: 10\nnodes:\n" + nodes)
    _one_line_error(["estimate", "--cluster", path, "--model", "tiny-gpt", *CPU_ESTIMATE], capsys, "limit of 1 MiB")


@pytest.mark.parametrize("name, fragment", [
    ("local-cpu-99999999", "limit of 1,024"), ("10000000000xH100", "limit of 131,072"),
    ("local-cpu-" + "9" * 5000, "limit of 1,024"), ("9" * 5000 + "xH100", "limit of 131,072"),
])
def test_huge_cluster_names_are_refused_before_building(name: str, fragment: str,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    _one_line_error(["plan", "--cluster", name, "--model", "tiny-gpt"], capsys, fragment)


# --- plan files -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def plan_json(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    path = tmp_path_factory.mktemp("plans") / "p.json"
    assert main(["estimate", "--model", "tiny-gpt", "--cluster", "local-cpu-2", "--dp", "1", "--tp", "1", "--pp",
                 "2", "--micro-batch", "2", "--global-batch", "4", "--json", str(path)]) == 0
    return json.loads(path.read_text())


def _edit(change: Callable[[dict[str, Any]], None]) -> Callable[[dict[str, Any]], dict[str, Any]]:
    def edited(data: dict[str, Any]) -> dict[str, Any]:
        data = json.loads(json.dumps(data))
        change(data)
        return data
    return edited


def _plan(data: dict[str, Any]) -> dict[str, Any]:
    return data["plans"][0]["plan"]


PLAN_CASES: dict[str, tuple[Callable[[dict[str, Any]], dict[str, Any]], list[str]]] = {
    "stage tp 0.5": (_edit(lambda d: _plan(d)["stages"][0].update(tp=0.5)), ["stages[0].tp", "whole number"]),
    "layer tp 0.5": (_edit(lambda d: _plan(d)["stages"][0]["strategies"][0].update(tp=0.5)),
                     ["strategies[0].tp", "whole number"]),
    "sequence_parallel 'false'": (_edit(lambda d: _plan(d)["stages"][0].update(sequence_parallel="false")),
                                  ["sequence_parallel", "true or false"]),
    "true as global batch": (_edit(lambda d: _plan(d).update(global_batch_size=True)),
                             ["global_batch_size", "whole number"]),
    "unknown plan key": (_edit(lambda d: _plan(d).update(bogus=1)), ["unknown key(s) ['bogus']"]),
    "unknown stage key": (_edit(lambda d: _plan(d)["stages"][1].update(zero=3)), ["stages[1]", "unknown key"]),
    "unknown setting": (_edit(lambda d: d["settings"].update(fp16=True)), ["settings", "unknown key"]),
    "string setting": (_edit(lambda d: d["settings"].update(fp8="no")), ["settings.fp8", "true or false"]),
    "edited per-replica micro-batch": (_edit(lambda d: _plan(d).update(micro_batch_size=4)),
                                       ["micro_batch_size is 4 per replica", "micro_batch_total"]),
    "layer beyond the model": (_edit(lambda d: d["model_spec"]["layers"].pop()), ["names layer 5"]),
    "null model sequence": (_edit(lambda d: d["model_spec"].update(seq_len=None)), ["seq_len", "whole number"]),
    "virtual stages on 3-layer stages": (_edit(lambda d: _plan(d).update(virtual_stages=100,
                                                                         schedule="interleaved-1f1b")),
                                         ["virtual_stages = 100", "only 3 layer"]),
}


@pytest.mark.parametrize("command", [["estimate"], ["export", "--format", "megatron"]])
@pytest.mark.parametrize("case", list(PLAN_CASES))
def test_bad_plan_file(case: str, command: list[str], plan_json: dict[str, Any], tmp_path: Path,
                       capsys: pytest.CaptureFixture[str]) -> None:
    edit, fragments = PLAN_CASES[case]
    path = _file(tmp_path, "p.json", json.dumps(edit(plan_json)))
    _one_line_error([command[0], path, *command[1:]], capsys, *fragments)


@pytest.mark.parametrize("text, fragment", [
    ('{"plans": [], "global_batch_size": Infinity}', "Infinity is not a JSON number"),
    ('{"plans": [], "plans": []}', "'plans' is given twice"),
    (b'{"plans": "\xff"}', "not UTF-8"),
    ("[" * 100_000, "nests too deeply"),
])
def test_bad_plan_json(text: str | bytes, fragment: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _one_line_error(["estimate", _file(tmp_path, "p.json", text)], capsys, fragment)


def test_plan_file_from_dev_zero_is_refused_at_once(capsys: pytest.CaptureFixture[str]) -> None:
    _one_line_error(["estimate", "/dev/zero"], capsys, "character device, not a regular file")


def test_plan_file_that_is_a_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _one_line_error(["estimate", str(tmp_path)], capsys, "is a directory")


# --- command-line values ----------------------------------------------------------------------------
@pytest.mark.parametrize("value, fragment", [
    ("0.5", "no unit"), ("0.9", "no unit"), ("", "cannot read memory size"), ("0.0000001GB", "below 1 MiB"),
    ("-8GB", "cannot read memory size"), ("nanGB", "cannot read memory size"),
])
def test_memory_limit_is_parsed_strictly(value: str, fragment: str, capsys: pytest.CaptureFixture[str]) -> None:
    _one_line_error(["plan", "--model", "tiny-gpt", "--cluster", "local-cpu-2", f"--memory-limit={value}"], capsys,
                    fragment)


@pytest.mark.parametrize("argv, fragment", [
    (["plan", "--global-batch", "99999999999999999999999"], "limit of 16,777,216"),
    (["estimate", "--dp", "1000000", "--tp", "1", "--pp", "1", "--micro-batch", "1"], "limit of 131,072"),
    (["compare", "--planners", ""], "empty planner"),
    (["compare", "--planners", "uniform,,amp"], "empty planner"),
    (["plan", "--bogus"], "unrecognized arguments: --bogus"),
    (["plan", "--top", "0"], "--top: must be positive"),
    (["estimate", "--zero", "7"], "invalid choice"),
    (["export"], "required"),
    (["nonsense"], "invalid choice"),
    (["plan", "--model", "tiny-gpt", "--seq-len", "64"], "--seq-len applies to HF configs"),
])
def test_command_line_errors_are_one_line(argv: list[str], fragment: str,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    line = _one_line_error(argv, capsys, fragment)
    assert "usage:" not in line


def test_help_still_prints_usage(capsys: pytest.CaptureFixture[str]) -> None:
    assert _run(["plan", "--help"]) == 0
    assert "usage: hetplan plan" in capsys.readouterr().out


def test_export_checks_a_plan_without_embedded_model(plan_json: dict[str, Any], tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """A format-1 file names its model and cluster: export checks the plan against them."""
    data = {"plans": json.loads(json.dumps(plan_json["plans"]))}
    path = _file(tmp_path, "old.json", json.dumps(data))
    assert _run(["export", path, "--format", "megatron"]) == 0
    capsys.readouterr()
    _plan(data)["stages"][1]["devices"] = [7]
    path = _file(tmp_path, "old.json", json.dumps(data))
    _one_line_error(["export", path, "--format", "megatron"], capsys, "uses GPU 7", "local-cpu-2")


# --- issue 32: the last crashing and silently accepted inputs -------------------------------------------
@pytest.mark.parametrize("node, fragment", [
    ("memory_gb: 1.0e+30", "limit of 1,048,576"),
    ("memory_gb: 1.0e-10", "below hetplan's floor of 1 MiB"),
    ("price_per_gpu_hour: 0", "price_per_gpu_hour must be positive"),
    ("price_per_gpu_hour: 1.0e+300", "limit of 1,000,000"),
])
def test_cluster_numbers_out_of_range(node: str, fragment: str, tmp_path: Path,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    """1e30 GiB overflowed an int64 array; 1e-10 GiB rounded to 0 bytes = "no override"."""
    text = f"name: lab\nnodes:\n  - {{gpu: H100, gpus: 2, intra_node_bandwidth_gbps: 1200, {node}}}\n"
    _one_line_error(["estimate", "--cluster", _file(tmp_path, "c.yaml", text), "--model", "tiny-gpt", *CPU_ESTIMATE],
                    capsys, fragment)


def test_gpu_type_memory_is_bounded_too(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = ("name: lab\ngpu_types: {big: {base: H100, memory_gb: 1.0e+30}}\n"
            "nodes:\n  - {gpu: big, gpus: 2, intra_node_bandwidth_gbps: 1200}\n")
    _one_line_error(["estimate", "--cluster", _file(tmp_path, "c.yaml", text), "--model", "tiny-gpt", *CPU_ESTIMATE],
                    capsys, "gpu_types", "memory_gb", "limit of 1,048,576")


def test_huge_layer_bytes_and_deep_meta(plan_json: dict[str, Any], tmp_path: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    """act_bytes 1e30 (a ModelSpec, or a plan's embedded one) and a meta nested 500 deep."""
    model = json.loads(json.dumps(plan_json["model_spec"]))
    model["layers"][1]["act_bytes"] = 1e30
    _one_line_error(["estimate", "--model", _file(tmp_path, "m.json", json.dumps(model)), "--cluster", "local-cpu-2",
                     *CPU_ESTIMATE], capsys, "act_bytes", "bytes per sample")
    _one_line_error(["estimate", _file(tmp_path, "p.json", json.dumps({**plan_json, "model_spec": model}))], capsys,
                    "model_spec", "act_bytes")
    deep: dict[str, Any] = {}
    for _ in range(500):
        deep = {"a": deep}
    model = {**plan_json["model_spec"], "meta": deep}
    _one_line_error(["estimate", "--model", _file(tmp_path, "m.json", json.dumps(model)), "--cluster", "local-cpu-2",
                     *CPU_ESTIMATE, "--json", str(tmp_path / "out.json")], capsys, "meta nests deeper", "32")


def test_step_bytes_are_bounded(plan_json: dict[str, Any], tmp_path: Path,
                                capsys: pytest.CaptureFixture[str]) -> None:
    """Each layer within its limit, but the step's bytes past int64's reach."""
    model = json.loads(json.dumps(plan_json["model_spec"]))
    for layer in model["layers"]:
        layer["act_bytes"] = 2.0**49
    argv = ["estimate", "--model", _file(tmp_path, "m.json", json.dumps(model)), "--cluster", "local-cpu-2",
            "--dp", "1", "--tp", "1", "--pp", "1", "--micro-batch", "1", "--global-batch", "4096"]
    _one_line_error(argv, capsys, "one step of", "2^60", "lower the global batch")


@pytest.mark.parametrize("edit, fragment", [
    (lambda d: _plan(d).__setitem__("model", "gpt2-amp"), "plans[0].model is 'gpt2-amp'"),
    (lambda d: _plan(d).__setitem__("model", "no-such-model"), "plans[0].model is 'no-such-model'"),
    (lambda d: _plan(d).__setitem__("cluster", ""), "plans[0].cluster is ''"),
    (lambda d: _plan(d).__setitem__("cluster", "8xV100"), "plans[0].cluster is '8xV100'"),
])
def test_plan_names_must_match_the_embedded_specs(edit: Callable[[dict[str, Any]], None], fragment: str,
                                                  plan_json: dict[str, Any], tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    path = _file(tmp_path, "p.json", json.dumps(_edit(edit)(plan_json)))
    _one_line_error(["estimate", path, "--json", str(tmp_path / "out.json")], capsys, fragment, "embeds")
    assert not (tmp_path / "out.json").exists()


def test_a_preset_named_cluster_with_other_gpus_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A plan for 8xV100 whose embedded cluster was edited to H100: re-costed on H100 before."""
    path = tmp_path / "v100.json"
    assert main(["estimate", "--model", "tiny-gpt", "--cluster", "8xV100", *CPU_ESTIMATE, "--json", str(path)]) == 0
    data = json.loads(path.read_text())
    for node in data["cluster_spec"]["nodes"]:
        node["gpu"] = "H100"
    capsys.readouterr()
    _one_line_error(["estimate", _file(tmp_path, "h100.json", json.dumps(data))], capsys,
                    "named '8xV100-16GB' like a preset", "H100")


@pytest.mark.parametrize("argv, fragment", [
    (["estimate", "--cluster", "", "--model", "tiny-gpt", *CPU_ESTIMATE], "--cluster: is empty"),
    (["plan", "--model", " ", "--cluster", "local-cpu-2"], "--model: is empty"),
    (["export", "p.json", "--format", "megatron", "--model", ""], "--model: is empty"),
    (["estimate", "--model", "tiny-gpt", "--cluster", "local-cpu-2", *CPU_ESTIMATE, "--tokens", "1e308"],
     "limit of 1e+18 tokens"),
    (["estimate", "--model", "tiny-gpt", "--cluster", "local-cpu-2", *CPU_ESTIMATE, "--price-per-gpu-hour", "1e300"],
     "limit of 1,000,000"),
    (["estimate", "--model", "tiny-gpt", "--cluster", "local-cpu-2", *CPU_ESTIMATE, "--price-per-gpu-hour", "0"],
     "must be a finite number > 0"),
    (["estimate", "--model", "tiny-gpt", "--cluster", "local-cpu-2", *CPU_ESTIMATE, "--price-per-gpu-hour",
      "Foo=3,CPU=1"], "prices Foo, which the cluster does not have; its GPU types are CPU"),
])
def test_empty_names_and_out_of_range_money(argv: list[str], fragment: str,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    _one_line_error(argv, capsys, fragment)


def test_whatif_prices_may_name_any_variants_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    """A what-if over GPU types prices each variant's type; a type in no variant is refused."""
    argv = ["whatif", "--model", "tiny-gpt", "--cluster", "2xT4", "--vary", "gpu=T4,H100", "--planner", "uniform",
            "--global-batch", "8", "--price-per-gpu-hour", "T4=1,H100=2"]
    assert _run(argv) == 0, capsys.readouterr().err
    capsys.readouterr()
    _one_line_error([*argv[:-1], "T4=1,A100-80GB=2"], capsys, "prices A100-80GB")


def test_profile_counts_are_bounded(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """An entry with tp 10^12 was counted and never used."""
    entry = {"layer": "decoder:1", "gpu": "CPU", "tp": 10**12, "batch": 1, "fwd_s": 0.1, "bwd_s": 0.2}
    path = _file(tmp_path, "prof.json", json.dumps({"entries": [entry]}))
    _one_line_error(["estimate", "--model", "tiny-gpt", "--cluster", "local-cpu-2", *CPU_ESTIMATE, "--profile", path],
                    capsys, "tp = 1,000,000,000,000", "limit of 4,096")


def test_non_regular_input_files_are_refused_without_blocking(tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """Opening a FIFO blocks until a writer comes: refused from its stat, never opened."""
    fifo = tmp_path / "cluster.yaml"
    os.mkfifo(fifo)
    _one_line_error(["estimate", "--cluster", str(fifo), "--model", "tiny-gpt", *CPU_ESTIMATE], capsys,
                    "FIFO (named pipe), not a regular file")


@pytest.mark.parametrize("out, fragment", [
    ("{tmp}", "is a directory; give a file name"),
    ("{tmp}/newdir/", "ends in '/', which names a directory"),
    ("{tmp}/missing/out.json", "it does not exist"),
])
def test_output_paths_are_checked_before_the_search(out: str, fragment: str, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """A bad --json fails at once, before the planner runs (it searched first before)."""
    argv = ["plan", "--model", "tiny-gpt", "--cluster", "local-cpu-2", "--global-batch", "4", "--planner", "uniform",
            "--json", out.format(tmp=tmp_path)]
    line = _one_line_error(argv, capsys, fragment)
    assert "--json" in line
    assert "rank" not in capsys.readouterr().out  # no table: nothing was planned


def test_json_through_a_symlink_names_the_target(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = tmp_path / "target.json"
    target.write_text("old")
    (tmp_path / "link.json").symlink_to(target)
    argv = ["estimate", "--model", "tiny-gpt", "--cluster", "local-cpu-2", *CPU_ESTIMATE,
            "--json", str(tmp_path / "link.json")]
    assert _run(argv) == 0
    assert f"wrote {target} (through the link {tmp_path / 'link.json'})" in capsys.readouterr().out
    assert json.loads(target.read_text())["plans"]
