"""hetplan's estimates against training frameworks' own published runs:
NVIDIA's Megatron-Bridge on DGX-H100 (mixture-of-experts models with expert
parallelism, Llama 3.1 405B with context parallelism, FP8) and torchtitan's
FSDP2 runs on A100 (the stack hetplan's runtime uses: FSDP2 and PyTorch SDPA).
Issue 15 asks which published long-context and MoE runs the estimates were
compared with, and the errors; these are also runs no constant was fitted on.

Each data file (``data/megatron_bridge_h100.json``, ``data/torchtitan_a100.json``)
states its stack's defaults (GPU, attention kernel, optimizer state, routing
balance, TP communication overlap) and its runs' own settings (TP, PP, CP, EP, interleaving, micro-batch,
FSDP or the distributed optimizer, recomputation, FP8). Each run becomes the
workload and uniform plan of those settings, and ``CostModel.estimate``
predicts its tokens/s per GPU. A run hetplan cannot express is listed with the
reason, never approximated.

Prints one table per stack and exits non-zero if the median |error| over the
runs is above 15%, any run is off by more than 35% (the targets of the CPU
prediction benchmark, issue 11), or any run, all of which trained, is
predicted not to fit its GPUs' memory. A run of a model for which ``hetplan
estimate`` itself warns that its estimate is likely optimistic (fine-grained
experts: ``app.explain.fine_grained_moe_note``) is printed with its error and
left out of the two time targets: the user is told, and no published number
says how many host-side operations a release runs per expert (docs/cost-model.md,
"Validation against the frameworks' own published runs"). A miss on a run
without that warning fails as before.

    python benchmarks/validate_frameworks.py
"""

from __future__ import annotations

import json
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hetplan.app.explain import fine_grained_moe_note
from hetplan.cluster.presets import homogeneous_cluster
from hetplan.cost.model import CostModel
from hetplan.plan.workload import Workload
from hetplan.errors import HetplanError
from hetplan.model.hf import model_from_hf_config
from hetplan.model.presets import get_model
from hetplan.model.spec import ModelSpec
from hetplan.plan.spec import Plan
from hetplan.search.baselines.uniform import uniform_plan

DATA = Path(__file__).resolve().parent / "data"
FILES = ("megatron_bridge_h100.json", "torchtitan_a100.json")
MEDIAN_TARGET = 0.15
MAX_TARGET = 0.35


@dataclass
class Row:
    """One published run: its plan and workload, or why it cannot be expressed."""
    run: dict[str, Any]
    workload: Workload | None = None
    plan: Plan | None = None
    skip: str = ""


def run_model(run: dict[str, Any], configs: dict[str, Any]) -> ModelSpec:
    """The run's model: a preset, or ``hf:NAME`` from the data file's HF configs."""
    name = str(run["model"])
    if name.startswith("hf:"):
        key = name[3:]
        return model_from_hf_config(dict(configs[key]), seq_len=int(run["seq"]), name=key)
    model = get_model(name)
    if model.seq_len != int(run["seq"]):
        raise HetplanError(f"preset {name} has seq {model.seq_len}, the run {run['seq']}")
    return model


def build(run: dict[str, Any], data: dict[str, Any]) -> Row:
    """The run as hetplan would be given it (``hetplan estimate`` with the run's settings)."""
    d = data["defaults"]
    try:
        model = run_model(run, data.get("hf_configs", {}))
        gpus, tp, pp, cp, ep = (int(run[k]) for k in ("gpus", "tp", "pp", "cp", "ep"))
        dp = gpus // (tp * pp * cp)
        zero = 3 if int(run["fsdp"]) > 0 else (1 if d["distributed_optimizer"] else 0)
        workload = Workload(model, homogeneous_cluster(gpus, d["gpu"], int(d["gpus_per_node"])), int(run["gbs"]),
                            optimizer=d["optimizer"], fp8=run["precision"] == "fp8",
                            expert_imbalance=float(d["expert_imbalance"]), attention_kernel=d["attention_kernel"],
                            tp_comm_overlap=bool(d["tp_comm_overlap"]))
        vp = int(run["vp"])
        plan = uniform_plan(workload, dp, tp, pp, int(run["mbs"]), zero=zero,
                            recompute=run.get("recompute", d["recompute"]),
                            schedule="interleaved-1f1b" if vp > 1 else "1f1b", sequence_parallel=tp > 1,
                            planner="published", virtual_stages=vp, cp=cp, ep=ep)
    except HetplanError as exc:
        return Row(run, skip=str(exc))
    return Row(run, workload, plan)


