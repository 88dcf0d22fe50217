"""The ``hetplan`` command line.

    hetplan plan      best plans for a model on a cluster (default: AMP's GPT-2 on
                      its heterogeneous cluster), with time, throughput, memory and why
    hetplan compare   several planners side by side on the same inputs
    hetplan estimate  cost one plan file, or one uniform dp/tp/pp setting
    hetplan export    a plan as torchtitan / Megatron / DeepSpeed settings
    hetplan models    list model presets
    hetplan clusters  list cluster presets and GPU types
    hetplan train/run train with a plan (runtime; needs torch)
    hetplan profile   measure layer times and collectives on your hardware (needs torch)
    hetplan tune      train the top plans for a few steps, re-rank them by measurement (needs torch)
    hetplan calibrate fit the cost model's rates to measured step times
    hetplan report    one self-contained HTML page for a plan file

A user mistake prints one line ``hetplan: error: ...`` and exits with status 2.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any, Sequence

from hetplan import __version__
from hetplan.argtypes import EXIT_USAGE, OneLineParser, at_most, finite_nonneg_float, gpu_prices, positive_int, token_count
from hetplan.cost.constants import (
    ATTENTION_KERNELS, DEFAULT_ATTENTION_KERNEL, PRECISION_BYTES, TOOL_ATTENTION_KERNEL, ZERO_IMPLEMENTATIONS,
)
from hetplan.errors import HetplanError, OutOfMemoryError
from hetplan.export import DEFAULT_TORCHTITAN_VERSION, TORCHTITAN_VERSIONS
from hetplan.limits import MAX_GLOBAL_BATCH, MAX_GPUS
from hetplan.report import cli as report_cli
from hetplan.runtime import cli as runtime_cli
from hetplan.runtime.profiling import cli as profile_cli
from hetplan import tune as tune_cli
from hetplan.target import PLAN_TARGETS

DEFAULT_MODEL = "gpt2-amp"
DEFAULT_CLUSTER = "amp-heterogeneous"
DEFAULT_GLOBAL_BATCH = 32
DEFAULT_PLANNER = "auto"
OFFLOAD_SEARCH = ("auto", "never")  # plan/compare --offload: may the planners offload activations


_batch = at_most(MAX_GLOBAL_BATCH)
_degree = at_most(MAX_GPUS)


def _global_batch(text: str) -> int | str:
    if text == "auto":
        return "auto"
    return _batch(text)


def _add_workload_args(p: argparse.ArgumentParser, batch_auto: bool = True) -> None:
    p.add_argument("--model", default=None, help=f"preset name, HF config.json, ModelSpec .json or pkg.mod:function (default {DEFAULT_MODEL})")
    p.add_argument("--cluster", default=None, help=f"preset name, NxGPU, or cluster .yaml (default {DEFAULT_CLUSTER})")
    p.add_argument("--global-batch", type=_global_batch if batch_auto else _batch, default=None,
                   help=f"samples per step (default {DEFAULT_GLOBAL_BATCH})" + ("; 'auto' lets batch-searching "
                                                                                 "planners choose" if batch_auto else ""))
    p.add_argument("--seq-len", type=positive_int, default=None, help="sequence length for HF configs")
    p.add_argument("--memory-limit", default=None, help="usable memory per GPU, e.g. 8GB (default: the GPU's)")
    p.add_argument("--optimizer", default="", help="adam-mixed (16-bit models), adam-mixed-fp32-grads (Megatron bf16, "
                   "FSDP fp32 reduce), adam-bf16-deepspeed (DeepSpeed BF16 optimizer: bf16 + fp32 gradients), "
                   "adam-fp32, sgd-fp32")
    p.add_argument("--profile", default=None, help="measured layer times (ProfileDB JSON)")
    p.add_argument("--calibration", default=None,
                   help="fitted rates from 'hetplan calibrate' (default: the cluster file's 'calibration:')")
    p.add_argument("--no-overlap", action="store_true", help="do not overlap gradient sync with backward")
    p.add_argument("--fp8", action="store_true",
                   help="linear layers' matmuls in FP8 (Transformer Engine), on GPUs with FP8 tensor cores")
    p.add_argument("--precision", choices=tuple(PRECISION_BYTES), default=None,
                   help="training precision (default: the model's; HF configs: bf16); the runtime trains in it")
    p.add_argument("--zero-impl", choices=ZERO_IMPLEMENTATIONS, default=None,
                   help="how ZeRO shards move between nodes: fsdp (PyTorch FSDP, Megatron distributed optimizer, "
                   "hetplan's runtime; default) or deepspeed (each GPU's shard traffic crosses its own NIC)")
    p.add_argument("--attention-kernel", choices=ATTENTION_KERNELS, default=None,
                   help="the fused attention kernel your training calls: flash2 (PyTorch SDPA: hetplan's runtime, "
                   "torchtitan, HF; the default), cudnn (Transformer Engine: Megatron-LM, NeMo; the default with "
                   "--target megatron), triton (MosaicML MPT)")
    p.add_argument("--tp-overlap", action="store_true",
                   help="TP communication overlapped with the matmuls, as Megatron-LM --tp-comm-overlap and "
                   "torchtitan's async TP run it (hetplan's own runtime does not)")
    p.add_argument("--expert-imbalance", type=finite_nonneg_float, default=None,
                   help="MoE models: tokens the busiest expert-parallel rank gets over the average (default 1.25; "
                   "1 = perfect balance; give what your router measures)")
    p.add_argument("--json", dest="json_path", default=None, help="also write the result as JSON here")
    p.add_argument("--tokens", type=token_count, default=None,
                   help="tokens to train (e.g. 300B): days and GPU-hours (and cost with prices)")
    p.add_argument("--price-per-gpu-hour", dest="prices", type=gpu_prices, default=None,
                   help="price per GPU-hour: one number, or GPU=PRICE,... per type (e.g. H100=4.9,A100-80GB=1.8)")


def _add_target_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", choices=PLAN_TARGETS, default=None,
                   help="keep only plans this tool can run ('hetplan export' succeeds; 'hetplan': hetplan's own "
                   "runtime, the default for models it builds; 'any': every plan, as the papers' planners search), "
                   "and say how much slower the best of them is than the best plan overall (docs/exports.md)")
    p.add_argument("--torchtitan-version", choices=TORCHTITAN_VERSIONS, default=DEFAULT_TORCHTITAN_VERSION,
                   help="with --target torchtitan: the release to run (0.2 runs ZeRO-0 only without TP/PP)")


def _add_offload_search_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--offload", choices=OFFLOAD_SEARCH, default="auto",
                   help="activation offloading to host memory: auto (default) lets the planners that search "
                   "recomputation (uniform, auto) offload layers where memory is short and the cost model ranks it "
                   "best; never keeps every plan's activations on the GPU")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="hetplan", description="Plan and run parallel training on heterogeneous GPU clusters.")
    parser.add_argument("--version", action="version", version=f"hetplan {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("plan", help="find the best plans for a model on a cluster")
    _add_workload_args(p)
    p.add_argument("--planner", default=DEFAULT_PLANNER, help=f"planner (default {DEFAULT_PLANNER}); see 'hetplan planners'")
    p.add_argument("--top", type=positive_int, default=5, help="how many plans to show")
    p.add_argument("--quiet", action="store_true", help="only the table")
    p.add_argument("--timeline", default=None, help="write the best plan's pipeline timeline here (.svg)")
    p.add_argument("--memory-chart", default=None, help="write the best plan's memory per GPU here (.svg)")
    p.add_argument("--smp-alpha", type=finite_nonneg_float, default=None,
                   help="--planner smp: weight of memory against compute in a module's cost, 0..1 (default 0.8)")
    p.add_argument("--smp-pp", type=positive_int, default=None,
                   help="--planner smp: the pipeline degree (default: every divisor of the GPU count, ranked)")
    _add_offload_search_arg(p)
    _add_target_args(p)
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("compare", help="run several planners on the same inputs")
    _add_workload_args(p)
    p.add_argument("--planners", default=None, help="comma-separated planner names (default: all)")
    _add_offload_search_arg(p)
    _add_target_args(p)
    p.set_defaults(func=cmd_compare)

    p = sub.add_parser("estimate", help="cost a plan file or one uniform dp/tp/pp setting")
    p.add_argument("plan_file", nargs="?", default=None, help="plan JSON from 'hetplan plan --json'")
    p.add_argument("--index", type=positive_int, default=1, help="which plan of a ranked file (1 = best)")
    _add_workload_args(p, batch_auto=False)
    p.add_argument("--tp", type=_degree, default=None)
    p.add_argument("--pp", type=_degree, default=None)
    p.add_argument("--dp", type=_degree, default=None)
    p.add_argument("--cp", type=_degree, default=1,
                   help="context-parallel degree: each sequence split over this many GPUs (default 1)")
    p.add_argument("--ep", type=_degree, default=1,
                   help="expert-parallel degree of MoE layers, taken from the dp x cp GPUs (default 1)")
    p.add_argument("--micro-batch", type=_batch, default=None, help="samples per dp replica per micro-batch")
    p.add_argument("--zero", type=int, choices=(0, 1, 2, 3), default=0)
    p.add_argument("--recompute", choices=("none", "selective", "full"), default="none")
    p.add_argument("--offload", action="store_true", help="keep saved activations in host memory (every layer)")
    p.add_argument("--sequence-parallel", action="store_true")
    p.add_argument("--schedule", choices=("1f1b", "gpipe", "interleaved-1f1b"), default="1f1b")
    p.add_argument("--virtual-stages", type=positive_int, default=1,
                   help="model chunks per device for interleaved-1f1b")
    p.add_argument("--timeline", default=None, help="write the pipeline timeline here (.svg)")
    p.add_argument("--memory-chart", default=None, help="write memory per GPU here (.svg)")
    p.add_argument("--simulate", action="store_true", help="replay the schedule event by event and compare")
    _add_target_args(p)
    p.set_defaults(func=cmd_estimate)

    p = sub.add_parser("export", help="write a plan as torchtitan/Megatron/DeepSpeed settings or module lists")
    p.add_argument("plan_file", help="plan JSON from 'hetplan plan --json'")
    p.add_argument("--format", required=True, choices=("modules", "torchtitan", "megatron", "deepspeed"))
    p.add_argument("--model", default=None, help="model the plan was made for (default: the one in the plan file)")
    p.add_argument("--cluster", default=None, help="cluster the plan was made for (default: the one in the plan file)")
    p.add_argument("--index", type=positive_int, default=1, help="which plan of a ranked file (1 = best)")
    p.add_argument("--torchtitan-version", choices=("0.3", "0.2"), default="0.3",
                   help="torchtitan release to write for: 0.3 (current: a Python config) or 0.2 (a TOML job file)")
    p.add_argument("--out", default=None, help="write here instead of printing (DeepSpeed pipeline code: "
                                               "beside it, as NAME.pipeline.py)")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("whatif", help="the best plan as the cluster or batch changes: one row per variant")
    _add_workload_args(p, batch_auto=False)
    p.add_argument("--vary", required=True, metavar="WHAT=V1,V2,...",
                   help="gpus=64,128,256 | gpu=H100,A100-80GB | global-batch=256,512 (on a homogeneous cluster)")
    p.add_argument("--planner", default=DEFAULT_PLANNER, help=f"planner (default {DEFAULT_PLANNER})")
    p.set_defaults(func=cmd_whatif)

    p = sub.add_parser("models", help="list model presets")
    p.add_argument("--json", dest="json_path", default=None)
    p.set_defaults(func=cmd_models)

    p = sub.add_parser("clusters", help="list cluster presets and GPU types")
    p.add_argument("--json", dest="json_path", default=None)
    p.set_defaults(func=cmd_clusters)

    p = sub.add_parser("planners", help="list planners")
    p.add_argument("--json", dest="json_path", default=None)
    p.set_defaults(func=cmd_planners)

    p = sub.add_parser("calibrate", help="fit the cost model's rates to measured step times")
    p.add_argument("measurements", nargs="+", metavar="FILE",
                   help="'hetplan tune' measurements JSON, 'hetplan train --out' summary.json, or a CSV "
                   "with columns plan,measured_step_s[,measured_peak_memory_bytes]")
    p.add_argument("-o", "--out", required=True, help="write the calibration here (JSON; use with --calibration)")
    p.add_argument("--profile", default=None, help="the measured layer times the plans were costed with")
    p.add_argument("--json", dest="json_path", default=None, help="also write the fit report as JSON here")
    p.set_defaults(func=cmd_calibrate)

    runtime_cli.register(sub)
    report_cli.register(sub)
    tune_cli.register(sub)
    profile_cli.register(sub)
    return parser


# --- helpers ---------------------------------------------------------------------
def load_workload(args: argparse.Namespace, global_batch: int | None = None, plan_file: Any = None) -> Any:
    """The workload from the command line; with ``plan_file`` (a PlanFile), the
    model, cluster and settings it was made for, which options override."""
    from hetplan.cluster import load_cluster
    from hetplan.cost import Workload
    from hetplan.model import load_model
    from hetplan.planfile import resolve_cluster, resolve_model
    from hetplan.cost.calibration import effective_calibration, read_calibration
    from hetplan.profile import load_profile
    from hetplan.target import plan_target
    from hetplan.units import parse_memory_size

    dtype = PRECISION_BYTES[args.precision] if args.precision else None
    if plan_file is not None:
        model = resolve_model(plan_file, args.model, args.seq_len, dtype)
        cluster = resolve_cluster(plan_file, args.cluster)
    else:
        model = load_model(args.model or DEFAULT_MODEL, seq_len=args.seq_len, dtype_bytes=dtype)
        cluster = load_cluster(args.cluster or DEFAULT_CLUSTER)
    saved = plan_file.settings if plan_file is not None else {}
    target = plan_target(model, getattr(args, "target", None) or saved.get("target"))  # hetplan.target
    gbs = global_batch if global_batch is not None else (args.global_batch or DEFAULT_GLOBAL_BATCH)
    limit = parse_memory_size(args.memory_limit) if args.memory_limit is not None \
        else saved.get("memory_limit_bytes", 0)
    profile = load_profile(args.profile) if args.profile else None
    calibration = effective_calibration(profile, cluster, read_calibration(args.calibration) if args.calibration
                                        else cluster.meta.get("calibration"))
    return Workload(model, cluster, gbs, optimizer=args.optimizer or saved.get("optimizer", ""),
                    memory_limit_bytes=limit,
                    overlap_grad_sync=not args.no_overlap and saved.get("overlap_grad_sync", True),
                    profile=profile, fp8=args.fp8 or saved.get("fp8", False),
                    zero_implementation=args.zero_impl or saved.get("zero_implementation", "fsdp"),
                    attention_kernel=_attention_kernel(args, saved),
                    tp_comm_overlap=args.tp_overlap or saved.get("tp_comm_overlap", False),
                    precision=args.precision or saved.get("precision", ""), calibration=calibration,
                    expert_imbalance=_expert_imbalance(args, saved),
                    # plan/compare: --offload auto|never; estimate's --offload (a flag) sets the plan, not a search
                    search_offload=getattr(args, "offload", "auto") != "never", target=target)


def _attention_kernel(args: argparse.Namespace, saved: dict[str, Any]) -> str:
    """--attention-kernel, else the plan file's, else the kernel the --target tool calls, else the default."""
    return (args.attention_kernel or saved.get("attention_kernel")
            or TOOL_ATTENTION_KERNEL.get(getattr(args, "target", None) or "", DEFAULT_ATTENTION_KERNEL))


