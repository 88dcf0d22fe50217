"""Metis's profiling scheme (§4.3) as a ProfileDB the cost model uses."""

from __future__ import annotations

import json

import pytest

from hetplan.cluster.io import load_cluster
from hetplan.cost.model import CostModel
from hetplan.plan.workload import Workload
from hetplan.errors import HetplanError
from hetplan.model.presets import get_model, gpt_decoder
from hetplan.profile.db import ProfileDB, ProfileEntry
from hetplan.profile.metis import (
    EXAMPLE_PATH,
    MetisMemoryProfile,
    MetisProfileDB,
    compose_batch,
    load_example,
    metis_profile_runs,
    missing_entries,
    oracle_profile_runs,
)
from hetplan.cost.synthetic_profile import synthesize


def test_non_profiled_mbs_is_composed_from_profiled_ones() -> None:
    """mbs 7 = mbs 4 + mbs 2 + mbs 1."""
    assert compose_batch(7, [1, 2, 4, 8, 16]) == [(4, 1.0), (2, 1.0), (1, 1.0)]
    assert compose_batch(40, [1, 2, 4, 8, 16]) == [(16, 2.0), (8, 1.0)]
    db = MetisProfileDB([ProfileEntry("blk", "T4", 1, b, 0.01 * b ** 0.9, 0.02 * b ** 0.9) for b in (1, 2, 4)])
    fwd, bwd = db.lookup("blk", "T4", 1, 7)
    parts = [db.lookup("blk", "T4", 1, b) for b in (1, 2, 4)]
    assert fwd == pytest.approx(sum(p[0] for p in parts))
    assert bwd == pytest.approx(sum(p[1] for p in parts))
    assert db.lookup("blk", "T4", 1, 4) == pytest.approx((0.01 * 4 ** 0.9, 0.02 * 4 ** 0.9))
    # a fraction of the smallest profiled size counts linearly
    assert db.lookup("blk", "T4", 1, 0.5)[0] == pytest.approx(0.005)


def test_missing_entry_is_none_not_a_crash() -> None:
    db = MetisProfileDB([ProfileEntry("blk", "T4", 1, 1, 0.01, 0.02)])
    assert db.lookup("blk", "V100-16GB", 1, 4) is None
    assert db.lookup("other", "T4", 1, 4) is None
    assert db.lookup("blk", "T4", 2, 4) is None


def test_repeated_layers_are_profiled_once() -> None:
    model = gpt_decoder("tiny", num_layers=6, hidden=256, heads=4, seq=64, vocab=1000)
    db = synthesize(model, ["T4", "V100"], tps=(1, 2), mbs=(1, 2, 4), k=2)
    keys = {e.layer for e in db.entries()}
    assert len(keys) == len({layer.profile_key for layer in model.layers}) == 3
    assert len(db) == 3 * 2 * 2 * 3
    assert not missing_entries(db, model, ["T4", "V100-16GB"], (1, 2))
    assert missing_entries(db, model, ["P100"], (1,))


def test_memory_of_layer_compositions_follows_the_paper_formula() -> None:
    """Mem(L(m)) = Σ_{n=m-k}^{m-1} (Mem(L(n,m)) − Mem(L(n,m−1))) / k and
    Mem(L(i,j)) = Mem(L(i,j−1)) + Mem(L(j)) beyond the measured windows."""
    # per-layer footprint f(m) = 10 + m, with 1 byte reused between neighbours
    k, n = 2, 6
    table = {}
    for i in range(n):
        for j in range(i, min(n - 1, i + k) + 1):
            table[(i, j)] = sum(10 + m for m in range(i, j + 1)) - (j - i)
    mem = MetisMemoryProfile("V100-16GB", k, n, {(1, 1): table})
    # measured windows are returned as measured
    assert mem.composition(1, 3, 1, 1) == table[(1, 3)]
    # the marginal of layer m is its footprint minus the reused byte
    assert mem.marginal(1, 1, 4) == pytest.approx(10 + 4 - 1)
    # a long range: last measured window plus marginals
    expected = table[(0, 2)] + sum(10 + m - 1 for m in range(3, 6))
    assert mem.composition(0, 5, 1, 1) == pytest.approx(expected)
    # non-additive: less than the sum of single layers
    assert mem.composition(0, 5, 1, 1) < sum(table[(m, m)] for m in range(6))


