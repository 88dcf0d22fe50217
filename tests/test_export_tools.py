"""hetplan's exports, loaded by the tools' own code at the versions they were
checked against (docs/exports.md; installed by `make`: pyproject's `tools`).

* torchtitan 0.3.0: the exported Python module's apply_plan runs on a real
  Trainer.Config, whose __post_init__ checks it (CUDA graphs with PP/EP, the
  pipeline micro-batch); its config dataclasses refuse unknown fields;
  ParallelDims checks the degrees against the world size; the pipeline module
  names are compared with torchtitan's own name generator; ConfigManager
  loads it with --module/--config as the launch script runs it.
* torchtitan 0.2.2: its ConfigManager parses the TOML job file (it refuses
  unknown fields: "Invalid field names"), in a subprocess with 0.2.2 on the
  path (.venv/tools/torchtitan-0.2.2).
* Megatron-LM core_v0.16.1: its training code is not on PyPI, so its parser
  is rebuilt from the option list dumped from its own parser
  (tests/data/megatron_lm_args.json, tests/data/make_megatron_args.py) and
  the parsed values build megatron-core 0.16.1's TransformerConfig, which
  checks the shape, TP/PP, recompute and pipeline layout. With Megatron-LM on
  the path, its real parse_args + validate_args run too.
* DeepSpeed 0.19.8: DeepSpeedConfig as deepspeed.initialize builds it (no
  mpu for a model given whole, AutoTP included); every top-level key must be
  one DeepSpeedConfig reads (it ignores unknown ones); the PipelineModule
  code runs against the real class.
* Launch scripts: run per node on fake H100/A100 machines with the real
  torchrun and DeepSpeed launcher, every rank lands on the plan's GPU.
* The README flow: real Llama-3-8B/70B configs on 64xH100, plan --target,
  export, and the tool's config code takes it.
"""

from __future__ import annotations

import argparse
import ast
import functools
import json
import os
import re
import subprocess
import sys
import tomllib
import types
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from hetplan.cluster.io import load_cluster
from hetplan.errors import HetplanError
from hetplan.export.tools import partition_uniform, render, to_toml
from hetplan.model.presets import get_model
from hetplan.plan.spec import LayerStrategy, Plan, uniform_stage

ROOT = Path(__file__).resolve().parents[1]
TORCHTITAN_OLD = ROOT / ".venv" / "tools" / "torchtitan-0.2.2"
MEGATRON_ARGS = Path(__file__).parent / "data" / "megatron_lm_args.json"


def make_plan(model: str, split: list[int], dp: int, tp: int, mbs: int = 1, nmb: int = 4, zero: int = 0,
              recompute: str = "none", sp: bool = False, schedule: str = "1f1b", virtual: int = 1,
              cluster: str = "galvatron-16x-a100") -> Plan:
    """A plan of ``len(split)`` stages holding ``split[j]`` layers each, on
    consecutive GPUs, every stage (dp, tp), ``mbs`` samples per replica."""
    spec = get_model(model)
    assert sum(split) == spec.num_layers
    stages, start, device = [], 0, 0
    for n in split:
        stages.append(uniform_stage(range(start, start + n), range(device, device + dp * tp), dp, tp, mbs * dp, zero,
                                    recompute, sp))
        start, device = start + n, device + dp * tp
    return Plan(spec.name, cluster, mbs * dp * nmb, mbs * dp, nmb, schedule, tuple(stages), virtual_stages=virtual)


# (name, plan): plans every tool must express. llama3-8b: 34 layers (embed, 32 blocks, head), GQA + SwiGLU + RMSNorm.
PLANS = {
    "dp8": lambda **kw: make_plan("llama3-8b", [34], 8, 1, **kw),
    "dp2-tp2-pp2": lambda **kw: make_plan("llama3-8b", [17, 17], 2, 2, **kw),
    "tp4-pp2-sp": lambda **kw: make_plan("llama3-8b", [17, 17], 1, 4, sp=True, **kw),
    "pp4-uneven": lambda **kw: make_plan("llama3-8b", [6, 10, 10, 8], 2, 1, **kw),
    "pp2-interleaved": lambda **kw: make_plan("llama3-8b", [17, 17], 2, 1, schedule="interleaved-1f1b", virtual=2,
                                              nmb=4, **kw),
    "gpt2-dp4-pp2": lambda **kw: make_plan("gpt2-amp", [13, 13], 4, 1, **kw),
}


def export(name: str, fmt: str, version: str = "0.3", **kw: Any):
    plan = PLANS[name](**kw)
    return plan, render(plan, get_model(plan.model), fmt, load_cluster(plan.cluster), version)


def one_line_refusal(plan: Plan, fmt: str, version: str = "0.3", *fragments: str) -> str:
    with pytest.raises(HetplanError) as info:
        render(plan, get_model(plan.model), fmt, load_cluster(plan.cluster), version)
    message = str(info.value)
    assert "\n" not in message and all(f in message for f in fragments), message
    return message


# --------------------------------------------------------------------------- torchtitan 0.3 (Python config)

tt_config = pytest.importorskip("torchtitan.config", reason="make installs torchtitan (pyproject's tools extra)")


# Modules torchtitan.trainer imports for training-time work that building and checking a Trainer.Config never
# runs: data loading (torchdata, datasets), TensorBoard logging, MoE GPU kernels (triton). The `tools` extra does
# not install them (they pull pyarrow, protobuf, triton: GPU-side or large), so the ones missing here are stood in
# for while torchtitan imports; Trainer.Config, its __post_init__ checks, the model registries and ConfigManager
# are torchtitan's own code.
_TRAINING_ONLY = {"torchdata.stateful_dataloader": "torchdata", "torch.utils.tensorboard": "tensorboard",
                  "datasets.distributed": "datasets", "torchtitan.distributed.minimal_async_ep.kernels": "triton"}


def _stand_in(name: str) -> types.ModuleType:
    """A module whose every public name is an empty class (a base class or a
    decorator-free placeholder is all torchtitan's imports ask of it)."""
    def placeholder(attr: str) -> type:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return type(attr, (), {})

    module = types.ModuleType(name)
    module.__path__ = []
    module.__getattr__ = placeholder
    return module


@functools.lru_cache(maxsize=None)
def torchtitan_trainer() -> Any:
    """torchtitan 0.3's Trainer (for Trainer.Config), imported with the
    training-time modules this machine lacks stood in for (removed again from
    sys.modules after the import, so nothing else sees them)."""
    import importlib.util

    added = []
    for name, package in _TRAINING_ONLY.items():
        if importlib.util.find_spec(package) is None:
            for part in (name.rsplit(".", 1)[0], name) if "." in name and name.split(".")[0] == package else (name,):
                if part not in sys.modules:
                    sys.modules[part] = _stand_in(part)
                    added.append(part)
    try:
        from torchtitan.config import ConfigManager  # noqa: F401 -- imported to check that it loads
        from torchtitan.models.llama3.config_registry import llama3_8b  # noqa: F401 -- imported to check that it loads
        from torchtitan.models.qwen3 import model_registry  # noqa: F401 -- imported to check that it loads
        from torchtitan.trainer import Trainer
        import torchtitan.experiments  # noqa: F401 -- imported to check that it loads
    finally:
        for name in added:
            sys.modules.pop(name, None)
    return Trainer


def run_torchtitan_python(text: str, config: Any = None) -> Any:
    """Run the exported module's apply_plan on a real Trainer.Config
    (``config`` or a default one): it returns a new Trainer.Config, whose
    __post_init__ runs torchtitan's checks on the plan's values."""
    trainer = torchtitan_trainer()
    module = types.ModuleType("hetplan_torchtitan_export")
    exec(compile(text, "export.py", "exec"), module.__dict__)
    result = module.apply_plan(config if config is not None else trainer.Config())
    assert type(result) is trainer.Config
    return result


def check_torchtitan_degrees(par: Any, world: int) -> None:
    """torchtitan's ParallelDims checks the degrees multiply to the world size."""
    from torchtitan.distributed.parallel_dims import ParallelDims

    ParallelDims(dp_replicate=par.data_parallel_replicate_degree, dp_shard=par.data_parallel_shard_degree,
                 cp=par.context_parallel_degree, tp=par.tensor_parallel_degree, pp=par.pipeline_parallel_degree,
                 ep=par.expert_parallel_degree, world_size=world)


