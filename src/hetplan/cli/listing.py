"""The listing commands: ``models``, ``clusters`` and ``planners`` (presets,
GPU types and planners, as tables and ``--json``)."""

from __future__ import annotations

import argparse
from typing import Any

from hetplan.app.records import write_json
from hetplan.cluster.catalog import GPU_CATALOG
from hetplan.cluster.presets import cluster_descriptions, get_cluster
from hetplan.model.presets import get_model, model_descriptions
from hetplan.report.text import table
from hetplan.search import planner_descriptions
from hetplan.units import format_bytes, format_count


def register(sub: Any) -> None:
    """Add ``models``, ``clusters`` and ``planners`` to the hetplan CLI."""
    for name, help_text, func in (("models", "list model presets", cmd_models),
                                  ("clusters", "list cluster presets and GPU types", cmd_clusters),
                                  ("planners", "list planners", cmd_planners)):
        p = sub.add_parser(name, help=help_text)
        p.add_argument("--json", dest="json_path", default=None)
        p.set_defaults(func=func)


def cmd_models(args: argparse.Namespace) -> int:
    rows, data = [], []
    for name, desc in model_descriptions().items():
        m = get_model(name)
        rows.append([name, format_count(m.total_params), m.num_layers, m.seq_len, desc])
        data.append({"name": name, "params": m.total_params, "layers": m.num_layers, "seq_len": m.seq_len,
                     "description": desc})
    print(table(["model", "params", "layers", "seq", "description"], rows, [False, True, True, True, False]))
    write_json(args.json_path, data)
    return 0


def cmd_clusters(args: argparse.Namespace) -> int:
    rows, data = [], []
    for name, desc in cluster_descriptions().items():
        gpus = get_cluster(name).num_devices if "<" not in name else "-"
        rows.append([name, gpus, desc])
        data.append({"name": name, "gpus": gpus, "description": desc})
    print(table(["cluster", "GPUs", "description"], rows, [False, True, False]))
    print()
    gpu_rows = [[g.name, format_bytes(g.memory_bytes), f"{g.peak_flops / 1e12:g}", f"{g.peak_flops_fp32 / 1e12:g}",
                 f"{g.memory_bandwidth_bytes_per_s / 1e9:g}"] for g in GPU_CATALOG.values()]
    print(table(["GPU", "memory", "TFLOP/s 16-bit", "TFLOP/s fp32", "GB/s"], gpu_rows))
    write_json(args.json_path, {"clusters": data, "gpus": [
        {"name": g.name, "memory_bytes": g.memory_bytes, "peak_flops": g.peak_flops,
         "peak_flops_fp32": g.peak_flops_fp32, "memory_bandwidth_bytes_per_s": g.memory_bandwidth_bytes_per_s,
         "source": g.source} for g in GPU_CATALOG.values()]})
    return 0


def cmd_planners(args: argparse.Namespace) -> int:
    described = planner_descriptions()
    print(table(["planner", "what it does"], list(described.items()), [False, False]))
    write_json(args.json_path, {"planners": [{"name": n, "description": d} for n, d in described.items()]})
    return 0
