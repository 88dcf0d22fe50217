"""The README's user flow, end to end on the command line, as a user runs it (issue 13).

In a fresh directory: a HuggingFace ``config.json`` and a cluster YAML; ``hetplan
plan`` saves a plan file; the inputs are deleted (a plan file is self-contained);
then ``estimate``, ``export`` in every format the README names, ``report`` and
training on CPU processes. Every step is a ``python -m hetplan`` subprocess with
a timeout, and each checks its exit status and the facts it must print or write.
``test_readme_commands_exist_with_their_options`` runs ``hetplan CMD --help`` for
every command of the README's code blocks and checks each option written there,
so the README cannot drift from the CLI.

The cluster YAML describes CPU processes (``gpu: CPU``, the catalog's entry for
them; the same node as ``local-cpu-2``), so one plan file goes through every step,
training included. The README's own GPU example (``examples/clusters/my-lab.yaml``,
a plan no tool can export as it is) is planned and estimated from the same
``config.json`` too.
"""

from __future__ import annotations

import ast
import html
import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
TIMEOUT = 180  # seconds per command; the whole file takes about a minute on 2 cores
FORMATS = ("modules", "torchtitan", "megatron", "deepspeed")
TOOL_NAMES = {"torchtitan": "torchtitan", "megatron": "Megatron-LM", "deepspeed": "DeepSpeed"}

# A tiny Llama, as transformers writes config.json (nothing is downloaded: hetplan
# builds it on the meta device).
LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
         "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
         "vocab_size": 256, "max_position_embeddings": 64, "hidden_act": "silu", "rms_norm_eps": 1e-05,
         "tie_word_embeddings": False}
# local-cpu-2 written as a file: two gloo processes on this machine over loopback
CPU_YAML = """# two CPU processes on this machine (the catalog's CPU type), like local-cpu-2
name: my-cpu-box
inter_node_bandwidth_gbps: 10
nodes:
  - name: box
    gpu: CPU
    gpus: 2
    intra_node_bandwidth_gbps: 10
"""
# The user's own training script (README: `hetplan run p.json -- examples/train.py`),
# for the HF model the config describes: hetplan needs only the plan file, the script
# builds its model from its own code (here the same config values).
TRAIN_SCRIPT = """import torch
import hetplan.runtime as hr
from transformers import LlamaConfig, LlamaForCausalLM

CONFIG = {config!r}


def loss_fn(output, target):
    return hr.cross_entropy_loss(output.logits, target)


def main():
    torch.set_num_threads(1)
    ctx = hr.init()  # the plan from $HETPLAN_PLAN, set by hetplan run
    spec = ctx.spec
    ctx.print(ctx.layout.describe())
    # HF models keep rotary buffers: built for real on every rank (docs/runtime.md)
    model = ctx.parallelize(lambda: LlamaForCausalLM(LlamaConfig(**CONFIG)), seed=0, meta_init=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(2):
        x, y = hr.synthetic_batch(spec.vocab_size, spec.seq_len, ctx.plan.global_batch_size, step)
        loss = ctx.train_step(model, (x, y), loss_fn)
        ctx.clip_grad_norm_(model, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        ctx.print(f"step {{step + 1}}  loss {{loss:.6f}}")
    ctx.close(exit_process=True)


main()
"""


def _hetplan(cwd: Path, *args: str, timeout: float = TIMEOUT) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "hetplan", *args], capture_output=True, text=True,
                          env=env, timeout=timeout, cwd=cwd)


def _ok(proc: subprocess.CompletedProcess) -> str:
    cmd = " ".join(proc.args[2:])
    assert proc.returncode == 0, f"{cmd}: exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def _one_line_refusal(proc: subprocess.CompletedProcess, tool: str) -> str:
    """An export a tool cannot express: exit 2 and one line naming the tool."""
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("hetplan: error: "), proc.stderr
    assert TOOL_NAMES[tool] in lines[0], lines[0]
    return lines[0]


def _iter_time(out: str) -> str:
    """The best plan's iteration time in a ranked table (first row)."""
    m = re.search(r"^1\s+\S.*?\s(\d+(?:\.\d+)? [mu]?s)\s", out, re.M)
    assert m, out
    return m.group(1)