def _expert_imbalance(args: argparse.Namespace, saved: dict[str, Any]) -> float:
    """--expert-imbalance, else the plan file's, else the default; checked by Workload."""
    from hetplan.cost.constants import EXPERT_LOAD_IMBALANCE

    given = getattr(args, "expert_imbalance", None)
    return given if given is not None else saved.get("expert_imbalance", EXPERT_LOAD_IMBALANCE)


def _write_json(path: str | None, data: Any) -> None:
    if not path:
        return
    try:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=2)
    except OSError as exc:
        raise HetplanError(f"cannot write {path}: {exc.strerror}") from None
    print(f"wrote {path}")


def _ranked_json(ranked: Any, cost_model: Any, args: argparse.Namespace) -> dict[str, Any]:
    """A ranked plan as JSON, with each GPU's peak memory by category
    (``memory_breakdown_bytes``: params, grads, optimizer, activations, buffers)
    and the time (and cost) to train (``training``: report/training.py)."""
    from hetplan.report.training import training_numbers

    data = ranked.to_dict()
    data["estimate"]["memory_breakdown_bytes"] = {str(d): parts for d, parts in
                                                  sorted(cost_model.memory_breakdown(ranked.plan).items())}
    w = cost_model.workload
    data["training"] = training_numbers(ranked.plan, ranked.estimate, w.cluster, w.model.seq_len, args.tokens,
                                        args.prices)
    return data


