"""Read and write cluster YAML files.

Format (every key is checked; an unknown key is an error, never ignored)::

    name: my-lab
    inter_node_bandwidth_gbps: 100      # default node-to-node bandwidth
    nodes:
      - gpu: V100-16GB                  # a catalog name (hetplan clusters --gpus)
        gpus: 4                         # GPUs in this node
        intra_node_bandwidth_gbps: 1200
        count: 3                        # optional: this many identical nodes
        inter_node_bandwidth_gbps: 10   # optional: this node's own network speed
        memory_gb: 16                   # optional: usable memory per GPU
      - gpu: T4
        gpus: 4
        intra_node_bandwidth_gbps: 50
    bandwidth_matrix_gbps: [[...], ...] # optional: full GPU-to-GPU matrix
"""

from __future__ import annotations

import os
from typing import Any

import yaml

from hetplan.cluster.spec import ClusterSpec, NodeSpec
from hetplan.errors import HetplanError
from hetplan.units import GIB

_TOP_KEYS = {"name", "inter_node_bandwidth_gbps", "nodes", "bandwidth_matrix_gbps", "description"}
_NODE_KEYS = {"gpu", "gpus", "intra_node_bandwidth_gbps", "count", "inter_node_bandwidth_gbps", "memory_gb", "name"}


def _number(where: str, value: Any, positive: bool = True) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise HetplanError(f"{where} must be a number, got {value!r}")
    if positive and value <= 0:
        raise HetplanError(f"{where} must be positive, got {value}")
    return float(value)


def cluster_from_dict(data: Any, source: str = "cluster") -> ClusterSpec:
    """Build a ClusterSpec from parsed YAML, checking every field."""
    if not isinstance(data, dict):
        raise HetplanError(f"{source}: expected a mapping with 'nodes', got {type(data).__name__}")
    unknown = set(data) - _TOP_KEYS
    if unknown:
        raise HetplanError(f"{source}: unknown key(s) {sorted(unknown)}; allowed: {sorted(_TOP_KEYS)}")
    nodes_data = data.get("nodes")
    if not isinstance(nodes_data, list) or not nodes_data:
        raise HetplanError(f"{source}: 'nodes' must be a non-empty list of nodes")
    nodes: list[NodeSpec] = []
    for i, nd in enumerate(nodes_data):
        where = f"{source}: nodes[{i}]"
        if not isinstance(nd, dict):
            raise HetplanError(f"{where} must be a mapping with gpu, gpus, intra_node_bandwidth_gbps")
        unknown = set(nd) - _NODE_KEYS
        if unknown:
            raise HetplanError(f"{where}: unknown key(s) {sorted(unknown)}; allowed: {sorted(_NODE_KEYS)}")
        for key in ("gpu", "gpus", "intra_node_bandwidth_gbps"):
            if key not in nd:
                raise HetplanError(f"{where}: missing '{key}'")
        gpus = _number(f"{where}.gpus", nd["gpus"])
        count = _number(f"{where}.count", nd.get("count", 1))
        if gpus != int(gpus) or count != int(count):
            raise HetplanError(f"{where}: 'gpus' and 'count' must be whole numbers")
        intra = _number(f"{where}.intra_node_bandwidth_gbps", nd["intra_node_bandwidth_gbps"])
        inter = _number(f"{where}.inter_node_bandwidth_gbps", nd["inter_node_bandwidth_gbps"]) \
            if "inter_node_bandwidth_gbps" in nd else 0.0
        memory = int(_number(f"{where}.memory_gb", nd["memory_gb"]) * GIB) if "memory_gb" in nd else 0
        for k in range(int(count)):
            label = str(nd.get("name", f"node{len(nodes)}"))
            if count > 1:
                label = f"{label}-{k}"
            nodes.append(NodeSpec(str(nd["gpu"]), int(gpus), intra, inter, memory, label))
    if len(nodes) > 1 and "inter_node_bandwidth_gbps" not in data and any(
        n.inter_bandwidth_gbps <= 0 for n in nodes
    ):
        raise HetplanError(f"{source}: several nodes but no 'inter_node_bandwidth_gbps'")
    inter = _number(f"{source}: inter_node_bandwidth_gbps", data["inter_node_bandwidth_gbps"]) \
        if "inter_node_bandwidth_gbps" in data else 0.0
    matrix = data.get("bandwidth_matrix_gbps")
    if matrix is not None:
        if not isinstance(matrix, list) or not all(isinstance(r, list) for r in matrix):
            raise HetplanError(f"{source}: bandwidth_matrix_gbps must be a list of rows")
        matrix = tuple(tuple(_number(f"{source}: bandwidth_matrix_gbps[{i}]", v, positive=False) for v in row)
                       for i, row in enumerate(matrix))
    return ClusterSpec(str(data.get("name", source)), tuple(nodes), inter, matrix,
                       description=str(data.get("description", f"from {source}")))


def load_cluster_yaml(path: str | os.PathLike[str]) -> ClusterSpec:
    """Read a cluster YAML file; any problem is one HetplanError line."""
    path = os.fspath(path)
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except OSError as exc:
        raise HetplanError(f"cannot read cluster file {path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise HetplanError(f"cluster file {path} is not valid YAML{where}: fix the syntax") from None
    name = os.path.splitext(os.path.basename(path))[0]
    if isinstance(data, dict) and "name" not in data:
        data = {**data, "name": name}
    return cluster_from_dict(data, source=path)


def cluster_to_dict(cluster: ClusterSpec) -> dict[str, Any]:
    """The YAML form of a cluster (one entry per node)."""
    nodes = []
    for node in cluster.nodes:
        entry: dict[str, Any] = {"name": node.name, "gpu": node.gpu.name, "gpus": node.num_gpus,
                                 "intra_node_bandwidth_gbps": node.intra_bandwidth_gbps}
        if node.inter_bandwidth_gbps:
            entry["inter_node_bandwidth_gbps"] = node.inter_bandwidth_gbps
        if node.memory_bytes:
            entry["memory_gb"] = node.memory_bytes / GIB
        nodes.append(entry)
    data: dict[str, Any] = {"name": cluster.name, "description": cluster.description, "nodes": nodes}
    if cluster.inter_bandwidth_gbps:
        data["inter_node_bandwidth_gbps"] = cluster.inter_bandwidth_gbps
    if cluster.bandwidth_matrix_gbps is not None:
        data["bandwidth_matrix_gbps"] = [list(r) for r in cluster.bandwidth_matrix_gbps]
    return data


def dump_cluster_yaml(cluster: ClusterSpec) -> str:
    return yaml.safe_dump(cluster_to_dict(cluster), sort_keys=False, allow_unicode=True)
