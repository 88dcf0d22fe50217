"""``hetplan train --elastic`` and ``hetplan run --elastic``: when a process (a GPU) dies, re-plan for the
ones left and go on; ``hetplan train --elastic`` also re-plans around a straggler (hetplan.app.straggler).

A run that loses a rank stops, as every run does: torchrun stops the other ranks, and the launch names
the rank that was killed (``runtime.launch.failure_line``). With ``--elastic`` the supervisor (this
module, in the ``hetplan train`` process; ``runtime/cli.py`` launches each plan) then takes the lost
rank's device out of the plan's cluster, re-plans with the plan file's own planner and settings for
what is left (``hetplan.app.replan``: an uneven plan where that is best, the very space hetplan
searches), writes the new plan file beside the checkpoints, and starts the ranks of the new plan from the newest complete checkpoint, which loads resharded under
the new plan (checkpoints are saved by parameter name). The data of step k is the same under every plan
(``reference.training_batch`` draws it from the seed and k), so the steps after a re-plan see the
samples an uninterrupted run would have seen, whatever the new data-parallel degree.

Each restart is a new torchrun launch with the new plan's world size: torchrun's own restarts
(``--max-restarts``) rerun the same number of processes per node, and a lost GPU changes that number.
On one machine the supervisor watches every rank, and which devices are gone is what its launch saw
die. On several (``--nnodes``), each node's supervisor watches its own ranks, and the supervisors agree on
the devices gone through a store on node 0 (``hetplan.runtime.nodes``); each then computes the same plan
from the same file and the same lost devices (the planners are deterministic:
``tests/test_determinism.py``, ``tests/test_replan.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from hetplan.app.replan import replan_file, replan_slower
from hetplan.app.straggler import STRAGGLER_FILE
from hetplan.errors import HetplanError
from hetplan.runtime.checkpoint_dirs import latest_checkpoint
from hetplan.runtime.launch import RankExit, killed_from_outside
from hetplan.runtime.nodes import NodeGroup, Report
from hetplan.units import format_time

# Re-plans one elastic run may make before it gives up: each costs a restart (minutes on a GPU
# cluster), so a run that keeps losing devices is a broken cluster to look at, not to plan around.
MAX_REPLANS = 8


@dataclass(frozen=True)
class Attempt:
    """One launch of a plan: whether it finished, why not (one line; "" when a rank said it already) and
    the plan devices of the ranks killed from outside (what an elastic run re-plans without), or of the
    stragglers the ranks stopped for (``slow``, hetplan.app.straggler); ``status``: the command's exit status."""

    ok: bool
    line: str = ""
    lost: tuple[int, ...] = ()
    status: int = 0
    slow: tuple[tuple[int, float], ...] = ()  # (plan device, measured slowdown): the ranks stopped to re-plan


def check_elastic_flags(args: argparse.Namespace) -> None:
    """``--elastic`` with the other flags of ``hetplan train`` or ``hetplan run``, before any work."""
    if not args.checkpoint_dir:
        raise HetplanError("--elastic needs --checkpoint-dir: a re-planned run continues from the newest checkpoint "
                           "there (and --checkpoint-every N for one every N steps)")
    if getattr(args, "verify", False):
        raise HetplanError("--elastic and --verify exclude each other: --verify compares one plan's run from step 0 "
                           "with one process; check a plan with --verify, then train it with --elastic")
    if getattr(args, "load_from", "") or getattr(args, "resume", False):
        raise HetplanError("--elastic starts from the newest checkpoint in --checkpoint-dir (or step 0); drop --load "
                           "and --resume")
    if getattr(args, "print_only", False):
        raise HetplanError("--elastic supervises the processes it starts on this machine; drop --print (or --elastic)")


def lost_devices(exits: Sequence[RankExit], layout: Any) -> tuple[int, ...]:
    """The plan devices of the ranks a signal from outside the run stopped
    (``launch.killed_from_outside``): the ranks that died, not those stopped
    or aborted after them."""
    return tuple(sorted(layout.position(e.rank).device for e in killed_from_outside(exits)))


