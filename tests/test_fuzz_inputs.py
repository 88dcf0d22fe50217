"""Fuzz every input surface: bad input is one ``hetplan: error:`` line and exit 2,
never a traceback, a hang or a memory blow-up (see tests/fuzzing.py).

At least 1,550 generated inputs per run (``QUOTA``), deterministic unless a
seed is given; more with e.g.::

    HETPLAN_FUZZ_SCALE=10 pytest -m fuzz --hypothesis-seed=7
"""

from __future__ import annotations

import json
import os
from typing import Any, Callable

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import fuzzing as fz

pytestmark = pytest.mark.fuzz

SCALE = float(os.environ.get("HETPLAN_FUZZ_SCALE", "1"))
QUOTA = {"cluster": 350, "model": 300, "plan": 400, "hf": 100, "cli": 400, "names": 30, "hostile": 12}  # 1,592 in all

CPU_ESTIMATE = ["--dp", "1", "--tp", "1", "--pp", "1", "--micro-batch", "1", "--global-batch", "1"]

CLUSTER = {
    "name": "fuzz-lab",
    "inter_node_bandwidth_gbps": 100,
    "gpu_types": {"H100-capped": {"base": "H100", "power_cap_w": 500},
                  "lab-card": {"peak_tflops": 100, "memory_gb": 24, "memory_bandwidth_gbps": 900}},
    "nodes": [
        {"gpu": "H100-capped", "gpus": 2, "intra_node_bandwidth_gbps": 1200, "count": 2, "memory_gb": 60},
        {"gpu": "A100-80GB", "gpus": 2, "intra_node_bandwidth_gbps": 600, "inter_node_bandwidth_gbps": 50,
         "overrides": {"memory_bandwidth_gbps": 1800}},
        {"gpu": "lab-card", "gpus": 1, "intra_node_bandwidth_gbps": 100},
    ],
}
MATRIX_CLUSTER = {
    "name": "fuzz-matrix",
    "nodes": [{"gpu": "T4", "gpus": 2, "intra_node_bandwidth_gbps": 50}],
    "bandwidth_matrix_gbps": [[0, 40], [40, 0]],
}
HF_CONFIGS = [
    {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
     "num_hidden_layers": 2, "intermediate_size": 128, "vocab_size": 128, "max_position_embeddings": 64},
    {"model_type": "gpt2", "n_embd": 64, "n_head": 4, "n_layer": 2, "vocab_size": 128, "n_positions": 64},
]
# Keys whose wrong type can only be a mistake (others are passed on to transformers).
HF_SHAPE_KEYS = {"hidden_size", "num_attention_heads", "num_key_value_heads", "num_hidden_layers",
                 "intermediate_size", "vocab_size", "n_embd", "n_head", "n_layer"}

