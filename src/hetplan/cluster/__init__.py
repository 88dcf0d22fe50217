"""Clusters: GPU catalog, ClusterSpec, presets and YAML files."""

import os

from hetplan.cluster.catalog import GPU_CATALOG, GPUSpec, get_gpu, power_capped
from hetplan.cluster.io import cluster_from_dict, cluster_to_dict, dump_cluster_yaml, load_cluster_yaml
from hetplan.cluster.presets import cluster_descriptions, cluster_names, get_cluster
from hetplan.cluster.spec import ClusterSpec, Device, NodeSpec


def load_cluster(name_or_path: str) -> ClusterSpec:
    """A preset name, a generic ``NxGPU`` name, or a path to a YAML file."""
    if name_or_path.endswith((".yaml", ".yml")) or os.path.sep in name_or_path:
        return load_cluster_yaml(name_or_path)
    return get_cluster(name_or_path)


__all__ = [
    "GPU_CATALOG", "GPUSpec", "get_gpu", "power_capped", "ClusterSpec", "NodeSpec", "Device",
    "load_cluster", "load_cluster_yaml", "cluster_from_dict", "cluster_to_dict", "dump_cluster_yaml",
    "get_cluster", "cluster_names", "cluster_descriptions",
]
