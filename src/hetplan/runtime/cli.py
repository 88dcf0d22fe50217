"""``hetplan train`` and ``hetplan run``: the runtime's commands.

    hetplan train --model tiny-gpt --plan p.json --steps 3 [--verify]
        train the plan's model (a built-in preset, the HF class of a config.json
        plan, or the model of a pkg.mod:build plan) on synthetic data with the plan, on this machine
        (torchrun, one process per device of the plan); print loss and step
        time. --verify also trains the single-process reference on the same
        data and seed and exits 1 if a loss or parameter differs by more than
        1e-5 (relative, fp32).

    hetplan run plan.json [--print] [--elastic --checkpoint-dir DIR] -- train.py [args]
        start a training script with the plan: torchrun with one process per
        device on this node (HETPLAN_PLAN tells hetplan.runtime.init where the
        plan is, HETPLAN_CHECKPOINT_DIR the script where its checkpoints go);
        for a multi-node plan (or --print) print the torchrun command
        for every node.

Importing this module does not import torch; the commands do.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable

from hetplan.app.elastic import Attempt, check_elastic_flags, lost_devices, train_elastic, with_stragglers
from hetplan.app.straggler import LAUNCHED_AT_ENV, RESTART_COST_ENV
from hetplan.io.argtypes import (
    EXIT_USAGE, OneLineParser, finite_nonneg_float, finite_positive_float, name_or_path, positive_int,
)
from hetplan.errors import HetplanError
from hetplan.runtime.checkpoint_dirs import CHECKPOINT_DIR_ENV, resume_checkpoint
from hetplan.runtime.heartbeat import describe_rank
from hetplan.runtime.nodes import NodeFlags, NodeGroup, NodeLaunch, node_flags, report_timeout_s
from hetplan.runtime import trainer
from hetplan.runtime import launch
from hetplan.plan.layout import PlanLayout
from hetplan.plan.file import read_plan_file
from hetplan.plan.runtime_facts import IMPLEMENTATIONS

# Largest relative difference --verify accepts, by precision. fp32: rounding
# only (a correct plan matches to ~1e-7). 16-bit: each matmul output is rounded
# to 8 (bf16) or 11 (fp16) significant bits, and a plan splits and orders the
# sums differently from one process (TP partial sums, reduction order); the
# reference runs the plan's micro-batches and replica shares (reference.row_groups),
# whose 16-bit weight gradients alone differ from one whole batch's by more
# (a tiny ViT's attention bias: 1.9e-3 in bf16). Measured on tiny-llama-bf16,
# 3 SGD steps, dp/tp/pp plans (docs/runtime.md): worst parameter difference
# 1.3e-4 in bf16, 2.6e-5 in fp16. The bounds leave ~8x room; a real error (a
# gradient missing or counted twice, the old autocast cache across FSDP
# reshards: 6e-3) is well above them.
VERIFY_TOLERANCE = {"fp32": 1e-5, "bf16": 1e-3, "fp16": 2e-4}


_TIMEOUT_HELP = ("seconds before a rank that stopped responding ends the run: the collective timeout, and the "
                 "heartbeat names a stopped rank after 0.8 of it (default 300; env HETPLAN_PG_TIMEOUT_S)")


def _timeout_env(args: argparse.Namespace) -> dict[str, str]:
    """What passes ``--timeout`` to the processes (hetplan.runtime.init reads it)."""
    return {"HETPLAN_PG_TIMEOUT_S": repr(args.timeout)} if getattr(args, "timeout", None) else {}


def _add_node_flags(p: Any) -> None:
    """``--nnodes/--node-rank/--rdzv-endpoint``: one supervisor of a multi-node ``--elastic`` run."""
    p.add_argument("--nnodes", type=positive_int, default=None,
                   help="with --elastic: the plan's node count; run this command on each node (docs/elastic.md)")
    p.add_argument("--node-rank", type=int, default=None,
                   help="with --nnodes: this node's place among the plan's nodes (0-based, as --print numbers them)")
    p.add_argument("--rdzv-endpoint", default="", metavar="HOST:PORT",
                   help="with --nnodes: the node of --node-rank 0 and a port; its supervisor keeps the nodes' store "
                   "there, each launch's torchrun uses the ports after it")


def register(subparsers: Any) -> None:
    """Add ``train`` and ``run`` to the hetplan CLI's subparsers."""
    p = subparsers.add_parser("train", help="train the plan's model (preset, HF config or pkg.mod:build) with a plan "
                              "on this machine (needs torch)")
    p.add_argument("--model", type=name_or_path, default=None,
                   help="the plan's model by name (default: the one the plan file embeds); "
                   "a plan of Python code runs it only if named here as pkg.mod:build, or with --trust-plan-code")
    p.add_argument("--plan", required=True, help="plan JSON from 'hetplan plan/estimate --json'")
    p.add_argument("--trust-plan-code", action="store_true",
                   help="import the Python code (pkg.mod:build) the plan file names as its model without naming it "
                   "with --model (docs/inputs.md, 'What a plan file can do')")
    p.add_argument("--steps", type=positive_int, default=3, help="training steps (default 3)")
    p.add_argument("--verify", action="store_true",
                   help="compare with the single-process reference; exit 1 above a relative difference of "
                   + ", ".join(f"{v:g} ({k})" for k, v in VERIFY_TOLERANCE.items()))
    p.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default=None,
                   help="check the plan trains in this precision (the plan file's setting decides)")
    p.add_argument("--compile", action="store_true", help="torch.compile each layer (after TP and checkpointing); "
                   "a plan made with --compile is compiled without it")
    p.add_argument("--dropout", type=finite_nonneg_float, default=0.0, metavar="P",
                   help="dropout probability at GPT-2's sites of the built-in model (default 0); its masks do not "
                   "depend on the plan, so --verify still holds")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--optimizer", choices=("sgd", "adamw"), default="sgd",
                   help="sgd (momentum 0.9, default) or adamw; --verify needs sgd (see docs/runtime.md)")
    p.add_argument("--optimizer-impl", choices=IMPLEMENTATIONS, default=None,
                   help="the optimizer's torch implementation (default: fused on CUDA, for-loop on CPU: "
                   "hetplan.plan.runtime_facts.OPTIMIZER_IMPLEMENTATION, what the cost model costs)")
    p.add_argument("--lr", type=finite_positive_float, default=None,
                   help="learning rate (default 0.1 for sgd, 1e-3 for adamw)")
    p.add_argument("--clip", type=finite_nonneg_float, default=1.0,
                   help="clip gradients to this global norm (0: off)")
    p.add_argument("--checkpoint-dir", default="", help="save a DCP checkpoint here every --checkpoint-every steps")
    p.add_argument("--checkpoint-every", type=positive_int, default=None,
                   help="steps between checkpoints (needs --checkpoint-dir; default: one at the end)")
    p.add_argument("--resume", action="store_true",
                   help="continue from the newest complete checkpoint in --checkpoint-dir (an error if there is none)")
    p.add_argument("--resume-or-start", action="store_true",
                   help="as --resume, but start from step 0 when --checkpoint-dir has no complete checkpoint "
                   "(for a job scheduler's restart script)")
    p.add_argument("--load", dest="load_from", default="", help="start from this checkpoint (saved under any plan)")
    p.add_argument("--out", default="", help="write summary.json (and state.pt with --verify) here")
    p.add_argument("--timeout", type=finite_positive_float, default=None, metavar="SECONDS", help=_TIMEOUT_HELP)
    p.add_argument("--elastic", action="store_true",
                   help="when a process (GPU) dies, re-plan for the ones left and continue from the newest "
                   "checkpoint; re-plan around a straggler when that wins back the restart (needs --checkpoint-dir; "
                   "docs/elastic.md)")
    p.add_argument("--restart-cost", type=finite_nonneg_float, default=None, metavar="SECONDS",
                   help="with --elastic: what a restart costs, weighed against a straggler re-plan's predicted gain "
                   "(default: measured, this launch's start to its first step)")
    _add_node_flags(p)
    p.set_defaults(func=cmd_train)

    p = subparsers.add_parser("run", help="start a training script with a plan via torchrun (needs torch)")
    p.add_argument("plan_file", help="plan JSON")
    p.add_argument("--print", dest="print_only", action="store_true",
                   help="print the torchrun command for every node instead of running")
    p.add_argument("--master-addr", default="NODE0_ADDRESS", help="address of the first node (multi-node)")
    p.add_argument("--master-port", type=int, default=29500)
    p.add_argument("--timeout", type=finite_positive_float, default=None, metavar="SECONDS", help=_TIMEOUT_HELP)
    p.add_argument("--elastic", action="store_true",
                   help="when a process (GPU) dies, re-plan for the ones left and start the script again with the "
                   "new plan; it resumes from the newest checkpoint in --checkpoint-dir (docs/elastic.md)")
    p.add_argument("--checkpoint-dir", default="",
                   help="the script's checkpoint directory, passed to it as $%s (--elastic writes its plans there)"
                   % CHECKPOINT_DIR_ENV)
    _add_node_flags(p)
    p.add_argument("script", nargs=argparse.REMAINDER, help="-- script.py [args]")
    p.set_defaults(func=cmd_run)


