"""Read and write cluster YAML files.

Format (every key is checked; an unknown key is an error, never ignored)::

    name: my-lab
    inter_node_bandwidth_gbps: 100      # default node-to-node bandwidth
    gpu_types:                          # optional: GPUs the catalog lacks or tunes
      H100-PCIe-capped:
        base: H100                      # optional: start from a catalog (or file) type
        peak_tflops: 756                # dense 16-bit tensor TFLOP/s
        peak_tflops_fp32: 51
        memory_gb: 80                   # GiB, as cards are sold
        memory_bandwidth_gbps: 2000     # GB/s (gigaBYTES, as datasheets quote memory)
        tdp_w: 350
        power_cap_w: 300                # optional: scales the compute peaks
    nodes:
      - gpu: V100-16GB                  # a catalog name (hetplan clusters) or a gpu_types name
        gpus: 4                         # GPUs in this node
        intra_node_bandwidth_gbps: 1200
        count: 3                        # optional: this many identical nodes
        inter_node_bandwidth_gbps: 10   # optional: this node's own network speed
        memory_gb: 16                   # optional: usable memory per GPU
        overrides: {memory_bandwidth_gbps: 800}   # optional: any GPU number, this node only
        price_per_gpu_hour: 2.1         # optional: what one GPU of this node costs per hour
        host_memory_gb: 2048            # optional: the node's host RAM (GiB) for offloaded activations
        zone: us-east-1a                # optional: its zone (every node gets one, or none does)
      - gpu: T4
        gpus: 4
        intra_node_bandwidth_gbps: 50
    bandwidth_matrix_gbps: [[...], ...] # optional: full GPU-to-GPU matrix
    inter_zone_bandwidth_gbps: 8.7      # between nodes of two zones (needed with 2+ zones)

Link bandwidths (``*_node_bandwidth_gbps``) are gigaBITS per second, as links
are sold; ``memory_bandwidth_gbps`` is gigaBYTES per second, as GPU datasheets
quote memory (and ``shared/calibration/hardware_specs.json`` records it).
A written cluster (``dump_cluster_yaml``) lists every GPU type that is not a
catalog entry in full under ``gpu_types``, so it reads back equal and never
falls back to a catalog entry of the same name.
"""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Any, Callable, Mapping

import yaml

from hetplan.io import fields
from hetplan.io.argtypes import MAX_PRICE_PER_GPU_HOUR
from hetplan.limits import (MAX_GPU_MEMORY_GIB, MAX_GPUS, MAX_GPUS_PER_NODE, MAX_HOST_MEMORY_GIB, MAX_NODES,
                            MIN_GPU_MEMORY_GIB, check_at_most)
from hetplan.cluster.catalog import (
    GPU_CATALOG, TERA, GPUSpec, find_catalog_gpu, get_gpu, in_si, in_units, is_catalog_gpu, normalise_gpu_name,
    power_capped,
)
from hetplan.cluster.spec import ClusterSpec, NodeSpec
from hetplan.errors import HetplanError, did_you_mean
from hetplan.units import GIB
from hetplan.io.userfiles import read_yaml
from hetplan.cost.calibration import calibration_from_dict, read_calibration
from hetplan.cluster.presets import get_cluster

_TOP_KEYS = {"name", "inter_node_bandwidth_gbps", "nodes", "bandwidth_matrix_gbps", "description", "gpu_types",
             "calibration", "inter_zone_bandwidth_gbps"}
_NODE_KEYS = {"gpu", "gpus", "intra_node_bandwidth_gbps", "count", "inter_node_bandwidth_gbps", "memory_gb", "name",
              "overrides", "price_per_gpu_hour", "host_memory_gb", "zone"}
GB_PER_S = 1e9  # memory bandwidth is quoted in decimal GB/s on datasheets