def _training_report(ranked: Any, workload: Any, args: argparse.Namespace) -> list[str]:
    from hetplan.report.training import training_lines, training_numbers

    return training_lines(training_numbers(ranked.plan, ranked.estimate, workload.cluster, workload.model.seq_len,
                                           args.tokens, args.prices))


def _header(workload: Any, extra: str = "") -> str:
    from hetplan.units import format_bytes, format_count

    m, c = workload.model, workload.cluster
    seq = f"seq {m.seq_len}" + (" (default; set --seq-len)" if m.meta.get("seq_len_default") else "")
    lines = [f"model    {m.name}: {m.num_layers} layers, {format_count(m.total_params)} params, {seq}",
             f"cluster  {c.name}: {c.summary()}",
             f"batch    {workload.global_batch_size} samples/step, {workload.precision}, optimizer {workload.optimizer}"
             + (", FP8 matmuls" if workload.fp8 else "")
             + (", DeepSpeed ZeRO collectives" if workload.zero_implementation == "deepspeed" else "")
             + (f", {workload.attention_kernel} attention" if workload.attention_kernel != DEFAULT_ATTENTION_KERNEL
                else "")
             + (", TP communication overlapped" if workload.tp_comm_overlap else "")
             + (f", memory limit {format_bytes(workload.memory_limit_bytes)}/GPU" if workload.memory_limit_bytes else "")]
    if workload.profile is not None:
        measured_dp = len(getattr(workload.profile, "data_parallel", ()))
        lines.append(f"costs    measured layer times ({len(workload.profile)} profile entries)"
                     + (f" and data-parallel wrappers ({measured_dp} points)" if measured_dp else "")
                     + " where the profile has them, the analytic model elsewhere")
    if workload.calibration is not None:
        lines.append(f"rates    calibrated: {workload.calibration.describe()}")
    if extra:
        lines.append(extra)
    return "\n".join(lines)