def require_torch() -> None:
    """The runtime's commands (and ``hetplan tune``'s trials) need torch: say how to install it."""
    try:
        import torch  # noqa: F401 -- only to see that torch is installed
    except ImportError:
        raise HetplanError("the runtime needs torch: pip install 'hetplan[torch]'") from None


def child_env() -> dict[str, str]:
    """The environment of a process the runtime starts: this hetplan first on its
    path, one thread per process unless the user set it (the processes share the cores)."""
    env = dict(os.environ)
    src = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("HETPLAN_NUM_THREADS", "1")
    return env


# --- hetplan train -------------------------------------------------------------------------------
def _check_writable_dir(flag: str, path: str) -> None:
    """``path`` is a directory, or one can be made there (checked, not made)."""
    if os.path.exists(path):
        if not os.path.isdir(path):
            raise HetplanError(f"{flag} {path}: it exists and is not a directory; give a directory")
        if not os.access(path, os.W_OK | os.X_OK):
            raise HetplanError(f"{flag} {path}: the directory is not writable; give another one")
        return
    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise HetplanError(f"{flag} {path}: cannot create it, {parent} is not a directory; give another path")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise HetplanError(f"{flag} {path}: cannot create it, {parent} is not writable; give another path")


def check_train_flags(args: argparse.Namespace) -> None:
    """The flags of ``hetplan train`` together, before any work (the types checked each one)."""
    resume = "--resume" if args.resume else "--resume-or-start" if args.resume_or_start else ""
    if args.resume and args.resume_or_start:
        raise HetplanError("--resume and --resume-or-start exclude each other: --resume-or-start also starts from "
                           "step 0 when there is no checkpoint; give one")
    if resume and not args.checkpoint_dir:
        raise HetplanError(f"{resume} needs --checkpoint-dir (the directory whose newest checkpoint to continue from)")
    if args.checkpoint_every is not None and not args.checkpoint_dir:
        raise HetplanError("--checkpoint-every needs --checkpoint-dir (where to save the checkpoints)")
    if resume and args.load_from:
        raise HetplanError(f"{resume} and --load exclude each other: --load starts from one checkpoint, "
                           f"{resume} from the newest in --checkpoint-dir; give one")
    if getattr(args, "elastic", False):
        check_elastic_flags(args)
    elif getattr(args, "restart_cost", None) is not None:
        raise HetplanError("--restart-cost weighs --elastic's re-plans around stragglers; add --elastic (or drop it)")
    if args.verify and args.load_from:
        raise HetplanError("--verify compares a run from step 0; drop --load (or --verify)")
    if args.verify and args.optimizer != "sgd":
        raise HetplanError("--verify needs --optimizer sgd: Adam turns rounding noise into full-size steps "
                           "(see docs/runtime.md)")
    if not getattr(args, "dropout", 0.0) < 1.0:
        raise HetplanError(f"--dropout {args.dropout:g}: give a probability below 1 (GPT-2 uses 0.1)")
    if args.load_from and not os.path.isdir(args.load_from):
        raise HetplanError(f"--load {args.load_from}: no such checkpoint directory")
    if args.out:
        _check_writable_dir("--out", args.out)
    if args.checkpoint_dir:
        _check_writable_dir("--checkpoint-dir", args.checkpoint_dir)