# A GPU's numbers as a file writes them: key -> (GPUSpec attribute, SI units per file unit).
GPU_NUMBER_KEYS: dict[str, tuple[str, float]] = {
    "peak_tflops": ("peak_flops", TERA),
    "peak_tflops_fp32": ("peak_flops_fp32", TERA),
    "peak_tflops_tf32": ("peak_flops_tf32", TERA),
    "peak_tflops_fp8": ("peak_flops_fp8", TERA),
    "memory_gb": ("memory_bytes", GIB),
    "memory_bandwidth_gbps": ("memory_bandwidth_bytes_per_s", GB_PER_S),
    "matmul_efficiency": ("matmul_efficiency", 1.0),
    "tdp_w": ("tdp_w", 1.0),
}
REQUIRED_WITHOUT_BASE = ("peak_tflops", "memory_gb", "memory_bandwidth_gbps")
OVERRIDE_KEYS = frozenset(GPU_NUMBER_KEYS) | {"power_cap_w"}
GPU_TYPE_KEYS = OVERRIDE_KEYS | {"base", "source"}


def _number(where: str, value: Any, positive: bool = True, zero_ok: bool = False) -> float:
    """A finite number; positive unless told otherwise (``zero_ok``: >= 0)."""
    return fields.number(where, value, 0.0 if positive else None, strict=not zero_ok)


def _text(where: str, value: Any) -> str:
    """A name or description: plain text (a number is taken as its text), never a list or mapping."""
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise HetplanError(f"{where} must be text, got {type(value).__name__}")
    text = str(value).strip()
    if not text or len(text) > 1000 or not text.isprintable():
        raise HetplanError(f"{where} must be one line of 1 to 1000 printable characters")
    return text


def _mapping(where: str, value: Any, what: str) -> dict[Any, Any]:
    if not isinstance(value, dict):
        raise HetplanError(f"{where} must be a mapping of {what}, got {type(value).__name__}")
    return value


def _check_keys(where: str, entry: Mapping[Any, Any], allowed: frozenset[str] | set[str]) -> None:
    fields.mapping(where, entry, allowed)


# --- GPU types ---------------------------------------------------------------------
def _gpu_numbers(where: str, entry: Mapping[str, Any]) -> dict[str, float | int]:
    """GPUSpec attributes (SI units) for the GPU numbers ``entry`` gives."""
    changes: dict[str, float | int] = {}
    for key, (attr, scale) in GPU_NUMBER_KEYS.items():
        if key not in entry:
            continue
        if key == "memory_gb":
            changes[attr] = _gpu_memory_bytes(f"{where}.{key}", entry[key])
            continue
        value = _number(f"{where}.{key}", entry[key], zero_ok=key not in REQUIRED_WITHOUT_BASE)
        if key == "matmul_efficiency" and value > 1:
            raise HetplanError(f"{where}.matmul_efficiency is a fraction of peak_tflops, at most 1, got {value}")
        si = in_si(value, scale)
        changes[attr] = int(si) if attr == "memory_bytes" else si
    if "power_cap_w" in entry:  # applied last (_with_cap), checked here with the other numbers
        _number(f"{where}.power_cap_w", entry["power_cap_w"])
    return changes


# A type made from another with a new 16-bit peak is the same chip with other SMs
# or clocks, so its other compute peaks scale alike unless given: H100 PCIe over
# SXM is 756/989 = 0.764 (bf16), 1513/1979 = 0.765 (fp8), 378/494.5 = 0.764 (TF32),
# 51/67 = 0.761 (fp32) (NVIDIA H100 datasheet via shared/calibration/hardware_specs.json).
_SCALE_WITH_PEAK = ("peak_flops_fp32", "peak_flops_fp8", "peak_flops_tf32")


def _derived(base: GPUSpec, name: str, source: str, changes: Mapping[str, float | int]) -> GPUSpec:
    """``base`` with ``changes``; a changed 16-bit peak carries the others along."""
    scaled: dict[str, Any] = dict(changes)
    if "peak_flops" in changes:
        ratio = in_units(float(changes["peak_flops"]), TERA) / in_units(base.peak_flops, TERA)
        for attr in _SCALE_WITH_PEAK:
            if attr not in changes:
                scaled[attr] = in_si(in_units(getattr(base, attr), TERA) * ratio, TERA)
    return replace(base, name=name, source=source, derived_from=base.catalog_name, **scaled)