@pytest.mark.parametrize("name", [n for n in PLANS if not n.startswith("gpt2")])
@pytest.mark.parametrize("zero, recompute", [(3, "none"), (0, "full"), (3, "selective")])
def test_torchtitan_03_python_config_loads(name: str, zero: int, recompute: str) -> None:
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC
    from torchtitan.distributed.pipeline_parallel import _generate_llm_fqn_per_model_part

    plan, result = export(name, "torchtitan", "0.3", zero=zero, recompute=recompute)
    config = run_torchtitan_python(result.text)
    par, training = config.parallelism, config.training
    check_torchtitan_degrees(par, plan.num_devices)
    first = plan.stages[0]
    assert (par.data_parallel_shard_degree, par.data_parallel_replicate_degree) == \
        ((first.dp, 1) if zero == 3 else (1, first.dp))  # ZeRO-0: HSDP of shard degree 1, which runs with TP/PP
    assert par.tensor_parallel_degree == first.tp and par.enable_sequence_parallel == first.sequence_parallel
    assert training.global_batch_size == plan.global_batch_size and training.seq_len == 8192
    dp = first.dp
    if plan.pp > 1:
        assert training.local_batch_size // par.pipeline_parallel_microbatch_size == plan.num_micro_batches
        parts = par.module_fqns_per_model_part
        v = plan.virtual_stages if plan.schedule == "interleaved-1f1b" else 1
        assert len(parts) == plan.pp * v
        assert [n for part in parts for n in part] == _generate_llm_fqn_per_model_part(1, 32)[0]
        assert par.pipeline_parallel_schedule == ("Interleaved1F1B" if v > 1 else "1F1B")
        if v == 1:
            assert [len(p) for p in parts] == [s.num_layers + (1 if j == plan.pp - 1 else 0)  # norm + lm_head
                                              for j, s in enumerate(plan.stages)]
    else:
        assert training.global_batch_size // (training.local_batch_size * dp) == plan.num_micro_batches
    expected = {"none": type(None), "full": FullAC.Config, "selective": SelectiveAC.Config}[recompute]
    assert isinstance(config.activation_checkpoint, expected)
    # Trainer.Config.__post_init__ refuses CUDA graphs with PP: the export turns them off there only
    assert training.disable_cuda_graphs == (plan.pp > 1)


def test_torchtitan_03_refuses_unknown_fields() -> None:
    """The check can fail: a field ParallelismConfig does not have raises."""
    _, result = export("dp8", "torchtitan", "0.3", zero=3)
    run_torchtitan_python(result.text)
    def renamed(old: str, new: str) -> str:
        text = re.sub(f"([\"']){old}\\1", f"'{new}'", result.text)
        assert text != result.text
        return text

    with pytest.raises(TypeError, match="unexpected keyword"):
        run_torchtitan_python(renamed("tensor_parallel_degree", "tensor_parallel_size"))
    with pytest.raises(AttributeError):  # TrainingConfig is a slots dataclass
        run_torchtitan_python(renamed("local_batch_size", "micro_batch_size"))
    _, piped = export("dp2-tp2-pp2", "torchtitan", "0.3", zero=3)
    with pytest.raises(ValueError, match="CUDA graphs do not support pipeline parallelism"):
        run_torchtitan_python(piped.text.replace("'disable_cuda_graphs': True", "'disable_cuda_graphs': False"))


def test_torchtitan_03_preset_registry_function() -> None:
    _, result = export("dp8", "torchtitan", "0.3", zero=3)
    tree = ast.parse(result.text)
    functions = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
    assert functions == {"apply_plan", "hetplan_llama3_8b"}
    assert "from torchtitan.models.llama3.config_registry import llama3_8b" in result.text
    source = Path(sys.modules["torchtitan.config"].__file__).parents[1] / "models/llama3/config_registry.py"
    assert "def llama3_8b() -> Trainer.Config:" in source.read_text()


def test_torchtitan_presets_are_torchtitans_models() -> None:
    """The shapes export matches a model to torchtitan's presets by are the
    installed torchtitan's own (model_registry of each flavor)."""
    from hetplan.export.tools import TORCHTITAN_PRESETS

    torchtitan_trainer()
    for preset in TORCHTITAN_PRESETS.values():
        registry = __import__(f"torchtitan.models.{preset.module}", fromlist=["model_registry"]).model_registry
        model = registry(preset.flavor).model
        attention, ffn = model.layers[0].attention, model.layers[0].feed_forward
        shape = (model.dim, len(model.layers), attention.n_heads, attention.n_kv_heads, ffn.w1.out_features,
                 model.vocab_size, float(attention.rope.theta))
        assert shape == (preset.hidden, preset.blocks, preset.heads, preset.kv_heads, preset.ffn, preset.vocab,
                         preset.rope_theta), preset
        config_registry = __import__(f"torchtitan.models.{preset.module}.config_registry", fromlist=["x"])
        assert getattr(config_registry, preset.function)().model_spec.flavor == preset.flavor


# --------------------------------------------------------------------------- torchtitan 0.2.x (TOML)

TORCHTITAN_02_CHECK = r'''
import ast, json, math, os, sys, types, importlib.util
# torchtitan 0.2.2's package __init__ imports its MoE kernels (triton, GPU only); load the package
# without it: torchtitan.config and everything it imports are 0.2.2's own code.
root = os.path.dirname(importlib.util.find_spec("torchtitan").origin)
assert root.startswith(sys.argv[1]), root
pkg = types.ModuleType("torchtitan"); pkg.__path__ = [root]; sys.modules["torchtitan"] = pkg
from torchtitan.config import ConfigManager
from torchtitan.distributed.parallel_dims import ParallelDims
# torchtitan's own pipeline-name generator (its module imports triton: run just the function)
source = open(os.path.join(root, "distributed", "pipeline_parallel.py")).read()
fn = next(n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef) and n.name == "generate_llm_fqn_per_model_part")
space = {"math": math}; exec(compile(ast.Module([fn], []), "pipeline_parallel.py", "exec"), space)
results = {}
for path, world, layers in json.loads(sys.argv[2]):
    try:
        c = ConfigManager().parse_args(["--job.config_file", path])
        p = c.parallelism
        ParallelDims(dp_replicate=p.data_parallel_replicate_degree, dp_shard=p.data_parallel_shard_degree,
                     cp=p.context_parallel_degree, tp=p.tensor_parallel_degree, pp=p.pipeline_parallel_degree,
                     ep=p.expert_parallel_degree, etp=p.expert_tensor_parallel_degree, world_size=world)
        results[path] = {"parallelism": vars(p), "training": {k: v for k, v in vars(c.training).items() if k != "dataloader"},
                         "ac": vars(c.activation_checkpoint), "model": [c.model.name, c.model.flavor],
                         "names": space["generate_llm_fqn_per_model_part"](1, layers)[0]}
    except Exception as exc:
        results[path] = {"error": f"{type(exc).__name__}: {exc}"}
print(json.dumps(results))
'''


