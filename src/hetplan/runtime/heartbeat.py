"""A heartbeat between the ranks of a run, so that a rank that stops responding is named.

A rank that is alive but stopped (SIGSTOP, a debugger, a frozen machine, a C
call that never returns while holding the GIL) leaves the others blocked in a
collective until the process group's timeout, which then says only that some
operation timed out. With the heartbeat every rank runs two daemon threads:

* the *beat* thread adds 1 to its counter ``<prefix>/<rank>`` in the run's
  rendezvous store every second (a connection of its own, so the process
  group's connection and timeouts are untouched) and reads the counters of the
  ranks it watches (all others, at most ``MAX_WATCHED``, the next ones in a
  ring, so a large run costs the store O(world) operations per second);
* the *watch* thread never touches the store. It compares, on this machine's
  ``time.monotonic()`` clock only (no clocks compared across machines), when
  each watched counter last moved and when the store last answered. A counter
  that has not moved for the heartbeat timeout while the store answers names
  that rank; a store that has not answered for it names the process hosting the
  store (rank 0 under ``run_local`` or a plain ``init_process_group``,
  torchrun's agent under torchrun). Store operations on a stopped store host
  block without a timeout (measured, torch 2.13), which is why the watch thread
  is separate.

On a hang the watch thread prints one line to stderr::

    hetplan: error: rank 1 (stage 1 of 2: layers.2..head, device 1; pid 4242 on node7) has not
    responded for 10 s (hung or stopped); stopping rank 0

and ends the process with ``os._exit(EXIT_CODE)``: the main thread may be
blocked inside a collective, so nothing else could end it. The launcher
(torchrun, ``run_local``) then stops the remaining ranks.

A rank that finishes marks its counter done (``RuntimeContext.close``), and a
destroyed process group stops the heartbeat silently, so a normal run ends
without messages. A process that was itself stopped and continued does not
blame the others for its own gap. A rank busy in a Python loop still beats;
the collective timeout (the same ``timeout``) ends that case.
"""

from __future__ import annotations

import datetime
import os
import socket
import threading
import time
from typing import Any, Callable

from hetplan.runtime.console import console

DEFAULT_INTERVAL_S = 1.0
EXIT_CODE = 3  # a peer stopped responding (1: the training failed, 2: a user mistake)
MAX_WATCHED = 8
_DONE = 1 << 40  # added to a counter when its rank finishes normally
# How long a rank waits at start for its watched peers' pid and host: they start
# together (the process group's rendezvous has just brought every rank up).
INFO_WAIT_S = 10.0
_starts = 0  # heartbeats started in this process: every rank runs the same code, so keys match


def heartbeat_timeout(pg_timeout_s: float, interval_s: float = DEFAULT_INTERVAL_S) -> float:
    """How long a counter may stand still: 0.8 x the process-group timeout,
    so the heartbeat names the rank before a collective's own timeout fires
    (a collective may have started waiting before the peer stopped)."""
    return max(3 * interval_s, 0.8 * pg_timeout_s)


def describe_rank(layout: Any, rank: int) -> str:
    """'stage 1 of 2: layers.2..head, dp 0 of 2, device 3': where ``rank`` sits in the plan
    (stages and indices from 0, as in the plan; device: the plan's device id)."""
    pos = layout.position(rank)
    chunks = [layout.chunk_names(c) for c in pos.chunks]
    layers = " | ".join(n[0] if len(n) == 1 else f"{n[0]}..{n[-1]}" for n in chunks if n)
    text = f"stage {pos.pp_index} of {layout.pp}: {layers}"
    dp, tp = layout.stage_dp(pos.pp_index), layout.replica_tp(pos.pp_index, pos.dp_index)
    if dp > 1:
        text += f", dp {pos.dp_index} of {dp}"
    if tp > 1:
        text += f", tp {pos.tp_index} of {tp}"
    return f"{text}, device {pos.device}"


def _die(message: str) -> None:
    try:
        console(message)  # the terminal, also when hetplan train sends this rank's stderr to a log
    finally:
        os._exit(EXIT_CODE)