def cmd_train(args: argparse.Namespace) -> int:
    check_train_flags(args)
    flags = _node_flags(args, args.plan)
    require_torch()
    if flags is not None:
        return _elastic_on_nodes(args, flags, lambda plan_path, resume, node: _train_plan(args, plan_path, resume, node),
                                 "hetplan train")
    if args.elastic:
        return train_elastic(args, lambda plan_path, resume: _train_plan(args, plan_path, resume))
    attempt = _train_plan(args, args.plan, False)
    if not attempt.ok and attempt.line:
        print(f"hetplan: error: {attempt.line}", file=sys.stderr, flush=True)
    return attempt.status


def _node_flags(args: argparse.Namespace, plan_path: str) -> NodeFlags | None:
    """The multi-node flags checked against the plan file at ``plan_path`` (None: not given)."""
    if args.nnodes is None and args.node_rank is None and not args.rdzv_endpoint:
        return None
    plan_file = read_plan_file(plan_path)
    return node_flags(args, len(launch.plan_nodes(plan_file.plan(), plan_file.cluster)))


def _elastic_on_nodes(args: argparse.Namespace, flags: NodeFlags,
                      launch_part: Callable[[str, bool, NodeLaunch | None], Attempt], command: str) -> int:
    """This node's supervisor of a multi-node ``--elastic`` run (hetplan.runtime.nodes): each launch runs
    ``launch_part(plan_path, resume, this node's part)``; the nodes agree on its outcome."""
    from hetplan.runtime.setup import env_timeout  # imports torch: the command needs it anyway

    group = NodeGroup.join(flags, args.plan, report_timeout_s(args.timeout or env_timeout()))
    try:
        return train_elastic(args, lambda plan_path, resume: launch_part(plan_path, resume, group.current),
                             command=command, nodes=group)
    finally:
        group.leave()