def parse_with_torchtitan_02(files: list[tuple[Path, int, int]]) -> dict[str, Any]:
    """torchtitan 0.2.2's ConfigManager on each (TOML file, world size, blocks), in one subprocess."""
    if not (TORCHTITAN_OLD / "torchtitan").is_dir():
        pytest.skip(f"torchtitan 0.2.2 is not in {TORCHTITAN_OLD} (make installs it)")
    env = {**os.environ, "PYTHONPATH": str(TORCHTITAN_OLD)}
    done = subprocess.run([sys.executable, "-c", TORCHTITAN_02_CHECK, str(TORCHTITAN_OLD),
                           json.dumps([[str(p), w, n] for p, w, n in files])],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


CASES_02 = [(name, zero, rc) for name in PLANS if not name.startswith("gpt2")
            for zero, rc in [(3, "none"), (3, "full"), (3, "selective"), (0, "none")]
            if not (zero == 0 and name not in ("dp8",))]  # ZeRO-0 with TP/PP: refused for 0.2 (below)


def test_torchtitan_02_toml_loads(tmp_path: Path) -> None:
    files, expected = [], {}
    for name, zero, rc in CASES_02:
        plan, result = export(name, "torchtitan", "0.2", zero=zero, recompute=rc)
        path = tmp_path / f"{name}-z{zero}-{rc}.toml"
        path.write_text(result.text)
        files.append((path, plan.num_devices, 32))
        expected[str(path)] = (plan, result.data)
    bad = tmp_path / "bad.toml"  # the field 0.2.x refused: the check can fail
    bad.write_text(files[0][0].read_text().replace("[parallelism]", "[parallelism]\nenable_sequence_parallel = true"))
    files.append((bad, 8, 32))
    results = parse_with_torchtitan_02(files)
    assert "Invalid field names" in results.pop(str(bad))["error"]
    for path, got in results.items():
        plan, data = expected[path]
        assert "error" not in got, (path, got)
        assert {k: got["parallelism"][k] for k in data["parallelism"]} == data["parallelism"], path
        assert {k: got["training"][k] for k in data["training"]} == data["training"], path
        assert got["ac"]["mode"] == data["activation_checkpoint"]["mode"]
        assert got["model"] == ["llama3", "8B"]
        parts = data["parallelism"].get("module_fqns_per_model_part")
        if parts:
            assert [n for part in parts for n in part] == got["names"]  # tok_embeddings ... norm, output


def test_torchtitan_02_toml_is_the_data() -> None:
    """Every 0.2 job file reads back (Python's tomllib) as exactly the data the
    export computed, its notes as comments; nested tables and a multi-line
    note too (a hand-written writer printed those as JSON, which is not TOML)."""
    for name, zero, rc in CASES_02:
        _, result = export(name, "torchtitan", "0.2", zero=zero, recompute=rc)
        assert tomllib.loads(result.text) == result.data, (name, zero, rc)
        assert result.text.startswith("# torchtitan ")
    data = {"model": {"name": "llama3", "flavor": "8B"},
            "quantize": {"linear": {"float8": {"filter_fqns": ["output", 'a "b" \\ c']}}}, "training": {"lr": 3e-4}}
    text = to_toml(data, ["first note", "two\nlines"])
    assert tomllib.loads(text) == data
    assert text.startswith("# first note\n# two\n# lines\n\n")


def test_torchtitan_02_never_writes_sequence_parallel_field() -> None:
    _, result = export("tp4-pp2-sp", "torchtitan", "0.2", zero=3)
    assert "enable_sequence_parallel" not in result.text
    _, result = export("dp2-tp2-pp2", "torchtitan", "0.2", zero=3)
    assert any("always shards" in n for n in result.notes) and "# note: torchtitan 0.2.x always" in result.text


# --------------------------------------------------------------------------- Megatron-LM


class ArgumentError(Exception):
    pass


class StrictParser(argparse.ArgumentParser):
    def error(self, message: str) -> None:
        raise ArgumentError(message)


def megatron_parser() -> argparse.ArgumentParser:
    """Megatron-LM core_v0.16.1's parser, rebuilt from its dumped options."""
    data = json.loads(MEGATRON_ARGS.read_text())
    assert data["tag"] == "core_v0.16.1"
    parser = StrictParser(allow_abbrev=False, add_help=False)
    types_ = {"int": int, "float": float, "str": str, None: None}
    for o in data["options"]:
        kw: dict[str, Any] = {"dest": o["dest"]}
        if not isinstance(o["default"], dict):  # defaults that are objects ({"repr": ...}) stay None here
            kw["default"] = o["default"]
        if o["action"] in ("store_true", "store_false"):
            kw["action"] = o["action"]
        elif o["action"] == "boolean_optional":
            kw["action"] = argparse.BooleanOptionalAction
            o["flags"] = [f for f in o["flags"] if not f.startswith("--no-")]
        elif o["action"] in ("store_const", "count", "append_const"):
            kw["action"] = "store_true"
        else:
            kw["action"] = "append" if o["action"] == "append" else "store"
            if o["nargs"] is not None:
                kw["nargs"] = o["nargs"]
            if o["type"]:
                kw["type"] = types_[o["type"]]
            if o["choices"]:
                kw["choices"] = o["choices"]
        parser.add_argument(*o["flags"], **kw)
    return parser


def megatron_args(command: str) -> list[str]:
    import shlex

    words = shlex.split(command)
    return words[words.index("pretrain_gpt.py") + 1:]


def check_megatron(args: list[str], world: int) -> argparse.Namespace:
    """Parse with Megatron's options, apply validate_args' rules on sizes, and
    build megatron-core's TransformerConfig (which checks shape, TP, recompute
    and the pipeline layout) as core_transformer_config_from_args does."""
    import torch
    import torch.nn.functional as F
    from megatron.core.transformer import TransformerConfig

    a = megatron_parser().parse_args(args)
    # validate_args (megatron/training/arguments.py, core_v0.16.1): the sizes
    model_parallel = a.tensor_model_parallel_size * a.pipeline_model_parallel_size * a.context_parallel_size
    assert world % model_parallel == 0
    dp = world // model_parallel
    if a.num_experts:  # the expert region: etp x ep x expert-dp x pp covers the same ranks
        etp = a.expert_tensor_parallel_size or a.tensor_model_parallel_size
        assert world % (etp * a.expert_model_parallel_size * a.pipeline_model_parallel_size) == 0
    assert a.global_batch_size % (a.micro_batch_size * dp) == 0
    if a.pipeline_model_parallel_layout is None and a.num_virtual_stages_per_pipeline_rank is None:
        assert a.num_layers % a.pipeline_model_parallel_size == 0
    assert not (a.fp16 and a.bf16)
    vpp = a.num_virtual_stages_per_pipeline_rank
    if a.pipeline_model_parallel_layout:
        from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout

        stages = PipelineParallelLayerLayout.get_num_stages_from_str(a.pipeline_model_parallel_layout)
        assert stages % a.pipeline_model_parallel_size == 0
        vpp = stages // a.pipeline_model_parallel_size
    config = TransformerConfig(
        num_layers=a.num_layers, hidden_size=a.hidden_size, num_attention_heads=a.num_attention_heads,
        num_query_groups=a.num_query_groups if a.group_query_attention else None,
        ffn_hidden_size=a.ffn_hidden_size, kv_channels=a.kv_channels,
        gated_linear_unit=a.swiglu, activation_func=F.silu if a.swiglu else F.gelu,
        normalization=a.normalization, add_bias_linear=a.add_bias_linear, add_qkv_bias=a.add_qkv_bias,
        hidden_dropout=a.hidden_dropout, attention_dropout=a.attention_dropout,
        tensor_model_parallel_size=a.tensor_model_parallel_size,
        pipeline_model_parallel_size=a.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=vpp if vpp and vpp > 1 else None,
        sequence_parallel=a.sequence_parallel and a.tensor_model_parallel_size > 1,
        recompute_granularity=a.recompute_granularity, recompute_method=a.recompute_method,
        recompute_num_layers=a.recompute_num_layers,
        pipeline_model_parallel_layout=a.pipeline_model_parallel_layout,
        bf16=a.bf16, fp16=a.fp16,
        pipeline_dtype=torch.bfloat16 if a.bf16 else torch.float16 if a.fp16 else torch.float32,
        context_parallel_size=a.context_parallel_size, expert_model_parallel_size=a.expert_model_parallel_size,
        **(_megatron_moe_config(a) if a.num_experts else {}),
    )
    a.transformer_config = config
    return a


def _megatron_moe_config(a: argparse.Namespace) -> dict[str, Any]:
    """TransformerConfig's MoE fields as core_transformer_config_from_args fills them."""
    freq = a.moe_layer_freq
    return {"num_moe_experts": a.num_experts, "moe_router_topk": a.moe_router_topk,
            "moe_ffn_hidden_size": a.moe_ffn_hidden_size, "moe_token_dispatcher_type": a.moe_token_dispatcher_type,
            "expert_tensor_parallel_size": a.expert_tensor_parallel_size,
            "moe_shared_expert_intermediate_size": a.moe_shared_expert_intermediate_size,
            "moe_expert_capacity_factor": a.moe_expert_capacity_factor,
            "moe_layer_freq": ast.literal_eval(freq) if isinstance(freq, str) else freq}


MEGATRON_CASES = [(name, zero, rc) for name in PLANS for zero, rc in [(0, "none"), (1, "full"), (1, "selective")]]


@pytest.mark.parametrize("name, zero, recompute", MEGATRON_CASES)
def test_megatron_command_parses(name: str, zero: int, recompute: str) -> None:
    pytest.importorskip("megatron.core", reason="make installs megatron-core (pyproject's tools extra)")
    plan, result = export(name, "megatron", zero=zero, recompute=recompute)
    commands = result.data
    assert sum(int(re.search(r"--nproc-per-node=(\d+)", c).group(1)) for _, c in commands) == plan.num_devices
    assert {re.search(r"--nnodes=(\d+)", c).group(1) for _, c in commands} == {str(len(commands))}
    args = megatron_args(commands[0][1])
    assert all(megatron_args(c) == args for _, c in commands)
    a = check_megatron(args, plan.num_devices)
    spec = get_model(plan.model)
    first = plan.stages[0]
    assert a.micro_batch_size == first.dp_split[0] and a.global_batch_size == plan.global_batch_size
    assert a.use_distributed_optimizer == (zero == 1)
    assert (a.recompute_granularity or "none") == recompute
    assert a.seq_length == spec.seq_len and a.hidden_size == spec.hidden_size
    if spec.family == "llama":
        assert a.group_query_attention and a.num_query_groups == 8 and a.swiglu and a.normalization == "RMSNorm"
        assert a.ffn_hidden_size == 14336 and a.bf16 and a.untie_embeddings_and_output_weights
    else:
        assert not a.group_query_attention and not a.swiglu and a.normalization == "LayerNorm"
    if name == "pp4-uneven":  # embed + 5 blocks | 10 | 10 | 7 blocks + head
        assert a.pipeline_model_parallel_layout == "Ettttt|tttttttttt|tttttttttt|tttttttL"
    if name == "pp2-interleaved":
        assert a.transformer_config.virtual_pipeline_model_parallel_size == 2


def test_megatron_parser_can_fail() -> None:
    """A flag Megatron does not have, or a value outside its choices, fails the check."""
    _, result = export("pp4-uneven", "megatron")
    args = megatron_args(result.data[0][1])
    with pytest.raises(ArgumentError, match="unrecognized"):
        megatron_parser().parse_args(args + ["--sequence-parallelism"])
    with pytest.raises(ArgumentError, match="invalid choice"):
        megatron_parser().parse_args([a if a != "RMSNorm" else "rmsnorm" for a in args])
    broken = [a.replace("Ettttt|", "Etttt|") for a in args]  # 31 blocks in the layout, 32 in the model
    with pytest.raises((AssertionError, ValueError)):
        check_megatron(broken, 8)


def test_megatron_real_parse_args_when_megatron_lm_is_on_the_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """Megatron-LM's own parse_args + validate_args (skipped unless its training code imports)."""
    arguments = pytest.importorskip("megatron.training.arguments", reason="Megatron-LM is not on PyPI")
    monkeypatch.setattr(arguments, "get_device_arch_version", lambda: 9)  # no GPU here: say Hopper
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    for name, zero, rc in MEGATRON_CASES:
        plan, result = export(name, "megatron", zero=zero, recompute=rc)
        monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *megatron_args(result.data[0][1])])
        monkeypatch.setenv("WORLD_SIZE", str(plan.num_devices))
        monkeypatch.setenv("RANK", "0")
        args = arguments.parse_args(ignore_unknown_args=False)
        arguments.validate_args(args, {})
        assert args.data_parallel_size == plan.stages[0].dp, name


