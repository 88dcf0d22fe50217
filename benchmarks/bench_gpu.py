"""On a GPU: predicted vs measured time and peak per plan, and the plain PyTorch loop beside each.

For the plans recorded on one H100 (``benchmarks/data/h100/``: gpt3-1.3b at micro-batch 8 x 2,
4 x 4 and 16 x 1 with full recomputation, the HF Llama-1B-class config at 4 x 4) and two more
built here (gpt3-1.3b at 2 x 8, and 4 x 4 with selective recomputation), each in a process of
its own:

* predicted: ``hetplan estimate`` of the plan (iteration time, largest peak per GPU);
* measured: ``hetplan train PLAN --optimizer adamw --steps 6`` (the median of steps 3..6, as
  ``h100-runs.json`` records it, and ``torch.cuda.max_memory_allocated``);
* the plain loop a user would write for the same model, micro-batches and bf16 autocast with
  fused AdamW (the method of the yardsticks in ``h100-runs.json``: the built-in GPT, or
  ``transformers.LlamaForCausalLM`` with ``labels``); none for recomputation, which a plain
  loop does not do.

A table, and exit status 1 when a target is missed: peak within 10%, time within 20% (issue
28), hetplan within 3% of the plain loop (issue 30). Without a GPU it says so and exits 0.
About 3-4 minutes on one H100 (7 runs of ~20 s each, most of it start-up).

    python benchmarks/bench_gpu.py [--steps 6] [--only NAME ...]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from typing import Any, Sequence

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.join(HERE, "..", "src")
sys.path.insert(0, SRC)
DATA = os.path.join(HERE, "data", "h100")

MEMORY_TOL = 0.10  # issue 28 "Done when": every measured peak predicted within +-10%
TIME_TOL = 0.20  # issue 28 item 5 / bench_gpu's brief: step time predicted within +-20%
PLAIN_TOL = 0.03  # issue 30 "Done when": hetplan train within 3% of the plain loop on a GPU
WARMUP = 2  # steps left out of the median, as h100-runs.json's "median_step_s_after_2"


@dataclass(frozen=True)
class Case:
    """One plan to train: a recorded plan file, or a uniform gpt3-1.3b plan built here;
    ``plain``: the yardstick (model kind, samples per micro-batch, micro-batches), if any."""

    name: str
    plan_file: str = ""
    micro_batch: int = 0  # a plan built here: samples per micro-batch ...
    recompute: str = "none"  # ... and its recomputation
    plain: tuple[str, int, int] | None = None


CASES = (
    Case("A_g13_mb8", "A_g13_mb8.json", plain=("gpt3-1.3b", 8, 2)),
    Case("B_g13_mb4", "B_g13_mb4.json", plain=("gpt3-1.3b", 4, 4)),
    Case("C_g13_rc", "C_g13_rc.json"),
    Case("D_llama1b", "D_llama1b.json", plain=("hf:llama1b.json", 4, 4)),
    Case("g13_mb2", micro_batch=2, plain=("gpt3-1.3b", 2, 8)),
    Case("g13_mb4_selective", micro_batch=4, recompute="selective"),
)
GLOBAL_BATCH = 16  # the recorded runs' global batch (h100-runs.json)
HF_SEQ = 2048  # the HF runs' sequence length (h100-runs.json, D_llama1b "--seq-len 2048")


@dataclass(frozen=True)
class Row:
    """Predicted and measured numbers of one plan (seconds, bytes; None: not run)."""

    name: str
    predicted_s: float
    measured_s: float | None
    predicted_peak: float
    measured_peak: float | None
    plain_s: float | None = None
    error: str = ""


def misses(row: Row) -> list[str]:
    """The targets this row misses, one phrase each."""
    if row.error:
        return [row.error]
    out = []
    if row.measured_peak is not None and abs(row.predicted_peak / row.measured_peak - 1) > MEMORY_TOL:
        out.append(f"peak {row.predicted_peak / row.measured_peak - 1:+.0%} off (> {MEMORY_TOL:.0%})")
    if row.measured_s is not None and abs(row.predicted_s / row.measured_s - 1) > TIME_TOL:
        out.append(f"time {row.predicted_s / row.measured_s - 1:+.0%} off (> {TIME_TOL:.0%})")
    if row.plain_s is not None and row.measured_s is not None and row.measured_s / row.plain_s - 1 > PLAIN_TOL:
        out.append(f"hetplan {row.measured_s / row.plain_s - 1:+.1%} vs the plain loop (> {PLAIN_TOL:.0%})")
    return out


def table(rows: Sequence[Row]) -> str:
    """The per-plan table: predicted / measured time and peak, the plain loop, the misses."""
    gib = 2.0 ** 30

    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v * 1e3:.1f}"

    def gb(v: float | None) -> str:
        return "-" if v is None else f"{v / gib:.1f}"

    lines = [f"{'plan':<20} {'pred ms':>8} {'meas ms':>8} {'plain ms':>8} {'pred GiB':>8} {'meas GiB':>8}  verdict"]
    for r in rows:
        verdict = "; ".join(misses(r)) or "ok"
        lines.append(f"{r.name:<20} {ms(r.predicted_s):>8} {ms(r.measured_s):>8} {ms(r.plain_s):>8} "
                     f"{gb(r.predicted_peak):>8} {gb(r.measured_peak):>8}  {verdict}")
    return "\n".join(lines)


def recorded_rows(runs: dict[str, Any], predicted: dict[str, tuple[float, float]]) -> list[Row]:
    """Rows from ``h100-runs.json`` (measured) and ``predicted`` (name -> seconds, bytes), with the
    recorded plain-loop yardsticks where the same model and micro-batches were timed."""
    plain = {"A_g13_mb8": runs["yardsticks"]["plain_pytorch_gpt3_1.3b_mbs8x2"]["fused AdamW"]["median_step_s"],
             "D_llama1b": runs["yardsticks"]["plain_hf_llama1b_seq2048_mbs4x4"]["median_step_s"]}
    rows = []
    for run in runs["runs"]:
        measured = run.get("measured") or {}
        if run["name"] not in predicted or "median_step_s_after_2" not in measured:
            continue
        seconds, peak = predicted[run["name"]]
        rows.append(Row(run["name"], seconds, measured["median_step_s_after_2"], peak,
                        measured["peak_memory_gib"] * 2.0 ** 30, plain.get(run["name"])))
    return rows


# --- on the GPU -----------------------------------------------------------------------------------
def _python(*args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, timeout=timeout)


def plan_path(case: Case, directory: str) -> str:
    """The recorded plan file, or the uniform gpt3-1.3b plan built and written here."""
    if case.plan_file:
        return os.path.join(DATA, case.plan_file)
    from hetplan.app.estimate import UniformSetting, estimate
    from hetplan.plan.file import save_plan

    result = estimate(UniformSetting(1, 1, 1, case.micro_batch, recompute=case.recompute), model="gpt3-1.3b",
                      cluster="1xH100", global_batch=GLOBAL_BATCH)
    path = os.path.join(directory, f"{case.name}.json")
    save_plan(path, result.ranked.plan, result.ranked.estimate)
    return path


def predict(path: str) -> tuple[float, float]:
    """``hetplan estimate``'s iteration time and largest peak per GPU of the plan file."""
    from hetplan.app.estimate import estimate

    e = estimate(path).ranked.estimate
    return e.iteration_time_s, float(e.max_memory_bytes)


