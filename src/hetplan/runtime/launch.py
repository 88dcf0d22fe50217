"""Starting processes for a plan: torchrun commands, and a cheap local launcher.

``torchrun_commands(plan, script, args)`` gives one command per node the plan
uses. Ranks follow the plan's devices in id order, node by node (see
hetplan.plan.layout), so node ``k`` runs ``--node-rank=k`` with as many
processes as the plan has devices there; torchrun gives ranks in node-rank
order and within a node by local rank, even when nodes run different numbers
of processes. Each command sets ``HETPLAN_PLAN`` so ``hetplan.runtime.init()``
finds the plan.

``run_local(fn, world_size, ...)`` runs ``fn(*args)`` in ``world_size``
processes on this machine with the torchrun environment variables set. It
forks them from a server process that has already imported torch and
torch.distributed (multiprocessing's forkserver), which costs a fraction of
torchrun's start-up -- what the distributed tests use. Results come back per
rank; a failing or hanging rank does not hang the caller: the others are
killed after a grace period or at the timeout.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import re
import shlex
import signal
import socket
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from hetplan.errors import HetplanError
from hetplan.runtime.console import current_context, log_stderr, rank_log
from hetplan.runtime.heartbeat import EXIT_CODE as HEARTBEAT_EXIT
from hetplan.runtime.heartbeat import describe_rank
from hetplan.io.argtypes import EXIT_USAGE
from hetplan.cluster.io import load_cluster

PRELOAD = ["torch", "torch.distributed", "torch.distributed.tensor", "torch.distributed.fsdp",
           "torch.distributed.pipelining", "torch.distributed.checkpoint", "hetplan.runtime.context"]


# --- torchrun -----------------------------------------------------------------------------
def plan_nodes(plan: Any, cluster: Any = None) -> list[tuple[int, list[int]]]:
    """(cluster node index, plan devices on it) in node order. ``cluster``:
    the one the plan file embeds; else the named one, and one pseudo-node if
    this machine does not know that name."""
    devices = sorted(d for s in plan.stages for d in s.devices)
    if cluster is None:
        try:
            cluster = load_cluster(plan.cluster)
        except (HetplanError, OSError):
            return [(0, devices)]
    by_node: dict[int, list[int]] = {}
    for d in devices:
        if d >= cluster.num_devices:
            raise HetplanError(f"the plan uses GPU {d}, but cluster {plan.cluster!r} has {cluster.num_devices}")
        by_node.setdefault(cluster.devices[d].node, []).append(d)
    return sorted(by_node.items())


def torchrun_commands(plan: Any, plan_path: str, script: Sequence[str], master_addr: str = "NODE0_ADDRESS",
                      master_port: int = 29500, python: str | None = None, cluster: Any = None,
                      env: dict[str, str] | None = None) -> list[tuple[int, str]]:
    """One shell command per node: (cluster node index, command); ``env``: more
    variables for the processes (e.g. HETPLAN_PG_TIMEOUT_S from ``--timeout``)."""
    nodes = plan_nodes(plan, cluster)
    python = python or sys.executable
    cmds = []
    for k, (node, devs) in enumerate(nodes):
        parts = [f"HETPLAN_PLAN={shlex.quote(os.path.abspath(plan_path))}",
                 *(f"{name}={shlex.quote(value)}" for name, value in (env or {}).items()), shlex.quote(python), "-m",
                 "torch.distributed.run", f"--nnodes={len(nodes)}", f"--node-rank={k}",
                 f"--nproc-per-node={len(devs)}", f"--master-addr={master_addr}", f"--master-port={master_port}"]
        parts += [shlex.quote(s) for s in script]
        cmds.append((node, " ".join(parts)))
    return cmds


def standalone_argv(num_processes: int, script: Sequence[str], python: str | None = None) -> list[str]:
    """argv for a single-node torchrun run."""
    return [python or sys.executable, "-m", "torch.distributed.run", *_standalone_args(num_processes, script)]


def _standalone_args(num_processes: int, script: Sequence[str]) -> list[str]:
    return ["--standalone", f"--nproc-per-node={num_processes}", *script]


# --- hetplan train's torchrun: a failed run said in one line --------------------------------------
# hetplan train sets this: each rank sends its stderr to <dir>/rank<R>.log (console.log_stderr), so the
# tracebacks of ranks that lost a peer do not bury what ended the run (failure_line says that).
RANK_LOG_ENV = "HETPLAN_RANK_LOG_DIR"
AGENT_LOG = "torchrun.log"  # torchrun's agent's own log lines, in the same directory
EXITS = "exits.json"  # the ranks' exit codes and pids of a failed run (main writes it)
# A rank that failed with one of these lost a peer (check_results, failure_line): what made
# the peer go is the better message.
PEER_LOST = ("Connection reset", "Connection closed", "killed by signal", "timed out")
# Signals a rank gets because another one went, not because it was stopped from outside:
# torchrun's agent sends SIGTERM to the rest once one rank is gone, and a rank whose peer
# vanished mid-collective may abort itself (a C++ exception out of a communication thread
# ends in std::terminate, which raises SIGABRT), at times before the agent has reaped the
# rank that was killed. Observed in tests/distributed/test_elastic_train.py under load.
AFTER_A_PEER = (signal.SIGTERM, signal.SIGABRT)


def reporting_argv(num_processes: int, script: Sequence[str], directory: str,
                   python: str | None = None, node: Sequence[str] = ()) -> list[str]:
    """argv for ``hetplan train``'s run: torchrun inside :func:`main`,
    which writes the exits of a failed run to ``directory`` instead of
    torchrun's report (a traceback around a table). ``node``: this node's torchrun
    arguments of a multi-node launch (``hetplan.runtime.nodes.NodeLaunch``); none: one node, standalone."""
    torchrun = [*node, *script] if node else _standalone_args(num_processes, script)
    return [python or sys.executable, "-m", "hetplan.runtime.launch", "--report-dir", directory, "--", *torchrun]


@dataclass(frozen=True)
class RankExit:
    """How one rank of a failed run ended: its exit code (negative: the signal that killed it) and pid."""

    rank: int
    exitcode: int
    pid: int


def read_exits(directory: str) -> list[RankExit]:
    """The exits :func:`main` recorded, by rank ([] when it recorded none)."""
    import json

    try:
        with open(os.path.join(directory, EXITS), encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return []
    return sorted((RankExit(int(r), int(e["exitcode"]), int(e["pid"])) for r, e in data.items()),
                  key=lambda e: e.rank)


def failure_line(exits: Sequence[RankExit], directory: str, describe: Callable[[int], str]) -> str:
    """What ended a failed ``hetplan train``, in one line naming the rank
    (``describe(rank)``: where it sits in the plan); "" when a rank said it
    already on the terminal (a hetplan error, exit 2; the heartbeat naming a
    stopped rank, exit 3). A rank killed by a signal other than SIGTERM (torchrun
    sends that to the others) comes first: the others then only lost a peer."""
    if not exits or any(e.exitcode in (EXIT_USAGE, HEARTBEAT_EXIT) for e in exits):
        return ""
    killed = killed_from_outside(exits)
    if killed:
        e = killed[0]
        return (f"{_who(e, describe)} stopped: killed by {_signal_name(e.exitcode)} without an error of its own "
                "(kill -9, or the out-of-memory killer: see dmesg); the other ranks were stopped "
                f"(their output: {directory})")
    raised = [(e, _last_error(rank_log(directory, e.rank))) for e in exits if e.exitcode > 0]
    if raised:
        raised.sort(key=lambda item: any(s in item[1] for s in PEER_LOST))
        e, error = raised[0]
        return f"{_who(e, describe)} failed: {error or f'exit status {e.exitcode}'} (traceback: {rank_log(directory, e.rank)})"
    e = exits[0]
    return f"{_who(e, describe)} stopped: {_signal_name(e.exitcode)} from outside the run (their output: {directory})"


def killed_from_outside(exits: Sequence[RankExit]) -> list[RankExit]:
    """The ranks a signal from outside the run stopped, in rank order: those killed
    by a signal other than ``AFTER_A_PEER``'s; where none was, those that aborted
    (a rank may abort on its own), never those torchrun stopped with SIGTERM.
    The order the supervisor saw the exits in does not matter."""
    signalled = [e for e in exits if e.exitcode < 0 and -e.exitcode != signal.SIGTERM]
    return [e for e in signalled if -e.exitcode not in AFTER_A_PEER] or signalled


def _who(e: RankExit, describe: Callable[[int], str]) -> str:
    """'rank 1 (stage 1 of 2: ..., device 1; pid 4242 on node7)', as the heartbeat names a rank."""
    try:
        where = describe(e.rank)
    except Exception:  # noqa: BLE001 - a description must never hide the report
        where = ""
    return f"rank {e.rank} ({where + '; ' if where else ''}pid {e.pid} on {socket.gethostname()})"


def _signal_name(exitcode: int) -> str:
    try:
        return signal.Signals(-exitcode).name
    except ValueError:
        return f"signal {-exitcode}"


def _last_error(path: str, limit: int = 300) -> str:
    """The last line of a rank's log (a traceback's exception line), without torch's ``[rankN]:`` prefix."""
    import re

    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            lines = [re.sub(r"^\[rank\d+\]:\s?", "", line).strip() for line in f]
    except OSError:
        return ""
    last = next((line for line in reversed(lines) if line), "")
    return last if len(last) <= limit else last[:limit] + "..."


