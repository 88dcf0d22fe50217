"""Starting processes for a plan: torchrun commands, and a cheap local launcher.

``torchrun_commands(plan, script, args)`` gives one command per node the plan
uses. Ranks follow the plan's devices in id order, node by node (see
hetplan.runtime.layout), so node ``k`` runs ``--node-rank=k`` with as many
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
            from hetplan.cluster import load_cluster

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
    return [python or sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={num_processes}", *script]


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
    except Exception:  # noqa: BLE001
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
        secondary = ("Connection reset", "Connection closed", "killed by signal", "timed out")
        bad.sort(key=lambda r: (any(s in r.error for s in secondary), not r.error, r.rank))
        r = bad[0]
        raise AssertionError(f"rank {r.rank} failed (exit {r.exitcode}): {r.error}\n{r.traceback}")
    return [r.value for r in results]
