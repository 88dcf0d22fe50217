"""``hetplan tune`` without training: which plans it tries, how a failing
trial is reported and skipped (an injected runner), the measurements file's
reader, the failure reasons, killing a hung trial, and bad inputs.
The real end-to-end run is tests/distributed/test_tune_cli.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from hetplan.cli import build_parser, main
from hetplan.cli.tune import cmd_tune
from hetplan.errors import HetplanError
from hetplan.plan.spec import Plan, uniform_stage
from hetplan.plan.file import read_plan_file
from hetplan.app.tune import (
    Measurement,
    TrialFailed,
    TrialRequest,
    failure_reason,
    parse_measurements,
    plan_kind,
    read_measurements,
    run_process_group,
    select_plans,
)


# --- (a) which plans -----------------------------------------------------------------------------
def _plan(dp: int = 1, tp: int = 1, split: tuple[int, ...] = (6,), zero: int = 0, recompute: str = "none",
          mbs: int = 4, schedule: str = "1f1b", first_device: int = 0) -> Plan:
    stages, layer, device = [], 0, first_device
    for count in split:
        devices = tuple(range(device, device + dp * tp))
        stages.append(uniform_stage(range(layer, layer + count), devices, dp, tp, mbs * dp, zero, recompute))
        layer, device = layer + count, device + dp * tp
    return Plan("tiny-gpt", "local-cpu-8", 32, mbs * dp, 32 // (mbs * dp), schedule, tuple(stages))


def _ranked(*plans: Plan) -> list[SimpleNamespace]:
    return [SimpleNamespace(plan=p) for p in plans]


def test_kind_is_the_shape_not_the_layer_split_or_gpus() -> None:
    assert plan_kind(_plan(split=(3, 3))) == plan_kind(_plan(split=(4, 2), first_device=2))
    different = [_plan(dp=2), _plan(tp=2), _plan(split=(3, 3)), _plan(zero=1), _plan(recompute="full"),
                 _plan(mbs=2), _plan(schedule="gpipe")]
    kinds = {plan_kind(p) for p in [_plan(), *different]}
    assert len(kinds) == 1 + len(different)


def test_select_takes_one_plan_per_kind_in_ranking_order() -> None:
    a, a_again, b, c = _plan(split=(3, 3)), _plan(split=(4, 2)), _plan(dp=2), _plan(zero=3, dp=2)
    ranked = _ranked(a, a_again, b, a, c)
    assert select_plans(ranked, 3) == [0, 2, 4]  # near-duplicates of #1 skipped for other kinds
    assert select_plans(ranked, 2) == [0, 2]


def test_select_fills_up_with_the_rest_when_kinds_run_out() -> None:
    a, a_again, b = _plan(split=(3, 3)), _plan(split=(4, 2)), _plan(dp=2)
    ranked = _ranked(a, a_again, b, a)
    assert select_plans(ranked, 3) == [0, 1, 2]  # two kinds, then the best remaining plan
    assert select_plans(ranked, 10) == [0, 1, 2, 3]
    assert select_plans(ranked, 1) == [0]


# --- (b) a failing trial is reported and skipped --------------------------------------------------
def _tune_args(tmp_path: Path, *extra: str) -> Any:
    return build_parser().parse_args(["tune", "--model", "tiny-gpt", "--cluster", "local-cpu-2", "--top-k", "3",
                                      "--steps", "2", "--warmup", "1", "-o", str(tmp_path / "best.json"), *extra])


class FakeRunner:
    """Trial 1 (the planner's #1) fails, trial 3 is the fastest."""

    def __init__(self, failure: BaseException | None = None) -> None:
        self.failure = failure or TrialFailed("torch.OutOfMemoryError: CUDA out of memory")
        self.requests: list[TrialRequest] = []

    def __call__(self, request: TrialRequest) -> Measurement:
        self.requests.append(request)
        assert read_plan_file(request.plan_path).plan().describe() == request.plan.describe()
        n = len(self.requests)
        if n == 1:
            raise self.failure
        times = {2: (5.0, 0.30, 0.50), 3: (5.0, 0.20, 0.20)}[n]
        return Measurement(times, 1000 * n, "cpu")


@pytest.mark.parametrize("failure", [TrialFailed("torch.OutOfMemoryError: CUDA out of memory"),
                                     RuntimeError("worker died")])
def test_failing_trial_is_reported_and_the_rest_still_run(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                          failure: BaseException) -> None:
    runner = FakeRunner(failure)
    assert cmd_tune(_tune_args(tmp_path, "--json", str(tmp_path / "table.json")), runner=runner) == 0
    assert len(runner.requests) == 3
    assert all(r.steps == 2 and r.warmup == 1 and r.num_processes == r.plan.num_devices and r.device == "cpu"
               and r.optimizer == "adamw" for r in runner.requests)
    out, err = capsys.readouterr()
    assert "trial 1/3: " in err and "trial 3/3: " in err and "left" in err
    trials = read_measurements(tmp_path / "best.measurements.json")
    assert [t.status.split(":")[0] for t in trials] == ["ok", "ok", "failed"]
    failed = trials[2]
    assert failed.measured_step_s is None and failed.measured_peak_memory_bytes is None
    assert ("CUDA out of memory" if isinstance(failure, TrialFailed) else "RuntimeError: worker died") in failed.status
    assert trials[0].measured_step_s == pytest.approx(0.20)  # the median of the steps after the warm-up
    assert trials[0].measured_step_times_s == (0.20, 0.20)
    assert trials[1].measured_step_s == pytest.approx(0.40)
    assert trials[0].measured_peak_memory_bytes == 3000
    assert failed.plan.describe() == runner.requests[0].plan.describe()  # the planner's #1
    best = read_plan_file(tmp_path / "best.json")
    assert best.plan(1).describe() == runner.requests[2].plan.describe() == trials[0].plan.describe()
    assert len(best.plans) == 2  # the plans that ran, fastest first; never the failed one
    assert "best by measurement" in out and "the planner's #1" in out and "failed" in out
    table = json.loads((tmp_path / "table.json").read_text())
    assert table["planner_best_agreed"] is False and table["trials"][0]["rank"] == 1
    assert main(["estimate", str(tmp_path / "best.json")]) == 0


def test_every_trial_failing_writes_measurements_but_no_plan(tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    def runner(request: TrialRequest) -> Measurement:
        raise TrialFailed("timed out after 1 s")

    assert cmd_tune(_tune_args(tmp_path), runner=runner) == 1
    assert "every trial failed" in capsys.readouterr().err
    assert not (tmp_path / "best.json").exists()
    assert all(not t.ok for t in read_measurements(tmp_path / "best.measurements.json"))


def test_too_few_steps_is_a_failure(tmp_path: Path) -> None:
    def runner(request: TrialRequest) -> Measurement:
        return Measurement((0.1,), None, "cpu")

    assert cmd_tune(_tune_args(tmp_path, "--measurements", str(tmp_path / "m.json")), runner=runner) == 1
    assert all("step time(s) came back" in t.status for t in read_measurements(tmp_path / "m.json"))


# --- the measurements file -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def measurements(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("m")
    cmd_tune(_tune_args(tmp), runner=FakeRunner())
    return json.loads((tmp / "best.measurements.json").read_text())


def _edit(data: dict[str, Any], change: Any) -> dict[str, Any]:
    data = json.loads(json.dumps(data))
    change(data)
    return data


BAD_MEASUREMENTS = {
    "other format": (lambda d: d.update(format="something"), "format must be"),
    "newer version": (lambda d: d.update(version=2), "newer"),
    "unknown top key": (lambda d: d.update(extra=1), "unknown key"),
    "no trials": (lambda d: d.update(trials=[]), "no trials"),
    "missing field": (lambda d: d["trials"][0].pop("device"), "missing 'device'"),
    "unknown field": (lambda d: d["trials"][0].update(note="x"), "unknown key"),
    "bad device": (lambda d: d["trials"][0].update(device="tpu"), "device must be one of"),
    "bad status": (lambda d: d["trials"][0].update(status="fine"), "status must be"),
    "ok without time": (lambda d: d["trials"][0].update(measured_step_s=None), "needs measured_step_s"),
    "failed with time": (lambda d: d["trials"][2].update(measured_step_s=1.0), "failed trial"),
    "negative time": (lambda d: d["trials"][0].update(measured_step_s=-1.0), "positive"),
    "nan time": (lambda d: d["trials"][0]["measured_step_times_s"].append(float("nan")), "finite"),
    "bool memory": (lambda d: d["trials"][0].update(measured_peak_memory_bytes=True), "whole number"),
    "two plans": (lambda d: d["trials"][0]["plan_file"]["plans"].append(d["trials"][0]["plan_file"]["plans"][0]),
                  "one plan"),
    "no model": (lambda d: d["trials"][0]["plan_file"].pop("model_spec"), "model_spec"),
    "bad plan": (lambda d: d["trials"][0]["plan_file"]["plans"][0]["plan"].update(schedule="zigzag"), "schedule"),
}


def test_measurements_round_trip(measurements: dict[str, Any]) -> None:
    trials = parse_measurements(measurements)
    assert [t.to_dict() for t in trials] == measurements["trials"]
    assert set(measurements) == {"format", "version", "trials"} and measurements["format"] == "hetplan-measurements"


@pytest.mark.parametrize("case", sorted(BAD_MEASUREMENTS))
def test_malformed_measurements_are_one_line_errors(case: str, measurements: dict[str, Any], tmp_path: Path) -> None:
    change, fragment = BAD_MEASUREMENTS[case]
    path = tmp_path / "m.json"
    path.write_text(json.dumps(_edit(measurements, change)))
    with pytest.raises(HetplanError) as info:
        read_measurements(path)
    message = str(info.value)
    assert "\n" not in message and str(path) in message and fragment in message, message


# --- failure reasons and killing a hung trial ----------------------------------------------------------
def test_failure_reason_is_the_last_error_line() -> None:
    torchrun_tail = ("[rank0]: Traceback (most recent call last):\n[rank0]:   File \"x.py\", line 1\n"
                     "[rank0]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\n"
                     "E0101 torch/distributed/elastic/multiprocessing/api.py:9] failed (exitcode: 1)\n"
                     "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:\n"
                     "============================\nx.py FAILED\n")
    assert failure_reason(torchrun_tail, 1) == "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"
    assert failure_reason("noise\nhetplan: error (rank 1): the plan uses 4 GPUs\nmore noise\n", 1) == \
        "error (rank 1): the plan uses 4 GPUs"
    assert "SIGKILL" in failure_reason("  traceback : Signal 9 (SIGKILL) received by PID 42\n", 1)
    assert failure_reason("", 3) == "exit status 3"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux /proc")
def test_timeout_kills_the_trial_and_its_detached_workers(tmp_path: Path) -> None:
    """Like torchrun: the worker runs in a session of its own, so killing the
    launcher's process group alone would leave it running."""
    pid_file = tmp_path / "worker.pid"
    code = ("import subprocess, sys, time\n"
            "w = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'], start_new_session=True)\n"
            f"open({str(pid_file)!r}, 'w').write(str(w.pid))\n"
            "time.sleep(120)\n")
    start = time.perf_counter()
    with pytest.raises(TrialFailed, match="timed out after 3 s"):
        run_process_group([sys.executable, "-c", code], None, 3.0, str(tmp_path / "err.txt"))
    assert time.perf_counter() - start < 30
    worker = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while _alive(worker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(worker)


def test_exit_status_comes_back(tmp_path: Path) -> None:
    code = run_process_group([sys.executable, "-c", "import sys; print('ValueError: bad', file=sys.stderr); "
                              "sys.exit(3)"], None, 60.0, str(tmp_path / "err.txt"))
    assert code == 3
    assert failure_reason((tmp_path / "err.txt").read_text(), code) == "ValueError: bad"


# --- bad inputs -------------------------------------------------------------------------------------------
def _one_line_error(argv: list[str], capsys: pytest.CaptureFixture[str], *fragments: str) -> None:
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse
        code = int(exc.code or 0)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("hetplan: error: "), err
    for fragment in fragments:
        assert fragment in err[0], (fragment, err[0])


@pytest.mark.parametrize("argv, fragments", [
    (["--top-k", "0"], ["--top-k", "must be positive"]),
    (["--top-k", "33"], ["--top-k", "limit of 32"]),
    (["--steps", "0"], ["--steps"]),
    (["--warmup", "-1"], ["--warmup", "0 or more"]),
    (["--trial-timeout", "nan"], ["--trial-timeout"]),
    (["--global-batch", "auto"], ["--global-batch"]),
    (["--cluster", "amp-heterogeneous"], ["4 nodes", "one node of the cluster", "local-cpu-N"]),
])
def test_bad_tune_inputs(argv: list[str], fragments: list[str], tmp_path: Path,
                         capsys: pytest.CaptureFixture[str]) -> None:
    base = ["tune", "--model", "tiny-gpt", "--cluster", "local-cpu-2", "-o", str(tmp_path / "o.json")]
    _one_line_error(base + argv, capsys, *fragments)


def test_out_is_required_and_checked(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _one_line_error(["tune", "--model", "tiny-gpt", "--cluster", "local-cpu-2"], capsys, "-o/--out")
    _one_line_error(["tune", "--model", "tiny-gpt", "--cluster", "local-cpu-2", "-o", str(tmp_path / "no" / "o.json")],
                    capsys, "no directory")
    _one_line_error(["tune", "--model", "tiny-gpt", "--cluster", "local-cpu-2", "-o", str(tmp_path / "o.json"),
                     "--measurements", str(tmp_path / "o.json")], capsys, "same file")


def test_more_gpus_than_this_machine_has(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available() and torch.cuda.device_count() >= 8:
        pytest.skip("this machine has 8 GPUs")
    _one_line_error(["tune", "--model", "tiny-gpt", "--cluster", "8xA100-80GB", "-o", str(tmp_path / "o.json")],
                    capsys, "8 GPUs", "CUDA device", "local-cpu-N")


def test_tune_is_listed_in_help() -> None:
    result = subprocess.run([sys.executable, "-m", "hetplan", "--help"], capture_output=True, text=True, timeout=60)
    assert "tune" in result.stdout


def test_trainer_peak_memory_on_cpu_is_the_rss() -> None:
    torch = pytest.importorskip("torch")
    import resource

    from hetplan.runtime.trainer import peak_memory_bytes

    peak = peak_memory_bytes(torch.device("cpu"))  # no process group: this process's own
    assert peak >= resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 * 0.99 and peak > 10 * 2**20