# --- one line for a refusal or an out-of-memory error of a rank -------------------------------------
ERROR_FILE = "rank{rank}.error.json"  # a rank's one-line error under hetplan run (run_user_script writes it)
_ASKED = re.compile(r"Tried to allocate ([0-9.]+) ?([KMGT]i?B)")  # torch's CUDA caching allocator's message
_UNIT = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
GIB = 2**30


def is_out_of_memory(exc: BaseException) -> bool:
    """``torch.OutOfMemoryError`` (CUDA's caching allocator ran out), without importing torch."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(exc, getattr(torch, "OutOfMemoryError", ()))


def asked_bytes(message: str) -> int | None:
    """The bytes an allocation asked for, from torch's OOM message ("Tried to
    allocate 2.00 GiB"); None when the message does not say (another allocator)."""
    found = _ASKED.search(message)
    if not found:
        return None
    try:
        return int(float(found.group(1)) * _UNIT.get(found.group(2)[0], 1))
    except ValueError:
        return None


def out_of_memory_line(exc: BaseException, ctx: Any, plan_path: str) -> str:
    """'rank R (stage S ..., device D) ran out of memory at step K: X GiB allocated,
    Y GiB more asked; the plan predicted Z GiB ...' and what to change, from the plan."""
    rank = int(os.environ.get("RANK", "0"))
    if ctx is None:  # before hr.init: no plan position yet
        return f"rank {rank} ran out of memory before the runtime was set up: {str(exc).splitlines()[0][:200]}"
    where = describe_rank(ctx.layout, rank)
    allocated = _allocated_bytes(ctx.device)
    asked = asked_bytes(str(exc))
    facts = [f"{allocated / GIB:.2f} GiB allocated" if allocated is not None else "",
             f"{asked / GIB:.2f} GiB more asked" if asked is not None else ""]
    predicted = _predicted_peak(plan_path, ctx.position.device)
    said = f"; the plan predicted {predicted / GIB:.2f} GiB at peak" if predicted is not None else ""
    return (f"rank {rank} ({where}) ran out of memory at step {ctx.step + 1}: "
            f"{', '.join(f for f in facts if f) or 'no sizes in the error'}{said}; "
            f"{_memory_advice(ctx.plan, ctx.position.pp_index)}")