def test_megatron_nodes_and_ranks() -> None:
    """Megatron numbers ranks TP fastest, then DP, then PP; torchrun node by node."""
    plan, result = export("dp2-tp2-pp2", "megatron")  # 8 GPUs of node 0
    assert [n for n, _ in result.data] == [0] and "CUDA_VISIBLE_DEVICES=0,1,2,3,4,5,6,7 torchrun" in result.text
    stages = tuple(replace(s, devices=tuple(d + 4 for d in s.devices)) for s in plan.stages)  # GPUs 4..11
    moved = plan.with_changes(stages=stages)
    commands = render(moved, get_model(moved.model), "megatron", load_cluster(moved.cluster)).data
    assert [n for n, _ in commands] == [0, 1]
    assert "CUDA_VISIBLE_DEVICES=4,5,6,7 torchrun --nnodes=2 --node-rank=0" in commands[0][1]
    assert "CUDA_VISIBLE_DEVICES=0,1,2,3 torchrun --nnodes=2 --node-rank=1" in commands[1][1]
    # stage 0 on node 1 and stage 1 on node 0: ranks 0-3 on node 1
    swapped = plan.with_changes(stages=(replace(plan.stages[0], devices=tuple(range(8, 12))), plan.stages[1]))
    commands = render(swapped, get_model(swapped.model), "megatron", load_cluster(swapped.cluster)).data
    assert [n for n, _ in commands] == [1, 0]
    split = plan.with_changes(stages=(replace(plan.stages[0], devices=(0, 1, 8, 9)),
                                      replace(plan.stages[1], devices=(2, 3, 10, 11))))
    one_line_refusal(split, "megatron", "0.3", "consecutive ranks", "node 0")


# --------------------------------------------------------------------------- DeepSpeed

DS_CASES = [("dp8", zero, rc) for zero in (0, 1, 2, 3) for rc in ("none", "selective", "full")] + \
           [("dp2-tp4", zero, "full") for zero in (1, 3)] + \
           [(name, zero, rc) for name in ("pp4-uneven", "gpt2-dp4-pp2") for zero in (0, 1) for rc in ("none", "full")]
PLANS["dp2-tp4"] = lambda **kw: make_plan("llama3-8b", [34], 2, 4, **kw)


def deepspeed_config(config: dict[str, Any], plan: Plan, monkeypatch: pytest.MonkeyPatch) -> Any:
    """DeepSpeedConfig as deepspeed.initialize builds it (deepspeed/__init__.py:553-571, 0.19.8) on the plan's
    GPUs: for a model given whole (AutoTP included, as its tutorial and HF Trainer call it) with no mpu, so it
    counts every rank as data-parallel; for a PipelineModule with the module's mpu (its grid's data-parallel
    size: the plan's dp)."""
    ds_config = pytest.importorskip("deepspeed.runtime.config")

    class PipelineMPU:  # what DeepSpeedConfig asks of PipelineModule.mpu()
        def get_data_parallel_world_size(self) -> int:
            return plan.stages[0].dp

    monkeypatch.setattr(ds_config.dist, "get_rank", lambda *a, **k: 0)
    monkeypatch.setattr(ds_config.dist, "get_world_size", lambda *a, **k: plan.num_devices)
    mpu = PipelineMPU() if plan.pp > 1 else None

    class Reads(dict):  # records the top-level keys DeepSpeed reads
        read: set[str]

        def get(self, key: Any, default: Any = None) -> Any:
            self.read.add(key)
            return super().get(key, default)

        def __getitem__(self, key: Any) -> Any:
            self.read.add(key)
            return super().__getitem__(key)

        def __contains__(self, key: Any) -> bool:
            self.read.add(key)
            return super().__contains__(key)

    wrapped = Reads(config)
    wrapped.read = set()
    parsed = ds_config.DeepSpeedConfig(wrapped, mpu=mpu)
    unread = set(config) - wrapped.read
    assert not unread, f"DeepSpeed ignores {unread}"
    return parsed


@pytest.mark.parametrize("name, zero, recompute", DS_CASES)
def test_deepspeed_config_loads(name: str, zero: int, recompute: str, monkeypatch: pytest.MonkeyPatch) -> None:
    plan, result = export(name, "deepspeed", zero=zero, recompute=recompute)
    first = plan.stages[0]
    parsed = deepspeed_config(result.data, plan, monkeypatch)
    # DeepSpeed's train_batch_size counts an AutoTP group's ranks as data-parallel (no mpu): tp x the samples
    assert parsed.train_batch_size == plan.global_batch_size * (first.tp if plan.pp == 1 else 1)
    assert parsed.train_micro_batch_size_per_gpu == first.dp_split[0]
    assert parsed.gradient_accumulation_steps == plan.num_micro_batches
    assert parsed.zero_optimization_stage == zero
    assert parsed.tensor_parallel_config.autotp_size == (first.tp if first.tp > 1 else 0)
    assert parsed.bfloat16_config.enabled == (get_model(plan.model).dtype_bytes == 2)
    if recompute == "none":
        assert "activation_checkpointing" not in result.data
    else:  # the block turns nothing on: a note says what code must
        assert any("deepspeed.checkpointing.checkpoint" in n or "activation_checkpoint_interval=1" in n
                   for n in result.notes)
        assert any(("attention core" in n) == (recompute == "selective") for n in result.notes
                   if "turns nothing on" in n)


def test_deepspeed_rejects_what_it_does_not_know(monkeypatch: pytest.MonkeyPatch) -> None:
    """The checks can fail: an unknown key in a section, and a top-level key DeepSpeed ignores."""
    plan, result = export("dp8", "deepspeed", zero=1)
    with pytest.raises(Exception, match="(?i)extra"):
        deepspeed_config({**result.data, "zero_optimization": {"stage": 1, "stages": 1}}, plan, monkeypatch)
    with pytest.raises(AssertionError, match="ignores"):
        deepspeed_config({**result.data, "zero_optimisation": {"stage": 1}}, plan, monkeypatch)
    with pytest.raises(AssertionError):  # batch sizes that do not add up
        deepspeed_config({**result.data, "train_batch_size": 7}, plan, monkeypatch)
    # the plan's batch as train_batch_size: DeepSpeed without an mpu counts the AutoTP ranks as data-parallel
    _, autotp = export("dp2-tp4", "deepspeed", zero=1)
    with pytest.raises(AssertionError, match="8 != 1 \\* 4 \\* 8"):
        deepspeed_config({**autotp.data, "train_batch_size": 8}, PLANS["dp2-tp4"](zero=1), monkeypatch)