def _run_planner(planner: Any, workload: Any, top_k: int, auto_batch: bool) -> list[Any]:
    if auto_batch and not getattr(planner, "searches_batch_size", False):
        raise HetplanError(f"planner {planner.name!r} does not search the batch size; "
                           "give --global-batch N or use a galvatron planner")
    try:
        return planner.plan_auto_batch(workload, top_k) if auto_batch else planner.plan(workload, top_k)
    except OutOfMemoryError as exc:
        raise _seq_len_hint(exc, workload.model) from None


def _runnable_best(planner: Any, workload: Any) -> Any:
    """The planner's best plan the default target runs (hetplan's runtime, for
    a model it builds: ``hetplan.target.plan_target``)."""
    from hetplan.target import search_for_target

    found, _ = search_for_target(lambda k: _run_planner(planner, workload, k, False), workload,
                                 workload.target or None, 1, planner.name)
    return found[0]


def _seq_len_hint(exc: OutOfMemoryError, model: Any) -> OutOfMemoryError:
    """For a model from a HF config, "nothing fits" may just mean a long
    sequence (activations grow with it): say so, and how to change it. Not
    when the weights and optimizer states alone exceed the cluster."""
    text = str(exc)
    if not model.meta.get("hf_class") or "optimizer states alone" in text:
        return exc
    how = "the default for this HF config" if model.meta.get("seq_len_default") else "from --seq-len"
    return OutOfMemoryError(f"{text}; or a shorter --seq-len (now {model.seq_len}, {how})")