def _allocated_bytes(device: Any) -> int | None:
    torch = sys.modules.get("torch")
    if torch is None or getattr(device, "type", "") != "cuda":
        return None
    return int(torch.cuda.memory_allocated(device))


def _predicted_peak(plan_path: str, device: int) -> int | None:
    """The peak the plan file's estimate gives ``device`` (its first plan: what
    ``hr.init`` and ``hetplan train`` run), or None when the file has none."""
    import json

    try:
        with open(plan_path, encoding="utf-8") as f:
            entry = json.load(f)["plans"][0]
        return int(entry["estimate"]["peak_memory_bytes"][str(device)])
    except (OSError, ValueError, KeyError, IndexError, TypeError):
        return None


def _memory_advice(plan: Any, stage_index: int) -> str:
    """What to change in the plan for this stage to need less memory."""
    stage = plan.stages[stage_index]
    ways = []
    if plan.micro_batch_size > 1:
        ways.append(f"a smaller micro-batch (now {plan.micro_batch_size})")
    if any(st.recompute != "full" for st in stage.strategies):
        ways.append("full recomputation (--recompute full)")
    if stage.dp > 1 and any(st.zero < 3 for st in stage.strategies):
        ways.append("ZeRO-3 (--zero 3)")
    ways.append("--memory-limit below this GPU's memory when planning")
    return "make a plan with " + ", or ".join(ways)