def _described(entry: Mapping[str, Any]) -> str:
    """'peak_tflops=600, tdp_w=350': what an entry changes, for names and sources."""
    return ", ".join(f"{k}={entry[k]:g}" for k in sorted(entry) if k in OVERRIDE_KEYS)


def _with_cap(where: str, spec: GPUSpec, entry: Mapping[str, Any]) -> GPUSpec:
    if "power_cap_w" not in entry:
        return spec
    cap = _number(f"{where}.power_cap_w", entry["power_cap_w"])
    try:
        return power_capped(spec, cap)
    except HetplanError as exc:
        raise HetplanError(f"{where}: {exc}") from None


def _build_gpu_type(name: str, entry: dict[str, Any], where: str,
                    resolve: Callable[[str], GPUSpec]) -> GPUSpec:
    """One ``gpu_types`` entry: its base (if any) with the given numbers, then the cap."""
    _check_keys(where, entry, GPU_TYPE_KEYS)
    changes = _gpu_numbers(where, entry)
    source = entry.get("source")
    if source is not None and not isinstance(source, str):
        raise HetplanError(f"{where}.source must be text, got {source!r}")
    if "base" in entry:
        base = resolve(str(entry["base"]))
        source = source or f"{base.name} with {_described(entry) or 'no changes'} ({where}); base: {base.source}"
        spec = _derived(base, name, source, changes)
    else:
        missing = [k for k in REQUIRED_WITHOUT_BASE if k not in entry]
        if missing:
            raise HetplanError(f"{where}: missing {', '.join(repr(k) for k in missing)} (needed without 'base'; "
                               "or give 'base: <catalog GPU>' to start from one)")
        fields: dict[str, Any] = {"peak_flops_fp32": 0.0, **changes}
        spec = GPUSpec(name=name, source=source or f"numbers given in {where}", **fields)
    return _with_cap(where, spec, entry)


def gpu_types_from_dict(data: Any, source: str = "cluster") -> dict[str, GPUSpec]:
    """The ``gpu_types`` mapping of a cluster file: name -> GPUSpec. A type may
    start from a catalog GPU or from another type of the file (``base``)."""
    raw = _mapping(f"{source}: gpu_types", data, "GPU type names to their numbers")
    entries: dict[str, tuple[str, dict[str, Any]]] = {}
    for key, entry in raw.items():
        name = str(key).strip()
        where = f"{source}: gpu_types.{name}"
        if not name:
            raise HetplanError(f"{source}: gpu_types has an empty name")
        shadowed = find_catalog_gpu(name)
        if shadowed is not None:
            raise HetplanError(f"{where} has the name of the catalog's {shadowed.name}: give it its own name "
                               f"(e.g. {name}-custom) and 'base: {name}' to start from the catalog entry")
        if normalise_gpu_name(name) in entries:
            raise HetplanError(f"{where}: defined twice (names ignore case, spaces and underscores)")
        entries[normalise_gpu_name(name)] = (name, _mapping(where, entry, "GPU numbers"))
    built: dict[str, GPUSpec] = {}

    def resolve(name: str, chain: tuple[str, ...]) -> GPUSpec:
        """Build ``name`` (a file type), building the types it starts from first."""
        if name in built:
            return built[name]
        if name in chain:
            raise HetplanError(f"{source}: gpu_types.{chain[0]}: 'base' goes round in a circle: "
                               f"{' -> '.join([*chain, name])}")
        where = f"{source}: gpu_types.{name}"

        def base_of(wanted: str) -> GPUSpec:
            if normalise_gpu_name(wanted) in entries:
                return resolve(entries[normalise_gpu_name(wanted)][0], (*chain, name))
            found = find_catalog_gpu(wanted)
            if found is None:
                known = [*GPU_CATALOG, *(n for n, _ in entries.values())]
                raise HetplanError(f"{where}.base: unknown GPU type {wanted!r}{did_you_mean(wanted, known)}; known types: {', '.join(known)}")
            return found

        built[name] = _build_gpu_type(name, entries[normalise_gpu_name(name)][1], where, base_of)
        return built[name]

    return {name: resolve(name, ()) for name, _ in entries.values()}