# --- commands -------------------------------------------------------------------------
def _smp_planner(args: argparse.Namespace) -> Any:
    """The smp planner with ``--smp-alpha`` / ``--smp-pp`` (hetplan.search.smp)."""
    from hetplan.search.smp import DEFAULT_ALPHA, SMPPlanner

    alpha = DEFAULT_ALPHA if args.smp_alpha is None else args.smp_alpha
    return SMPPlanner(alpha=alpha, pp=args.smp_pp)


def cmd_plan(args: argparse.Namespace) -> int:
    from hetplan.cost import CostModel
    from hetplan.planfile import workload_record
    from hetplan.target import default_notes, search_for_target
    from hetplan.report.text import (
        breakdown, explain, fine_grained_moe_note, memory_table, ranked_table, runtime_pipeline_note,
    )
    from hetplan.search import get_planner

    auto = args.global_batch == "auto"
    workload = load_workload(args, global_batch=1 if auto else None)
    planner = _smp_planner(args) if args.planner == "smp" else get_planner(args.planner)
    start = time.perf_counter()
    # the planner's best candidates, less those the target cannot run (hetplan.target): hetplan's runtime by default
    tool = workload.target or None
    explicit = tool is not None and bool(args.target)
    ranked, target = search_for_target(lambda k: _run_planner(planner, workload, k, auto), workload, tool, args.top,
                                       planner.name, "merge" if explicit else "fallback", args.torchtitan_version)
    elapsed = time.perf_counter() - start
    best = ranked[0]
    if auto:
        workload = load_workload(args, global_batch=best.plan.global_batch_size)
    cost_model = CostModel(workload)
    print(_header(workload, f"planner  {planner.name}: searched in {elapsed:.2f} s"))
    print()
    print(ranked_table(ranked))
    target_lines = ([target.summary(), *(f"note: {n}" for n in target.notes)] if explicit and target else
                    [f"note: {n}" for n in default_notes(target, workload) if args.target != "any"])
    if target_lines:
        print()
        print("\n".join(target_lines))
    if not args.quiet:
        print()
        print(f"best plan: {best.plan.describe()}")
        print(breakdown(best.estimate, any(s.cp > 1 or s.ep > 1 for s in best.plan.stages)))
        print()
        print(memory_table(best.plan, best.estimate, workload, cost_model.memory_breakdown(best.plan)))
        print()
        for line in [*explain(best.plan, best.estimate, workload), *_training_report(best, workload, args)]:
            print(f"- {line}")
        for note in [*best.plan.notes, runtime_pipeline_note(best.plan, workload.model),
                     fine_grained_moe_note(workload.model)]:
            if note:
                print(f"- note: {note}")
    extra = {}
    if explicit and target is not None and args.json_path:
        from hetplan.target import target_json

        extra = target_json(target, _ranked_json(target.best_overall, cost_model, args))
    _write_json(args.json_path, {"planner": planner.name, "search_time_s": elapsed,
                                 "plans": [_ranked_json(r, cost_model, args) for r in ranked],
                                 **extra, **workload_record(workload)})
    _write_pictures(args, workload, best)
    return 0


def _write_text(path: str, text: str) -> None:
    try:
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
    except OSError as exc:
        raise HetplanError(f"cannot write {path}: {exc.strerror}") from None
    print(f"wrote {path}")


def _write_pictures(args: argparse.Namespace, workload: Any, ranked: Any) -> None:
    """--timeline and --memory-chart: SVG pictures of one plan."""
    from hetplan.cost import CostModel
    from hetplan.report.svg import memory_svg, timeline_svg
    from hetplan.simulate import simulate_plan

    plan, estimate = ranked.plan, ranked.estimate
    if getattr(args, "timeline", None):
        events = simulate_plan(CostModel(workload), plan, estimate)
        labels = []
        for s in plan.stages:
            gpus = "+".join(sorted({workload.cluster.devices[d].gpu.name for d in s.devices}))
            labels.append(f"{gpus} dp{s.dp} tp{s.tp}")
        _write_text(args.timeline, timeline_svg(events, labels, plan.describe(), estimate.iteration_time_s))
    if getattr(args, "memory_chart", None):
        _write_text(args.memory_chart, memory_svg(plan, estimate, workload, f"peak memory per GPU: {plan.describe()}"))