def _train_plan(args: argparse.Namespace, plan_path: str, resume: bool, node: NodeLaunch | None = None) -> Attempt:
    """One run of ``hetplan train`` with the plan file at ``plan_path``
    (``resume``: from the newest checkpoint of ``--checkpoint-dir``, or step 0; ``node``: this node's part
    of a multi-node launch, else every rank on this machine)."""
    import torch

    from hetplan.runtime.build import model_build
    from hetplan.runtime.preflight import preflight
    from hetplan.runtime.setup import check_plan_precision

    plan, spec, cluster, layout, precision = check_plan_precision(plan_path, args.model, args.trust_plan_code)
    if args.precision and args.precision != precision:
        raise HetplanError(f"the plan trains in {precision}, not {args.precision}; make a plan with "
                           f"--precision {args.precision} (the cost model and the runtime use the plan's)")
    how = model_build(spec, args.dropout)  # a pkg.mod:build model: imported and checked against the plan's
    with torch.device("meta"):
        meta = how.build()
    preflight(layout, spec, meta, how.example_inputs)
    start_from = _start_checkpoint(args, resume)  # verified before any process starts
    nodes = launch.plan_nodes(plan, cluster)
    n = layout.world_size
    compiled = args.compile or plan_compiles(plan_path)
    here = nodes[node.node_rank][1] if node else [d for _, devices in nodes for d in devices]
    print(f"hetplan train: {spec.name} ({spec.total_params:,} parameters), {args.steps} steps of "
          f"{plan.global_batch_size} samples, {precision}{', compiled' if compiled else ''}, "
          f"{n} process{'es' if n > 1 else ''}"
          + (f", {len(here)} on node {node.node_rank} of {node.nnodes}" if node else ""), flush=True)
    print(f"plan: {layout.describe()}", flush=True)
    # a multi-node run does not re-plan around stragglers: the slowed device's node would be cut into
    # runs of one type (hetplan.app.replan.slowed_cluster), no longer one per machine
    env = {**child_env(), **_timeout_env(args), **({} if node else _elastic_env(args))}
    if len(nodes) > 1 and node is None:  # a plan for several nodes (e.g. Metis's uneven ones): all its processes here
        env.update(HETPLAN_ONE_MACHINE="1", HETPLAN_DEVICE=env.get("HETPLAN_DEVICE", "cpu"))
        print(f"note: the plan spans {len(nodes)} nodes of {plan.cluster!r}; hetplan train runs its {n} processes "
              f"on this machine ({env['HETPLAN_DEVICE']}): the losses are the plan's, the speeds are not its GPUs' "
              f"(on the real cluster: 'hetplan run {plan_path} --print -- SCRIPT')", flush=True)
    if start_from and start_from[1] is not None:
        print(f"resuming from {start_from[0]} (step {start_from[1]})", flush=True)
    with tempfile.TemporaryDirectory(prefix="hetplan-train-") as tmp:
        out = args.out or tmp
        worker_args = _worker_args(args, plan_path, out, start_from, compiled)
        if n == 1 and node is None:
            torch.set_num_threads(int(os.environ.get("HETPLAN_NUM_THREADS", torch.get_num_threads())))
            trainer.train(trainer.parse_args(worker_args))
        else:
            ranks = [r for r in range(n) if layout.devices[r] in here]
            attempt = _run_ranks(ranks, worker_args, env, layout, args.out, node)
            if not attempt.ok:
                return with_stragglers(attempt, args.checkpoint_dir) if args.elastic else attempt
        if args.verify:
            return Attempt(True, status=_verify(args, plan, spec, out, precision))
    return Attempt(True)