class Heartbeat:
    """Beat and watch threads for one rank (see module doc).

    ``connect()`` returns a store (``add``/``set``/``get``/``check``) and is
    called in the beat thread. ``store_host``: the rank whose process hosts
    the store, or None for another process (``store_name`` says which).
    ``alive()`` False (the process group is gone) stops it silently.
    ``on_hang(message)`` defaults to printing it and ``os._exit(EXIT_CODE)``.
    """

    def __init__(self, connect: Callable[[], Any], rank: int, world_size: int, timeout_s: float, *,
                 describe: Callable[[int], str] | None = None, store_host: int | None = 0,
                 store_name: str = "the rendezvous store", interval_s: float = DEFAULT_INTERVAL_S,
                 prefix: str = "hetplan/heartbeat", on_hang: Callable[[str], None] | None = None,
                 alive: Callable[[], bool] | None = None) -> None:
        self.rank, self.world_size = rank, world_size
        self.timeout_s, self.interval_s = float(timeout_s), float(interval_s)
        self.watched = [(rank + k) % world_size for k in range(1, min(world_size - 1, MAX_WATCHED) + 1)]
        self._connect, self._describe = connect, describe or (lambda r: "")
        self._store_host, self._store_name = store_host, store_name
        self._prefix = prefix
        self._on_hang = on_hang or _die
        self._alive = alive or (lambda: True)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        now = time.monotonic()
        self._last_ok = now
        self._seen: dict[int, int] = {}
        self._changed = {r: now for r in self.watched}
        self._done: set[int] = set()
        self._info: dict[int, str] = {}
        self._threads: list[threading.Thread] = []
        self._finished = False  # stopped because the run ended (not because a peer hung)
        self._store: Any = None  # the connection start() opened, handed to the beat thread
        self.reported = ""

    def _key(self, rank: int) -> str:
        return f"{self._prefix}/{rank}"

    def _info_key(self, rank: int) -> str:
        return f"{self._prefix}/info/{rank}"

    def _publish_info(self, store: Any) -> None:
        """This rank's pid and host, for the peers' reports."""
        store.set(self._info_key(self.rank), f"pid {os.getpid()} on {socket.gethostname()}")

    def _exchange_info(self) -> Any:
        """Publish this rank's pid and host and wait (at most ``INFO_WAIT_S``)
        for its watched peers' before training starts, so that a peer that
        stops later is named with them even when it hosts the store and its
        store stops with it. Best effort: returns the connection, or None
        (a rank is then named without them)."""
        try:
            store = self._connect()
            self._publish_info(store)
            store.wait([self._info_key(r) for r in self.watched], datetime.timedelta(seconds=INFO_WAIT_S))
            for r in self.watched:
                self._info[r] = store.get(self._info_key(r)).decode(errors="replace")
            return store
        except Exception:  # noqa: BLE001 - a peer late or a store without wait: the beat thread retries
            return None

    # --- threads ----------------------------------------------------------------------------
    def start(self) -> Heartbeat:
        self._store = self._exchange_info()
        for name, target in (("beat", self._beat), ("watch", self._watch)):
            t = threading.Thread(target=target, name=f"hetplan-heartbeat-{name}", daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def stop(self, join_s: float = 2.0) -> None:
        """Mark this rank done (best effort) and end both threads; returns within ``join_s``."""
        if self._stop.is_set():
            return
        self._finished = True
        self._stop.set()
        deadline = time.monotonic() + join_s
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(max(0.0, deadline - time.monotonic()))

    def _beat(self) -> None:
        store, self._store = self._store, None  # the start's connection, now this thread's
        info_sent = store is not None
        while True:
            stopping = self._stop.is_set()
            try:
                if store is None:
                    store = self._connect()
                if stopping:
                    if self._finished:
                        store.add(self._key(self.rank), _DONE)
                    return
                store.add(self._key(self.rank), 1)
                if not info_sent:
                    self._publish_info(store)
                    info_sent = True
                values = {r: store.add(self._key(r), 0) for r in self.watched}
                for r in self.watched:
                    key = self._info_key(r)
                    if r not in self._info and store.check([key]):
                        self._info[r] = store.get(key).decode(errors="replace")
            except Exception:  # noqa: BLE001 - the store went away or failed: counts as no answer
                if stopping:
                    return
            else:
                now = time.monotonic()
                with self._lock:
                    self._last_ok = now
                    for r, v in values.items():
                        if v >= _DONE:
                            self._done.add(r)
                        elif v != self._seen.get(r):
                            self._seen[r], self._changed[r] = v, now
            self._stop.wait(self.interval_s)

    def _watch(self) -> None:
        last_tick = time.monotonic()
        while not self._stop.wait(self.interval_s):
            try:
                if not self._alive():
                    self._finished = True
                    self._stop.set()
                    return
            except Exception:  # noqa: BLE001 - e.g. torch tearing down at exit
                return
            now = time.monotonic()
            if now - last_tick > 5 * self.interval_s:
                # this process itself did not run (stopped, or starved): the gap is its own
                with self._lock:
                    self._last_ok = now
                    self._changed = {r: now for r in self.watched}
            last_tick = now
            message = self._check(now)
            if message:
                self.reported = message
                self._stop.set()
                self._on_hang(message)
                return

    def _check(self, now: float) -> str:
        with self._lock:
            store_age = now - self._last_ok
            done = set(self._done)
            stale = [(now - self._changed[r], r) for r in self.watched if r not in done]
        if store_age > self.timeout_s:
            if self._store_host is not None and self._store_host in done:
                return ""  # the store's host finished and took the store along: the run is ending
            if self._store_host is None or self._store_host == self.rank:
                what = f"{self._store_name} has"
            else:
                what = f"{self._who(self._store_host)}, which hosts {self._store_name}, has"
            return (f"hetplan: error: {what} not responded for {store_age:.0f} s (hung or stopped); "
                    f"stopping rank {self.rank}")
        if store_age > 3 * self.interval_s:
            return ""  # the store is slow: the counters say nothing yet
        for age, r in sorted(stale, reverse=True):
            if age > self.timeout_s:
                return (f"hetplan: error: {self._who(r)} has not responded for {age:.0f} s (hung or stopped); "
                        f"stopping rank {self.rank}")
        return ""

    def _who(self, rank: int) -> str:
        try:
            where = self._describe(rank)
        except Exception:  # noqa: BLE001 - a description must never hide the report
            where = ""
        info = self._info.get(rank, "")
        details = "; ".join(x for x in (where, info) if x)
        return f"rank {rank}" + (f" ({details})" if details else "")


def start(layout: Any, rank: int, pg_timeout_s: float, interval_s: float = DEFAULT_INTERVAL_S) -> Heartbeat | None:
    """Start the heartbeat of this rank of an initialised default process group
    (None when ``HETPLAN_HEARTBEAT=0`` or the world has one process)."""
    global _starts
    if layout.world_size < 2 or os.environ.get("HETPLAN_HEARTBEAT", "1").lower() in ("0", "off", "no", "false"):
        return None
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    try:
        base = c10d._get_default_store()
        while hasattr(base, "underlying_store"):  # PrefixStore(s) around the real one
            base = base.underlying_store
    except Exception as exc:  # noqa: BLE001 - no store to beat in: train without the heartbeat
        import warnings

        warnings.warn(f"hetplan: no heartbeat (cannot reach the process group's store: {exc})", stacklevel=2)
        return None
    timeout_s = heartbeat_timeout(pg_timeout_s, interval_s)
    connect: Callable[[], Any]
    if isinstance(base, dist.TCPStore):
        host, port = base.host, base.port
        store_timeout = datetime.timedelta(seconds=max(5.0, min(timeout_s, 60.0)))

        def connect() -> Any:  # a connection of its own (its own timeout; no sharing with the process group)
            return dist.TCPStore(host, port, is_master=False, timeout=store_timeout, wait_for_workers=False)

        agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        store_host = None if agent else 0
        store_name = (f"the torchrun agent's store at {host}:{port}" if agent
                      else f"the rendezvous store ({host}:{port})")
    else:
        connect, store_host, store_name = (lambda: base), None, f"the rendezvous store ({type(base).__name__})"
    _starts += 1
    prefix = f"hetplan/heartbeat/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}.{_starts}"
    hb = Heartbeat(connect, rank, layout.world_size, timeout_s, describe=lambda r: describe_rank(layout, r),
                   store_host=store_host, store_name=store_name, interval_s=interval_s, prefix=prefix,
                   alive=dist.is_initialized)
    return hb.start()