def cmd_compare(args: argparse.Namespace) -> int:
    from hetplan.report.text import table
    from hetplan.search import get_planner, planner_names
    from hetplan.units import format_time

    auto = args.global_batch == "auto"
    workload = load_workload(args, global_batch=1 if auto else None)
    names = planner_names() if args.planners is None else [n.strip() for n in args.planners.split(",")]
    if not all(names):
        raise HetplanError(f"--planners {args.planners!r} names an empty planner; give names separated by commas "
                           "(see 'hetplan planners'), or leave --planners out for all")
    rows_json, results, targets = [], [], {}
    from hetplan.target import candidate_count, search_for_target, tool_name

    tool = workload.target or None  # hetplan's runtime by default (hetplan.target)
    explicit = tool is not None and bool(args.target)
    for name in names:
        planner = get_planner(name)
        start = time.perf_counter()
        try:
            batch = auto and getattr(planner, "searches_batch_size", False)
            # its best plan the tool can run, of its candidate_count(1) best
            found, target = search_for_target(lambda k: _run_planner(planner, workload, k, batch), workload, tool,
                                              1, name, "fallback", args.torchtitan_version)
            best = found[0]
            if target is not None:
                targets[name] = target
            error = ""
        except HetplanError as exc:
            best, error = None, str(exc)
        results.append((name, best, time.perf_counter() - start, error))
    base = next((r for r in results if r[0] == "megatron" and r[1] is not None), None)
    base = base or next((r for r in results if r[1] is not None), None)
    rows = []
    for name, best, elapsed, error in results:
        if best is None:
            rows.append([name, f"no plan: {error}", "-", "-", "-", "no", f"{elapsed:.2f} s"])
            rows_json.append({"planner": name, "error": error, "search_time_s": elapsed, "fits": False})
            continue
        e = best.estimate
        speedup = base[1].estimate.iteration_time_s / e.iteration_time_s if base else 1.0
        rows.append([name, best.plan.describe(), format_time(e.iteration_time_s), f"{e.samples_per_s:.2f}",
                     f"{speedup:.2f}x", "yes" if e.fits else "OOM", f"{elapsed:.2f} s"])
        rows_json.append({"planner": name, "iteration_time_s": e.iteration_time_s, "samples_per_s": e.samples_per_s,
                          "speedup": speedup, "fits": e.fits, "search_time_s": elapsed,
                          "global_batch_size": best.plan.global_batch_size,
                          "plan": best.plan.to_dict(), "estimate": e.to_dict()})
        if name in targets:  # what the tool costs this planner: its best plan overall, and why the tool refuses it
            t = targets[name]
            if t.source != name:
                rows[-1][1] += f" [{t.source} fallback]"
            if explicit:
                rows[-1].insert(-1, f"+{100 * t.slowdown:.1f}%")
            rows_json[-1].update({"target": t.tool, "source": t.source, "slowdown": t.slowdown,
                                  "best_overall": {**t.best_overall.to_dict(), "refusal": t.best_overall_refusal}})
    for row in rows if explicit else ():
        if len(row) == 7:  # a planner without a plan
            row.insert(-1, "-")
    extra = ""
    if explicit:
        extra = (f"target   {tool_name(args.target)}: each planner's best plan it can run, of its {candidate_count(1)} "
                 "best (the uniform planner's where it can run none); 'vs own best': slower than the planner's best")
    print(_header(workload, extra))
    print()
    base_name = base[0] if base else "-"
    head = ["planner", "best plan", "iter time", "samples/s", f"vs {base_name}", "fits", "search"]
    right = [False, False, True, True, True, False, True]
    if explicit:
        head.insert(-1, "vs own best")
        right.insert(-1, True)
    print(table(head, rows, right))
    _write_json(args.json_path, rows_json)
    return 0


def _check_target_runs(plan: Any, workload: Any, torchtitan_version: str) -> None:
    """A plan is costed for the code that will run it: hetplan's runtime unless
    ``--target`` (or the plan file) names a tool; one that code would refuse or
    run differently is refused here in one line (``hetplan.target.refusal``)."""
    from hetplan.target import RUNTIME, refusal, tool_name

    tool = workload.target
    why = refusal(plan, workload, tool, torchtitan_version) if tool else ""
    if why:
        hint = ("; to cost it for a tool instead, give --target torchtitan, megatron or deepspeed (or --target any)"
                if tool == RUNTIME else "")
        raise HetplanError(f"{tool_name(tool)} cannot run this plan as costed: {why}{hint}")


