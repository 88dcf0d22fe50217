"""Plans of models given as Python code (``--model pkg.mod:build``) train with nothing but the plan file.

``hetplan plan --planner smp --model tests.smp_models:NAME ... --json p.json``
records the build function and a hash of its parameters; ``hetplan train --trust-plan-code
--plan p.json --verify`` rebuilds the model from it, trains it on synthetic
batches shaped like its example inputs (torchrun, gloo, pp2 x dp2) and matches
the single-process reference; a changed or missing build function is refused
in one line before any process starts; ``hr.init("p.json", trust_plan_code=True)`` + ``ctx.parallelize()``
in a user's script (``hetplan run``) needs no model either.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from hetplan.cli import main

torch = pytest.importorskip("torch")

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
TOL = 1e-5


def _hetplan(*args: str, path: str = ROOT, timeout: float = 300) -> subprocess.CompletedProcess:
    """The CLI with ``path`` (where the build functions live) on PYTHONPATH."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.join(ROOT, "src"), path]), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "hetplan.cli", *args], capture_output=True, text=True,
                          env=env, timeout=timeout, cwd=ROOT)


def _smp_plan(monkeypatch: pytest.MonkeyPatch, reference: str, plan: str, cluster: str, path: str = ROOT,
              pp: int = 2) -> None:
    """``hetplan plan --planner smp`` in this process, which has imported torch already: a process start
    less per test. The build function's module is dropped from ``sys.modules`` after, so a later import
    reads the file again, as the ``hetplan train`` processes do."""
    monkeypatch.syspath_prepend(path)
    try:
        assert main(["plan", "--planner", "smp", "--smp-pp", str(pp), "--model", reference, "--cluster", cluster,
                     "--global-batch", "8", "--json", plan, "--quiet"]) == 0
    finally:
        sys.modules.pop(reference.split(":")[0], None)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt_lm", "resnet_classes", "encdec"])
def test_smp_plan_of_a_build_function_trains_and_verifies(name: str, tmp_path, monkeypatch) -> None:
    """GPT with its own next-token ``hetplan_loss``; CNN with example targets (class labels);
    encoder-decoder with the default loss (mean output squared)."""
    from hetplan.plan.file import read_plan_file

    plan = str(tmp_path / "p.json")
    _smp_plan(monkeypatch, f"tests.smp_models:{name}", plan, "local-cpu-4")
    pf = read_plan_file(plan)
    assert pf.model.source.reference == f"tests.smp_models:{name}" and pf.model.source.module_hash
    assert len(pf.plan().stages) == 2
    proc = _hetplan("train", "--plan", plan, "--steps", "2", "--verify", "--trust-plan-code")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "4 processes" in proc.stdout and "verify: OK" in proc.stdout, proc.stdout


def _write_module(directory, hidden: int) -> None:
    (directory / "um_cli.py").write_text(textwrap.dedent(f"""
        import torch
        from torch import nn

        def build():
            return nn.Sequential(nn.Linear(4, {hidden}), nn.Tanh(), nn.Linear({hidden}, 2)), torch.zeros(2, 4)
    """))


def test_changed_or_missing_build_function_is_refused_before_start(tmp_path, monkeypatch) -> None:
    code = tmp_path / "code"
    code.mkdir()
    _write_module(code, 8)
    plan = str(tmp_path / "p.json")
    _smp_plan(monkeypatch, "um_cli:build", plan, "local-cpu-2", path=str(code), pp=1)
    _write_module(code, 16)
    proc = _hetplan("train", "--plan", plan, "--steps", "1", "--trust-plan-code", path=str(code))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        "hetplan: error: the model built by um_cli:build differs from the one the plan was made for: "), lines
    assert "processes" not in proc.stdout  # refused before any process started
    proc = _hetplan("train", "--plan", plan, "--steps", "1", "--trust-plan-code", path=str(tmp_path))  # not on the path
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "cannot import 'um_cli'" in lines[0] and "PYTHONPATH" in lines[0], lines


