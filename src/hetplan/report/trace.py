"""The predicted pipeline timeline as a Chrome trace (the Trace Event Format that
Perfetto and chrome://tracing open), so it lies beside a PyTorch profiler trace of
the real run (``torch.profiler`` exports the same format). Also the stage labels
the SVG timeline and the trace share."""

from __future__ import annotations

import json
from typing import Any, Sequence

from hetplan.plan.spec import Plan
from hetplan.plan.workload import Workload
from hetplan.simulate.events import Event

# Trace Event Format (Google, "Trace Event Format" document, used by Perfetto's JSON
# importer): timestamps and durations are in microseconds.
_US_PER_S = 1e6
_PASS_NAMES = {"F": "forward", "B": "backward"}


def stage_labels(plan: Plan, workload: Workload) -> list[str]:
    """One label per stage with every dimension it runs: its GPU type(s), dp, cp,
    tp, ep, layers, virtual stages and offloaded layers (dimensions at 1 left out)."""
    labels = []
    for stage in plan.stages:
        gpus = "+".join(sorted({workload.cluster.devices[d].gpu.name for d in stage.devices}))
        text = f"{gpus} dp{stage.dp}" + (f" cp{stage.cp}" if stage.cp > 1 else "") + f" tp{stage.tp}"
        text += (f" ep{stage.ep}" if stage.ep > 1 else "") + f" {stage.num_layers}L"
        text += f" v{plan.virtual_stages}" if plan.virtual_stages > 1 else ""
        offloaded = sum(st.offload for st in stage.strategies)
        labels.append(text + (f" offload:{offloaded}L" if offloaded else ""))
    return labels


def chrome_trace(events: Sequence[Event], labels: Sequence[str], title: str) -> dict[str, Any]:
    """Process = the plan (named ``title``), one thread per pipeline stage (named by
    ``labels``), one complete ('X') event per forward/backward of a micro-batch."""
    meta: list[dict[str, Any]] = [{"name": "process_name", "ph": "M", "pid": 0, "tid": 0,
                                   "args": {"name": f"hetplan prediction: {title}"}}]
    for stage, label in enumerate(labels):
        meta.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": stage,
                     "args": {"name": f"stage {stage}: {label}"}})
        meta.append({"name": "thread_sort_index", "ph": "M", "pid": 0, "tid": stage, "args": {"sort_index": stage}})
    passes = [{"name": f"{_PASS_NAMES[e.kind]} mb{e.micro_batch}", "cat": _PASS_NAMES[e.kind], "ph": "X",
               "ts": e.start_s * _US_PER_S, "dur": (e.end_s - e.start_s) * _US_PER_S, "pid": 0, "tid": e.stage,
               "args": {"micro_batch": e.micro_batch, "stage": e.stage}} for e in events]
    return {"traceEvents": meta + passes, "displayTimeUnit": "ms"}


def chrome_trace_json(events: Sequence[Event], labels: Sequence[str], title: str) -> str:
    """``chrome_trace`` as the JSON text ``--trace`` writes."""
    return json.dumps(chrome_trace(events, labels, title))