def measure(path: str, steps: int, directory: str) -> tuple[float, float]:
    """``hetplan train``'s median step (after the warm-up) and peak, from its summary.json."""
    out = os.path.join(directory, os.path.basename(path) + ".out")
    proc = _python("-m", "hetplan", "train", path, "--optimizer", "adamw", "--steps", str(steps), "--out", out)
    if proc.returncode != 0:
        raise RuntimeError((proc.stderr.strip().splitlines() or ["hetplan train failed"])[-1])
    with open(os.path.join(out, "summary.json"), encoding="utf-8") as f:
        summary = json.load(f)
    return statistics.median(summary["step_times_s"][WARMUP:]), float(summary["peak_memory_bytes"])


def plain_loop(model: str, micro_batch: int, micro_batches: int, steps: int) -> float:
    """The yardstick's median step: the model on CUDA with fp32 weights, bf16 autocast, the
    micro-batches' losses accumulated, fused AdamW (h100-runs.json "yardsticks")."""
    import torch

    dev = torch.device("cuda")
    torch.manual_seed(0)
    if model.startswith("hf:"):
        import transformers

        with open(os.path.join(DATA, model[3:]), encoding="utf-8") as f:
            config = transformers.AutoConfig.for_model(**json.load(f))
        with dev:
            net = transformers.LlamaForCausalLM(config)
        vocab, seq = config.vocab_size, HF_SEQ

        def loss_of(x: torch.Tensor) -> torch.Tensor:
            return net(input_ids=x, labels=x).loss
    else:
        from hetplan.model.presets import get_model
        from hetplan.runtime.models import build_preset_model, cross_entropy_loss

        spec = get_model(model)
        with dev:
            net = build_preset_model(spec)
        vocab, seq = spec.vocab_size, spec.seq_len

        def loss_of(x: torch.Tensor) -> torch.Tensor:
            return cross_entropy_loss(net(x), x)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-4, fused=True)
    x = torch.randint(0, vocab, (micro_batch, seq), device=dev)
    times = []
    for _ in range(steps):
        torch.cuda.synchronize()
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(micro_batches):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = loss_of(x) / micro_batches
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times[WARMUP:])


