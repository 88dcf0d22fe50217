"""The clusters and model of the search-scale benchmark, so anyone can rerun it.

``mixed_cluster(n)``: ``n`` GPUs (a multiple of 8, at least 16) of four
generations — H100, A100-80GB, A100-40GB and V100 in equal shares of nodes of
8 — plus three uneven nodes of 4 (A100-40GB), 2 (V100) and 2 (H100), what a
shared cluster hands out; NVLink inside nodes, 200 Gb/s between them.
``homogeneous_cluster(n)``: ``n`` H100 in nodes of 8.
``scale_model(blocks)``: a GPT with ``blocks`` blocks, hidden 4096, 32 heads,
sequence 2048 — the model of the planner-speed issue.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from hetplan.cluster.presets import NVLINK2_V100_GBPS, NVLINK3_A100_GBPS, NVLINK4_H100_GBPS, \
    homogeneous_cluster as preset_homogeneous
from hetplan.cluster.spec import ClusterSpec, NodeSpec
from hetplan.model.presets import gpt_decoder
from hetplan.model.spec import ModelSpec

TYPES = ("H100", "A100-80GB", "A100-40GB", "V100-16GB")
INTRA_GBPS = {"H100": NVLINK4_H100_GBPS, "A100-80GB": NVLINK3_A100_GBPS, "A100-40GB": NVLINK3_A100_GBPS,
              "V100-16GB": NVLINK2_V100_GBPS}
UNEVEN = (("A100-40GB", 4), ("V100-16GB", 2), ("H100", 2))
INTER_GBPS = 200.0


def mixed_cluster(num_gpus: int) -> ClusterSpec:
    """Four GPU generations in nodes of 8 plus uneven nodes of 4, 2 and 2."""
    if num_gpus < 16 or num_gpus % 8:
        raise ValueError("the mixed cluster needs a multiple of 8 GPUs, at least 16")
    full = (num_gpus - 8) // 8
    nodes = []
    for i in range(full):
        gpu = TYPES[i * len(TYPES) // full]
        nodes.append(NodeSpec(gpu, 8, INTRA_GBPS[gpu], name=f"n{i}"))
    for k, (gpu, count) in enumerate(UNEVEN):
        nodes.append(NodeSpec(gpu, count, INTRA_GBPS[gpu], name=f"u{k}"))
    return ClusterSpec(f"mixed-{num_gpus}", tuple(nodes), INTER_GBPS,
                       description=f"{num_gpus} GPUs: H100/A100-80/A100-40/V100 nodes of 8 + nodes of 4, 2, 2")


def homogeneous_cluster(num_gpus: int) -> ClusterSpec:
    return preset_homogeneous(num_gpus, "H100")


def scale_model(blocks: int) -> ModelSpec:
    return gpt_decoder(f"gpt-{blocks}x4096", blocks, 4096, 32, 2048)
