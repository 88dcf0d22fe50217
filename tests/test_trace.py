"""``--trace``: the predicted timeline as a Chrome trace that Perfetto opens (Trace
Event Format: 'X' complete events with name/ph/ts/dur/pid/tid in microseconds,
'M' metadata naming the process and threads), and stage labels with every
dimension (issue 33, item 4)."""

from __future__ import annotations

import json
from pathlib import Path


from hetplan.cli import main
from hetplan.cluster.io import load_cluster
from hetplan.model.presets import get_model
from hetplan.plan.workload import Workload
from hetplan.report.trace import stage_labels
from hetplan.search.baselines.uniform import uniform_plan

REQUIRED = {"name", "ph", "ts", "dur", "pid", "tid"}  # a complete event's keys (Trace Event Format, "X")


def test_trace_of_256_micro_batches_is_valid_trace_event_json(tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    assert main(["estimate", "--model", "gpt2-amp", "--cluster", "amp-heterogeneous", "--global-batch", "512",
                 "--dp", "2", "--tp", "1", "--pp", "4", "--micro-batch", "1", "--trace", str(path)]) == 0
    trace = json.loads(path.read_text())
    events = trace["traceEvents"]
    passes = [e for e in events if e["ph"] == "X"]
    assert all(REQUIRED <= e.keys() and e["dur"] > 0 and e["ts"] >= 0 for e in passes)
    assert len(passes) == 4 * 256 * 2  # every stage's forward and backward of every micro-batch
    assert {e["tid"] for e in passes} == {0, 1, 2, 3}
    names = {(e["name"], e["tid"]) for e in events if e["ph"] == "M"}
    assert ("process_name", 0) in names and {("thread_name", t) for t in range(4)} <= names
    per_stage = sorted((e["ts"], e["ts"] + e["dur"]) for e in passes if e["tid"] == 0)
    assert all(end <= nxt + 1e-6 for (_, end), (nxt, _) in zip(per_stage, per_stage[1:]))  # a stage runs one at a time


def test_stage_labels_carry_cp_ep_virtual_stages_and_offload() -> None:
    workload = Workload(get_model("gpt2-amp"), load_cluster("amp-heterogeneous"), 32)
    plan = uniform_plan(workload, 2, 1, 2, 1, cp=2, offload=True, schedule="interleaved-1f1b", virtual_stages=2)
    labels = stage_labels(plan, workload)
    assert all(" cp2 " in label and " v2" in label and "offload:" in label for label in labels)