def _elastic_env(args: argparse.Namespace) -> dict[str, str]:
    """What tells the ranks of an ``--elastic`` launch when it started and what a restart costs
    (hetplan.app.straggler: the stragglers check at each checkpoint)."""
    if not getattr(args, "elastic", False):
        return {}
    env = {LAUNCHED_AT_ENV: repr(time.time())}
    if args.restart_cost is not None:
        env[RESTART_COST_ENV] = repr(args.restart_cost)
    return env


def plan_compiles(plan_path: str) -> bool:
    """Whether the plan was costed with each layer compiled (``hetplan plan --compile``):
    then ``hetplan train`` compiles it, as costed, without ``--compile``."""
    return bool(read_plan_file(plan_path).settings.get("compile", False))


def _worker_args(args: argparse.Namespace, plan_path: str, out: str, start_from: tuple[str, int | None] | None,
                 compiled: bool) -> list[str]:
    """The trainer's command line (``hetplan.runtime.trainer``) for ``hetplan train``'s flags
    (``compiled``: ``--compile``, or a plan costed compiled)."""
    worker_args = ["--plan", os.path.abspath(plan_path), "--steps", str(args.steps),
                   "--seed", str(args.seed), "--optimizer", args.optimizer, "--clip", str(args.clip),
                   "--out", out]
    if args.model:
        worker_args += ["--model", args.model]
    if args.trust_plan_code:
        worker_args.append("--trust-plan-code")
    if compiled:
        worker_args.append("--compile")
    if args.optimizer_impl:
        worker_args += ["--optimizer-impl", args.optimizer_impl]
    if args.dropout:
        worker_args += ["--dropout", repr(args.dropout)]
    if args.lr is not None:
        worker_args += ["--lr", str(args.lr)]
    if args.verify:
        worker_args.append("--export")
    if args.checkpoint_dir:
        worker_args += ["--checkpoint-dir", args.checkpoint_dir, "--checkpoint-every",
                        str(args.checkpoint_every or args.steps)]
    if start_from:  # --load, or the checkpoint --resume found: the one verified above
        worker_args += ["--load-from", start_from[0]]
    return worker_args