def _best(out: str) -> str:
    m = re.search(r"^best plan: (.+)$", out, re.M)
    assert m, out
    return m.group(1).strip()


# --- the README's commands -----------------------------------------------------------------------
def readme_commands() -> list[tuple[str, list[str], str]]:
    """(command, options, line) for every ``.venv/bin/hetplan CMD ...`` in the README's
    code blocks (continuation lines joined, comments and a script's own arguments after
    ``--`` dropped; ``hetplan models | clusters | planners`` is three commands) and every
    ```hetplan CMD ...``` in its text."""
    text = README.read_text(encoding="utf-8")
    lines = re.findall(r"`(hetplan [a-z][^`]*)`", re.sub(r"^```.*?^```", "", text, flags=re.S | re.M))
    for block in re.findall(r"^```[^\n]*\n(.*?)^```", text, re.S | re.M):
        lines += [line for line in re.sub(r"\\\n\s*", " ", block).splitlines() if ".venv/bin/hetplan" in line]
    out: list[tuple[str, list[str], str]] = []
    for line in lines:
        m = re.search(r"(?:^|/)hetplan\s+(.*)", line)
        if m:
            rest = re.sub(r"\s+#.*$", "", m.group(1)).strip()
            if re.fullmatch(r"[\w-]+(\s*\|\s*[\w-]+)+", rest):
                out += [(name.strip(), [], line.strip()) for name in rest.split("|")]
                continue
            words = rest.split()
            if "--" in words:
                words = words[:words.index("--")]
            options = [w.split("=")[0] for w in words[1:] if re.match(r"--?[a-z]", w)]
            out.append((words[0], options, line.strip()))
    return out


def test_readme_commands_exist_with_their_options() -> None:
    commands = readme_commands()
    names = sorted({name for name, _, _ in commands})
    assert {"plan", "estimate", "export", "report", "train", "run", "profile", "tune", "calibrate"} <= set(names), names
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    running = {name: subprocess.Popen([sys.executable, "-m", "hetplan", name, "--help"], stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT) for name in names}
    helps = {}
    try:
        for name, proc in running.items():
            out, err = proc.communicate(timeout=TIMEOUT)
            assert proc.returncode == 0, f"the README's `hetplan {name}`: `hetplan {name} --help` exits " \
                                         f"{proc.returncode}: {err}"
            helps[name] = out
    finally:
        for proc in running.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for name, options, line in commands:
        for option in options:
            assert re.search(rf"(?<![\w-]){re.escape(option)}(?![\w-])", helps[name]), \
                f"README: {line!r}: `hetplan {name}` has no option {option}"
    # an option the README's text names (`--tokens 300B` adds ...) is some command's option
    others = {"--pipeline-model-parallel-layout"}  # Megatron-LM's, in the exports' description
    every = "\n".join(helps.values())
    for option in sorted(set(re.findall(r"(?<![\w-])--[a-z][\w-]*", README.read_text(encoding="utf-8"))) - others):
        assert re.search(rf"(?<![\w-]){re.escape(option)}(?![\w-])", every), f"README names {option}: no command has it"
    # the formats the README names are the CLI's, and the flow below exports each of them
    line = re.search(r"--format\s+(\w+)\s+# or ([\w, ]+);", README.read_text(encoding="utf-8"))
    listed = [line.group(1), *(name.strip() for name in line.group(2).split(","))]
    choices = re.search(r"--format \{([\w,]+)\}", helps["export"]).group(1).split(",")
    assert sorted(listed) == sorted(choices) == sorted(FORMATS)