FUZZ_SETTINGS = dict(deadline=None, database=None, derandomize=not os.environ.get("HETPLAN_FUZZ_SEEDED"),
                     print_blob=True, phases=(Phase.explicit, Phase.generate), report_multiple_bugs=False,
                     suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module", autouse=True)
def _imported() -> None:
    """Import what hetplan imports lazily (torch, transformers: seconds) before
    the clock of the first input starts."""
    for module in ("torch", "transformers", "hetplan.model.hf", "hetplan.runtime.context"):
        try:
            __import__(module)
        except ImportError:
            pass


def _examples(kind: str) -> int:
    return max(1, int(QUOTA[kind] * SCALE))


def _settings(kind: str) -> Any:
    return settings(max_examples=_examples(kind), **FUZZ_SETTINGS)


def _fuzz(kind: str, body: Callable[..., None], inputs: st.SearchStrategy[tuple[Any, ...]]) -> None:
    """Run ``body(*args)`` on generated argument tuples and check that the quota was met.
    (Generation only: a failing input is reported as found, not shrunk, which
    could take minutes of runs of the CLI.)"""
    seen: list[int] = []

    @_settings(kind)
    @given(inputs)
    def run(args: tuple[Any, ...]) -> None:
        seen.append(1)
        body(*args)

    run()
    assert len(seen) >= _examples(kind), f"only {len(seen)} {kind} inputs generated"


@pytest.fixture(scope="module")
def plan_file(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A valid two-stage plan file of tiny-gpt on local-cpu-2, as JSON."""
    path = tmp_path_factory.mktemp("fuzz") / "plan.json"
    argv = ["estimate", "--model", "tiny-gpt", "--cluster", "local-cpu-2", "--dp", "1", "--tp", "1", "--pp", "2",
            "--micro-batch", "2", "--global-batch", "4", "--json", str(path)]
    assert fz.run_cli(argv).code == 0
    return json.loads(path.read_text())


@pytest.fixture(scope="module")
def model_spec(plan_file: dict[str, Any]) -> dict[str, Any]:
    return plan_file["model_spec"]


def test_cluster_files(tmp_path: Any) -> None:
    def body(base: dict[str, Any], mutation: fz.Mutation, damage: Any) -> None:
        text = fz.to_yaml(mutation.apply(base))
        path = fz.write(str(tmp_path), "cluster.yaml", fz.damaged(text, damage) if damage else text)
        argv = ["estimate", "--cluster", path, "--model", "tiny-gpt", *CPU_ESTIMATE]
        must_fail = not damage and mutation.must_fail(base, lambda p: False)
        fz.check_outcome(argv, fz.run_cli(argv), must_fail, f"{mutation} {damage}")

    bases = st.sampled_from([CLUSTER, MATRIX_CLUSTER])
    _fuzz("cluster", body, _mutated(bases))


def _mutated(bases: st.SearchStrategy[Any]) -> st.SearchStrategy[tuple[Any, ...]]:
    """(base, a mutation of that base, a text damage or None)."""
    return bases.flatmap(lambda b: st.tuples(st.just(b), fz.mutations(b), _maybe_damage()))


def _maybe_damage() -> st.SearchStrategy[Any]:
    return st.none() | st.none() | st.none() | fz.damages()


def test_model_files(tmp_path: Any, model_spec: dict[str, Any]) -> None:
    def body(mutation: fz.Mutation, damage: Any) -> None:
        text = fz.to_json(mutation.apply(model_spec))
        path = fz.write(str(tmp_path), "model.json", fz.damaged(text, damage) if damage else text)
        argv = ["estimate", "--model", path, "--cluster", "local-cpu-2", *CPU_ESTIMATE]
        must_fail = not damage and mutation.must_fail(model_spec, lambda p: p[:1] == ("meta",))
        fz.check_outcome(argv, fz.run_cli(argv), must_fail, f"{mutation} {damage}")

    _fuzz("model", body, st.tuples(fz.mutations(model_spec), _maybe_damage()))


def test_plan_files(tmp_path: Any, plan_file: dict[str, Any]) -> None:
    def informational(path: tuple[Any, ...]) -> bool:
        # the estimate and training numbers are hetplan's output, recomputed by every reader
        return len(path) >= 3 and path[0] == "plans" and path[2] in ("estimate", "training") or \
            path[:2] == ("model_spec", "meta")

    def body(mutation: fz.Mutation, damage: Any, command: list[str]) -> None:
        text = fz.to_json(mutation.apply(plan_file))
        path = fz.write(str(tmp_path), "plan.json", fz.damaged(text, damage) if damage else text)
        argv = [command[0], path, *command[1:]]
        must_fail = not damage and mutation.must_fail(plan_file, informational)
        fz.check_outcome(argv, fz.run_cli(argv), must_fail, f"{mutation} {damage}")

    commands = st.sampled_from([["estimate"], ["export", "--format", "megatron"], ["export", "--format", "torchtitan"],
                                ["export", "--format", "deepspeed"], ["export", "--format", "modules"]])
    _fuzz("plan", body, st.tuples(fz.mutations(plan_file), _maybe_damage(), commands))


def test_plan_names_that_disagree_with_the_embedded_specs(tmp_path: Any, plan_file: dict[str, Any]) -> None:
    """A plan's model or cluster name edited while the file embeds the specs: always refused."""
    def body(field: str, name: str, command: list[str]) -> None:
        data = json.loads(json.dumps(plan_file))
        data["plans"][0]["plan"][field] = name
        path = fz.write(str(tmp_path), "plan.json", fz.to_json(data))
        argv = [command[0], path, *command[1:]]
        fz.check_outcome(argv, fz.run_cli(argv), name != plan_file["plans"][0]["plan"][field], f"{field}={name!r}")

    commands = st.sampled_from([["estimate"], ["export", "--format", "megatron"], ["report", "-o", "/dev/null"]])
    _fuzz("names", body, st.tuples(st.sampled_from(["model", "cluster"]), st.sampled_from(fz.EDITED_NAMES), commands))


def test_hostile_module_sources_are_never_run_by_reading_a_plan(tmp_path: Any, plan_file: dict[str, Any]) -> None:
    """A plan file whose model names code to import: commands that do not build
    the model (estimate, export) read it without importing anything (an
    ``os:abort`` would end this process)."""
    def body(source: str, command: list[str]) -> None:
        data = json.loads(json.dumps(plan_file))
        data["model_spec"]["meta"]["module_source"] = source
        path = fz.write(str(tmp_path), "plan.json", fz.to_json(data))
        argv = [command[0], path, *command[1:]]
        fz.check_outcome(argv, fz.run_cli(argv), False, source)

    commands = st.sampled_from([["estimate"], ["export", "--format", "torchtitan"], ["export", "--format", "modules"]])
    _fuzz("hostile", body, st.tuples(st.sampled_from(fz.HOSTILE_MODULE_SOURCES), commands))


def test_hf_configs(tmp_path: Any) -> None:
    pytest.importorskip("transformers")
    from hetplan.model.hf import model_from_hf_config

    for config in HF_CONFIGS:  # the first build of a family imports its modeling code: seconds, not timed
        model_from_hf_config(dict(config), seq_len=16)

    def body(base: dict[str, Any], mutation: fz.Mutation, damage: Any) -> None:
        text = fz.to_json(mutation.apply(base))
        path = fz.write(str(tmp_path), "config.json", fz.damaged(text, damage) if damage else text)
        argv = ["estimate", "--model", path, "--cluster", "local-cpu-2", "--seq-len", "16", *CPU_ESTIMATE]
        must_fail = not damage and mutation.must_fail(base, lambda p: not p or p[0] not in HF_SHAPE_KEYS)
        fz.check_outcome(argv, fz.run_cli(argv), must_fail, f"{mutation} {damage}")

    _fuzz("hf", body, _mutated(st.sampled_from(HF_CONFIGS)))


# Command lines: a valid one per command, then one option's value replaced or one option added.
CLI_BASES = [
    ["plan", "--model", "tiny-gpt", "--cluster", "local-cpu-2", "--global-batch", "8", "--planner", "uniform",
     "--top", "1", "--quiet"],
    ["estimate", "--model", "tiny-gpt", "--cluster", "local-cpu-4", "--dp", "2", "--tp", "1", "--pp", "2",
     "--micro-batch", "1", "--global-batch", "4"],
    ["compare", "--model", "tiny-gpt", "--cluster", "local-cpu-2", "--global-batch", "4", "--planners", "uniform"],
    ["whatif", "--model", "tiny-gpt", "--cluster", "2xT4", "--vary", "global-batch=4,8", "--planner", "uniform"],
]
CLI_OPTIONS = ["--model", "--cluster", "--global-batch", "--seq-len", "--memory-limit", "--optimizer", "--precision",
               "--zero-impl", "--attention-kernel", "--tokens", "--price-per-gpu-hour", "--top", "--planner",
               "--planners", "--tp", "--pp", "--dp", "--micro-batch", "--zero", "--recompute", "--schedule",
               "--virtual-stages", "--vary", "--index", "--profile"]
CLI_VALUES = ["nan", "inf", "-inf", "-1", "0", "0.5", "1e308", "", " ", "99999999999999999999999", "8GB", "0.5GB",
              "GB", "1e-9GB", "auto", "true", "x", "local-cpu-3", "local-cpu-0", "2xT4", "0xT4", "tiny-gpt",
              "tiny-llama-bf16", "/dev/null", "/nonexistent/file", "/tmp", "fp16", "bf16", "adam-fp32",
              "gpus=2,4", "gpu=T4", "global-batch=", "=", ",", "H100=x", "300B", "1T", "interleaved-1f1b", "3",
              "--json", "\u00e9", "-" * 3, "/dev/zero", "{fifo}", "1e30", "1e19"]
# Options whose empty value would otherwise mean the default (issue 32): refused.
NAME_OPTIONS = ("--model", "--cluster")


@pytest.fixture(scope="module")
def fifo(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A named pipe: opening it to read blocks until a writer comes, so an input file must be refused unopened."""
    path = tmp_path_factory.mktemp("fifo") / "input.yaml"
    os.mkfifo(path)
    return str(path)


def test_command_lines(fifo: str) -> None:
    def body(base: list[str], option: str, value: str, replace: bool) -> None:
        value = value.replace("{fifo}", fifo)
        argv = list(base)
        if replace and option in argv:
            argv[argv.index(option) + 1] = value
        else:
            argv += [option, value]
        if "--profile" in argv or value.startswith("--"):
            argv = [a for a in argv if a != "--json"]  # never write files from the command-line fuzz
        must_fail = option in NAME_OPTIONS and not value.strip() or value in ("/dev/zero", fifo)
        fz.check_outcome(argv, fz.run_cli(argv), must_fail, "")

    _fuzz("cli", body, st.tuples(st.sampled_from(CLI_BASES), st.sampled_from(CLI_OPTIONS), st.sampled_from(CLI_VALUES),
                                 st.booleans()))


# A plan file's model source that names code: what hetplan would import and call if it trusted the file
# (issue 32: "os:abort" aborted 'hetplan train'). None of these may be imported unless named.
HOSTILE_REFERENCES = ("os:abort", "os:fork", "os:_exit", "sys:exit", "builtins:breakpoint", "subprocess:call",
                      "hetplan_fuzz_never_there.mod:build")
QUOTA["source"] = 60  # each 'train' input loads the plan and stops before the model: ~0.2 s


def test_hostile_module_source(tmp_path: Any, plan_file: dict[str, Any]) -> None:
    """A plan whose model source names code (as format 3's meta or format 4's typed source):
    'train' refuses it before any import (one line saying what to pass), every other command
    reads the plan without importing anything."""
    import sys

    def body(reference: str, legacy: bool, command: list[str]) -> None:
        doc = json.loads(json.dumps(plan_file))
        if legacy:
            doc["model_spec"].pop("source", None)
            doc["model_spec"]["meta"]["module_source"] = reference
        else:
            doc["model_spec"]["source"] = {"kind": "module", "reference": reference, "module_hash": ""}
        path = fz.write(str(tmp_path), "plan.json", fz.to_json(doc))
        argv = [command[0], *(["--plan"] if command[0] == "train" else []), path, *command[1:]]
        outcome = fz.run_cli(argv)
        fz.check_outcome(argv, outcome, command[0] == "train", f"{reference} legacy={legacy}")
        if command[0] == "train":
            assert "imports only when you name it" in outcome.stderr, outcome.stderr
        assert "hetplan_fuzz_never_there" not in sys.modules

    commands = st.sampled_from([["train", "--steps", "1"], ["estimate"], ["export", "--format", "torchtitan"]])
    references = st.sampled_from(HOSTILE_REFERENCES) | st.from_regex(r"[a-z_]{1,8}(\.[a-z_]{1,8}){0,2}:[a-z_]{1,8}",
                                                                      fullmatch=True)
    _fuzz("source", body, st.tuples(references, st.booleans(), commands))
