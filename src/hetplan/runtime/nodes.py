"""Several nodes of one ``--elastic`` run: how their supervisors agree on which devices are gone.

Every node runs its own supervisor (``hetplan train --elastic --nnodes N --node-rank I --rdzv-endpoint
HOST:PORT``, or ``hetplan run`` likewise); HOST is the node started with ``--node-rank 0``. That node's
supervisor hosts a ``torch.distributed.TCPStore`` on PORT for the whole run (the other supervisors are its
clients). Each launch is one torchrun per node, with torchrun's static rendezvous on the address of the
launch's first node and port ``PORT + 1 + launch`` (the plan fixes which ranks each node runs; c10d's
dynamic rendezvous would number the nodes by its own order). After a launch ends, each supervisor
publishes what its node saw (the devices of its ranks killed from outside, or that it finished), waits
for the other nodes' reports (``report_timeout_s``; a node that does not report by then is gone, all its
devices), and proposes the union; the first proposal written wins (the store's ``compare_set``), so every
node reads the same set of lost devices even when their waits ended differently. Every node then makes
the same new plan from the plan file and that set (the planners are deterministic) and launches its part
of it. The store's host is a single point: when it is gone every other supervisor fails to reach it and
stops with one line, none goes on alone, so the nodes never split into two runs.
"""

from __future__ import annotations

import datetime
import json
import socket
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

from hetplan.errors import HetplanError
from hetplan.plan.file import read_plan_file
from hetplan.runtime.launch import plan_nodes

# torchrun stops the workers of a failed node with SIGTERM and kills them 30 s later (the default
# ``timeout`` of torch.distributed.elastic.multiprocessing.api.PContext.close): the time a node's launch may
# take to end after its ranks noticed a peer gone, on top of the collective timeout that bounds the noticing.
AGENT_STOP_S = 30.0
# How often a supervisor looks at the store while it waits (a check of a few keys: cheap).
POLL_S = 0.2


def report_timeout_s(collective_timeout_s: float) -> float:
    """How long a supervisor waits for the other nodes' reports after its launch ended: their ranks notice
    a peer gone within the collective timeout (the heartbeat names a stopped one before it), and torchrun
    stops them within ``AGENT_STOP_S``; a node silent longer is gone."""
    return collective_timeout_s + AGENT_STOP_S


def parse_endpoint(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (``--rdzv-endpoint``), as a host and a port."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise HetplanError(f"--rdzv-endpoint {text!r}: give HOST:PORT of the node started with --node-rank 0 "
                           "(e.g. node0.cluster:29400)")
    return host.strip("[]"), int(port)


@dataclass(frozen=True)
class NodeFlags:
    """This supervisor's flags: ``nnodes`` supervisors, this one ``node_rank`` (as ``hetplan run --print``
    numbers the plan's nodes), the store at ``host:port``."""

    nnodes: int
    node_rank: int
    host: str
    port: int


def node_flags(args: Any, plan_node_count: int) -> NodeFlags | None:
    """``--nnodes/--node-rank/--rdzv-endpoint`` checked against each other and the plan (None: none given)."""
    given = [args.nnodes is not None, args.node_rank is not None, bool(args.rdzv_endpoint)]
    if not any(given):
        return None
    if not all(given):
        raise HetplanError("--nnodes, --node-rank and --rdzv-endpoint go together: give all three on every node")
    if not args.elastic:
        raise HetplanError("--nnodes runs a multi-node --elastic run; add --elastic (without it, run the commands "
                           "of 'hetplan run PLAN --print -- SCRIPT' on each node)")
    if args.nnodes != plan_node_count:
        raise HetplanError(f"--nnodes {args.nnodes}: the plan runs on {plan_node_count} node(s); start one "
                           f"supervisor on each, with --nnodes {plan_node_count}")
    if not 0 <= args.node_rank < args.nnodes:
        raise HetplanError(f"--node-rank {args.node_rank}: give 0..{args.nnodes - 1} (the node's place in the plan)")
    host, port = parse_endpoint(args.rdzv_endpoint)
    return NodeFlags(args.nnodes, args.node_rank, host, port)


@dataclass(frozen=True)
class NodeLaunch:
    """This node's part of one launch: torchrun's ``--nnodes``, ``--node-rank``, ``--master-addr/-port``."""

    nnodes: int
    node_rank: int
    master_addr: str
    master_port: int

    def torchrun_args(self, processes: int) -> list[str]:
        return [f"--nnodes={self.nnodes}", f"--node-rank={self.node_rank}", f"--nproc-per-node={processes}",
                f"--master-addr={self.master_addr}", f"--master-port={self.master_port}"]