def train_elastic(args: argparse.Namespace, launch_plan: Callable[[str, bool], Attempt],
                  command: str = "hetplan train", nodes: NodeGroup | None = None) -> int:
    """Run ``launch_plan(plan_path, resume)`` until it finishes, re-planning after each launch that
    lost devices; one line and exit 1 when a launch failed for another reason. ``args``: ``plan`` and
    ``checkpoint_dir``; ``command``: the command the progress lines name; ``nodes``: the supervisors of
    a multi-node run (``launch_plan`` runs this node's part, ``nodes.current``), whose agreed outcome of
    each launch is what re-plans (hetplan.runtime.nodes)."""
    plan_path = args.plan
    for replans in range(MAX_REPLANS + 1):
        if nodes is not None and nodes.enter(plan_path) is None:
            print(f"{command}: --elastic: {plan_path} uses no device of this node (node {nodes.me} of the first "
                  "launch): its part of the run is over", flush=True)
            return 0
        attempt = launch_plan(plan_path, replans > 0)
        if nodes is not None:
            attempt = agreed(nodes, attempt)
        if attempt.ok:
            return attempt.status
        if not attempt.lost and not attempt.slow:
            if attempt.line:
                print(f"hetplan: error: {attempt.line}", file=sys.stderr, flush=True)
            return attempt.status or 1
        if replans == MAX_REPLANS:
            break
        plan_path = _replan(args, plan_path, attempt, replans + 1, command)
    print(f"hetplan: error: {attempt.line}; --elastic re-planned {MAX_REPLANS} times already: look at the "
          "cluster before training on it", file=sys.stderr, flush=True)
    return 1


def agreed(nodes: NodeGroup, attempt: Attempt) -> Attempt:
    """The outcome of a multi-node launch every node agrees on, from this node's ``attempt``: finished
    when every node finished, else the devices lost on any node (or of a node that did not report)."""
    decision = nodes.agree(Report(attempt.ok, attempt.lost, attempt.line, attempt.status))
    if decision.ok:
        return Attempt(True, status=attempt.status)
    return Attempt(False, decision.line, decision.lost, status=decision.status or 1)


def _replan(args: argparse.Namespace, plan_path: str, attempt: Attempt, count: int, command: str) -> str:
    """The plan for the devices left after ``attempt`` (or for its stragglers as slow as measured), written
    as a plan file in the checkpoint directory."""
    try:  # no replayed step: a run waits for the plan
        replan = replan_slower(plan_path, dict(attempt.slow), replay=0) if attempt.slow else \
            replan_file(plan_path, [str(d) for d in attempt.lost], replay=0)
    except HetplanError as exc:
        raise HetplanError(f"{attempt.line}; --elastic cannot re-plan: {exc}") from None
    path = os.path.join(args.checkpoint_dir, f"plan-replan-{count}.json")
    _write_whole(path, replan.result.record())
    new = replan.result.best
    if attempt.slow:
        what = "with " + ", ".join(f"device {d} {f:.2f}x slower" for d, f in attempt.slow) + " (measured)"
    else:
        left = replan.old_cluster.num_devices - len(replan.lost)
        what = f"for the {left} devices left without device(s) {', '.join(map(str, replan.lost))}"
    print(f"{command}: {attempt.line}", file=sys.stderr, flush=True)
    print(f"{command}: --elastic: re-planned {what}: {new.plan.describe()}, "
          f"{format_time(new.estimate.iteration_time_s)}/step ({100 * (replan.slowdown - 1):+.1f}%), plan file {path}; "
          f"{continue_from(args.checkpoint_dir)}", flush=True)
    return path


def _write_whole(path: str, data: Any) -> None:
    """``data`` as JSON at ``path``, replaced whole: the nodes of a multi-node run write the same plan to a
    shared checkpoint directory while the ranks of another node may already read it."""
    temporary = f"{path}.{os.getpid()}.tmp"
    try:
        with open(temporary, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=2)
        os.replace(temporary, path)
    except OSError as exc:
        raise HetplanError(f"cannot write {path}: {exc.strerror}") from None


def with_stragglers(attempt: Attempt, root: str) -> Attempt:
    """``attempt`` as the stop of ranks that left ``STRAGGLER_FILE`` in ``root`` for a re-plan around
    stragglers (the file is read once and removed); unchanged when there is none."""
    path = os.path.join(root, STRAGGLER_FILE)
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        os.remove(path)
        slow = tuple(sorted((int(d), float(v)) for d, v in data["slow"].items()))
        line = str(data["line"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return attempt
    return Attempt(False, f"the ranks stopped after a checkpoint: {line}", slow=slow, status=1)


def continue_from(root: str) -> str:
    """Where the re-planned run starts: the newest complete checkpoint in ``root`` (newer ones a kill cut
    short are skipped), or step 0 when there is none yet (the run died before its first checkpoint)."""
    found = latest_checkpoint(root, note=lambda text: None)
    if found is None:
        return f"no complete checkpoint in {root} yet: the new plan starts from step 0"
    return f"continuing from {found[0]} (step {found[1]})"
