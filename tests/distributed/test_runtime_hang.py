"""A run cannot wedge: a rank that stops responding is named by the others, which then exit.

The stopped rank is stopped for real (SIGSTOP) in a training run: two trainer
processes started here with the torchrun environment (rank 0 hosts the store,
as under ``run_local`` or a plain ``init_process_group``), and ``hetplan train
--timeout`` (torchrun, whose agent hosts the store). The heartbeat's own logic
is checked first on an in-memory store, without processes. Also: ``--timeout``
takes only a finite number of seconds > 0.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from hetplan.cli import main
from rt_helpers import make_plan, write_plan

SRC = os.path.join(os.path.dirname(__file__), "..", "..", "src")
TIMEOUT_S = 10.0  # --timeout / HETPLAN_PG_TIMEOUT_S in these tests; the heartbeat fires after 0.8 of it
MARGIN_S = 10.0  # a loaded machine's slack on top of the timeout
HEARTBEAT_LINE = "has not responded"


# --- the heartbeat on an in-memory store (no processes) --------------------------------------
class _Store:
    """add/set/get/check like a TCPStore; ``hold`` makes every operation block (a stopped store host)."""

    def __init__(self) -> None:
        self.data: dict[str, object] = {}
        self.lock = threading.Lock()
        self.open = threading.Event()
        self.open.set()

    def add(self, key: str, n: int) -> int:
        self.open.wait()
        with self.lock:
            self.data[key] = int(self.data.get(key, 0)) + n
            return int(self.data[key])

    def set(self, key: str, value: str) -> None:
        self.open.wait()
        with self.lock:
            self.data[key] = value.encode()

    def check(self, keys: list[str]) -> bool:
        self.open.wait()
        with self.lock:
            return all(k in self.data for k in keys)

    def get(self, key: str) -> bytes:
        self.open.wait()
        with self.lock:
            return self.data[key]


def _pair(store: _Store, timeout_s: float = 0.6) -> tuple[list, list[list[str]]]:
    from hetplan.runtime.heartbeat import Heartbeat

    reports: list[list[str]] = [[], []]
    beats = [Heartbeat(lambda: store, r, 2, timeout_s, describe=lambda r: f"stage {r} of 2", store_host=0,
                       interval_s=0.05, on_hang=reports[r].append).start() for r in range(2)]
    return beats, reports


def _wait_for(condition, limit_s: float) -> float:
    t0 = time.monotonic()
    while not condition() and time.monotonic() - t0 < limit_s:
        time.sleep(0.02)
    return time.monotonic() - t0


def test_heartbeat_names_the_rank_whose_counter_stopped() -> None:
    store = _Store()
    beats, reports = _pair(store)
    time.sleep(0.3)
    beats[1]._stop.set()  # rank 1 stops beating without finishing (as if stopped)
    waited = _wait_for(lambda: reports[0], 3.0)
    beats[0].stop()
    assert len(reports[0]) == 1, reports
    assert reports[0][0].startswith("hetplan: error: rank 1 (stage 1 of 2; pid ") and HEARTBEAT_LINE in reports[0][0]
    assert reports[0][0].endswith("(hung or stopped); stopping rank 0")
    assert 0.4 < waited < 2.0, waited


def test_heartbeat_is_silent_when_a_rank_finishes() -> None:
    store = _Store()
    beats, reports = _pair(store)
    time.sleep(0.2)
    t0 = time.monotonic()
    beats[1].stop()  # rank 1 is done: rank 0 may outlive it as long as it likes
    assert time.monotonic() - t0 < 0.5
    time.sleep(1.5)
    beats[0].stop()
    assert reports == [[], []]


def test_heartbeat_names_a_store_host_that_stopped() -> None:
    store = _Store()
    beats, reports = _pair(store)
    time.sleep(0.2)
    store.open.clear()  # every store operation now blocks, like on a stopped TCPStore host
    _wait_for(lambda: reports[1], 3.0)
    t0 = time.monotonic()
    for b in beats:
        b.stop(join_s=0.3)  # returns although the beat thread is stuck in the store
    assert time.monotonic() - t0 < 1.5
    store.open.set()
    assert len(reports[1]) == 1, reports
    assert reports[1][0].startswith("hetplan: error: rank 0 (stage 0 of 2; pid ")
    assert "which hosts the rendezvous store, has not responded" in reports[1][0]


# --- real processes -----------------------------------------------------------------------------
def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": SRC, "OMP_NUM_THREADS": "1", "HETPLAN_NUM_THREADS": "1", **extra}


class _Lines:
    """A pipe read in a thread; each line with the time it arrived."""

    def __init__(self, stream) -> None:
        self.lines: list[tuple[float, str]] = []
        self._thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._thread.start()

    def _read(self, stream) -> None:
        for line in stream:
            self.lines.append((time.monotonic(), line.rstrip("\n")))

    def first(self, needle: str) -> tuple[float, str] | None:
        return next(((t, line) for t, line in list(self.lines) if needle in line), None)

    def text(self) -> str:
        self._thread.join(5)
        return "\n".join(line for _, line in self.lines)


def _start_ranks(plan_path: str, steps: int, timeout_s: float) -> list[subprocess.Popen]:
    """The trainer on two processes with the torchrun environment; rank 0 hosts the store."""
    from hetplan.runtime.launch import free_port

    env = _env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
               GROUP_RANK="0", HETPLAN_PG_TIMEOUT_S=str(timeout_s))
    return [subprocess.Popen([sys.executable, "-m", "hetplan.runtime.trainer", "--plan", plan_path,
                              "--steps", str(steps)], env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for r in range(2)]


def _kill(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()  # SIGKILL also ends a stopped process
    for p in procs:
        p.wait(30)


def _wait_for_step(out: _Lines, step: int, limit_s: float = 120.0) -> None:
    assert _wait_for(lambda: out.first(f"step {step:>4}") is not None, limit_s) < limit_s, out.text()


@pytest.mark.parametrize("stopped", [1, 0], ids=["rank1", "rank0-store-host"])
def test_the_other_rank_names_a_stopped_rank_and_exits(stopped: int, tmp_path) -> None:
    plan = write_plan(tmp_path, make_plan(pp=2, micro=2))
    procs = _start_ranks(plan, 100_000, TIMEOUT_S)
    other = procs[1 - stopped]
    try:
        out, err = _Lines(procs[0].stdout), _Lines(other.stderr)
        _Lines(procs[stopped].stderr)
        _wait_for_step(out, 3)
        os.kill(procs[stopped].pid, signal.SIGSTOP)
        t0 = time.monotonic()
        try:
            code = other.wait(TIMEOUT_S + MARGIN_S)
        except subprocess.TimeoutExpired:
            code = None
        waited = time.monotonic() - t0
    finally:
        _kill(procs)
    text = err.text()
    assert code is not None, f"rank {1 - stopped} still running {waited:.0f} s after rank {stopped} stopped"
    lines = [line for line in text.splitlines() if HEARTBEAT_LINE in line]
    assert len(lines) == 1 and code == 3 and "Traceback" not in text, (code, text)
    line = lines[0]
    assert line.startswith(f"hetplan: error: rank {stopped} (stage {stopped} of 2: "), line
    assert f"pid {procs[stopped].pid} on " in line and line.endswith(f"stopping rank {1 - stopped}"), line
    if stopped == 0:
        assert "which hosts the rendezvous store" in line, line
    assert 0.8 * TIMEOUT_S - 1 < waited < TIMEOUT_S + MARGIN_S, waited


def test_normal_run_longer_than_the_heartbeat_timeout_prints_nothing(tmp_path) -> None:
    plan = write_plan(tmp_path, make_plan(pp=2, micro=2))
    timeout = 6.0  # heartbeat after 4.8 s; the run takes longer than that (400 steps: ~13 s here, 3.9 s for 120)
    procs = _start_ranks(plan, 400, timeout)
    try:
        t0 = time.monotonic()
        outs = [p.communicate(timeout=240) for p in procs]
        took = time.monotonic() - t0
    finally:
        _kill(procs)
    assert [p.returncode for p in procs] == [0, 0], outs
    assert "step  400" in outs[0][0]
    for _, err in outs:
        assert HEARTBEAT_LINE not in err and "hetplan: error" not in err, err
    assert took > 0.8 * timeout, took


def test_hetplan_train_timeout_stops_a_run_with_a_stopped_rank(tmp_path) -> None:
    """``hetplan train --timeout`` reaches the ranks (torchrun; its agent hosts the store)."""
    plan = write_plan(tmp_path, make_plan(pp=2, micro=2))
    proc = subprocess.Popen([sys.executable, "-m", "hetplan.cli", "train", "--plan", plan, "--steps", "100000",
                             "--timeout", str(TIMEOUT_S), "--out", str(tmp_path / "out")], env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    stopped = None
    try:
        out, err = _Lines(proc.stdout), _Lines(proc.stderr)
        _wait_for_step(out, 3)
        stopped = _rank_pid(proc.pid, 1)
        os.kill(stopped, signal.SIGSTOP)
        waited = _wait_for(lambda: err.first(HEARTBEAT_LINE) is not None, TIMEOUT_S + MARGIN_S)
        os.kill(stopped, signal.SIGKILL)  # torchrun would wait 30 s for the stopped rank to take its SIGTERM
        code = proc.wait(60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # the session this test started
            proc.wait(30)
    found = err.first(HEARTBEAT_LINE)
    text = err.text()
    assert found is not None, text
    line = found[1]
    assert line.startswith("hetplan: error: rank 1 (stage 1 of 2: ") and f"pid {stopped} on " in line, line
    assert line.endswith("stopping rank 0"), line
    assert 0.8 * TIMEOUT_S - 1 < waited < TIMEOUT_S + MARGIN_S, (waited, text)
    assert code == 1 and "training failed" in text, (code, text)


def test_hetplan_train_names_a_killed_rank_in_one_line(tmp_path) -> None:
    """A rank SIGKILLed (as by the out-of-memory killer) dies without a Python
    error; the other rank then fails with a gloo traceback. ``hetplan train``
    names the killed rank in one line; the tracebacks are in OUT/logs."""
    plan = write_plan(tmp_path, make_plan(pp=2, micro=2))
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "hetplan.cli", "train", "--plan", plan, "--steps", "100000",
                             "--timeout", str(TIMEOUT_S), "--out", str(out)], env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, err = _Lines(proc.stdout), _Lines(proc.stderr)
        _wait_for_step(stdout, 1)
        killed = _rank_pid(proc.pid, 1)
        os.kill(killed, signal.SIGKILL)
        t0 = time.monotonic()
        code = proc.wait(60)
        waited = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # the session this test started
            proc.wait(30)
    lines = [line for line in err.text().splitlines() if line.strip()]
    assert code == 1 and len(lines) == 1, (code, lines)
    logs = out / "logs"
    assert lines[0] == (f"hetplan: error: rank 1 (stage 1 of 2: layers.2..head, device 1; pid {killed} on "
                        f"{socket.gethostname()}) stopped: killed by SIGKILL without an error of its own (kill -9, "
                        f"or the out-of-memory killer: see dmesg); the other ranks were stopped (their output: {logs})")
    assert "Connection" in (logs / "rank0.log").read_text()  # rank 0's gloo traceback, kept out of the way
    assert waited < TIMEOUT_S, waited  # torchrun's stop, not the heartbeat's timeout
    print(f"killed rank 1 after step 1; hetplan train ended {waited:.1f} s later")


def test_failure_line_names_what_stopped_the_run(tmp_path) -> None:
    """The rule behind that line, on recorded exits: a rank's own hetplan message
    (exit 2, or the heartbeat's 3) stands alone; a killed rank comes before ranks
    that lost a peer; of ranks that raised, the one that did not lose a peer."""
    from hetplan.runtime.launch import RankExit, failure_line, rank_log

    logs = str(tmp_path)
    for rank, last in ((0, "RuntimeError: [gloo] Read error: Connection reset by peer"),
                       (1, "ValueError: the forward got a bad shape")):
        with open(rank_log(logs, rank), "w", encoding="utf-8") as f:
            f.write(f"Traceback (most recent call last):\n  File \"x.py\", line 1\n[rank{rank}]: {last}\n")

    def line(*exits: tuple[int, int]) -> str:
        return failure_line([RankExit(r, code, 100 + r) for r, code in exits], logs, lambda r: f"stage {r} of 2")

    here = socket.gethostname()
    assert line((0, 3), (1, -9)) == "" and line((0, 2), (1, 2)) == ""
    assert line((0, 1), (1, -9)).startswith(f"rank 1 (stage 1 of 2; pid 101 on {here}) stopped: killed by SIGKILL ")
    assert line((0, 1), (1, 1)) == (f"rank 1 (stage 1 of 2; pid 101 on {here}) failed: ValueError: the forward got a "
                                    f"bad shape (traceback: {rank_log(logs, 1)})")
    assert line((0, -15), (1, -15)).startswith(f"rank 0 (stage 0 of 2; pid 100 on {here}) stopped: SIGTERM from ")


def _rank_pid(root: int, rank: int, limit_s: float = 30.0) -> int:
    """The pid of the process with RANK=rank among root's descendants (Linux /proc)."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        children: dict[int, list[int]] = {}
        for name in os.listdir("/proc"):
            if name.isdigit():
                try:
                    with open(f"/proc/{name}/stat") as f:
                        ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                except (OSError, IndexError, ValueError):
                    continue
                children.setdefault(ppid, []).append(int(name))
        todo, seen = [root], []
        while todo:
            pid = todo.pop()
            seen.append(pid)
            todo += children.get(pid, [])
        for pid in seen[1:]:
            try:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    env = f.read().split(b"\0")
            except OSError:
                continue
            if f"RANK={rank}".encode() in env and b"HETPLAN_PG_TIMEOUT_S=" + repr(TIMEOUT_S).encode() in env:
                return pid
        time.sleep(0.2)
    raise AssertionError(f"no process with RANK={rank} under {root}")


# --- --timeout ------------------------------------------------------------------------------------
@pytest.mark.parametrize("value", ["0", "nan", "-5", "inf", "soon"])
@pytest.mark.parametrize("command", ["train", "run", "run-after-plan"])
def test_timeout_must_be_a_finite_positive_number(command: str, value: str, capsys, tmp_path) -> None:
    plan = write_plan(tmp_path, make_plan(dp=2, micro=2))
    argv = {"train": ["train", "--plan", plan, "--timeout", value],
            "run": ["run", "--timeout", value, plan, "--", "train.py"],
            "run-after-plan": ["run", plan, "--timeout", value, "--", "train.py"]}[command]
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("hetplan: error: argument --timeout: "), captured.err
    assert repr(value) in lines[0] and captured.out == ""


def test_timeout_reaches_the_printed_commands(capsys, tmp_path) -> None:
    plan = write_plan(tmp_path, make_plan(dp=2, micro=2))
    assert main(["run", plan, "--print", "--timeout", "90", "--", "train.py"]) == 0
    assert "HETPLAN_PG_TIMEOUT_S=90.0 " in capsys.readouterr().out