@pytest.mark.parametrize("name", ["pp4-uneven", "gpt2-dp4-pp2"])
def test_deepspeed_pipeline_code(name: str) -> None:
    """The PipelineModule code splits the layers at the plan's boundaries,
    run against DeepSpeed's own PipelineModule."""
    pipe = pytest.importorskip("deepspeed.pipe")
    from deepspeed.runtime.utils import partition_uniform as ds_uniform

    plan, result = export(name, "deepspeed", zero=1, recompute="full")
    code = result.files[".pipeline.py"]
    module = types.ModuleType("hetplan_ds_pipeline")
    exec(compile(code, "pipeline.py", "exec"), module.__dict__)
    parts = module.PARTS
    assert parts == [0] + [sum(s.num_layers for s in plan.stages[:j + 1]) for j in range(plan.pp)]
    assert "activation_checkpoint_interval=1" in code
    _assert_blocks_only_checkpointed(module, pipe.PipelineModule)
    if parts == ds_uniform(parts[-1], plan.pp):
        assert 'partition_method="uniform"' in code and not hasattr(module, "PlanPipelineModule")
        return
    cls = module.PlanPipelineModule
    assert issubclass(cls, pipe.PipelineModule)
    for stage in range(plan.pp):  # DeepSpeed's own _set_bounds on each pipeline rank
        obj = object.__new__(cls)
        obj._layer_specs, obj.num_stages, obj.global_rank = [None] * parts[-1], plan.pp, 0
        obj._topo = types.SimpleNamespace(get_coord=lambda rank, s=stage: types.SimpleNamespace(pipe=s))
        obj._partition_layers(method="parameters")
        assert (obj._local_start, obj._local_stop) == (parts[stage], parts[stage + 1])
    obj._layer_specs = [None] * (parts[-1] + 1)
    with pytest.raises(ValueError, match="splits"):
        obj._partition_layers()


def _assert_blocks_only_checkpointed(module: types.ModuleType, pipeline_module: type) -> None:
    """DeepSpeed's own ``_is_checkpointable`` on the exported build's
    ``checkpointable_layers``: the blocks, never the embedding (whose weights a
    reentrant checkpoint leaves without a gradient) or the head."""
    import torch
    from deepspeed.runtime.activation_checkpointing import checkpointing

    kinds = {i: "Block" for i in module.BLOCKS}
    classes = {name: type(name, (torch.nn.Linear,), {}) for name in ("Embed", "Block", "Head")}
    layers = [classes[kinds.get(i, "Head" if i else "Embed")](1, 1) for i in range(module.PARTS[-1])]
    owner = object.__new__(pipeline_module)
    owner.activation_checkpoint_func = checkpointing.checkpoint
    owner.checkpointable_layers = module.checkpointable_layers(layers)
    wrapped = [pipeline_module._is_checkpointable(owner, [layer]) for layer in layers]
    assert wrapped == [i in kinds for i in range(len(layers))]


def test_partition_uniform_is_deepspeeds() -> None:
    utils = pytest.importorskip("deepspeed.runtime.utils")
    for items in range(1, 40):
        for parts in range(1, 9):
            assert partition_uniform(items, parts) == utils.partition_uniform(items, parts), (items, parts)


# --------------------------------------------------------------------------- refusals


def mixed(plan: Plan, **change: Any) -> Plan:
    """``plan`` with the first layer of its last stage's strategy changed."""
    last = plan.stages[-1]
    strategies = (replace(last.strategies[1], **change),) + last.strategies[1:]
    stage = replace(last, strategies=strategies)
    return plan.with_changes(stages=plan.stages[:-1] + (stage,))


REFUSALS = [
    (lambda: mixed(make_plan("llama3-8b", [17, 17], 2, 1, zero=1), zero=3), ("torchtitan", "megatron", "deepspeed"),
     "one ZeRO stage"),
    (lambda: mixed(make_plan("llama3-8b", [17, 17], 2, 1, recompute="full"), recompute="selective"),
     ("torchtitan", "megatron", "deepspeed"), "mixes ['full', 'selective']"),
    (lambda: make_plan("llama3-8b", [17, 17], 2, 1).with_changes(stages=(
        make_plan("llama3-8b", [17, 17], 2, 1).stages[0],
        replace(make_plan("llama3-8b", [17, 17], 2, 1).stages[1], dp_split=(2, 0)))),
     ("torchtitan", "megatron", "deepspeed"), "splits batches evenly"),
    (lambda: make_plan("llama3-8b", [17, 17], 2, 1).with_changes(stages=(
        make_plan("llama3-8b", [17, 17], 2, 1).stages[0],
        uniform_stage(range(17, 34), range(4, 8), 1, 4, 2))),
     ("torchtitan", "megatron", "deepspeed"), "one (dp, tp) on every stage"),
    (lambda: make_plan("llama3-8b", [34], 4, 2).with_changes(stages=(replace(
        make_plan("llama3-8b", [34], 4, 2).stages[0],
        strategies=(LayerStrategy(tp=1),) + make_plan("llama3-8b", [34], 4, 2).stages[0].strategies[1:]),)),
     ("torchtitan", "megatron", "deepspeed"), "their own tp"),
    (lambda: make_plan("llama3-8b", [34], 8, 1, zero=1), ("torchtitan",), "ZeRO-1 has no setting"),
    (lambda: make_plan("llama3-8b", [34], 8, 1, zero=2), ("megatron",), "ZeRO-2"),
    (lambda: make_plan("llama3-8b", [17, 17], 2, 2, zero=2), ("deepspeed",), "ZeRO-0/1 only"),
    (lambda: make_plan("llama3-8b", [17, 17], 2, 2), ("deepspeed",), "AutoTP"),
    (lambda: make_plan("llama3-8b", [17, 17], 2, 1, schedule="gpipe"), ("megatron",), "not GPipe"),
    (lambda: make_plan("gpt2-amp", [13, 13], 4, 1, zero=3), ("torchtitan",), "no model for 'gpt2-amp'"),
    (lambda: make_plan("bert-huge-32", [get_model("bert-huge-32").num_layers], 8, 1), ("megatron",),
     "family 'bert'"),
]


@pytest.mark.parametrize("index", range(len(REFUSALS)))
def test_plans_a_tool_cannot_express_are_refused_in_one_line(index: int) -> None:
    build, formats, fragment = REFUSALS[index]
    plan = build()
    for fmt in formats:
        one_line_refusal(plan, fmt, "0.3", fragment)


def test_torchtitan_02_refuses_zero0_with_tp_or_pp_and_03_maps_it_to_hsdp() -> None:
    plan = make_plan("llama3-8b", [17, 17], 2, 2)
    one_line_refusal(plan, "torchtitan", "0.2", "DDP has not supported > 1D parallelism")
    data = render(plan, get_model(plan.model), "torchtitan", None, "0.3").data
    assert data["parallelism"]["data_parallel_replicate_degree"] == 2
    assert data["parallelism"]["data_parallel_shard_degree"] == 1


def test_model_without_architecture_is_refused_for_megatron() -> None:
    spec = get_model("llama3-8b")
    bare = replace(spec, meta={})
    plan = make_plan("llama3-8b", [34], 8, 1)
    with pytest.raises(HetplanError, match="gives no architecture") as info:
        render(plan, bare, "megatron", load_cluster(plan.cluster))
    assert "\n" not in str(info.value)
    bad = replace(spec, meta={"architecture": {**spec.meta["architecture"], "kv_heads": "eight"}})
    with pytest.raises(HetplanError, match="kv_heads"):
        render(plan, bad, "megatron", load_cluster(plan.cluster))


# --------------------------------------------------------------------------- the install


def test_makefile_installs_the_tools_extra() -> None:
    """pyproject's `tools` extra and the Makefile's TOOLS list are the same pins."""
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["tools"]
    makefile = (ROOT / "Makefile").read_text()
    block = re.search(r"^TOOLS := (.*?)(?<!\\)\n", makefile, re.S | re.M).group(1)
    assert sorted(block.replace("\\\n", " ").split()) == sorted(extra)
    assert all("==" in pin for pin in extra)


# --------------------------------------------------------------------------- context and expert parallelism


def with_cp_ep(plan: Plan, cp: int = 1, ep: int = 1) -> Plan:
    """``plan`` with every stage given context-parallel degree ``cp`` (more
    devices: dp x cp x tp, consecutive) and expert-parallel degree ``ep``."""
    stages, device = [], 0
    for stage in plan.stages:
        n = stage.dp * cp * stage.tp
        stages.append(replace(stage, cp=cp, ep=ep, devices=tuple(range(device, device + n))))
        device += n
    return plan.with_changes(stages=tuple(stages))