def _start_checkpoint(args: argparse.Namespace, resume: bool = False) -> tuple[str, int | None] | None:
    """The checkpoint the run starts from, (path, step; None for ``--load``:
    the trainer reads it from the checkpoint), verified in this
    process before any rank starts (manifest, every file's size and sha256:
    hetplan.runtime.checkpoint): ``--load``'s, or for ``--resume`` the newest
    complete one in ``--checkpoint-dir`` (none: an error). None: step 0 (no such
    flag, or ``--resume-or-start`` with no checkpoint, said in a note).
    ``resume``: as ``--resume-or-start`` (an elastic run's restart)."""
    from hetplan.runtime import checkpoint as ck

    if args.load_from:
        ck.verify_here(args.load_from)
        return args.load_from, None
    if not (args.resume or args.resume_or_start or resume):
        return None
    found = resume_checkpoint(args.checkpoint_dir, args.resume_or_start or resume)
    if found is None:  # --elastic's supervisor said so in its line
        if args.resume_or_start:
            print(f"note: no complete checkpoint in {args.checkpoint_dir}: starting from step 0 (--resume-or-start)",
                  file=sys.stderr, flush=True)
        return None
    ck.verify_here(found[0])
    if args.verify:
        raise HetplanError(f"--verify compares a run from step 0, and this one would resume from step {found[1]} "
                           f"({found[0]}); drop --verify, or start from step 0 (drop --resume)")
    return found


def _run_ranks(ranks: list[int], worker_args: list[str], env: dict[str, str], layout: Any, out: str,
               node: NodeLaunch | None = None) -> Attempt:
    """Run the trainer on the processes of ``ranks`` (torchrun; ``node``: this node's part of a multi-node
    launch, in ``OUT/logs/nodeI``, else all ranks). Each rank's stderr goes to
    a log (``OUT/logs``, or a temporary directory kept when the run fails), so a
    failed run ends in one line naming what stopped it, not the tracebacks of the
    ranks that lost a peer (hetplan.runtime.launch.failure_line), and the devices
    of the ranks killed from outside (what ``--elastic`` re-plans without)."""
    import shutil

    logs = os.path.join(out, "logs") if out else tempfile.mkdtemp(prefix="hetplan-train-logs-")
    if node is not None:
        logs = os.path.join(logs, f"node{node.node_rank}")
    os.makedirs(logs, exist_ok=True)
    argv = launch.reporting_argv(len(ranks), ["-m", "hetplan.runtime.trainer", *worker_args], logs,
                                 node=node.torchrun_args(len(ranks)) if node else ())
    code = subprocess.call(argv, env={**env, launch.RANK_LOG_ENV: logs})
    if code == 0:
        wrote = [r for r in ranks if os.path.isfile(launch.rank_log(logs, r))
                 and os.path.getsize(launch.rank_log(logs, r))]
        if wrote:
            print(f"note: rank(s) {', '.join(map(str, wrote))} wrote warnings to stderr: see {logs}", file=sys.stderr)
        elif not out:
            shutil.rmtree(logs, ignore_errors=True)
        return Attempt(True)
    exits = launch.read_exits(logs)
    if any(e.exitcode == EXIT_USAGE for e in exits):  # a rank printed its one hetplan error line (trainer.main)
        return Attempt(False, status=EXIT_USAGE)
    line = launch.failure_line(exits, logs, lambda r: describe_rank(layout, r))
    line = line or f"training failed (exit status {code}); see the messages above and the ranks' output in {logs}"
    return Attempt(False, line, lost_devices(exits, layout), status=1)