def cmd_estimate(args: argparse.Namespace) -> int:
    from hetplan.cost import CostModel
    from hetplan.plan import RankedPlan
    from hetplan.planfile import read_plan_file, workload_record
    from hetplan.report.text import (
        breakdown, fine_grained_moe_note, memory_table, ranked_table, runtime_pipeline_note,
    )
    from hetplan.search.baselines.uniform import uniform_plan
    from hetplan.validate import validate_plan

    degrees = (args.tp, args.pp, args.dp, args.micro_batch)
    if args.offload and args.plan_file in OFFLOAD_SEARCH:  # 'estimate --offload never': read as a plan file
        raise HetplanError(f"estimate's --offload takes no value (it offloads every layer); --offload "
                           f"{'|'.join(OFFLOAD_SEARCH)} is for plan and compare")
    if args.plan_file:
        if any(d is not None for d in degrees) or args.cp != 1 or args.ep != 1:
            raise HetplanError("give either a plan file or --tp/--pp/--dp/--cp/--ep/--micro-batch, not both")
        if args.offload:
            raise HetplanError("--offload applies to a --tp/--pp/--dp plan; a plan file sets offload per layer: "
                               "drop --offload or the plan file")
        plan_file = read_plan_file(args.plan_file)
        plan = plan_file.plan(args.index)
        if plan_file.model is None:  # a format-1 file: names only
            args.model = args.model or plan.model
            args.cluster = args.cluster or plan.cluster
        workload = load_workload(args, global_batch=plan.global_batch_size, plan_file=plan_file)
        validate_plan(plan, workload.model, workload.cluster)
    else:
        missing = [n for n, d in zip(("--tp", "--pp", "--dp", "--micro-batch"), degrees) if d is None]
        if missing:
            raise HetplanError(f"estimate needs a plan file or all of --tp --pp --dp --micro-batch (missing {' '.join(missing)})")
        workload = load_workload(args)
        if args.virtual_stages > 1 and args.schedule != "interleaved-1f1b":
            raise HetplanError("--virtual-stages needs --schedule interleaved-1f1b")
        plan = uniform_plan(workload, args.dp, args.tp, args.pp, args.micro_batch, args.zero, args.recompute,
                            args.schedule, args.sequence_parallel, planner="manual",
                            virtual_stages=args.virtual_stages, offload=args.offload, cp=args.cp, ep=args.ep)
        validate_plan(plan, workload.model, workload.cluster)
    _check_target_runs(plan, workload, args.torchtitan_version)
    cost_model = CostModel(workload)
    estimate = cost_model.estimate(plan)
    print(_header(workload))
    print()
    print(ranked_table([RankedPlan(plan, estimate)]))
    print()
    print(breakdown(estimate, any(s.cp > 1 or s.ep > 1 for s in plan.stages)))
    print()
    print(memory_table(plan, estimate, workload, cost_model.memory_breakdown(plan)))
    print()
    for line in _training_report(RankedPlan(plan, estimate), workload, args):
        print(f"- {line}")
    for note in (runtime_pipeline_note(plan, workload.model), fine_grained_moe_note(workload.model)):
        if note:
            print(f"note: {note}")
    if args.simulate:
        from hetplan.simulate import build_schedule, format_schedule, makespan, simulate_plan

        events = simulate_plan(CostModel(workload), plan, estimate)
        pipeline = estimate.iteration_time_s - estimate.dp_sync_s - estimate.optimizer_s
        print()
        if plan.num_micro_batches * plan.pp <= 64:
            print(format_schedule(build_schedule(plan.schedule, plan.pp, plan.num_micro_batches)))
        print(f"simulated pipeline {makespan(events) * 1e3:.2f} ms vs closed form {pipeline * 1e3:.2f} ms")
    _write_json(args.json_path, {"plans": [_ranked_json(RankedPlan(plan, estimate), cost_model, args)],
                                 **workload_record(workload)})
    _write_pictures(args, workload, RankedPlan(plan, estimate))
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    import os

    from hetplan.export import render, settings_notes
    from hetplan.planfile import read_plan_file, resolve_cluster, resolve_model
    from hetplan.validate import validate_plan

    plan_file = read_plan_file(args.plan_file)
    plan = plan_file.plan(args.index)
    model = resolve_model(plan_file, args.model)
    cluster = resolve_cluster(plan_file, args.cluster)
    validate_plan(plan, model, cluster)  # never export a plan that cannot run
    result = render(plan, model, args.format, cluster, args.torchtitan_version)
    for note in [*result.notes, *settings_notes(plan_file.settings, args.format)]:
        print(f"note: {note}", file=sys.stderr)
    outputs = {args.out: result.text} if args.out else {}
    for suffix, text in result.files.items():
        if args.out:
            outputs[os.path.splitext(args.out)[0] + suffix] = text
        else:
            print(f"note: {suffix} file (give --out to write it):\n{text}", file=sys.stderr)
    for path, text in outputs.items():
        try:
            with open(path, "w", encoding="utf-8") as f:
                f.write(text if text.endswith("\n") else text + "\n")
        except OSError as exc:
            raise HetplanError(f"cannot write {path}: {exc.strerror}") from None
        print(f"wrote {path}")
    if not args.out:
        print(result.text)
    return 0