CP_EP_PLANS = {  # (plan, world size)
    "llama-dp2-cp2-tp2-pp2": lambda **kw: with_cp_ep(make_plan("llama3-8b", [17, 17], 2, 2, **kw), cp=2),
    "llama-dp4-cp4": lambda **kw: with_cp_ep(make_plan("llama3-8b", [34], 4, 1, **kw), cp=4),
    "mixtral-dp8-ep8": lambda **kw: with_cp_ep(make_plan("mixtral-8x7b", [34], 8, 1, **kw), ep=8),
    "mixtral-dp4-cp2-ep4-tp2": lambda **kw: with_cp_ep(make_plan("mixtral-8x7b", [34], 4, 2, **kw), cp=2, ep=4),
}


@pytest.mark.parametrize("name", CP_EP_PLANS)
def test_cp_ep_megatron_command_parses(name: str) -> None:
    """--context-parallel-size, --expert-model-parallel-size and the MoE shape
    go through Megatron's parser and megatron-core's TransformerConfig."""
    pytest.importorskip("megatron.core", reason="make installs megatron-core (pyproject's tools extra)")
    plan = CP_EP_PLANS[name](zero=1)
    spec = get_model(plan.model)
    result = render(plan, spec, "megatron", load_cluster(plan.cluster))
    a = check_megatron(megatron_args(result.data[0][1]), plan.num_devices)
    first = plan.stages[0]
    assert a.context_parallel_size == first.cp == a.transformer_config.context_parallel_size
    assert a.tensor_model_parallel_size == first.tp
    if spec.family == "moe":
        config = a.transformer_config
        assert (config.num_moe_experts, config.moe_router_topk, config.moe_ffn_hidden_size) == (8, 2, 14336)
        assert config.expert_model_parallel_size == first.ep and config.expert_tensor_parallel_size == first.tp
        assert a.moe_token_dispatcher_type == "alltoall" and a.rotary_base == 1e6
    else:
        assert a.num_experts is None


def test_cp_ep_megatron_checks_can_fail() -> None:
    """megatron-core refuses EP without experts and more EP ranks than experts divide."""
    pytest.importorskip("megatron.core", reason="make installs megatron-core (pyproject's tools extra)")
    plan = CP_EP_PLANS["mixtral-dp8-ep8"](zero=1)
    args = megatron_args(render(plan, get_model(plan.model), "megatron", load_cluster(plan.cluster)).data[0][1])
    without = args[:args.index("--num-experts")] + args[args.index("--num-experts") + 2:]
    with pytest.raises(ValueError, match="num_moe_experts"):
        check_megatron(without, plan.num_devices)


@pytest.mark.parametrize("name", CP_EP_PLANS)
def test_cp_ep_torchtitan_03(name: str) -> None:
    plan = CP_EP_PLANS[name](zero=3)
    first = plan.stages[0]
    if first.ep > 1 and first.tp > 1:  # 0.3 runs experts without TP: refused with the reason
        one_line_refusal(plan, "torchtitan", "0.3", "torchtitan 0.3", "tp")
        return
    result = render(plan, get_model(plan.model), "torchtitan", load_cluster(plan.cluster), "0.3")
    base = torchtitan_moe_config() if first.ep > 1 else None  # a MoE model: the dispatcher check runs
    config = run_torchtitan_python(result.text, base)
    par = config.parallelism
    check_torchtitan_degrees(par, plan.num_devices)  # ParallelDims: dp x cp x tp x pp = world
    assert (par.context_parallel_degree, par.expert_parallel_degree) == (first.cp, first.ep)
    assert config.training.disable_cuda_graphs == (first.ep > 1 or plan.pp > 1)
    if first.ep > 1:  # the check can fail: EP with CUDA graphs and torchtitan's default dispatcher
        with pytest.raises(ValueError, match="token dispatcher"):
            run_torchtitan_python(result.text.replace("'disable_cuda_graphs': True", "'disable_cuda_graphs': False"),
                                  torchtitan_moe_config())


def torchtitan_moe_config() -> Any:
    """A Trainer.Config of a torchtitan MoE model (qwen3's debugmodel_moe,
    its default all-to-all token dispatcher): Trainer.Config checks EP
    against the model's dispatchers."""
    torchtitan_trainer()
    from torchtitan.models.qwen3 import model_registry

    return torchtitan_trainer().Config(model_spec=model_registry("debugmodel_moe"))


def test_cp_ep_torchtitan_02(tmp_path: Path) -> None:
    files, expected = [], {}
    for name, make in CP_EP_PLANS.items():
        plan = make(zero=3)
        result = render(plan, get_model(plan.model), "torchtitan", load_cluster(plan.cluster), "0.2")
        path = tmp_path / f"{name}.toml"
        path.write_text(result.text)
        files.append((path, plan.num_devices, 32))
        expected[str(path)] = plan
    bad = tmp_path / "bad.toml"  # ETP other than 1 or tp: torchtitan's ParallelDims refuses it
    bad.write_text(files[-1][0].read_text().replace("expert_tensor_parallel_degree = 2",
                                                    "expert_tensor_parallel_degree = 4"))
    files.append((bad, 16, 32))
    results = parse_with_torchtitan_02(files)
    assert "ETP" in results.pop(str(bad))["error"]
    for path, got in results.items():
        assert "error" not in got, (path, got)
        first = expected[path].stages[0]
        par = got["parallelism"]
        assert (par["context_parallel_degree"], par["expert_parallel_degree"]) == (first.cp, first.ep)
        assert par["expert_tensor_parallel_degree"] == (first.tp if first.ep > 1 else 1)


def test_cp_ep_refusals() -> None:
    """What a tool cannot run is refused in one line naming it."""
    one_line_refusal(CP_EP_PLANS["llama-dp4-cp4"](zero=3), "deepspeed", "0.3", "DeepSpeed", "cp=4")
    one_line_refusal(CP_EP_PLANS["mixtral-dp8-ep8"](zero=1), "deepspeed", "0.3", "DeepSpeed", "ep=8")
    dense_ep = with_cp_ep(make_plan("llama3-8b", [34], 8, 1), ep=2)
    one_line_refusal(dense_ep, "megatron", "0.3", "no MoE layer")
    # ZeRO-0 replicates: torchtitan takes EP from dp_shard x cp = 1 x 1
    one_line_refusal(CP_EP_PLANS["mixtral-dp8-ep8"](zero=0), "torchtitan", "0.3", "dp_shard x cp", "ep=8")
    odd = with_cp_ep(make_plan("mixtral-8x7b", [34], 6, 1, cluster="galvatron-16x-a100"), ep=3)
    one_line_refusal(odd, "megatron", "0.3", "ep=3", "8 experts")
    uneven = with_cp_ep(make_plan("llama3-8b", [17, 17], 2, 1), cp=2)
    uneven = uneven.with_changes(stages=(uneven.stages[0], replace(uneven.stages[1], cp=1, devices=(8, 9))))
    one_line_refusal(uneven, "torchtitan", "0.3", "stage 1", "cp=1")


def test_hf_mixtral_config_exports_for_megatron(tmp_path: Path) -> None:
    """A Mixtral config.json (the public shape) exports with its experts, GQA and rope base."""
    pytest.importorskip("megatron.core", reason="make installs megatron-core (pyproject's tools extra)")
    pytest.importorskip("transformers")
    from hetplan.model.load import load_model

    config = {"model_type": "mixtral", "architectures": ["MixtralForCausalLM"], "hidden_size": 4096,
              "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
              "intermediate_size": 14336, "num_local_experts": 8, "num_experts_per_tok": 2, "vocab_size": 32000,
              "max_position_embeddings": 32768, "rope_theta": 1e6, "rms_norm_eps": 1e-5,
              "tie_word_embeddings": False}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    spec = load_model(str(path), seq_len=4096)
    stage = uniform_stage(range(spec.num_layers), range(16), 8, 2, 8, zero=1)
    plan = Plan(spec.name, "galvatron-16x-a100", 64, 8, 8, "1f1b", (replace(stage, ep=4),))
    result = render(plan, spec, "megatron", load_cluster(plan.cluster))
    a = check_megatron(megatron_args(result.data[0][1]), 16)
    assert (a.num_experts, a.moe_router_topk, a.expert_model_parallel_size, a.num_query_groups) == (8, 2, 4, 8)
    assert a.rotary_base == 1_000_000 and a.transformer_config.expert_tensor_parallel_size == 2


# --------------------------------------------------------------------------- activation offloading


def with_offload(plan: Plan, blocks_only: bool = False, first_only: bool = False) -> Plan:
    """``plan`` with its layers' activations offloaded (every layer; or the
    transformer blocks only; or the first layer only)."""
    model = get_model(plan.model)
    stages = []
    for stage in plan.stages:
        strategies = tuple(replace(s, offload=(not blocks_only or model.layers[i].kind not in ("embedding", "head"))
                                   and (not first_only or i == 0))
                           for i, s in zip(stage.layers, stage.strategies))
        stages.append(replace(stage, strategies=strategies))
    return plan.with_changes(stages=tuple(stages))