def _verify(args: argparse.Namespace, plan: Any, spec: Any, out: str, precision: str) -> int:
    import json

    import torch

    from hetplan.runtime.build import model_build
    from hetplan.runtime.reference import (
        build_reference,
        compare,
        make_optimizer,
        row_groups,
        train_reference,
        training_batch,
    )

    with open(os.path.join(out, "summary.json"), encoding="utf-8") as f:
        summary = json.load(f)
    state = torch.load(os.path.join(out, "state.pt"))
    start = int(summary.get("start_step", 0))
    if start:
        raise HetplanError("--verify compares a run from step 0; drop --resume/--load")
    how = model_build(spec, args.dropout)
    if how.meta_init:
        ref = build_reference(how.build, args.seed)
    else:  # built for real under the seed, as every rank built it
        torch.manual_seed(args.seed)
        ref = how.build()
    opt = make_optimizer(ref.parameters(), args.optimizer, args.lr)
    batches = [training_batch(spec, how, plan.global_batch_size, s, args.seed) for s in range(args.steps)]
    layout = PlanLayout.from_plan(plan, [layer.name for layer in spec.layers])
    ref_losses = train_reference(ref, batches, how.loss, opt, clip=args.clip or None, precision=precision,
                                 seed=args.seed, groups=row_groups(layout))
    result = compare(summary["losses"], ref_losses, state, ref.state_dict())
    print(f"verify: single-process reference on the same data, seed, initial values, precision ({precision}) and "
          "micro-batches")
    print(f"{'step':>4}  {'loss (plan)':>14}  {'loss (reference)':>16}  {'rel. diff':>9}")
    for i, (a, b) in enumerate(zip(summary["losses"], ref_losses)):
        print(f"{i + 1:>4}  {a:>14.8f}  {b:>16.8f}  {abs(a - b) / max(abs(b), 1e-12):>9.1e}")
    print(f"largest relative parameter difference {result['param_rel_diff']:.1e} ({result['worst_param']})")
    worst = max(result["loss_rel_diff"], result["param_rel_diff"])
    tol = VERIFY_TOLERANCE[precision]
    if worst > tol or result["missing"]:
        print(f"verify: FAILED: largest relative difference {worst:.1e} > {tol:g} ({precision})", file=sys.stderr)
        return 1
    print(f"verify: OK (largest relative difference {worst:.1e} <= {tol:g}, {precision})")
    return 0


# --- hetplan run ------------------------------------------------------------------------------------
def cmd_run(args: argparse.Namespace) -> int:
    script = list(args.script)
    if "--" in script:  # options given after the plan file, before "--"
        cut = script.index("--")
        head, script = script[:cut], script[cut + 1:]
        extra = OneLineParser(prog="hetplan run", add_help=False)
        extra.add_argument("--print", dest="print_only", action="store_true")
        extra.add_argument("--master-addr", default=args.master_addr)
        extra.add_argument("--master-port", type=int, default=args.master_port)
        extra.add_argument("--timeout", type=finite_positive_float, default=args.timeout)
        extra.add_argument("--elastic", action="store_true")
        extra.add_argument("--checkpoint-dir", default=args.checkpoint_dir)
        extra.add_argument("--nnodes", type=positive_int, default=args.nnodes)
        extra.add_argument("--node-rank", type=int, default=args.node_rank)
        extra.add_argument("--rdzv-endpoint", default=args.rdzv_endpoint)
        more, unknown = extra.parse_known_args(head)
        if unknown:
            raise HetplanError(f"unknown option(s) for 'hetplan run': {' '.join(unknown)}")
        args.print_only = args.print_only or more.print_only
        args.master_addr, args.master_port = more.master_addr, more.master_port
        args.timeout, args.checkpoint_dir = more.timeout, more.checkpoint_dir
        args.elastic = args.elastic or more.elastic
        args.nnodes, args.node_rank, args.rdzv_endpoint = more.nnodes, more.node_rank, more.rdzv_endpoint
    if not script:
        raise HetplanError("no training script: use 'hetplan run plan.json -- train.py [args]'")
    if args.elastic:
        check_elastic_flags(args)
    if args.checkpoint_dir:
        _check_writable_dir("--checkpoint-dir", args.checkpoint_dir)
    plan_file = read_plan_file(args.plan_file)
    plan = plan_file.plan()
    nodes = launch.plan_nodes(plan, plan_file.cluster)
    flags = node_flags(args, len(nodes))
    if args.elastic and len(nodes) > 1 and flags is None:
        raise HetplanError(f"this plan spans {len(nodes)} nodes: run 'hetplan run PLAN --elastic --nnodes "
                           f"{len(nodes)} --node-rank I --rdzv-endpoint HOST:PORT ...' on each node I, HOST the one "
                           "of --node-rank 0 (docs/elastic.md)")
    if args.print_only or (len(nodes) > 1 and flags is None):
        cmds = launch.torchrun_commands(plan, args.plan_file, script, args.master_addr, args.master_port,
                                        cluster=plan_file.cluster, env=_timeout_env(args))
        n = sum(len(d) for _, d in nodes)
        print(f"# {n} processes on {len(nodes)} node{'s' if len(nodes) > 1 else ''}; run on each node:")
        for k, (node, cmd) in enumerate(cmds):
            devs = nodes[k][1]
            print(f"# node {node} (GPUs {', '.join(map(str, devs))})")
            print(cmd)
        return 0
    require_torch()
    if flags is not None:
        args.plan = args.plan_file
        return _elastic_on_nodes(args, flags, lambda plan_path, resume, node: _run_plan_script(args, plan_path, script,
                                                                                              node), "hetplan run")
    if args.elastic:
        args.plan = args.plan_file
        return train_elastic(args, lambda plan_path, resume: _run_plan_script(args, plan_path, script),
                             command="hetplan run")
    attempt = _run_plan_script(args, args.plan_file, script)
    if attempt.line:
        print(f"hetplan: {attempt.line}", file=sys.stderr, flush=True)
    return attempt.status