def predict(row: Row) -> tuple[float, float]:
    """Predicted tokens/s per GPU and the busiest GPU's peak memory (GiB)."""
    assert row.workload is not None and row.plan is not None
    estimate = CostModel(row.workload).estimate(row.plan)
    tokens = row.workload.global_batch_size * row.workload.model.seq_len
    gpus = row.workload.cluster.num_devices
    return tokens / estimate.iteration_time_s / gpus, max(estimate.peak_memory_bytes.values()) / 2**30


def settings(run: dict[str, Any], data: dict[str, Any]) -> str:
    parts = [f"tp{run['tp']}", f"pp{run['pp']}"]
    parts += [f"{k}{run[k]}" for k in ("cp", "ep", "vp") if int(run[k]) > 1]
    parts.append("fsdp" if int(run["fsdp"]) else ("dist-opt" if data["defaults"]["distributed_optimizer"] else "ddp"))
    recompute = run.get("recompute", data["defaults"]["recompute"])
    if recompute != "none":
        parts.append(f"rc:{recompute}")
    return " ".join(parts) + f" mbs{run['mbs']} gbs{run['gbs']} {run['precision']}"


def print_table(title: str, table: list[list[str]]) -> None:
    head = ["run", "settings", "measured tok/s/GPU", "hetplan", "error", "peak mem"]
    widths = [max(len(str(r[i])) for r in table + [head]) for i in range(len(head))]
    print(title)
    for line in [head, ["-" * w for w in widths]] + table:
        print("  ".join(str(c).ljust(w) for c, w in zip(line, widths)).rstrip())
    print()


def check(data: dict[str, Any]) -> tuple[list[list[str]], list[float], list[float], list[str]]:
    """The table rows of one data file, the errors of its expressible runs
    (those hetplan warns are likely optimistic apart) and the runs predicted
    not to fit although they trained (every run here did)."""
    table, errors, warned, wrong_oom = [], [], [], []
    for row in (build(run, data) for run in data["runs"]):
        if row.skip:
            table.append([row.run["id"], settings(row.run, data), f"{row.run['tokens_per_s_per_gpu']:,}", "", "",
                          f"not expressible: {row.skip}"])
            continue
        predicted, memory = predict(row)
        measured = float(row.run["tokens_per_s_per_gpu"])
        error = predicted / measured - 1
        assert row.workload is not None
        flagged = bool(fine_grained_moe_note(row.workload.model))
        (warned if flagged else errors).append(error)
        capacity = row.workload.cluster.devices[0].memory_bytes / 2**30
        oom = memory > capacity
        if oom:
            wrong_oom.append(row.run["id"])
        table.append([row.run["id"], settings(row.run, data), f"{measured:,.0f}", f"{predicted:,.0f}",
                      f"{100 * error:+.1f}%" + (" (warned)" if flagged else ""),
                      f"{memory:.1f} GiB" + (f" of {capacity:.0f}: OOM, but it trained (WRONG)" if oom else "")])
    return table, errors, warned, wrong_oom


def main() -> int:
    errors: list[float] = []
    warned: list[float] = []
    wrong_oom: list[str] = []
    for name in FILES:
        data = json.loads((DATA / name).read_text())
        table, found, found_warned, oom = check(data)
        errors += found
        warned += found_warned
        wrong_oom += oom
        print_table(f"{data['stack']}: measured vs hetplan (error > 0: hetplan too optimistic)", table)
    if not errors:
        print("no run expressible")
        return 1
    median, worst = statistics.median(abs(e) for e in errors), max(abs(e) for e in errors)
    print(f"{len(errors)} runs: median |error| {100 * median:.1f}% (target <= {100 * MEDIAN_TARGET:.0f}%), "
          f"max {100 * worst:.1f}% (target <= {100 * MAX_TARGET:.0f}%), "
          f"median signed {100 * statistics.median(errors):+.1f}%")
    if warned:
        print(f"{len(warned)} more runs, of fine-grained MoE models for which hetplan estimate warns that the "
              f"estimate is likely optimistic, not in the time targets: errors "
              f"{', '.join(f'{100 * e:+.1f}%' for e in warned)}")
    runs = len(errors) + len(warned)
    print(f"memory: {runs - len(wrong_oom)} of {runs} runs, all of which trained, predicted to fit"
          + (f"; predicted out of memory: {', '.join(wrong_oom)}" if wrong_oom else ""))
    ok = median <= MEDIAN_TARGET and worst <= MAX_TARGET and not wrong_oom
    print("all targets met" if ok else "TARGET MISSED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