def test_offload_refused_by_torchtitan_and_megatron_in_one_line() -> None:
    """Neither tool offloads hetplan's per-layer saved tensors: refused, never dropped."""
    for recompute in ("none", "full"):
        plan = with_offload(make_plan("llama3-8b", [34], 8, 1, recompute=recompute))
        one_line_refusal(plan, "torchtitan", "0.3", "no activation offloading", "34 layers", "--offload never")
        one_line_refusal(plan, "torchtitan", "0.2", "no activation offloading")
        one_line_refusal(plan, "megatron", "0.3", "--cpu-offloading-num-layers", "--offload never")


def test_offload_deepspeed_cpu_checkpointing(monkeypatch: pytest.MonkeyPatch) -> None:
    """DeepSpeed keeps checkpointed block inputs on the host (cpu_checkpointing),
    which is hetplan's full recompute + offload on every block: mapped, and the
    config loads; any other offloading is refused in one line."""
    plan = with_offload(make_plan("llama3-8b", [34], 8, 1, zero=1, recompute="full"))
    result = render(plan, get_model(plan.model), "deepspeed", load_cluster(plan.cluster))
    assert result.data["activation_checkpointing"]["cpu_checkpointing"] is True
    parsed = deepspeed_config(result.data, plan, monkeypatch)
    assert parsed.activation_checkpointing_config.cpu_checkpointing is True
    assert any("cpu_checkpointing keeps" in n for n in result.notes)
    assert any("keep their activations on the GPU" in n for n in result.notes)  # embedding and head offloaded
    blocks = with_offload(make_plan("llama3-8b", [34], 8, 1, zero=1, recompute="full"), blocks_only=True)
    notes = render(blocks, get_model(blocks.model), "deepspeed", load_cluster(blocks.cluster)).notes
    assert not any("keep their activations on the GPU" in n for n in notes)
    plain = make_plan("llama3-8b", [34], 8, 1, zero=1, recompute="full")
    data = render(plain, get_model(plain.model), "deepspeed", load_cluster(plain.cluster)).data
    assert data["activation_checkpointing"]["cpu_checkpointing"] is False
    for bad in (with_offload(make_plan("llama3-8b", [34], 8, 1, zero=1)),  # no recompute: whole activations
                with_offload(make_plan("llama3-8b", [34], 8, 1, zero=1, recompute="selective")),
                with_offload(make_plan("llama3-8b", [34], 8, 1, zero=1, recompute="full"),
                             first_only=True)):  # nothing but the embedding: the blocks keep theirs
        one_line_refusal(bad, "deepspeed", "0.3", "cpu_checkpointing", "--offload never")


# --------------------------------------------------------------------------- launch scripts and placement

def mixed_cluster() -> Any:
    """An H100 node (GPUs 0-3) and an A100 node (GPUs 4-7)."""
    from hetplan.cluster.spec import ClusterSpec, NodeSpec

    return ClusterSpec("h100-a100", (NodeSpec("H100", 4, 900), NodeSpec("A100-80GB", 4, 600)), 200)


def mixed_plan(dp: int, tp: int, zero: int) -> Plan:
    """Two stages of llama3-8b on the mixed cluster: the short first stage
    (embedding + 6 blocks) on the A100 node, the long one on the H100 node,
    so rank 0 is on node 1."""
    first = uniform_stage(range(0, 7), range(4, 8), dp, tp, dp, zero)
    second = uniform_stage(range(7, 34), range(0, 4), dp, tp, dp, zero)
    return Plan("llama3-8b", "h100-a100", 4 * dp, dp, 4, "1f1b", (first, second))


# tool, torchtitan version, plan: every launcher (torchrun for torchtitan and Megatron, DeepSpeed's own)
LAUNCH_CASES = [("torchtitan", "0.3", lambda: mixed_plan(2, 2, 3)), ("megatron", "0.3", lambda: mixed_plan(2, 2, 1)),
                ("deepspeed", "0.3", lambda: mixed_plan(4, 1, 1))]
SHOW_ENV = ("import json, os, sys\n"
            "keys = ('RANK', 'LOCAL_RANK', 'WORLD_SIZE', 'CUDA_VISIBLE_DEVICES', 'GPU')\n"
            "info = {k: os.environ.get(k) for k in keys}\n"
            "path = os.path.join(os.environ['RANKINFO_DIR'], 'rank' + os.environ['RANK'] + '.json')\n"
            "open(path, 'w').write(json.dumps(info | {'argv': sys.argv[1:]}))\n")


def write_export(result: Any, folder: Path, main: str) -> Path:
    """What ``hetplan export --out folder/x<main>`` writes."""
    (folder / f"x{main}").write_text(result.text)
    for suffix, text in result.files.items():
        (folder / f"x{suffix}").write_text(text)
    return folder / "x.launch.sh"


def machine(tmp: Path, gpu: str) -> dict[str, str]:
    """The environment of a node with ``gpu`` GPUs: an nvidia-smi that says
    so, the tools' launchers (torchrun, deepspeed) of this venv."""
    bin_dir = tmp / f"bin-{gpu.replace(' ', '_')}"
    bin_dir.mkdir(exist_ok=True)
    smi = bin_dir / "nvidia-smi"
    smi.write_text(f"#!/bin/sh\nfor i in 0 1 2 3; do echo 'NVIDIA {gpu}'; done\n")
    smi.chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}:{Path(sys.executable).parent}:{os.environ['PATH']}",
            "MASTER_ADDR": "127.0.0.1"}


def fake_programs(tmp: Path) -> dict[str, str]:
    """Stand-ins for what the scripts start (torchtitan.train, pretrain_gpt.py,
    the user's DeepSpeed script): each process prints its rank and GPUs."""
    package = tmp / "fake" / "torchtitan"
    package.mkdir(parents=True, exist_ok=True)
    (package / "__init__.py").write_text("")
    (package / "train.py").write_text(SHOW_ENV)
    (tmp / "fake" / "pretrain_gpt.py").write_text(SHOW_ENV)
    (tmp / "ranks").mkdir(exist_ok=True)
    return {"PYTHONPATH": str(tmp / "fake"), "MEGATRON_LM": str(tmp / "fake"),
            "TRAIN_SCRIPT": str(tmp / "fake" / "pretrain_gpt.py"), "RANKINFO_DIR": str(tmp / "ranks")}