def run_case(case: Case, steps: int, directory: str) -> Row:
    path = plan_path(case, directory)
    seconds, peak = predict(path)
    try:
        measured_s, measured_peak = measure(path, steps, directory)
    except (RuntimeError, subprocess.TimeoutExpired) as exc:
        return Row(case.name, seconds, None, peak, None, error=f"hetplan train failed: {exc}")
    plain_s = None
    if case.plain:
        proc = _python(os.path.abspath(__file__), "--plain", case.plain[0], str(case.plain[1]), str(case.plain[2]),
                       "--steps", str(steps))
        if proc.returncode != 0:
            return Row(case.name, seconds, measured_s, peak, measured_peak, error="plain loop failed: "
                       + (proc.stderr.strip().splitlines() or ["?"])[-1])
        plain_s = float(proc.stdout.strip().splitlines()[-1])
    return Row(case.name, seconds, measured_s, peak, measured_peak, plain_s)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6, help="training steps per run (the first 2 are warm-up)")
    ap.add_argument("--only", nargs="*", default=None, help="run only these plans")
    ap.add_argument("--plain", nargs=3, metavar=("MODEL", "MICRO_BATCH", "MICRO_BATCHES"),
                    help=argparse.SUPPRESS)  # one yardstick, in its own process (run_case)
    args = ap.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("bench_gpu: no CUDA GPU on this machine: nothing measured (run it where there is one)")
        return 0
    if args.plain:
        print(plain_loop(args.plain[0], int(args.plain[1]), int(args.plain[2]), args.steps))
        return 0
    print(f"bench_gpu on {torch.cuda.get_device_name()}, torch {torch.__version__}, {args.steps} steps per run")
    cases = [c for c in CASES if not args.only or c.name in args.only]
    with tempfile.TemporaryDirectory(prefix="bench-gpu-") as directory:
        rows = [run_case(c, args.steps, directory) for c in cases]
    print(table(rows))
    missed = [r.name for r in rows if misses(r)]
    if missed:
        print(f"FAIL: {len(missed)} of {len(rows)} plans miss a target: {', '.join(missed)}", file=sys.stderr)
        return 1
    print(f"OK: every plan within its targets (peak {MEMORY_TOL:.0%}, time {TIME_TOL:.0%}, "
          f"plain loop {PLAIN_TOL:.0%})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
