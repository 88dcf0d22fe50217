"""The planning commands: ``plan``, ``compare``, ``estimate``, ``export`` and
``whatif``. Each reads its flags, calls the application layer
(``hetplan.app``) and prints what ``hetplan.report`` renders."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from hetplan.app.compare import compare_planners
from hetplan.app.estimate import UniformSetting, estimate_plan_file, estimate_setting
from hetplan.app.planning import DEFAULT_TOP, plan_workload, runnable_best
from hetplan.app.records import write_json, write_text
from hetplan.app.replay import DEFAULT_REPLAY, REPLAY_ENV, default_replay
from hetplan.app.whatif import check_varies, parse_vary, run_whatif, whatif_record
from hetplan.app.workload import DEFAULT_PLANNER
from hetplan.io.argtypes import MAX_COUNT, finite_nonneg_float, name_or_path, positive_int, zero_or_at_most
from hetplan.cli.options import (
    OFFLOAD_SEARCH, add_offload_search_arg, add_target_args, add_workload_args, auto_batch, batch_size, degree,
    load_workload, workload_options,
)
from hetplan.cost.model import CostModel
from hetplan.plan.workload import Workload
from hetplan.errors import HetplanError
from hetplan.export.target import export_way_out
from hetplan.export.tools import settings_notes, try_render
from hetplan.plan.spec import RankedPlan
from hetplan.plan.file import read_plan_file, resolve_cluster, resolve_model
from hetplan.report.compare import compare_text
from hetplan.report.svg import memory_svg, timeline_svg
from hetplan.report.trace import chrome_trace_json, stage_labels
from hetplan.report.text import estimate_text, plan_text, workload_header
from hetplan.report.whatif import whatif_table
from hetplan.search import get_planner, planner_names
from hetplan.search.smp import DEFAULT_ALPHA, SMPPlanner
from hetplan.simulate.plan import build_schedule, closed_form_pipeline_s, format_schedule, makespan, simulate_plan
from hetplan.plan.validate import validate_plan

# estimate --simulate prints the schedule grid up to this many slots (stages x micro-batches):
# a wider grid does not fit a terminal (the limit cli.py had).
SCHEDULE_PRINT_LIMIT = 64


def register(sub: Any) -> None:
    """Add ``plan``, ``compare``, ``estimate``, ``export`` and ``whatif`` to the hetplan CLI."""
    for add in (_add_plan, _add_compare, _add_estimate, _add_export, _add_whatif):
        add(sub)


def _add_plan(sub: Any) -> None:
    p = sub.add_parser("plan", help="find the best plans for a model on a cluster")
    add_workload_args(p)
    p.add_argument("--planner", default=DEFAULT_PLANNER, help=f"planner (default {DEFAULT_PLANNER}); see 'hetplan planners'")
    p.add_argument("--top", type=positive_int, default=DEFAULT_TOP, help="how many plans to show")
    p.add_argument("--quiet", action="store_true", help="only the table")
    p.add_argument("--timeline", default=None, help="write the best plan's pipeline timeline here (.svg)")
    p.add_argument("--trace", default=None,
                   help="write the best plan's predicted timeline here as a Chrome trace (.json, opens in Perfetto)")
    p.add_argument("--memory-chart", default=None, help="write the best plan's memory per GPU here (.svg)")
    p.add_argument("--smp-alpha", type=finite_nonneg_float, default=None,
                   help="--planner smp: weight of memory against compute in a module's cost, 0..1 (default 0.8)")
    p.add_argument("--smp-pp", type=positive_int, default=None,
                   help="--planner smp: the pipeline degree (default: every divisor of the GPU count, ranked)")
    add_offload_search_arg(p)
    add_target_args(p)
    add_replay_args(p, plans=True)
    p.set_defaults(func=cmd_plan)


def _add_compare(sub: Any) -> None:
    p = sub.add_parser("compare", help="run several planners on the same inputs")
    add_workload_args(p)
    p.add_argument("--planners", default=None, help="comma-separated planner names (default: all)")
    add_offload_search_arg(p)
    add_target_args(p)
    p.set_defaults(func=cmd_compare)


def _add_estimate(sub: Any) -> None:
    p = sub.add_parser("estimate", help="cost a plan file or one uniform dp/tp/pp setting")
    p.add_argument("plan_file", nargs="?", default=None, help="plan JSON from 'hetplan plan --json'")
    p.add_argument("--index", type=positive_int, default=1, help="which plan of a ranked file (1 = best)")
    add_workload_args(p, batch_auto=False)
    p.add_argument("--tp", type=degree, default=None)
    p.add_argument("--pp", type=degree, default=None)
    p.add_argument("--dp", type=degree, default=None)
    p.add_argument("--cp", type=degree, default=1,
                   help="context-parallel degree: each sequence split over this many GPUs (default 1)")
    p.add_argument("--ep", type=degree, default=1,
                   help="expert-parallel degree of MoE layers, taken from the dp x cp GPUs (default 1)")
    p.add_argument("--micro-batch", type=batch_size, default=None, help="samples per dp replica per micro-batch")
    p.add_argument("--zero", type=int, choices=(0, 1, 2, 3), default=0)
    p.add_argument("--recompute", choices=("none", "selective", "full"), default="none")
    p.add_argument("--offload", action="store_true", help="keep saved activations in host memory (every layer)")
    p.add_argument("--sequence-parallel", action="store_true")
    p.add_argument("--schedule", choices=("1f1b", "gpipe", "interleaved-1f1b"), default="1f1b")
    p.add_argument("--virtual-stages", type=positive_int, default=1,
                   help="model chunks per device for interleaved-1f1b")
    p.add_argument("--timeline", default=None, help="write the pipeline timeline here (.svg)")
    p.add_argument("--trace", default=None,
                   help="write the predicted timeline here as a Chrome trace (.json, opens in Perfetto)")
    p.add_argument("--memory-chart", default=None, help="write memory per GPU here (.svg)")
    p.add_argument("--simulate", action="store_true", help="replay the schedule event by event and compare")
    add_target_args(p)
    add_replay_args(p, plans=False)
    p.set_defaults(func=cmd_estimate)


def _add_export(sub: Any) -> None:
    p = sub.add_parser("export", help="write a plan as torchtitan/Megatron/DeepSpeed settings or module lists")
    p.add_argument("plan_file", help="plan JSON from 'hetplan plan --json'")
    p.add_argument("--format", required=True, choices=("modules", "torchtitan", "megatron", "deepspeed"))
    p.add_argument("--model", type=name_or_path, default=None, help="model the plan was made for (default: the one in the plan file)")
    p.add_argument("--cluster", type=name_or_path, default=None, help="cluster the plan was made for (default: the one in the plan file)")
    p.add_argument("--index", type=positive_int, default=1, help="which plan of a ranked file (1 = best)")
    p.add_argument("--torchtitan-version", choices=("0.3", "0.2"), default="0.3",
                   help="torchtitan release to write for: 0.3 (current: a Python config) or 0.2 (a TOML job file)")
    p.add_argument("--out", default=None, help="write here instead of printing (DeepSpeed pipeline code: "
                                               "beside it, as NAME.pipeline.py)")
    p.set_defaults(func=cmd_export)


def _add_whatif(sub: Any) -> None:
    p = sub.add_parser("whatif", help="the best plan as the cluster or batch changes: one row per variant")
    add_workload_args(p, batch_auto=False)
    p.add_argument("--vary", required=True, metavar="WHAT=V1,V2,...",
                   help="gpus=64,128,256 | gpu=H100,A100-80GB | global-batch=256,512 (on a homogeneous cluster)")
    p.add_argument("--planner", default=DEFAULT_PLANNER, help=f"planner (default {DEFAULT_PLANNER})")
    p.set_defaults(func=cmd_whatif)


# --- plan and compare --------------------------------------------------------------------------
def add_replay_args(p: argparse.ArgumentParser, plans: bool) -> None:
    """``--no-replay`` (and for ``plan`` ``--replay N``): the replay check (hetplan.app.replay)."""
    if plans:
        p.add_argument("--replay", type=zero_or_at_most(MAX_COUNT), default=None, metavar="N",
                       help=f"check the N best plans by one training step of hetplan's runtime on fake tensors "
                            f"(default {DEFAULT_REPLAY}, or ${REPLAY_ENV}); those that do not fit are ranked last")
    p.add_argument("--no-replay", action="store_true", help="skip the replay check (the analytic memory only)")


def replay_count(args: argparse.Namespace) -> int:
    """How many plans to replay: none with ``--no-replay``, else ``--replay`` or the default."""
    if args.no_replay:
        return 0
    given = getattr(args, "replay", None)
    return default_replay() if given is None else given


def _smp_planner(args: argparse.Namespace) -> SMPPlanner:
    """The smp planner with ``--smp-alpha`` / ``--smp-pp`` (hetplan.search.smp)."""
    alpha = DEFAULT_ALPHA if args.smp_alpha is None else args.smp_alpha
    return SMPPlanner(alpha=alpha, pp=args.smp_pp)


def cmd_plan(args: argparse.Namespace) -> int:
    planner = _smp_planner(args) if args.planner == "smp" else args.planner
    result = plan_workload(workload_options(args), planner, args.top, auto_batch(args), args.torchtitan_version,
                           args.tokens, args.prices, replay_count(args))
    print(plan_text(result.report, args.quiet))
    if args.json_path:
        write_json(args.json_path, result.record())
    _write_pictures(args, result.workload, result.best)
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    names = planner_names() if args.planners is None else [n.strip() for n in args.planners.split(",")]
    if not all(names):
        raise HetplanError(f"--planners {args.planners!r} names an empty planner; give names separated by commas "
                           "(see 'hetplan planners'), or leave --planners out for all")
    result = compare_planners(workload_options(args), names, auto_batch(args), args.torchtitan_version)
    print(compare_text(result))
    write_json(args.json_path, result.record())
    return 0


def _write_pictures(args: argparse.Namespace, workload: Workload, ranked: RankedPlan) -> None:
    """--timeline, --trace and --memory-chart: pictures of one plan (SVG, Chrome trace)."""
    plan, estimate = ranked.plan, ranked.estimate
    if args.timeline or args.trace:
        events = simulate_plan(CostModel(workload), plan, estimate)
        labels = stage_labels(plan, workload)
        if args.timeline:
            write_text(args.timeline, timeline_svg(events, labels, plan.describe(), estimate.iteration_time_s))
        if args.trace:
            write_text(args.trace, chrome_trace_json(events, labels, plan.describe()))
    if args.memory_chart:
        write_text(args.memory_chart, memory_svg(plan, estimate, workload, f"peak memory per GPU: {plan.describe()}"))


# --- estimate ----------------------------------------------------------------------------------
def cmd_estimate(args: argparse.Namespace) -> int:
    degrees = (args.tp, args.pp, args.dp, args.micro_batch)
    if args.offload and args.plan_file in OFFLOAD_SEARCH:  # 'estimate --offload never': read as a plan file
        raise HetplanError(f"estimate's --offload takes no value (it offloads every layer); --offload "
                           f"{'|'.join(OFFLOAD_SEARCH)} is for plan and compare")
    options = workload_options(args)
    if args.plan_file:
        if any(d is not None for d in degrees) or args.cp != 1 or args.ep != 1:
            raise HetplanError("give either a plan file or --tp/--pp/--dp/--cp/--ep/--micro-batch, not both")
        if args.offload:
            raise HetplanError("--offload applies to a --tp/--pp/--dp plan; a plan file sets offload per layer: "
                               "drop --offload or the plan file")
        result = estimate_plan_file(options, args.plan_file, args.index, args.torchtitan_version, args.tokens,
                                    args.prices)
    else:
        missing = [n for n, d in zip(("--tp", "--pp", "--dp", "--micro-batch"), degrees) if d is None]
        if missing:
            raise HetplanError(f"estimate needs a plan file or all of --tp --pp --dp --micro-batch (missing {' '.join(missing)})")
        setting = UniformSetting(args.dp, args.tp, args.pp, args.micro_batch, args.cp, args.ep, args.zero,
                                 args.recompute, args.schedule, args.sequence_parallel, args.virtual_stages,
                                 args.offload)
        result = estimate_setting(options, setting, args.torchtitan_version, args.tokens, args.prices)
    result = result.replayed(replay_count(args) > 0)
    print(estimate_text(result.report))
    if args.simulate:
        _print_simulation(result.workload, result.ranked)
    write_json(args.json_path, result.record())
    _write_pictures(args, result.workload, result.ranked)
    return 0


def _print_simulation(workload: Workload, ranked: RankedPlan) -> None:
    """``estimate --simulate``: the schedule (when small) and the simulated pipeline against the closed form."""
    plan, estimate = ranked.plan, ranked.estimate
    events = simulate_plan(CostModel(workload), plan, estimate)
    pipeline = closed_form_pipeline_s(estimate)
    print()
    if plan.num_micro_batches * plan.pp <= SCHEDULE_PRINT_LIMIT:
        print(format_schedule(build_schedule(plan.schedule, plan.pp, plan.num_micro_batches)))
    print(f"simulated pipeline {makespan(events) * 1e3:.2f} ms vs closed form {pipeline * 1e3:.2f} ms")


# --- export and whatif -------------------------------------------------------------------------
def cmd_export(args: argparse.Namespace) -> int:
    plan_file = read_plan_file(args.plan_file)
    plan = plan_file.plan(args.index)
    model = resolve_model(plan_file, args.model)
    cluster = resolve_cluster(plan_file, args.cluster)
    validate_plan(plan, model, cluster)  # never export a plan that cannot run
    result, why = try_render(plan, model, args.format, cluster, args.torchtitan_version)
    if result is None:
        raise HetplanError(f"{why}; {export_way_out(plan_file, args.index, args.format, args.torchtitan_version)}")
    for note in [*result.notes, *settings_notes(plan_file.settings, args.format)]:
        print(f"note: {note}", file=sys.stderr)
    outputs = {args.out: result.text} if args.out else {}
    for suffix, text in result.files.items():
        if args.out:
            outputs[os.path.splitext(args.out)[0] + suffix] = text
        else:
            print(f"note: {suffix} file (give --out to write it):\n{text}", file=sys.stderr)
    for path, text in outputs.items():
        write_text(path, text if text.endswith("\n") else text + "\n")
    if not args.out:
        print(result.text)
    return 0


def cmd_whatif(args: argparse.Namespace) -> int:
    """Plan the same model under each variant of the cluster or batch (``hetplan.app.whatif``)."""
    what, items = parse_vary(args.vary)
    base = load_workload(args)
    check_varies(base, what)
    planner = get_planner(args.planner)
    print(workload_header(base, f"whatif   {what} = {', '.join(items)}, planner {planner.name}"))
    results = run_whatif(base, what, items, planner, args.tokens, args.prices, best_of=runnable_best)
    print()
    print(whatif_table(results, args.tokens))
    if args.json_path:  # the JSON adds the memory breakdown, which needs each variant's cost model
        write_json(args.json_path, whatif_record(what, results, args.tokens, args.prices))
    return 0