def cmd_whatif(args: argparse.Namespace) -> int:
    """Plan the same model under each variant of the cluster or batch (``report/whatif.py``)."""
    from hetplan.cost import CostModel
    from hetplan.report.whatif import check_varies, parse_vary, run_whatif, whatif_table
    from hetplan.search import get_planner

    what, items = parse_vary(args.vary)
    base = load_workload(args)
    check_varies(base, what)
    planner = get_planner(args.planner)
    print(_header(base, f"whatif   {what} = {', '.join(items)}, planner {planner.name}"))
    results = run_whatif(base, what, items, planner, args.tokens, args.prices,
                         best_of=_runnable_best)
    print()
    print(whatif_table(results, args.tokens))
    if args.json_path:  # the JSON adds the memory breakdown, which needs each variant's cost model
        data = [{"variant": {what: r.value}, "error": r.error} if r.best is None else
                {"variant": {what: r.value}, "cluster": r.workload.cluster.name,
                 **_ranked_json(r.best, CostModel(r.workload), args)} for r in results]
        _write_json(args.json_path, {"vary": what, "variants": data})
    return 0


def cmd_calibrate(args: argparse.Namespace) -> int:
    """Fit a Calibration to measured plans, print the fit, write it."""
    from hetplan.calibrate import fit, fit_report, load_observations
    from hetplan.profile import load_profile

    profile = load_profile(args.profile) if args.profile else None
    observations = load_observations(args.measurements, profile)
    print(f"calibrate: {len(observations)} measured plan(s)", file=sys.stderr, flush=True)
    result = fit(observations, progress=lambda line: print(line, file=sys.stderr, flush=True))
    print("\n".join(fit_report(result, observations)))
    print()
    _write_text(args.out, json.dumps(result.calibration.to_dict(), indent=1) + "\n")
    print(f"use it with --calibration {args.out} (or 'calibration: {args.out}' in the cluster file)")
    _write_json(args.json_path, {
        "calibration": result.calibration.to_dict(),
        "parameters": [{"name": p.label, "fitted": ok} for p, ok in zip(result.parameters, result.identifiable)],
        "plans": [{"name": o.name, "measured_step_s": o.measured_step_s, "before_s": b, "after_s": a}
                  for o, b, a in zip(observations, result.before_s, result.after_s)]})
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    from hetplan.model import get_model, model_descriptions
    from hetplan.report.text import table
    from hetplan.units import format_count

    rows, data = [], []
    for name, desc in model_descriptions().items():
        m = get_model(name)
        rows.append([name, format_count(m.total_params), m.num_layers, m.seq_len, desc])
        data.append({"name": name, "params": m.total_params, "layers": m.num_layers, "seq_len": m.seq_len,
                     "description": desc})
    print(table(["model", "params", "layers", "seq", "description"], rows, [False, True, True, True, False]))
    _write_json(args.json_path, data)
    return 0


def cmd_clusters(args: argparse.Namespace) -> int:
    from hetplan.cluster import GPU_CATALOG, cluster_descriptions, get_cluster
    from hetplan.report.text import table
    from hetplan.units import format_bytes

    rows, data = [], []
    for name, desc in cluster_descriptions().items():
        gpus = get_cluster(name).num_devices if "<" not in name else "-"
        rows.append([name, gpus, desc])
        data.append({"name": name, "gpus": gpus, "description": desc})
    print(table(["cluster", "GPUs", "description"], rows, [False, True, False]))
    print()
    gpu_rows = [[g.name, format_bytes(g.memory_bytes), f"{g.peak_flops / 1e12:g}", f"{g.peak_flops_fp32 / 1e12:g}",
                 f"{g.memory_bandwidth_bytes_per_s / 1e9:g}"] for g in GPU_CATALOG.values()]
    print(table(["GPU", "memory", "TFLOP/s 16-bit", "TFLOP/s fp32", "GB/s"], gpu_rows))
    _write_json(args.json_path, {"clusters": data, "gpus": [
        {"name": g.name, "memory_bytes": g.memory_bytes, "peak_flops": g.peak_flops,
         "peak_flops_fp32": g.peak_flops_fp32, "memory_bandwidth_bytes_per_s": g.memory_bandwidth_bytes_per_s,
         "source": g.source} for g in GPU_CATALOG.values()]})
    return 0


def cmd_planners(args: argparse.Namespace) -> int:
    from hetplan.report.text import table
    from hetplan.search import planner_descriptions

    described = planner_descriptions()
    print(table(["planner", "what it does"], list(described.items()), [False, False]))
    _write_json(args.json_path, {"planners": [{"name": n, "description": d} for n, d in described.items()]})
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "command", None):
        args = parser.parse_args(["plan", *(argv or [])])
    try:
        return int(args.func(args) or 0)
    except HetplanError as exc:
        print(f"hetplan: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("hetplan: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # output piped into `head` and closed early
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    sys.exit(main())
