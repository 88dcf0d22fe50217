"""Calibration: fitted rates recover known ones, apply where they should, and
travel in files (``hetplan calibrate``, ``--calibration``, cluster YAML)."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest

from hetplan.app.calibrate import Observation, fit, load_observations, predict_step_s
from hetplan.cluster.io import cluster_from_dict, cluster_to_dict, load_cluster_yaml
from hetplan.cluster.presets import homogeneous_cluster
from hetplan.cost.calibration import Calibration, read_calibration
from hetplan.cost.model import CostModel
from hetplan.plan.workload import Workload
from hetplan.errors import HetplanError
from hetplan.model.presets import gpt_decoder
from hetplan.plan.file import workload_record
from hetplan.search.baselines.uniform import uniform_plan

TRUTH = Calibration({"A100-80GB": 1.3}, {"intra": 0.6, "inter": 0.45}, 3.0)
SETTINGS = ((16, 1, 1, 4, 0), (2, 8, 1, 4, 0), (1, 8, 2, 4, 0), (16, 1, 1, 4, 3), (4, 2, 2, 4, 1), (8, 2, 1, 8, 0),
            (8, 1, 1, 4, 0), (1, 8, 1, 4, 0), (1, 4, 2, 4, 0), (8, 1, 1, 4, 3), (2, 2, 2, 4, 1))  # 16 and 8 GPUs


def _workload(hidden: int, layers: int, gpus: int = 16, calibration: Calibration | None = None) -> Workload:
    model = gpt_decoder(f"gpt-{hidden}", layers, hidden, 16, 1024, vocab=32000)
    return Workload(model, homogeneous_cluster(gpus, "A100-80GB"), 64, calibration=calibration)


def _synthetic(truth: Calibration, gpus: int = 16) -> list[Observation]:
    """Step times the cost model predicts under ``truth``: what a cluster
    with those rates would measure."""
    out = []
    for hidden, layers in ((1024, 8), (2048, 16)):
        w = _workload(hidden, layers, gpus)
        for dp, tp, pp, mb, zero in SETTINGS:
            if dp * tp * pp != gpus:
                continue
            plan = uniform_plan(w, dp, tp, pp, mb, zero, "none")
            name = f"h{hidden} dp{dp} tp{tp} pp{pp} zero{zero}"
            out.append(Observation(name, w, plan, predict_step_s(Observation(name, w, plan, 1.0), truth)))
    return out


def test_fit_recovers_known_rates() -> None:
    observations = _synthetic(TRUTH)
    result = fit(observations)
    got = result.calibration
    assert all(result.identifiable)
    assert got.compute("A100-80GB") == pytest.approx(1.3, rel=0.01)
    assert got.bandwidth("intra") == pytest.approx(0.6, rel=0.01)
    assert got.bandwidth("inter") == pytest.approx(0.45, rel=0.01)
    assert got.latency_scale == pytest.approx(3.0, rel=0.03)
    before = max(abs(e) for e in result.errors(observations, after=False))
    after = max(abs(e) for e in result.errors(observations, after=True))
    assert before > 0.2 and after < 0.005


def test_rates_no_plan_depends_on_stay_at_one() -> None:
    """Plans inside one node say nothing about the network between nodes."""
    observations = _synthetic(Calibration({"A100-80GB": 0.8}, {"intra": 0.5}, 1.0), gpus=8)
    result = fit(observations)
    fitted = dict(zip((p.label for p in result.parameters), result.identifiable))
    assert fitted["inter-node bandwidth"] is False and fitted["compute A100-80GB"] is True
    assert result.calibration.bandwidth("inter") == 1.0
    assert result.calibration.compute("A100-80GB") == pytest.approx(0.8, rel=0.01)


def test_compute_factor_scales_a_one_gpu_step_exactly() -> None:
    """One GPU: the step is compute and the optimizer step, both on the GPU."""
    base = _workload(1024, 4, gpus=1)
    plan = uniform_plan(base, 1, 1, 1, 4, 0, "none")
    slow = dataclasses.replace(base, calibration=Calibration({"A100-80GB": 2.0}))
    t0 = CostModel(base).estimate(plan).iteration_time_s
    assert CostModel(slow).estimate(plan).iteration_time_s == pytest.approx(2 * t0, rel=1e-9)


def test_bandwidth_factor_slows_only_communication() -> None:
    """Half the in-node bandwidth: TP all-reduces take twice as long (their
    latency made negligible here), compute not at all."""
    base = _workload(1024, 8, calibration=Calibration({}, {}, 1e-3))
    plan = uniform_plan(base, 2, 8, 1, 4, 0, "none")
    slow = dataclasses.replace(base, calibration=Calibration({}, {"intra": 0.5}, 1e-3))
    a, b = CostModel(base).estimate(plan), CostModel(slow).estimate(plan)
    assert b.compute_s == pytest.approx(a.compute_s)
    assert b.tp_comm_s == pytest.approx(2 * a.tp_comm_s, rel=0.01)


def test_latency_factor_scales_tp_latency() -> None:
    """TP all-reduces pay one latency each: the step grows by the count of
    them times the added latency."""
    base = _workload(1024, 8)
    plan = uniform_plan(base, 2, 8, 1, 4, 0, "none")
    slower = dataclasses.replace(base, calibration=Calibration({}, {}, 2.0))
    kernel = CostModel(base).kernel
    latency = kernel.tp_link(tuple(range(8)))[1]
    count = float(kernel.tp_collective_counts("none").sum())
    assert count == 2 * (2 * 8 + 1)  # two passes: 2 per block over 8 blocks, 1 in the vocabulary-parallel embedding
    a, b = CostModel(base).estimate(plan), CostModel(slower).estimate(plan)
    assert b.tp_comm_s - a.tp_comm_s == pytest.approx(plan.num_micro_batches * count * latency, rel=1e-6)


@pytest.mark.parametrize("bad, message", [
    ({"format": "hetplan-calibration", "compute_scale": {"H100": -1}}, "must be positive"),
    ({"format": "hetplan-calibration", "compute_scale": {"H100": 1e9}}, "outside"),
    ({"format": "hetplan-calibration", "bandwidth_scale": {"nvlink": 1.0}}, "must be one of"),
    ({"format": "hetplan-calibration", "latency": 2.0}, "latency"),
    ({"format": "something-else"}, "format must be"),
    ({"format": "hetplan-calibration", "version": 7}, "not supported"),
])
def test_bad_calibration_files_are_one_clear_error(tmp_path, bad, message) -> None:
    path = tmp_path / "cal.json"
    path.write_text(json.dumps(bad))
    with pytest.raises(HetplanError, match=message):
        read_calibration(path)


def test_cluster_file_carries_its_calibration(tmp_path) -> None:
    (tmp_path / "cal.json").write_text(json.dumps(TRUTH.to_dict()))
    (tmp_path / "c.yaml").write_text("nodes:\n  - {gpu: A100-80GB, gpus: 8, intra_node_bandwidth_gbps: 2400}\n"
                                     "calibration: cal.json\n")
    cluster = load_cluster_yaml(tmp_path / "c.yaml")
    assert cluster.meta["calibration"] == TRUTH
    again = cluster_from_dict(cluster_to_dict(cluster), "copy")  # what a plan file embeds
    assert again.meta["calibration"] == TRUTH


def _plan_file(tmp_path, workload: Workload, plan, name: str) -> str:
    path = tmp_path / name
    path.write_text(json.dumps({"plans": [{"plan": plan.to_dict()}], **workload_record(workload)}))
    return str(path)


def test_calibrate_cli_from_csv_then_estimate_with_it(tmp_path) -> None:
    observations = _synthetic(TRUTH)[:6]
    rows = ["plan,measured_step_s"]
    for k, o in enumerate(observations):
        rows.append(f"{_plan_file(tmp_path, o.workload, o.plan, f'p{k}.json')},{o.measured_step_s!r}")
    (tmp_path / "m.csv").write_text("\n".join(rows) + "\n")
    assert len(load_observations([str(tmp_path / "m.csv")])) == 6
    cal = tmp_path / "cal.json"
    run = subprocess.run([sys.executable, "-m", "hetplan", "calibrate", str(tmp_path / "m.csv"), "-o", str(cal)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "median |error|" in run.stdout
    assert read_calibration(cal).compute("A100-80GB") == pytest.approx(1.3, rel=0.02)
    est = subprocess.run([sys.executable, "-m", "hetplan", "estimate", str(tmp_path / "p0.json"),
                          "--calibration", str(cal)], capture_output=True, text=True, timeout=300)
    assert est.returncode == 0, est.stderr
    assert "rates    calibrated: compute A100-80GB x1.3" in est.stdout


def test_train_summary_is_a_measurement(tmp_path) -> None:
    o = _synthetic(TRUTH)[0]
    plan_path = _plan_file(tmp_path, o.workload, o.plan, "p.json")
    summary = tmp_path / "summary.json"
    summary.write_text(json.dumps({"step_times_s": [9.0, 0.5, 0.7, 0.6], "config": {"plan_path": plan_path}}))
    (found,) = load_observations([str(summary)])
    assert found.measured_step_s == 0.6  # the median after the warm-up step
    assert found.plan == o.plan


def test_bad_measurement_inputs(tmp_path) -> None:
    (tmp_path / "x.json").write_text("{}")
    with pytest.raises(HetplanError, match="neither"):
        load_observations([str(tmp_path / "x.json")])
    (tmp_path / "m.csv").write_text("plan,time\nfoo.json,1\n")
    with pytest.raises(HetplanError, match="needs columns"):
        load_observations([str(tmp_path / "m.csv")])
    run = subprocess.run([sys.executable, "-m", "hetplan", "calibrate", str(tmp_path / "x.json"), "-o",
                          str(tmp_path / "c.json")], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and run.stderr.startswith("hetplan: error:") and run.stderr.count("\n") == 1


def test_profiled_all_reduce_sets_link_factors() -> None:
    """A profile's measured all-reduce (alpha-beta fit) is what the kernel
    charges for that group: the factors reproduce the measured fit."""
    from hetplan.cluster.io import load_cluster
    from hetplan.cost.calibration import effective_calibration, link_calibration_from_profile
    from hetplan.cost.comm import collective_latency
    from hetplan.profile import CollectiveFit, ProfileDB

    cluster = load_cluster("local-cpu-2")
    profile = ProfileDB(fits=[CollectiveFit("all_reduce", 2, "intra", 8e-4, 8.0, 8.0)])
    cal = link_calibration_from_profile(profile, cluster)
    assert cal is not None
    assert cal.latency_scale * collective_latency(cluster, (0, 1), "allreduce") == pytest.approx(8e-4)
    model = gpt_decoder("g", 2, 256, 4, 128, vocab=1024, dtype_bytes=4)
    kernel = CostModel(Workload(model, cluster, 8, calibration=cal)).kernel
    rate, latency = kernel.tp_link((0, 1))
    assert latency == pytest.approx(8e-4)
    # ring all-reduce of M bytes over 2 ranks moves M per rank: M / busbw
    assert rate == pytest.approx(1 / (8.0e9 / 8), rel=1e-6)
    given = Calibration({}, {}, 2.0)
    assert effective_calibration(profile, cluster, given).latency_scale == 2.0  # a fitted calibration wins
    assert effective_calibration(None, cluster, given) is given
    assert link_calibration_from_profile(ProfileDB(), cluster) is None


def test_profiled_all_gather_slower_than_all_reduce() -> None:
    """gloo's all-gather runs at half the all-reduce's bus bandwidth in this
    profile: the kernel's all-gather rate doubles against its all-reduce's."""
    from hetplan.cluster.io import load_cluster
    from hetplan.cost.calibration import link_calibration_from_profile
    from hetplan.profile import CollectiveFit, ProfileDB

    cluster = load_cluster("local-cpu-2")
    fits = [CollectiveFit("all_reduce", 2, "intra", 8e-4, 8.0, 8.0),
            CollectiveFit("all_gather", 2, "intra", 4e-4, 8.0, 4.0)]
    cal = link_calibration_from_profile(ProfileDB(fits=fits), cluster)
    assert cal is not None and cal.op_bandwidth("allgather") == 0.5 and cal.op_latency("allgather") == 0.5
    model = gpt_decoder("g", 2, 256, 4, 128, vocab=1024, dtype_bytes=4)
    plain = CostModel(Workload(model, cluster, 8)).kernel
    kernel = CostModel(Workload(model, cluster, 8, calibration=cal)).kernel
    ratio = kernel.collective_rate("allgather", (0, 1)) / kernel.collective_rate("allreduce", (0, 1))
    assert ratio == pytest.approx(2 * plain.collective_rate("allgather", (0, 1))
                                  / plain.collective_rate("allreduce", (0, 1)))
    assert read_back(cal) == cal


def read_back(cal: Calibration) -> Calibration:
    from hetplan.cost.calibration import calibration_from_dict

    return calibration_from_dict(json.loads(json.dumps(cal.to_dict())))


def test_profiled_tp_layers_keep_their_measured_collectives() -> None:
    """A layer profiled at tp 2 with its TP collectives inside (hetplan profile)
    is costed at its measured time whole, with no TP estimate added; an entry
    without them (an old profile) gets the kernel's TP communication on top."""
    from hetplan.cluster.io import load_cluster
    from hetplan.profile import ProfileDB, ProfileEntry

    model = gpt_decoder("g", 2, 256, 4, 128, vocab=1024, dtype_bytes=4)
    cluster = load_cluster("local-cpu-2")
    keys = sorted({layer.profile_key for layer in model.layers})

    def estimate(comm_inside: float):
        entries = [ProfileEntry(k, "CPU", 2, 4, 0.010, 0.020, tp_comm_fwd_s=comm_inside, tp_comm_bwd_s=comm_inside)
                   for k in keys]
        workload = Workload(model, cluster, 8, profile=ProfileDB(entries))
        plan = uniform_plan(workload, 1, 2, 1, 4)
        return CostModel(workload).estimate(plan), plan

    inside, plan = estimate(0.004)
    assert inside.tp_comm_s == 0.0
    assert inside.compute_s == pytest.approx(plan.num_micro_batches * len(model.layers) * 0.030)
    old, _ = estimate(0.0)
    assert old.tp_comm_s > 0 and old.compute_s == pytest.approx(inside.compute_s)