# --- plan from a config.json and a YAML, then everything from the plan file alone ---------------
@pytest.fixture(scope="module")
def flow(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Plans made the way the README says, then the inputs deleted. Where a tool
    refuses the best plan (one line, exit 2), a user re-plans with --target TOOL, as
    the refusal and docs/exports.md say: ``files[fmt]`` is the plan file each format
    is exported from."""
    pytest.importorskip("transformers")
    work = tmp_path_factory.mktemp("readme-flow")
    (work / "my-llama").mkdir()
    (work / "my-llama" / "config.json").write_text(json.dumps(LLAMA, indent=2))
    (work / "my.yaml").write_text(CPU_YAML)
    shutil.copy(ROOT / "examples" / "clusters" / "my-lab.yaml", work / "my-lab.yaml")

    planned = _ok(_hetplan(work, "plan", "--model", "my-llama/config.json", "--cluster", "my.yaml",
                           "--global-batch", "8", "--json", "plan.json"))
    lab = _ok(_hetplan(work, "plan", "--model", "my-llama/config.json", "--cluster", "my-lab.yaml",
                       "--global-batch", "256", "--json", "lab.json"))
    files, targeted, refusals = {"modules": "plan.json"}, {}, {}
    for fmt in FORMATS[1:]:
        probe = _hetplan(work, "export", "plan.json", "--format", fmt)
        if probe.returncode == 0:
            files[fmt] = "plan.json"
            continue
        refusals[fmt] = _one_line_refusal(probe, fmt)
        files[fmt] = f"plan-{fmt}.json"
        targeted[fmt] = _ok(_hetplan(work, "plan", "--model", "my-llama/config.json", "--cluster", "my.yaml",
                                     "--global-batch", "8", "--target", fmt, "--json", files[fmt]))
    shutil.rmtree(work / "my-llama")
    for name in ("my.yaml", "my-lab.yaml"):
        (work / name).unlink()
    return {"work": work, "planned": planned, "lab": lab, "files": files, "targeted": targeted,
            "refusals": refusals}


def _best_plan(work: Path, file: str) -> dict[str, Any]:
    return json.loads((work / file).read_text())["plans"][0]["plan"]


def test_plan_prints_the_workload_and_the_best_plan(flow) -> None:
    out = flow["planned"]
    assert re.search(r"^model +my-llama: 6 layers, \d+K params, seq 64", out, re.M), out  # named by its folder
    assert re.search(r"^cluster +my-cpu-box: 1x2 CPU", out, re.M), out
    assert re.search(r"^batch +8 samples/step, bf16", out, re.M), out  # HF configs plan in bf16
    assert "time goes to" in out and "peak mem/GPU" in out and "wrote plan.json" in out
    assert _best(out).startswith("dp") and _iter_time(out).endswith("s")
    lab = flow["lab"]
    assert "cluster  my-lab: 2x8 A100-80GB + 1x4 V100-32GB + 1x2 RTX-4090 (22 GPUs)" in lab, lab
    for fmt, out in flow["targeted"].items():  # the price of the tool, in one line
        assert re.search(rf"^best plan {re.escape(TOOL_NAMES[fmt])} can run: ", out, re.M), out


def test_estimate_from_the_plan_file_alone(flow) -> None:
    work = flow["work"]
    assert not (work / "my-llama").exists() and not (work / "my.yaml").exists()
    for file, made in (("plan.json", flow["planned"]), ("lab.json", flow["lab"])):
        out = _ok(_hetplan(work, "estimate", file))
        assert re.search(rf"^1 +{re.escape(_best(made))} ", out, re.M), out  # the file's best plan, first row
        assert _iter_time(out) == _iter_time(made), (out, made)  # same model, cluster, settings: same time
        assert "time goes to" in out and "GPU-hours per billion tokens" in out


def test_export_every_format_from_the_plan_file_alone(flow) -> None:
    work, files = flow["work"], flow["files"]
    outs = {}
    for fmt in FORMATS:
        out_file = {"modules": "modules.json", "torchtitan": "torchtitan_plan.py", "megatron": "megatron.sh",
                    "deepspeed": "ds.json"}[fmt]
        proc = _hetplan(work, "export", files[fmt], "--format", fmt, "--out", out_file)
        _ok(proc)
        assert f"wrote {out_file}" in proc.stdout + proc.stderr
        outs[fmt] = (work / out_file).read_text()

    layers = ["model.embed_tokens", *(f"model.layers.{i}" for i in range(4)), "lm_head"]
    best = _best_plan(work, files["modules"])
    stages = json.loads(outs["modules"])
    assert [name for stage in stages for name in stage] == layers and len(stages) == len(best["stages"])

    best = _best_plan(work, files["torchtitan"])
    st = best["stages"][0]
    module = ast.parse(outs["torchtitan"])
    values = {node.targets[0].id: ast.literal_eval(node.value) for node in module.body
              if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name)}
    par, train = values["PARALLELISM"], values["TRAINING"]
    assert par["data_parallel_replicate_degree"] * par["data_parallel_shard_degree"] == st["dp"]
    assert (par["tensor_parallel_degree"], par["pipeline_parallel_degree"]) == (st["tp"], len(best["stages"]))
    assert train["global_batch_size"] == 8 and train["seq_len"] == 64
    assert train["mixed_precision_param"] == "bfloat16"
    assert "def apply_plan(config)" in outs["torchtitan"]

    best = _best_plan(work, files["megatron"])
    st = best["stages"][0]
    cmd = outs["megatron"]
    assert "torchrun" in cmd and "pretrain_gpt.py" in cmd
    for arg in ("--num-layers 4", "--hidden-size 64", "--num-attention-heads 4", "--ffn-hidden-size 128",
                "--group-query-attention", "--num-query-groups 2", "--swiglu", "--normalization RMSNorm",
                "--seq-length 64", "--vocab-size 255", "--bf16", "--global-batch-size 8",
                f"--micro-batch-size {best['micro_batch_size']}", f"--tensor-model-parallel-size {st['tp']}",
                f"--pipeline-model-parallel-size {len(best['stages'])}"):
        assert re.search(rf"(?<![\w-]){re.escape(arg)}(?![\w-])", cmd), (arg, cmd)

    best = _best_plan(work, files["deepspeed"])
    ds = json.loads(outs["deepspeed"])
    assert ds["train_batch_size"] == 8 and ds["bf16"] == {"enabled": True}
    assert ds["train_micro_batch_size_per_gpu"] == best["micro_batch_size"]
    assert ds["gradient_accumulation_steps"] == best["num_micro_batches"]
    assert ds["zero_optimization"]["stage"] == best["stages"][0]["strategies"][0]["zero"]


def test_exporters_refuse_the_readme_lab_plan_in_one_line(flow) -> None:
    """The README's my-lab.yaml plan splits data unevenly over its mixed GPUs: the
    module list exports, each tool refuses in one line saying why."""
    work = flow["work"]
    stages = json.loads(_ok(_hetplan(work, "export", "lab.json", "--format", "modules")))
    assert sum(len(stage) for stage in stages) == 6
    for fmt in FORMATS[1:]:
        line = _one_line_refusal(_hetplan(work, "export", "lab.json", "--format", fmt), fmt)
        assert "hetplan runtime" in line, line


def test_report_from_the_plan_file_alone(flow) -> None:
    work = flow["work"]
    proc = _hetplan(work, "report", "plan.json", "-o", "report.html")
    _ok(proc)
    page = (work / "report.html").read_text(encoding="utf-8")
    assert page.lstrip().lower().startswith("<!doctype html")
    assert html.escape(_best(flow["planned"])) in page
    assert "<svg" in page and "my-cpu-box" in page and "my-llama" in page
    assert _iter_time(flow["planned"]) in page


# --- train: the plan made from config.json, on the CPU processes it was made for ----------------
@pytest.mark.slow
def test_plan_from_config_json_trains_with_a_user_script(flow) -> None:
    """``hetplan run plan.json -- script.py``: the README's way to train your own model."""
    work = flow["work"]
    best = _best_plan(work, "plan.json")
    assert len(best["stages"]) == 1, "HF decoders train with one pipeline stage (docs/runtime.md)"
    (work / "train_llama.py").write_text(TRAIN_SCRIPT.format(config=LLAMA))
    out = _ok(_hetplan(work, "run", "plan.json", "--", "train_llama.py"))
    assert re.search(r"^2 processes: pp=1 dp=2 ", out, re.M), out
    steps = re.findall(r"^step (\d+) +loss (\S+)$", out, re.M)
    assert [step for step, _ in steps] == ["1", "2"], out  # one line per step, from rank 0 only
    losses = [float(loss) for _, loss in steps]
    assert all(abs(loss - math.log(256)) < 0.5 for loss in losses), losses  # ~ln(vocab) at the start


@pytest.mark.slow
def test_hetplan_train_verifies_the_plan_from_config_json(flow) -> None:
    proc = _hetplan(flow["work"], "train", "--plan", "plan.json", "--steps", "2", "--verify")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "verify: OK" in proc.stdout, proc.stdout