def _run_plan_script(args: argparse.Namespace, plan_path: str, script: list[str],
                     node: NodeLaunch | None = None) -> Attempt:
    """One run of the user's script under the plan at ``plan_path`` (``$HETPLAN_PLAN``; the script's
    checkpoints in ``$HETPLAN_CHECKPOINT_DIR`` when ``--checkpoint-dir`` is given): a one-node plan, or
    ``node``'s part of a multi-node launch."""
    plan_file = read_plan_file(plan_path)
    plan = plan_file.plan()
    n = len(launch.plan_nodes(plan, plan_file.cluster)[node.node_rank if node else 0][1])
    env = {**child_env(), **_timeout_env(args), "HETPLAN_PLAN": os.path.abspath(plan_path)}
    if args.checkpoint_dir:
        env[CHECKPOINT_DIR_ENV] = os.path.abspath(args.checkpoint_dir)
    layout = PlanLayout.from_plan(plan, [layer.name for layer in plan_file.model.layers]) \
        if plan_file.model is not None else None  # names each rank in a failure line; None: ranks by number
    return _run_user_script(n, script, env, layout, node)


def _run_user_script(n: int, script: list[str], env: dict[str, str], layout: Any,
                     node: NodeLaunch | None = None) -> Attempt:
    """The user's script on ``n`` processes (torchrun), each rank's stderr in a
    log. A HetplanError or CUDA out-of-memory error of a rank is one line,
    printed once (rank 0's, else the first failing rank's:
    hetplan.runtime.launch.run_user_script), exit 2; any other error shows the
    traceback of the rank that failed first (not of those that lost a peer)
    and returns the line naming it, with the script's exit status and the
    devices of the ranks killed from outside (what ``--elastic`` re-plans without)."""
    import shutil

    logs = tempfile.mkdtemp(prefix="hetplan-run-logs-")
    argv = launch.reporting_argv(n, launch.user_script_argv(logs, script), logs,
                                 node=node.torchrun_args(n) if node else ())
    code = subprocess.call(argv, env=env)
    found = launch.first_error(logs) if code else None
    if found is not None:
        rank, line = found
        print(f"hetplan: error: {line}" if line.startswith("rank ") else f"hetplan: error (rank {rank}): {line}",
              file=sys.stderr, flush=True)
        shutil.rmtree(logs, ignore_errors=True)
        return Attempt(False, status=EXIT_USAGE)
    if code:
        exits = launch.read_exits(logs)
        line = launch.failure_line(exits, logs, lambda r: describe_rank(layout, r))
        failed = re.search(r"\(traceback: (.*)\)$", line)
        if failed and os.path.isfile(failed.group(1)):
            with open(failed.group(1), encoding="utf-8", errors="replace") as f:
                sys.stderr.write(f.read())
        line = line or f"the script failed (exit status {code}); the ranks' output is in {logs}"
        return Attempt(False, line, lost_devices(exits, layout) if layout is not None else (), status=code)
    shutil.rmtree(logs, ignore_errors=True)
    return Attempt(True)