def _node_gpu(where: str, nd: Mapping[str, Any], custom: Mapping[str, GPUSpec]) -> GPUSpec:
    """A node's GPU: a file-defined or catalog type, with its per-node overrides."""
    try:
        spec = get_gpu(_text(f"{where}.gpu", nd["gpu"]), custom)
    except HetplanError as exc:
        raise HetplanError(f"{where}.gpu: {exc}") from None
    if "overrides" not in nd:
        return spec
    overrides = _mapping(f"{where}.overrides", nd["overrides"], "GPU numbers")
    _check_keys(f"{where}.overrides", overrides, OVERRIDE_KEYS)
    if not overrides:
        return spec
    if "memory_gb" in overrides and "memory_gb" in nd:
        raise HetplanError(f"{where}: memory_gb given both on the node and in its overrides; give it once")
    changes = _gpu_numbers(f"{where}.overrides", overrides)
    described = _described(overrides)
    name = f"{spec.name}[{described.replace(', ', ',')}]"
    # the source names the file, not the node, so equal overrides on two nodes are one GPU type
    spec = _derived(spec, name, f"{spec.source}; overridden in a cluster file: {described}", changes)
    return _with_cap(f"{where}.overrides", spec, overrides)


# --- clusters ----------------------------------------------------------------------
def cluster_from_dict(data: Any, source: str = "cluster") -> ClusterSpec:
    """Build a ClusterSpec from parsed YAML, checking every field."""
    if not isinstance(data, dict):
        raise HetplanError(f"{source}: expected a mapping with 'nodes', got {type(data).__name__}")
    _check_keys(source, data, _TOP_KEYS)
    custom = gpu_types_from_dict(data["gpu_types"], source) if data.get("gpu_types") is not None else {}
    nodes_data = data.get("nodes")
    if not isinstance(nodes_data, list) or not nodes_data:
        raise HetplanError(f"{source}: 'nodes' must be a non-empty list of nodes")
    _check_cluster_size(source, nodes_data)
    nodes: list[NodeSpec] = []
    for i, nd in enumerate(nodes_data):
        nodes += _nodes(f"{source}: nodes[{i}]", nd, custom, len(nodes))
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
    meta = {"calibration": _calibration(source, data["calibration"])} if data.get("calibration") is not None else {}
    inter_zone = _number(f"{source}: inter_zone_bandwidth_gbps", data["inter_zone_bandwidth_gbps"]) \
        if "inter_zone_bandwidth_gbps" in data else 0.0
    cluster = ClusterSpec(_text(f"{source}: name", data.get("name", source)), tuple(nodes), inter, matrix,
                          description=_text(f"{source}: description", data.get("description", f"from {source}")),
                          meta=meta, inter_zone_bandwidth_gbps=inter_zone)
    _check_name_is_not_a_preset(cluster, source)
    return cluster


def _calibration(source: str, value: Any) -> Any:
    """A cluster's ``calibration:``: the path of a ``hetplan calibrate`` file
    (relative to the cluster file) or the calibration itself, inline."""
    if isinstance(value, str):
        base = os.path.dirname(source) if os.path.exists(source) else ""
        return read_calibration(os.path.join(base, value))
    return calibration_from_dict(value, f"{source}: calibration")


def _check_cluster_size(source: str, nodes_data: list[Any]) -> None:
    """Count GPUs and nodes from the entries, before any node is built."""
    gpus = nodes = 0
    for i, nd in enumerate(nodes_data):
        if not isinstance(nd, dict):
            continue  # _nodes says what is wrong with it
        where = f"{source}: nodes[{i}]"
        per_node = _number(f"{where}.gpus", nd.get("gpus", 1))
        count = _number(f"{where}.count", nd.get("count", 1))
        check_at_most(f"{where}.gpus", per_node, MAX_GPUS_PER_NODE, "give one entry per node (count: N for many)")
        check_at_most(f"{where}.count", count, MAX_NODES, "is the number right?")
        nodes += int(count)
        gpus += int(count) * int(per_node)
    check_at_most(f"{source}: nodes (count included)", nodes, MAX_NODES, "is the cluster right?")
    check_at_most(f"{source}: GPUs in the cluster", gpus, MAX_GPUS, "is the cluster right?")


