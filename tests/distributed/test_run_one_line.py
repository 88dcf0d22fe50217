"""A refusal or an out-of-memory error on a rank is one line, printed once, exit 2
(issue 32 item 6, issue 28 item 3): ``hetplan run`` (a user's script), ``hetplan
train`` and a ``hetplan tune`` trial, 2 ranks under torchrun and gloo.

CUDA's out-of-memory error is faked on CPU: a ``sitecustomize`` module on the
ranks' PYTHONPATH makes rank 1's ``RuntimeContext.train_step`` raise
``torch.OutOfMemoryError`` with the text of torch's CUDA caching allocator.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
# The message torch 2.x's CUDA caching allocator raises (c10/cuda/CUDACachingAllocator.cpp).
CUDA_OOM = ("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 1 has a total capacity of 79.10 GiB of which "
            "1.53 GiB is free. Including non-PyTorch memory, this process has 77.56 GiB memory in use.")
FAKE_OOM = f'''import os
if os.environ.get("RANK") == "1":
    import torch
    from hetplan.runtime import context

    def _out_of_memory(self, *args, **kwargs):
        raise torch.OutOfMemoryError({CUDA_OOM!r})

    context.RuntimeContext.train_step = _out_of_memory
'''
REFUSING_SCRIPT = """import hetplan.runtime as hr
from hetplan.errors import HetplanError

ctx = hr.init()
raise HetplanError("this model has a skip connection across stages; give it without one")
"""


def _hetplan(*args: str, extra_path: str = "") -> subprocess.CompletedProcess:
    path = os.pathsep.join(p for p in (os.path.join(ROOT, "src"), extra_path) if p)
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "hetplan.cli", *args], capture_output=True, text=True, env=env,
                          timeout=300, cwd=ROOT)


@pytest.fixture(scope="module")
def plan(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = str(tmp_path_factory.mktemp("plan") / "p.json")
    proc = _hetplan("estimate", "--model", "tiny-gpt", "--cluster", "local-cpu-2", "--global-batch", "4", "--tp", "1",
                    "--pp", "2", "--dp", "1", "--micro-batch", "2", "--json", path)
    assert proc.returncode == 0, proc.stderr
    return path


@pytest.fixture(scope="module")
def fake_oom(tmp_path_factory: pytest.TempPathFactory) -> str:
    directory = tmp_path_factory.mktemp("fake_oom")
    (directory / "sitecustomize.py").write_text(FAKE_OOM)
    return str(directory)


def _one_error_line(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr and "[rank" not in proc.stderr, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("hetplan: error")]
    assert len(errors) == 1 and proc.stderr.strip() == errors[0], proc.stderr
    return errors[0]


def _check_oom_line(line: str, plan: str) -> None:
    predicted = json.loads(Path(plan).read_text())["plans"][0]["estimate"]["peak_memory_bytes"]["1"] / 2**30
    assert "rank 1 (stage 1 of 2: layers.2..head, device 1) ran out of memory at step 1: " in line, line
    assert "2.00 GiB more asked" in line and f"the plan predicted {predicted:.2f} GiB" in line, line
    assert "a smaller micro-batch (now 2)" in line and "recomputation" in line, line


@pytest.mark.slow
def test_run_refusal_in_a_user_script_is_one_line_once(plan: str, tmp_path: Path) -> None:
    """Both ranks raise the same HetplanError: printed once, rank 0's."""
    script = tmp_path / "refuse.py"
    script.write_text(REFUSING_SCRIPT)
    line = _one_error_line(_hetplan("run", plan, "--", str(script)))
    assert line == "hetplan: error (rank 0): this model has a skip connection across stages; give it without one"


@pytest.mark.slow
def test_run_out_of_memory_is_one_line(plan: str, fake_oom: str) -> None:
    proc = _hetplan("run", plan, "--", os.path.join(ROOT, "examples", "train.py"), "--steps", "2",
                    extra_path=fake_oom)
    _check_oom_line(_one_error_line(proc), plan)


@pytest.mark.slow
def test_train_out_of_memory_is_one_line(plan: str, fake_oom: str) -> None:
    proc = _hetplan("train", "--plan", plan, "--steps", "2", extra_path=fake_oom)
    _check_oom_line(_one_error_line(proc), plan)


@pytest.mark.slow
def test_tune_records_out_of_memory_as_a_failed_trial(tmp_path: Path, fake_oom: str) -> None:
    out = str(tmp_path / "best.json")
    proc = _hetplan("tune", "--model", "tiny-gpt", "--cluster", "local-cpu-2", "--global-batch", "4", "--top-k", "1",
                    "--steps", "1", "--warmup", "0", "--planner", "megatron", "-o", out, extra_path=fake_oom)
    assert "Traceback" not in proc.stderr, proc.stderr
    assert "trial 1/1: failed" in proc.stderr and "ran out of memory at step 1" in proc.stderr, proc.stderr