def run_nodes(script: Path, nodes: list[tuple[int, dict[str, str]]]) -> list[dict[str, Any]]:
    """Run the launch script for each (node rank, node environment) at once
    (torchrun's agents meet at MASTER_ADDR); each process's rank and GPUs."""
    port = 29500 + os.getpid() % 2000
    procs = [subprocess.Popen(["bash", str(script), str(rank)], env={**env, "MASTER_PORT": str(port)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for rank, env in nodes]
    outputs = [p.communicate(timeout=240)[0] for p in procs]
    for p, out in zip(procs, outputs):
        assert p.returncode == 0, out[-3000:]
    return [json.loads(path.read_text()) for path in sorted(Path(nodes[0][1]["RANKINFO_DIR"]).glob("rank*.json"))]


@pytest.mark.parametrize("tool, version, build", LAUNCH_CASES, ids=[c[0] for c in LAUNCH_CASES])
def test_launch_puts_each_stage_on_the_plans_gpus(tool: str, version: str, build: Any, tmp_path: Path) -> None:
    """The launch scripts, run on an H100 and an A100 machine with the tools'
    real launchers (torchrun; DeepSpeed's runner), start every rank on the
    plan's GPU: the stage the plan gives the A100 node runs there. Run on a
    machine of the wrong GPU type, a node rank refuses to start."""
    if tool == "deepspeed":
        pytest.importorskip("deepspeed.launcher.runner")
    plan, cluster = build(), mixed_cluster()
    result = render(plan, get_model(plan.model), tool, cluster, version)
    script = write_export(result, tmp_path, {"torchtitan": ".py", "megatron": ".txt", "deepspeed": ".json"}[tool])
    for text in [result.files[".launch.sh"], result.files[".sbatch"]]:
        path = tmp_path / "check.sh"
        path.write_text(text)
        done = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
    programs = fake_programs(tmp_path)
    h100, a100 = ({**machine(tmp_path, name), **programs, "GPU": gpu}
                  for name, gpu in (("H100 80GB HBM3", "H100"), ("A100-SXM4-80GB", "A100-80GB")))
    got = run_nodes(script, [(0, a100), (1, h100)])  # node rank 0: the A100 node, as the script's plan says
    order = [d for stage in plan.stages for d in stage.devices]
    assert sorted(int(p["RANK"]) for p in got) == list(range(plan.num_devices))
    for p in got:
        rank = int(p["RANK"])
        device = cluster.devices[order[rank]]
        local = int(p["CUDA_VISIBLE_DEVICES"].split(",")[int(p["LOCAL_RANK"])])
        assert (p["GPU"], local) == (device.gpu.name, device.local_rank), (rank, p)
        assert p["WORLD_SIZE"] == str(plan.num_devices)
    stage0 = {int(p["RANK"]) for p in got if p["GPU"] == "A100-80GB"}
    assert stage0 == set(range(len(plan.stages[0].devices)))  # the plan's first stage, on the A100s
    if tool == "torchtitan":
        assert got[0]["argv"] == ["--module", "x", "--config", "hetplan_llama3_8b"]
    wrong = subprocess.run(["bash", str(script), "0"], env=h100, capture_output=True, text=True)
    assert wrong.returncode == 2 and "must run on A100 GPUs" in wrong.stderr, wrong.stderr


def test_sbatch_asks_for_each_gpu_type_in_rank_order() -> None:
    """On the mixed cluster the Slurm job is heterogeneous: first the A100
    node (node rank 0), then the H100 node, one task per node."""
    plan = mixed_plan(2, 2, 1)
    text = render(plan, get_model(plan.model), "megatron", mixed_cluster()).files[".sbatch"]
    directives = [line.split(None, 1)[1] for line in text.splitlines() if line.startswith("#SBATCH")]
    assert directives == ["--nodes=1", "--ntasks-per-node=1", "--gpus-per-node=4", "--exclusive",
                          "--constraint=A100", "hetjob", "--nodes=1", "--ntasks-per-node=1", "--gpus-per-node=4",
                          "--exclusive", "--constraint=H100"]
    assert 'srun --het-group=0-1 --ntasks-per-node=1 --kill-on-bad-exit=1 bash "$LAUNCH"' in text
    homogeneous = render(PLANS["dp2-tp2-pp2"](zero=1), get_model("llama3-8b"), "megatron").files[".sbatch"]
    assert "hetjob" not in homogeneous and "--constraint" not in homogeneous


def test_deepspeed_hostfile_lists_nodes_in_rank_order() -> None:
    """DeepSpeed's own hostfile parser reads the hostfile; its hosts come in
    the plan's rank order (the A100 node first)."""
    runner = pytest.importorskip("deepspeed.launcher.runner")
    plan = mixed_plan(4, 1, 1)
    files = render(plan, get_model(plan.model), "deepspeed", mixed_cluster()).files
    pool = runner._parse_hostfile(files[".hostfile"].splitlines())
    assert list(pool.items()) == [("node1", 4), ("node0", 4)]


def test_deepspeed_refuses_a_rank_order_its_launcher_cannot_give() -> None:
    """DeepSpeed's launcher sorts a host's slots: a stage on GPUs 3..0 of a node cannot be placed."""
    plan = mixed_plan(4, 1, 1)
    reversed_first = replace(plan.stages[0], devices=(7, 6, 5, 4))
    plan = plan.with_changes(stages=(reversed_first, plan.stages[1]))
    with pytest.raises(HetplanError, match="DeepSpeed's launcher puts rank 0 on GPU 0 of node 1") as info:
        render(plan, get_model(plan.model), "deepspeed", mixed_cluster())
    assert "\n" not in str(info.value)
    # torchrun (torchtitan, Megatron) takes any order through CUDA_VISIBLE_DEVICES
    text = render(plan, get_model(plan.model), "megatron", mixed_cluster()).files[".launch.sh"]
    assert "0) NPROC=4; GPUS=3,2,1,0; check_gpu A100 ;;" in text


# --------------------------------------------------------------------------- the README flow, real Llama 3 configs

# HF config.json values of the public model cards (meta-llama Llama-3.1-8B / -70B): hidden, layers, heads, ffn.
LLAMA3_SHAPES = {"8b": (4096, 32, 32, 14336), "70b": (8192, 80, 64, 28672)}


def llama3_config(size: str, folder: Path) -> Path:
    hidden, layers, heads, ffn = LLAMA3_SHAPES[size]
    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": hidden,
              "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": 8,
              "intermediate_size": ffn, "vocab_size": 128256, "rope_theta": 500000.0,
              "max_position_embeddings": 131072, "tie_word_embeddings": False, "rms_norm_eps": 1e-5,
              "hidden_act": "silu", "torch_dtype": "bfloat16"}
    path = folder / f"llama3-{size}.json"
    path.write_text(json.dumps(config))
    return path


def readme_flow(size: str, tool: str, folder: Path, out: str) -> tuple[Any, Path]:
    """hetplan plan --target TOOL on 64xH100, then hetplan export of the plan
    it ranks first (the one it marks for the tool): the plan and --out."""
    from hetplan.cli import main
    from hetplan.plan.file import read_plan_file

    pytest.importorskip("transformers")
    model = llama3_config(size, folder)
    plans = folder / "plans.json"
    assert main(["plan", "--model", str(model), "--cluster", "64xH100", "--global-batch", "256", "--target", tool,
                 "--top", "1", "--quiet", "--json", str(plans)]) == 0
    assert main(["export", str(plans), "--format", tool, "--out", str(folder / out)]) == 0
    return read_plan_file(str(plans)).plan(1), folder / out


@pytest.mark.parametrize("size", LLAMA3_SHAPES)
def test_readme_flow_torchtitan(size: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """torchtitan's ConfigManager loads the export as its launch script runs
    it (--module x --config hetplan_llama3_*: tyro builds Trainer.Config,
    whose __post_init__ checks it), and the config passes the checks
    Trainer.__init__ makes before it touches a GPU (trainer.py:297-306,
    412-435): ParallelDims, sequence length, batch sizes."""
    torchtitan_trainer()
    from torchtitan.config import ConfigManager

    name = f"hetplan_readme_{size}"  # a module name of its own: Python caches imported modules
    plan, out = readme_flow(size, "torchtitan", tmp_path, f"{name}.py")
    monkeypatch.syspath_prepend(str(tmp_path))
    config = ConfigManager().parse_args(["--module", name, "--config", f"hetplan_llama3_{size}"])
    par, training = config.parallelism, config.training
    check_torchtitan_degrees(par, plan.num_devices)
    assert (config.model_spec.name, config.model_spec.flavor) == ("llama3", size.upper())
    batch_degree = par.data_parallel_replicate_degree * par.data_parallel_shard_degree
    assert training.global_batch_size == plan.global_batch_size
    assert training.global_batch_size % (training.local_batch_size * batch_degree) == 0
    divisor = (par.tensor_parallel_degree if par.enable_sequence_parallel else 1) * \
        (2 * par.context_parallel_degree if par.context_parallel_degree > 1 else 1)
    assert training.seq_len % divisor == 0
    assert "--config hetplan_llama3_" + size in (tmp_path / f"{name}.launch.sh").read_text()


@pytest.mark.parametrize("size", LLAMA3_SHAPES)
def test_readme_flow_megatron(size: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Megatron-LM's parser (its real parse_args + validate_args when its
    training code is on the path) and megatron-core's TransformerConfig take
    the launch script's pretrain_gpt.py arguments."""
    pytest.importorskip("megatron.core", reason="make installs megatron-core (pyproject's tools extra)")
    plan, _ = readme_flow(size, "megatron", tmp_path, "x.txt")
    script = (tmp_path / "x.launch.sh").read_text()
    args = megatron_args(script.splitlines()[-1].replace('"$MEGATRON_LM/pretrain_gpt.py"', "pretrain_gpt.py"))
    a = check_megatron(args, plan.num_devices)
    assert (a.num_layers, a.hidden_size) == (LLAMA3_SHAPES[size][1], LLAMA3_SHAPES[size][0])
    assert a.global_batch_size == plan.global_batch_size
    try:
        import megatron.training.arguments as arguments
    except ImportError:
        return
    monkeypatch.setattr(arguments, "get_device_arch_version", lambda: 9)  # no GPU here: say Hopper
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *args])
    monkeypatch.setenv("WORLD_SIZE", str(plan.num_devices))
    monkeypatch.setenv("RANK", "0")
    arguments.validate_args(arguments.parse_args(ignore_unknown_args=False), {})


@pytest.mark.parametrize("size", LLAMA3_SHAPES)
def test_readme_flow_deepspeed(size: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """DeepSpeedConfig as deepspeed.initialize builds it takes the exported
    config (AutoTP plans without an mpu, as its tutorial initialises)."""
    plan, out = readme_flow(size, "deepspeed", tmp_path, "x.json")
    parsed = deepspeed_config(json.loads(out.read_text()), plan, monkeypatch)
    first = plan.stages[0]
    assert parsed.train_micro_batch_size_per_gpu * parsed.gradient_accumulation_steps * first.dp == \
        plan.global_batch_size