def _nodes(where: str, nd: Any, custom: Mapping[str, GPUSpec], first_index: int) -> list[NodeSpec]:
    """One ``nodes`` entry: ``count`` identical nodes."""
    if not isinstance(nd, dict):
        raise HetplanError(f"{where} must be a mapping with gpu, gpus, intra_node_bandwidth_gbps")
    _check_keys(where, nd, _NODE_KEYS)
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
    memory = _gpu_memory_bytes(f"{where}.memory_gb", nd["memory_gb"]) if "memory_gb" in nd else 0
    price = _price(f"{where}.price_per_gpu_hour", nd["price_per_gpu_hour"]) if "price_per_gpu_hour" in nd else 0.0
    host = _host_memory_bytes(where, nd["host_memory_gb"]) if "host_memory_gb" in nd else 0
    zone = _text(f"{where}.zone", nd["zone"]) if "zone" in nd else ""
    gpu = _node_gpu(where, nd, custom)
    nodes = []
    for k in range(int(count)):
        label = _text(f"{where}.name", nd.get("name", f"node{first_index + k}"))
        if count > 1:
            label = f"{label}-{k}"
        nodes.append(NodeSpec(gpu, int(gpus), intra, inter, memory, label, price_per_gpu_hour=price,
                              host_memory_bytes=host, zone=zone))
    return nodes


def _price(where: str, value: Any) -> float:
    """A node's price per GPU-hour: > 0 and at most MAX_PRICE_PER_GPU_HOUR, the
    rule of --price-per-gpu-hour (hetplan.io.argtypes.gpu_prices)."""
    price = _number(where, value)
    check_at_most(where, price, int(MAX_PRICE_PER_GPU_HOUR), "give the price of one GPU-hour in dollars")
    return price


def _gpu_memory_bytes(where: str, value: Any) -> int:
    """A GPU's ``memory_gb`` in bytes: at least MIN_GPU_MEMORY_GIB (a smaller value
    would round to 0 bytes, which means "no override"), at most MAX_GPU_MEMORY_GIB
    (far from the planners' int64 overflow)."""
    gib = _number(where, value)
    if gib < MIN_GPU_MEMORY_GIB:
        raise HetplanError(f"{where} = {gib:g} GiB is below hetplan's floor of 1 MiB ({MIN_GPU_MEMORY_GIB:g} GiB); "
                           "give the GPU's memory in GiB")
    check_at_most(where, gib, MAX_GPU_MEMORY_GIB, "give the GPU's memory in GiB")
    return int(gib * GIB)


def _host_memory_bytes(where: str, value: Any) -> int:
    """A node's ``host_memory_gb`` (GiB of host RAM, shared by its GPUs' offloaded activations) in bytes."""
    gib = _number(f"{where}.host_memory_gb", value)
    check_at_most(f"{where}.host_memory_gb", gib, MAX_HOST_MEMORY_GIB, "give the node's host RAM in GiB")
    return int(gib * GIB)


def _check_name_is_not_a_preset(cluster: ClusterSpec, source: str) -> None:
    """Plans record only the cluster's name; if a file with its own GPU types is
    named like a preset, costing its plans again would silently use the preset."""
    if all(is_catalog_gpu(g) for g in cluster.gpu_specs):
        return

    try:
        get_cluster(cluster.name)
    except HetplanError:
        return
    raise HetplanError(f"{source}: the cluster is named {cluster.name!r} like a preset, but defines its own GPU "
                       "types; plans store only the name, so set 'name:' to one of its own")