def test_memory_interpolates_in_the_micro_batch() -> None:
    model = gpt_decoder("tiny", num_layers=4, hidden=256, heads=4, seq=64, vocab=1000)
    db = synthesize(model, ["T4"], tps=(1,), mbs=(1, 2, 4), k=1, noise=0.0)
    m1 = db.stage_memory(0, 3, 1, 1, 1.0)
    m2 = db.stage_memory(0, 3, 1, 2, 1.0)
    m3 = db.stage_memory(0, 3, 1, 3, 1.0)
    assert m1 < m2 < m3
    assert m3 - m2 == pytest.approx(m2 - m1, rel=1e-6)
    # micro-batches in flight add the per-sample slope
    assert db.stage_memory(0, 3, 1, 2, 3.0) == pytest.approx(m2 + 2 * 2 * (m2 - m1))
    assert db.stage_memory(0, 3, 8, 2, 1.0) is None  # tp 8 not profiled


def test_round_trip_and_plain_profiledb_compatibility(tmp_path) -> None:
    model = gpt_decoder("tiny", num_layers=3, hidden=128, heads=4, seq=32, vocab=500)
    db = synthesize(model, ["T4", "P100"], tps=(1, 2), mbs=(1, 2), k=1)
    path = tmp_path / "p.json"
    path.write_text(db.to_json())
    back = MetisProfileDB.load(path)
    assert back.entries() == db.entries()
    assert back.memory_profile is not None and db.memory_profile is not None
    assert back.memory_profile.windows.keys() == db.memory_profile.windows.keys()
    for key, table in db.memory_profile.windows.items():
        assert back.memory_profile.windows[key] == pytest.approx(table, abs=1.0)
    plain = ProfileDB.load(path)  # the core loader reads the same file (without the memory part)
    assert len(plain) == len(db)


def test_malformed_profile_is_a_clear_error(tmp_path) -> None:
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"format": "hetplan-metis-profile", "entries": [{"layer": "x"}]}))
    with pytest.raises(HetplanError, match="malformed"):
        MetisProfileDB.load(path)
    path.write_text("{not json")
    with pytest.raises(HetplanError, match="not valid JSON"):
        MetisProfileDB.load(path)


def test_shipped_example_covers_gpt3_13b_on_the_three_gpu_types() -> None:
    db = load_example()
    model = get_model("gpt3-1.3b")
    assert EXAMPLE_PATH.endswith(".json")
    assert not missing_entries(db, model, ["P100", "T4", "V100-16GB"], (1, 2, 4, 8))
    assert db.has_memory and db.memory_profile is not None and db.memory_profile.gpu == "V100-16GB"
    # the cost model uses it: layer times come from the profile, not the FLOP model
    workload = Workload(model, load_cluster("metis-t4-v100-8"), 32, profile=db)
    cm = CostModel(workload)
    t4 = load_cluster("metis-t4-v100-8").devices[0].gpu
    measured = db.lookup(model.layers[1].profile_key, t4.name, 1, 4)
    fwd, bwd, _ = cm.kernel.layer_time(1, t4, 4, 1)
    assert (fwd, bwd) == pytest.approx(measured)


def test_profiling_cost_metis_vs_oracle() -> None:
    """Table 4's profiling columns: Metis profiles far fewer runs than the Oracle."""
    model = get_model("gpt3-6.7b")
    metis = metis_profile_runs(model, num_gpu_types=2)
    oracle = oracle_profile_runs(model, num_gpu_types=2)
    assert metis < oracle / 10