def record_error(directory: str, line: str) -> None:
    """Keep this rank's one-line error for :func:`first_error` (the launcher prints it once)."""
    import json

    rank = int(os.environ.get("RANK", "0"))
    path = os.path.join(directory, ERROR_FILE.format(rank=rank))
    with open(path, "w", encoding="utf-8") as f:
        json.dump({"rank": rank, "time": time.time(), "line": line}, f)


def first_error(directory: str) -> tuple[int, str] | None:
    """(rank, line) of rank 0's error if it had one, else of the rank that failed first."""
    import glob
    import json

    found = []
    for path in glob.glob(os.path.join(directory, ERROR_FILE.format(rank="*"))):
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
            found.append((data["rank"] != 0, float(data["time"]), int(data["rank"]), str(data["line"])))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    if not found:
        return None
    _, _, rank, line = min(found)
    return rank, line


def run_user_script(directory: str, script: Sequence[str]) -> None:
    """``hetplan run``'s rank: the user's script as ``__main__``; a HetplanError
    (from ``hr.init``, ``ctx.parallelize``, ...) or a CUDA out-of-memory error is
    kept as one line for the launcher and ends the rank with exit 2; any other
    exception keeps its traceback."""
    import runpy

    log_stderr(directory, int(os.environ.get("RANK", "0")))  # a rank that only lost a peer stays off the terminal
    sys.argv = list(script)
    sys.path.insert(0, os.path.dirname(os.path.abspath(script[0])))
    try:
        runpy.run_path(script[0], run_name="__main__")
        code = 0
    except HetplanError as exc:
        record_error(directory, str(exc))
        code = EXIT_USAGE
    except Exception as exc:
        if not is_out_of_memory(exc):
            raise
        record_error(directory, out_of_memory_line(exc, current_context(), os.environ.get("HETPLAN_PLAN", "")))
        code = EXIT_USAGE
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # skip interpreter teardown, as the trainer does, with process groups still up


def user_script_argv(directory: str, script: Sequence[str]) -> list[str]:
    """torchrun's script for ``hetplan run``: :func:`run_user_script` on ``script``."""
    return ["-m", "hetplan.runtime.launch", USER_SCRIPT_FLAG, directory, "--", *script]


USER_SCRIPT_FLAG = "--user-script"


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m hetplan.runtime.launch --report-dir DIR -- TORCHRUN_ARGS``:
    torchrun (its agent in this process), but its agent logs to DIR/torchrun.log,
    and a failed run writes each failed rank's exit code and pid to DIR/exits.json
    (for :func:`failure_line`) instead of raising ChildFailedError's traceback."""
    import json
    import logging

    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == [USER_SCRIPT_FLAG] and args[2:3] == ["--"] and len(args) > 3:
        run_user_script(args[1], args[3:])
    if args[:1] != ["--report-dir"] or args[2:3] != ["--"]:
        raise SystemExit("usage: python -m hetplan.runtime.launch --report-dir DIR -- TORCHRUN_ARGS")
    directory, torchrun_args = args[1], args[3:]
    os.makedirs(directory, exist_ok=True)
    if os.path.exists(os.path.join(directory, EXITS)):  # an earlier run's (hetplan train --out reused)
        os.remove(os.path.join(directory, EXITS))
    agent = logging.getLogger("torch.distributed.elastic")
    agent.propagate = False
    agent.addHandler(logging.FileHandler(os.path.join(directory, AGENT_LOG), mode="w"))
    try:
        torchrun.run(torchrun.parse_args(torchrun_args))
    except ChildFailedError as exc:
        exits = {str(rank): {"exitcode": f.exitcode, "pid": f.pid} for rank, f in exc.failures.items()}
        with open(os.path.join(directory, EXITS), "w", encoding="utf-8") as f:
            json.dump(exits, f)
        return 1
    except SignalException as exc:  # this process was told to stop: torchrun stopped the ranks
        return 128 + int(exc.sigval)
    return 0