def load_cluster_yaml(path: str | os.PathLike[str]) -> ClusterSpec:
    """Read a cluster YAML file; any problem is one HetplanError line."""
    path = os.fspath(path)
    data = read_yaml(path, "cluster file")
    name = os.path.splitext(os.path.basename(path))[0]
    if isinstance(data, dict) and "name" not in data:
        data = {**data, "name": name}
    return cluster_from_dict(data, source=path)


def gpu_type_to_dict(gpu: GPUSpec) -> dict[str, Any]:
    """A GPU type in full, as a ``gpu_types`` entry. Every number is written
    (with a ``base``, zeros too), so the base only records where the type comes
    from and it reads back the same whatever the catalog then holds."""
    entry: dict[str, Any] = {"base": gpu.derived_from} if gpu.derived_from else {}
    for key, (attr, scale) in GPU_NUMBER_KEYS.items():
        value = getattr(gpu, attr)
        if value or key in REQUIRED_WITHOUT_BASE or gpu.derived_from:
            entry[key] = in_units(float(value), scale)
    entry["source"] = gpu.source
    return entry


def cluster_to_dict(cluster: ClusterSpec) -> dict[str, Any]:
    """The YAML form of a cluster (one entry per node; GPU types that are not
    catalog entries written in full under ``gpu_types``)."""
    custom = [g for g in cluster.gpu_specs if not is_catalog_gpu(g)]
    for gpu in custom:
        if find_catalog_gpu(gpu.name) is not None:
            raise HetplanError(f"cluster {cluster.name!r}: its GPU type {gpu.name!r} differs from the catalog's "
                               "entry of that name; give it its own name before writing the cluster")
    nodes = []
    for node in cluster.nodes:
        entry: dict[str, Any] = {"name": node.name, "gpu": node.gpu.name, "gpus": node.num_gpus,
                                 "intra_node_bandwidth_gbps": node.intra_bandwidth_gbps}
        if node.inter_bandwidth_gbps:
            entry["inter_node_bandwidth_gbps"] = node.inter_bandwidth_gbps
        if node.memory_bytes:
            entry["memory_gb"] = node.memory_bytes / GIB
        if node.price_per_gpu_hour:
            entry["price_per_gpu_hour"] = node.price_per_gpu_hour
        if node.host_memory_bytes:
            entry["host_memory_gb"] = node.host_memory_bytes / GIB
        if node.zone:
            entry["zone"] = node.zone
        nodes.append(entry)
    data: dict[str, Any] = {"name": cluster.name, "description": cluster.description}
    if custom:
        data["gpu_types"] = {gpu.name: gpu_type_to_dict(gpu) for gpu in custom}
    data["nodes"] = nodes
    if cluster.inter_bandwidth_gbps:
        data["inter_node_bandwidth_gbps"] = cluster.inter_bandwidth_gbps
    if cluster.inter_zone_bandwidth_gbps:
        data["inter_zone_bandwidth_gbps"] = cluster.inter_zone_bandwidth_gbps
    if cluster.bandwidth_matrix_gbps is not None:
        data["bandwidth_matrix_gbps"] = [list(r) for r in cluster.bandwidth_matrix_gbps]
    if cluster.meta.get("calibration") is not None:  # inline, so a plan file carries it
        data["calibration"] = cluster.meta["calibration"].to_dict()
    return data


def dump_cluster_yaml(cluster: ClusterSpec) -> str:
    return yaml.safe_dump(cluster_to_dict(cluster), sort_keys=False, allow_unicode=True)


def is_cluster_path(name_or_path: str) -> bool:
    """Whether ``--cluster`` names a YAML file (else a preset or ``NxGPU``)."""
    return name_or_path.endswith((".yaml", ".yml")) or os.path.sep in name_or_path


def load_cluster(name_or_path: str) -> ClusterSpec:
    """A preset name, a generic ``NxGPU`` name, or a path to a YAML file."""
    if is_cluster_path(name_or_path):
        return load_cluster_yaml(name_or_path)
    return get_cluster(name_or_path)
