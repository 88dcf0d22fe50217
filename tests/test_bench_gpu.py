"""benchmarks/bench_gpu.py off the GPU: it says there is none and exits 0, and its
table and targets work on the data recorded on one H100 (so they are not dead code)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "bench_gpu.py"
RUNS = ROOT / "benchmarks" / "data" / "h100" / "h100-runs.json"


def _bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_gpu", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_gpu"] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_without_a_gpu_it_says_so_and_exits_0(capsys: pytest.CaptureFixture[str],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # also where a GPU is
    assert _bench().main([]) == 0
    assert "no CUDA GPU on this machine: nothing measured" in capsys.readouterr().out


def test_table_and_targets_on_the_recorded_h100_runs() -> None:
    """Predictions put 5% above each recorded peak and time: the memory and time
    targets hold, and the recorded hetplan-vs-plain gaps (issue 30: +12.7% on
    gpt3-1.3b 8 x 2, +13.2% on the HF Llama) miss the 3% target."""
    bench = _bench()
    runs = json.loads(RUNS.read_text())
    measured = {r["name"]: r["measured"] for r in runs["runs"] if "median_step_s_after_2" in r.get("measured", {})}
    predicted = {n: (m["median_step_s_after_2"] * 1.05, m["peak_memory_gib"] * 2 ** 30 * 1.05)
                 for n, m in measured.items()}
    rows = bench.recorded_rows(runs, predicted)
    by_name = {r.name: r for r in rows}
    assert set(by_name) == set(measured) and {"A_g13_mb8", "D_llama1b"} <= set(by_name)
    assert bench.misses(by_name["A_g13_mb8"]) == ["hetplan +12.7% vs the plain loop (> 3%)"]
    assert bench.misses(by_name["D_llama1b"]) == ["hetplan +13.2% vs the plain loop (> 3%)"]
    assert all(not bench.misses(r) for r in rows if r.plain_s is None)
    text = bench.table(rows)
    assert text.splitlines()[0].split()[:3] == ["plan", "pred", "ms"]
    line = next(l for l in text.splitlines() if l.startswith("A_g13_mb8"))
    assert line.split()[1:6] == ["393.9", "375.1", "332.8", "44.8", "42.7"]
    off = bench.Row("x", 1.3, 1.0, 1.0 * 2 ** 30, 1.2 * 2 ** 30)
    assert bench.misses(off) == ["peak -17% off (> 10%)", "time +30% off (> 20%)"]