@dataclass(frozen=True)
class Report:
    """What one node's launch ended in: ``ok`` (finished), the plan devices of its ranks killed from
    outside, its one line and exit status."""

    ok: bool
    lost: tuple[int, ...] = ()
    line: str = ""
    status: int = 0

    def text(self) -> str:
        return json.dumps({"ok": self.ok, "lost": list(self.lost), "line": self.line, "status": self.status})

    @staticmethod
    def read(text: bytes | str) -> Report:
        data = json.loads(text)
        return Report(bool(data["ok"]), tuple(int(d) for d in data["lost"]), str(data["line"]), int(data["status"]))


def decide(reports: Sequence[Report | None], devices: Sequence[Sequence[int]], timeout_s: float) -> Report:
    """The launch's outcome from the nodes' reports in node-rank order (None: the node did not report in
    ``timeout_s``, so all its ``devices`` are gone): finished when every node finished, else the union of
    the lost devices and the first node's line."""
    missing = [rank for rank, report in enumerate(reports) if report is None]
    lost = {d for report in reports if report is not None for d in report.lost}
    lost.update(d for rank in missing for d in devices[rank])
    # a node whose ranks were killed says what ended the launch; the others' ranks only lost a peer
    failed = sorted((report for report in reports if report is not None and not report.ok),
                    key=lambda report: not report.lost)
    lines = [report.line for report in failed if report.line][:1]
    if missing:
        lines.insert(0, f"node(s) {', '.join(map(str, missing))} of the launch did not report within "
                     f"{timeout_s:.0f} s: their devices are gone")
    status = next((report.status for report in failed if report.status), 1 if missing else 0)
    return Report(not missing and not failed, tuple(sorted(lost)), "; ".join(lines), status)