# --- local fork-based launcher ------------------------------------------------------------------
@dataclass
class RankResult:
    rank: int
    exitcode: int | None
    value: Any = None
    error: str = ""  # exception "Type: message" when the rank raised
    traceback: str = ""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(fn: Callable[..., Any], rank: int, world_size: int, port: int, args: tuple[Any, ...],
            env: dict[str, str], out_dir: str) -> None:
    os.environ.update({
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank), "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world_size), "LOCAL_WORLD_SIZE": str(world_size), "GROUP_RANK": "0",
    })
    os.environ.update(env)
    import torch

    torch.set_num_threads(int(os.environ.get("HETPLAN_NUM_THREADS", "1")))
    result: dict[str, Any] = {}
    code = 0
    try:
        result["value"] = fn(*args)
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        result["error"] = f"{type(exc).__name__}: {exc}"
        result["traceback"] = traceback.format_exc()
        code = 1
    try:
        with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
            pickle.dump(result, f)
    except Exception:  # noqa: BLE001 - unpicklable value
        with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
            pickle.dump({"error": "result not picklable", "traceback": traceback.format_exc()}, f)
        code = 1
    try:
        import torch.distributed as dist

        if code == 0 and dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001 -- a value that cannot be sent is reported as text
        pass
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # skip interpreter teardown: avoids "terminate called without an active exception"


_CTX: Any = None


def _context() -> Any:
    global _CTX
    if _CTX is None:
        _CTX = mp.get_context("forkserver")
        _CTX.set_forkserver_preload(PRELOAD)
    return _CTX


def run_local(fn: Callable[..., Any], world_size: int, args: tuple[Any, ...] = (), *, timeout_s: float = 120.0,
              grace_s: float = 10.0, env: dict[str, str] | None = None) -> list[RankResult]:
    """Run ``fn(*args)`` on ``world_size`` local processes (see module doc).

    ``fn`` must be importable (a module-level function). Each rank's return
    value or exception comes back as a RankResult; nothing raises here.
    """
    ctx = _context()
    port = free_port()
    env = {"HETPLAN_PG_TIMEOUT_S": str(int(max(10, timeout_s))), **(env or {})}
    with tempfile.TemporaryDirectory(prefix="hetplan-run-") as out_dir:
        procs = [ctx.Process(target=_worker, args=(fn, r, world_size, port, args, env, out_dir), daemon=False)
                 for r in range(world_size)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout_s
        first_failure: float | None = None
        while True:
            alive = [p for p in procs if p.exitcode is None]
            if not alive:
                break
            now = time.monotonic()
            if first_failure is None and any(p.exitcode not in (None, 0) for p in procs):
                first_failure = now
            if now > deadline or (first_failure is not None and now > first_failure + grace_s):
                for p in alive:
                    os.kill(p.pid, signal.SIGKILL)
                for p in alive:
                    p.join(5)
                break
            alive[0].join(0.05)
        results = []
        for r, p in enumerate(procs):
            p.join(1)
            data: dict[str, Any] = {}
            path = os.path.join(out_dir, f"rank{r}.pkl")
            if os.path.exists(path):
                with open(path, "rb") as f:
                    data = pickle.load(f)
            elif p.exitcode is not None and p.exitcode < 0:
                data = {"error": f"killed by signal {-p.exitcode}"}
            results.append(RankResult(r, p.exitcode, data.get("value"), data.get("error", ""),
                                      data.get("traceback", "")))
        return results


def check_results(results: list[RankResult]) -> list[Any]:
    """Values of all ranks, or an AssertionError showing the first failure."""
    bad = [r for r in results if r.exitcode != 0 or r.error]
    if bad:
        # a rank that failed on its own explains more than one that lost its peer
        bad.sort(key=lambda r: (any(s in r.error for s in PEER_LOST), not r.error, r.rank))
        r = bad[0]
        raise AssertionError(f"rank {r.rank} failed (exit {r.exitcode}): {r.error}\n{r.traceback}")
    return [r.value for r in results]


if __name__ == "__main__":
    sys.exit(main())