MASKED = """
import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, h, mask=None):
        return torch.where(mask[..., None], h + torch.tanh(self.fc(h)), h)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(4, 8)
        self.blocks = nn.ModuleList([Block(8) for _ in range(2)])
        self.out = nn.Linear(8, 2)

    def forward(self, x, mask):
        h = self.inp(x)
        for b in self.blocks:
            h = b(h, mask=mask)  # the model's keyword input, passed on unchanged
        return self.out(h)


def build():
    return Net(), (torch.zeros(2, 3, 4), torch.ones(2, 3, dtype=torch.bool))
"""


def test_keyword_input_passed_on_to_each_block_trains_pipelined(tmp_path, monkeypatch) -> None:
    """``block(h, mask=mask)``: the example inputs after the first are passed by
    name, as train_step passes them, so the plan gets pp2 and each stage its
    mask rows (2 micro-batches), matching the reference."""
    import json

    code = tmp_path / "code"
    code.mkdir()
    (code / "um_mask.py").write_text(MASKED)
    monkeypatch.syspath_prepend(str(code))
    plan = str(tmp_path / "p.json")
    assert main(["plan", "--planner", "smp", "--smp-pp", "2", "--model", "um_mask:build", "--cluster", "local-cpu-2",
                 "--global-batch", "8", "--json", plan, "--quiet"]) == 0  # in this process: no start-up to wait for
    data = json.loads(open(plan, encoding="utf-8").read())
    data["plans"] = [p for p in data["plans"] if p["plan"]["num_micro_batches"] == 2]  # the best has 1
    with open(plan, "w", encoding="utf-8") as f:
        json.dump(data, f)
    proc = _hetplan("train", "--plan", plan, "--steps", "2", "--verify", "--model", "um_mask:build", path=str(code))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "pp=2" in proc.stdout and "micro-batches=2" in proc.stdout and "verify: OK" in proc.stdout, proc.stdout


SCRIPT = """
import sys
import torch
import hetplan.runtime as hr

ctx = hr.init(sys.argv[1], trust_plan_code=True)  # the model: the pkg.mod:build the plan file records
model = ctx.parallelize()
how = ctx.model_build
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, foreach=False)
losses = []
for step in range(2):
    x, y, inputs = how.batch(ctx.plan.global_batch_size, step, 0)
    losses.append(float(ctx.train_step(model, (x, y), how.loss, inputs=inputs)))
    opt.step()
    opt.zero_grad()
state = ctx.full_state_dict(model)
if ctx.rank == 0:
    torch.save({"losses": losses, "state": state}, sys.argv[2])
ctx.close(exit_process=True)
"""


@pytest.mark.slow
def test_init_with_the_plan_alone_in_a_user_script(tmp_path, monkeypatch) -> None:
    from hetplan.runtime.build import model_build
    from hetplan.runtime.reference import build_reference, compare, train_reference, training_batch
    from hetplan.runtime.setup import check_plan

    plan = str(tmp_path / "p.json")
    _smp_plan(monkeypatch, "tests.smp_models:gpt_lm", plan, "local-cpu-2")
    script = tmp_path / "train_it.py"
    script.write_text(SCRIPT)
    out = str(tmp_path / "out.pt")
    proc = _hetplan("run", plan, "--", str(script), plan, out)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = torch.load(out)
    spec = check_plan(plan, trust_plan_code=True)[1]  # the reference imports the plan's code too
    how = model_build(spec)
    ref = build_reference(how.build, 0)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9, foreach=False)
    ref_losses = train_reference(ref, [training_batch(spec, how, 8, s, 0) for s in range(2)], how.loss, opt)
    cmp = compare(result["losses"], ref_losses, result["state"], ref.state_dict())
    assert not cmp["missing"] and cmp["loss_rel_diff"] <= TOL and cmp["param_rel_diff"] <= TOL, cmp
    assert ref_losses[1] < ref_losses[0]  # the next-token loss of hetplan_loss, learning


@pytest.mark.slow
def test_tune_trains_trials_of_a_build_function_plan(tmp_path) -> None:
    """``hetplan tune`` goes through the same trainer, so such plans are measured too."""
    out = str(tmp_path / "best.json")
    proc = _hetplan("tune", "--planner", "smp", "--model", "tests.smp_models:resnet_classes", "--cluster",
                    "local-cpu-2", "--global-batch", "8", "--top-k", "1", "--steps", "1", "--warmup", "0",
                    "-o", out)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "trial 1/1: ok" in proc.stderr, proc.stderr