@dataclass
class NodeGroup:
    """The supervisors of one multi-node ``--elastic`` run, seen from one of them (``me``: its
    ``--node-rank``, which names its machine for the whole run). ``where[m]``: machine m's node index in
    the current plan's cluster (None: its devices are all gone); the same on every node, since every
    node updates it from the same decisions."""

    store: Any
    me: int
    nnodes: int
    port: int
    timeout_s: float
    where: list[int | None] = field(default_factory=list)
    members: list[int] = field(default_factory=list)  # the machines of the current launch, by node rank
    devices: list[list[int]] = field(default_factory=list)  # their plan devices, by node rank
    cluster: Any = None
    launches: int = 0
    current: NodeLaunch | None = None  # this node's part of the launch entered last

    @staticmethod
    def join(flags: NodeFlags, plan_path: str, timeout_s: float) -> NodeGroup:
        """Start (``--node-rank 0``) or reach the store, publish this machine's address and wait for
        every node's."""
        from torch.distributed import TCPStore  # the runtime's commands only (this module is torch-free)

        try:
            store = TCPStore(flags.host, flags.port, is_master=flags.node_rank == 0, wait_for_workers=False,
                             timeout=datetime.timedelta(seconds=timeout_s))
        except (RuntimeError, OSError) as exc:
            raise HetplanError(f"--rdzv-endpoint {flags.host}:{flags.port}: cannot "
                               f"{'serve' if flags.node_rank == 0 else 'reach'} the nodes' store ({exc}); "
                               "give the address of the node started with --node-rank 0 and a free port") from None
        pf = read_plan_file(plan_path)
        group = NodeGroup(store, flags.node_rank, flags.nnodes, flags.port, timeout_s,
                          where=[node for node, _ in plan_nodes(pf.plan(), pf.cluster)])
        store.set(f"addr/{flags.node_rank}", own_address(flags.host, flags.port))
        silent = group.wait_for([f"addr/{m}" for m in range(flags.nnodes)], timeout_s)
        if silent:
            raise HetplanError(f"node(s) {', '.join(k.split('/')[1] for k in silent)} did not join the run at "
                               f"{flags.host}:{flags.port} within {timeout_s:.0f} s: start the same command there "
                               "with their --node-rank")
        return group

    def wait_for(self, keys: Sequence[str], timeout_s: float) -> list[str]:
        """Wait until the store holds ``keys`` or ``timeout_s`` passed; the keys still missing."""
        deadline = time.monotonic() + timeout_s
        missing = list(keys)
        while True:
            missing = [key for key in missing if not self._check(key)]
            if not missing or time.monotonic() > deadline:
                return missing
            time.sleep(POLL_S)

    def _check(self, key: str) -> bool:
        return bool(self._call("check", [key]))

    def _call(self, method: str, *args: Any) -> Any:
        """``store.method(*args)``; a store that cannot be reached is one line (its host is gone)."""
        try:
            return getattr(self.store, method)(*args)
        except (RuntimeError, OSError) as exc:  # torch's DistStoreError is a RuntimeError
            raise HetplanError(store_gone_line(exc)) from None

    def enter(self, plan_path: str) -> NodeLaunch | None:
        """This node's part of the next launch of the plan at ``plan_path``; None when the plan uses none
        of its devices (this node's part of the run is over)."""
        pf = read_plan_file(plan_path)
        nodes = plan_nodes(pf.plan(), pf.cluster)
        index = [node for node, _ in nodes]
        self.cluster = pf.cluster
        self.members = sorted((m for m in range(self.nnodes) if self.where[m] in index),
                              key=lambda m: index.index(self.where[m]))
        self.devices = [nodes[index.index(self.where[m])][1] for m in self.members]
        launch = self.launches
        self.launches += 1
        self.current = None
        if self.me in self.members:
            master = self._call("get", f"addr/{self.members[0]}").decode()
            self.current = NodeLaunch(len(self.members), self.members.index(self.me), master, self.port + 1 + launch)
        return self.current

    def agree(self, mine: Report) -> Report:
        """Publish this node's report of the launch just ended and return the decision every node reads."""
        prefix = f"launch{self.launches - 1}/"
        self._call("set", f"{prefix}report/{self.me}", mine.text())
        keys = [f"{prefix}report/{m}" for m in self.members]
        silent = set(self.wait_for(keys, self.timeout_s))
        reports = [None if key in silent else Report.read(self._call("get", key)) for key in keys]
        proposal = decide(reports, self.devices, self.timeout_s)
        decision = Report.read(self._call("compare_set", f"{prefix}decision", "", proposal.text()))
        here = set(self.devices[self.members.index(self.me)])
        if here <= set(decision.lost) and not here <= set(mine.lost):  # counted as silent: the others went on
            raise HetplanError(f"the other nodes decided without this one ({decision.line}); its devices are out of "
                               "the run: restart it with the nodes left ('hetplan replan', docs/elastic.md)")
        if decision.lost:
            self.where = nodes_left(self.cluster, self.where, decision.lost)
        return decision

    def leave(self) -> None:
        """This supervisor ends; the store's host keeps serving until every other node has left: for as long
        as a report may take when it ran the last launch with them (they end with it), for the rest of the
        run when its devices are out of the plan (the others go on)."""
        try:
            self._call("set", f"gone/{self.me}", "1")
            if self.me == 0:
                others = [f"gone/{m}" for m in range(1, self.nnodes) if self.where[m] is not None]
                if self.current is not None:
                    self.wait_for(others, self.timeout_s)
                elif self.wait_for(others, 0.0):
                    print(f"hetplan: node 0 serves the nodes' store until the other nodes end (port {self.port})",
                          file=sys.stderr, flush=True)
                    self.wait_for(others, float("inf"))
        except HetplanError:
            pass  # the others are gone with the store's connection: nothing left to serve


def nodes_left(cluster: Any, where: Sequence[int | None], lost: Sequence[int]) -> list[int | None]:
    """Each machine's node index in the cluster without the ``lost`` devices
    (``hetplan.app.replan.cluster_without``: a node left with none is dropped, the others keep their order)."""
    gone = set(lost)
    kept = [any(d not in gone for d in cluster.node_devices(node)) for node in range(cluster.num_nodes)]
    return [None if node is None or not kept[node] else sum(kept[:node]) for node in where]


def own_address(host: str, port: int) -> str:
    """The address this machine reaches ``host`` from (the route's source address; no packet is sent):
    where the other nodes reach this one when it is a launch's first node."""
    family = socket.getaddrinfo(host, port, proto=socket.IPPROTO_UDP)[0][0]
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect((host, port))
        return str(s.getsockname()[0])


def store_gone_line(exc: BaseException) -> str:
    """The one line of a supervisor that lost the nodes' store (its host, the node started with
    ``--node-rank 0``, is gone)."""
    first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return (f"the nodes' store on the node started with --node-rank 0 is gone ({first[:200]}): that node is lost, "
            "and the nodes cannot agree without it; restart the run on the nodes left with "
            "'hetplan replan PLAN --without node:0' and --resume (docs/elastic.md)")
