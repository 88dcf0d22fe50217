"""The workload a command plans for, from typed options instead of an
``argparse.Namespace``: the command line fills ``WorkloadOptions`` from its
flags (``hetplan.cli.options``), Python callers build it directly
(``hetplan.app.plan``), and both get the same ``Workload``.

Where an option is left out (None), a plan file's saved setting applies, then
the default; so ``hetplan estimate plan.json`` costs the plan as it was made.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hetplan.cluster.io import load_cluster
from hetplan.plan.workload import Workload
from hetplan.cost.calibration import effective_calibration, read_calibration
from hetplan.cost.constants import (
    DEFAULT_ATTENTION_KERNEL, EXPERT_LOAD_IMBALANCE, PRECISION_BYTES, TOOL_ATTENTION_KERNEL,
)
from hetplan.model.load import load_model
from hetplan.plan.file import PlanFile, resolve_cluster, resolve_model
from hetplan.profile import load_profile
from hetplan.export.target import plan_target
from hetplan.units import parse_memory_size

# What ``hetplan plan`` runs with no options: AMP's GPT-2 setting on AMP's mixed
# V100/T4 cluster at batch 32 (the AMP paper's heterogeneous experiment; docs/planners/amp.md).
DEFAULT_MODEL = "gpt2-amp"
DEFAULT_CLUSTER = "amp-heterogeneous"
DEFAULT_GLOBAL_BATCH = 32
DEFAULT_PLANNER = "auto"  # hetplan's own planner (search/auto.py)


@dataclass(frozen=True)
class WorkloadOptions:
    """What a user says about the workload; None: the plan file's, else the default.

    ``model``/``cluster``: a preset name or a file (what ``--model``/``--cluster`` take);
    ``memory_limit``: usable memory per GPU, e.g. "8GB" or bytes; ``target``: the
    tool the plans must run on (``hetplan.export.target.PLAN_TARGETS``); ``search_offload``:
    may the planners offload activations (``plan --offload auto|never``); ``compile``: cost the
    runtime with each layer ``torch.compile``d (``Workload.compile``)."""

    model: str | None = None
    cluster: str | None = None
    global_batch: int | None = None
    seq_len: int | None = None
    memory_limit: str | int | None = None
    optimizer: str = ""
    profile: str | None = None
    calibration: str | None = None
    overlap_grad_sync: bool | None = None
    fp8: bool | None = None
    precision: str | None = None
    zero_impl: str | None = None
    attention_kernel: str | None = None
    tp_overlap: bool | None = None
    expert_imbalance: float | None = None
    target: str | None = None
    search_offload: bool = True
    compile: bool | None = None


def load_workload(options: WorkloadOptions, global_batch: int | None = None,
                  plan_file: PlanFile | None = None) -> Workload:
    """The workload of ``options``; with ``plan_file``, the model, cluster and
    settings it was made for, which options override. ``global_batch``
    overrides the options' (a plan's own batch, or 1 while a planner chooses it)."""
    dtype = PRECISION_BYTES[options.precision] if options.precision else None
    if plan_file is not None:
        model = resolve_model(plan_file, options.model, options.seq_len, dtype)
        cluster = resolve_cluster(plan_file, options.cluster)
    else:
        model = load_model(options.model or DEFAULT_MODEL, seq_len=options.seq_len, dtype_bytes=dtype)
        cluster = load_cluster(options.cluster or DEFAULT_CLUSTER)
    saved = plan_file.settings if plan_file is not None else {}
    target = plan_target(model, options.target or saved.get("target"))  # hetplan.export.target
    gbs = global_batch if global_batch is not None else (options.global_batch or DEFAULT_GLOBAL_BATCH)
    limit = parse_memory_size(options.memory_limit) if options.memory_limit is not None \
        else saved.get("memory_limit_bytes", 0)
    profile = load_profile(options.profile) if options.profile else None
    calibration = effective_calibration(profile, cluster, read_calibration(options.calibration)
                                        if options.calibration else cluster.meta.get("calibration"))
    return Workload(model, cluster, gbs, optimizer=options.optimizer or saved.get("optimizer", ""),
                    memory_limit_bytes=limit,
                    overlap_grad_sync=_given(options.overlap_grad_sync, saved, "overlap_grad_sync", True),
                    profile=profile, fp8=_given(options.fp8, saved, "fp8", False),
                    zero_implementation=options.zero_impl or saved.get("zero_implementation", "fsdp"),
                    attention_kernel=_attention_kernel(options, saved),
                    tp_comm_overlap=_given(options.tp_overlap, saved, "tp_comm_overlap", False),
                    precision=options.precision or saved.get("precision", ""), calibration=calibration,
                    expert_imbalance=_given(options.expert_imbalance, saved, "expert_imbalance",
                                            EXPERT_LOAD_IMBALANCE),
                    search_offload=options.search_offload, target=target,
                    compile=_given(options.compile, saved, "compile", False))


def _given(value: Any, saved: dict[str, Any], key: str, default: Any) -> Any:
    """The option if given, else the plan file's setting, else the default (checked by Workload)."""
    return value if value is not None else saved.get(key, default)


def _attention_kernel(options: WorkloadOptions, saved: dict[str, Any]) -> str:
    """The option, else the plan file's, else the kernel the given target tool calls, else the default."""
    return (options.attention_kernel or saved.get("attention_kernel")
            or TOOL_ATTENTION_KERNEL.get(options.target or "", DEFAULT_ATTENTION_KERNEL))
