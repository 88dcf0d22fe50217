"""ClusterSpec: nodes of GPUs (possibly of different types and counts) and links.

Devices get global ids node by node: node 0's GPUs are 0..n0-1, node 1's follow,
and so on; a Plan names devices by these ids. Bandwidths are in gigabits per
second as links are sold (``*_gbps``); ``bandwidth_bytes_per_s`` converts.
Between two nodes the usable bandwidth is the smaller of the two nodes' network
bandwidth (a node's NIC is shared by its GPUs). Nodes may carry a zone; between
nodes of two zones the link is also at most the cluster's inter-zone bandwidth,
per node pair, as Sailor's zone data gives it (issue 35: 48 Gbps inside a zone,
8.7 Gbps across). A full device-to-device matrix overrides everything when given.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Iterable, Sequence

from hetplan.cluster.catalog import GPUSpec, get_gpu, normalise_gpu_name
from hetplan.errors import HetplanError
from hetplan.units import gbps_to_bytes_per_s


@dataclass(frozen=True)
class NodeSpec:
    """A machine with ``num_gpus`` GPUs of one type.

    Attributes:
        gpu_type: the GPU: a catalog name (see ``hetplan.cluster.catalog``) or a
            GPUSpec (a type a cluster file defines); after construction, the
            type's name.
        num_gpus: GPUs in this node.
        intra_bandwidth_gbps: GPU-to-GPU bandwidth inside the node, per direction.
        inter_bandwidth_gbps: this node's network bandwidth to other nodes;
            0 means the cluster-wide default.
        memory_bytes: per-GPU memory override (0 = the GPU type's value).
        name: label used in reports.
        price_per_gpu_hour: what one of its GPUs costs per hour (0 = not given).
        host_memory_bytes: the node's host (CPU) memory, shared by its GPUs'
            offloaded activations (0 = its GPU type's reference server:
            ``cost.memory.node_host_memory_bytes``).
        gpu_spec: the resolved GPU type (set from ``gpu_type`` when not given);
            compared with the rest, so two nodes of differently capped or tuned
            GPUs never compare equal.
        zone: the zone (data centre, cloud zone) the node is in; "" = none.
            Links between zones run at most at the cluster's
            ``inter_zone_bandwidth_gbps``.
    """

    gpu_type: str | GPUSpec
    num_gpus: int
    intra_bandwidth_gbps: float
    inter_bandwidth_gbps: float = 0.0
    memory_bytes: int = 0
    name: str = ""
    gpu_spec: GPUSpec | None = None
    price_per_gpu_hour: float = 0.0
    host_memory_bytes: int = 0
    zone: str = ""

    def __post_init__(self) -> None:
        spec = self._resolve_gpu()
        object.__setattr__(self, "gpu_type", spec.name)
        object.__setattr__(self, "gpu_spec", spec)
        label = self.name or spec.name
        if self.num_gpus <= 0:
            raise HetplanError(f"node {label!r}: num_gpus must be positive")
        if not (self.intra_bandwidth_gbps > 0 and math.isfinite(self.intra_bandwidth_gbps)):
            raise HetplanError(
                f"node {label!r}: intra-node bandwidth must be positive, got {self.intra_bandwidth_gbps}"
            )
        if not (self.inter_bandwidth_gbps >= 0 and math.isfinite(self.inter_bandwidth_gbps)):
            raise HetplanError(f"node {label!r}: inter-node bandwidth must be positive")
        if self.memory_bytes < 0:
            raise HetplanError(f"node {label!r}: memory must be positive")
        if not (self.price_per_gpu_hour >= 0 and math.isfinite(self.price_per_gpu_hour)):
            raise HetplanError(f"node {label!r}: price_per_gpu_hour must be a number >= 0")
        if self.host_memory_bytes < 0:
            raise HetplanError(f"node {label!r}: host_memory_gb must be positive (or left out for the default)")
        if self.zone != self.zone.strip() or not self.zone.isprintable() or len(self.zone) > 1000:
            raise HetplanError(f"node {label!r}: zone must be one line of printable characters without "
                               f"surrounding spaces, got {self.zone!r}")

    def _resolve_gpu(self) -> GPUSpec:
        """The GPUSpec this node runs: given directly, given as ``gpu_spec``
        (what ``dataclasses.replace`` passes back), or looked up in the catalog."""
        if isinstance(self.gpu_type, GPUSpec):
            if self.gpu_spec is not None and self.gpu_spec != self.gpu_type:
                raise HetplanError(f"node {self.name!r}: gpu_type and gpu_spec name different GPUs")
            return self.gpu_type
        if self.gpu_spec is not None:
            if normalise_gpu_name(self.gpu_type) != normalise_gpu_name(self.gpu_spec.name):
                raise HetplanError(f"node {self.name!r}: gpu_type {self.gpu_type!r} is not gpu_spec "
                                   f"{self.gpu_spec.name!r}")
            return self.gpu_spec
        return get_gpu(self.gpu_type)  # raises a clear error for unknown types

    @property
    def gpu(self) -> GPUSpec:
        assert self.gpu_spec is not None  # set in __post_init__
        return self.gpu_spec


@dataclass(frozen=True)
class Device:
    """One GPU: its global id, node, position in the node, and type."""

    id: int
    node: int
    local_rank: int
    gpu: GPUSpec
    memory_bytes: int


@dataclass(frozen=True)
class ClusterSpec:
    """A cluster: nodes plus how fast they talk to each other.

    Attributes:
        name: preset or file name.
        nodes: the machines, in device-id order.
        inter_bandwidth_gbps: default node-to-node network bandwidth.
        bandwidth_matrix_gbps: optional full device-to-device matrix (overrides
            the node model; diagonal ignored).
        description: where the cluster comes from (paper, file).
        inter_zone_bandwidth_gbps: the link between two nodes of different
            zones (per node pair, per direction); needed when the nodes are in
            two or more zones, 0 when they carry no zones. A bandwidth matrix
            overrides it (replan's matrices are read off ``link_gbps``).
    """

    name: str
    nodes: tuple[NodeSpec, ...]
    inter_bandwidth_gbps: float
    bandwidth_matrix_gbps: tuple[tuple[float, ...], ...] | None = None
    description: str = ""
    meta: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)
    inter_zone_bandwidth_gbps: float = 0.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "nodes", tuple(self.nodes))
        if not self.nodes:
            raise HetplanError(f"cluster {self.name!r} has no nodes")
        self._check_zones()
        if len(self.nodes) > 1 and self.inter_bandwidth_gbps <= 0 and any(
            n.inter_bandwidth_gbps <= 0 for n in self.nodes
        ):
            raise HetplanError(
                f"cluster {self.name!r}: inter-node bandwidth must be positive, got {self.inter_bandwidth_gbps}"
            )
        self._check_gpu_names()
        if self.bandwidth_matrix_gbps is not None:
            n = self.num_devices
            rows = self.bandwidth_matrix_gbps
            if len(rows) != n or any(len(r) != n for r in rows):
                raise HetplanError(
                    f"cluster {self.name!r}: bandwidth matrix must be {n}x{n} (one row per GPU)"
                )
            for i, row in enumerate(rows):
                for j, value in enumerate(row):
                    if i != j and value <= 0:
                        raise HetplanError(
                            f"cluster {self.name!r}: bandwidth between GPU {i} and {j} must be positive"
                        )
            object.__setattr__(self, "bandwidth_matrix_gbps", tuple(tuple(map(float, r)) for r in rows))

    def _check_zones(self) -> None:
        """Zones on every node or on none, and a link between them when there are several."""
        zoned = [node for node in self.nodes if node.zone]
        bandwidth = self.inter_zone_bandwidth_gbps
        if not (bandwidth >= 0 and math.isfinite(bandwidth)):
            raise HetplanError(f"cluster {self.name!r}: inter_zone_bandwidth_gbps must be a positive number, "
                               f"got {bandwidth}")
        if zoned and len(zoned) < len(self.nodes):
            bare = next(node for node in self.nodes if not node.zone)
            raise HetplanError(f"cluster {self.name!r}: node {bare.name or bare.gpu.name!r} has no zone but others "
                               "do; give every node a 'zone' or none")
        if not zoned and bandwidth > 0:
            raise HetplanError(f"cluster {self.name!r}: inter_zone_bandwidth_gbps is given but no node has a zone; "
                               "give the nodes their 'zone' or drop it")
        if len(self.zones) > 1 and bandwidth <= 0:
            raise HetplanError(f"cluster {self.name!r}: nodes in {len(self.zones)} zones but no "
                               "inter_zone_bandwidth_gbps; give the bandwidth between zones in Gbit/s")

    @property
    def zones(self) -> tuple[str, ...]:
        """The nodes' distinct zones in node order (empty when they carry none)."""
        return tuple(dict.fromkeys(node.zone for node in self.nodes if node.zone))

    def _check_gpu_names(self) -> None:
        """One name, one GPU: costs are cached and reported by GPU type name."""
        seen: dict[str, GPUSpec] = {}
        for node in self.nodes:
            key = normalise_gpu_name(node.gpu.name)
            if seen.setdefault(key, node.gpu) != node.gpu:
                raise HetplanError(
                    f"cluster {self.name!r}: two different GPU types are both named {node.gpu.name!r}; "
                    "give each its own name"
                )

    @property
    def gpu_specs(self) -> tuple[GPUSpec, ...]:
        """Distinct GPU types, in node order."""
        return tuple({node.gpu.name: node.gpu for node in self.nodes}.values())

    @cached_property
    def devices(self) -> tuple[Device, ...]:
        devices: list[Device] = []
        for node_index, node in enumerate(self.nodes):
            gpu = node.gpu
            memory = node.memory_bytes or gpu.memory_bytes
            for local in range(node.num_gpus):
                devices.append(Device(len(devices), node_index, local, gpu, memory))
        return tuple(devices)

    @property
    def num_devices(self) -> int:
        return sum(node.num_gpus for node in self.nodes)

    @property
    def num_nodes(self) -> int:
        return len(self.nodes)

    @property
    def gpu_types(self) -> tuple[str, ...]:
        """Distinct GPU types, in node order."""
        return tuple(gpu.name for gpu in self.gpu_specs)

    @property
    def is_homogeneous(self) -> bool:
        return len(self.gpu_types) == 1 and len({n.num_gpus for n in self.nodes}) == 1

    def node_devices(self, node_index: int) -> list[int]:
        return [d.id for d in self.devices if d.node == node_index]

    def node_inter_gbps(self, node_index: int) -> float:
        node = self.nodes[node_index]
        return node.inter_bandwidth_gbps or self.inter_bandwidth_gbps

    def network_gbps(self, nodes: Iterable[int]) -> float:
        """The slowest network link among ``nodes`` (two or more): the slowest
        NIC, and the inter-zone link when they lie in more than one zone.
        A ring over nodes runs every link at once, so this is what its
        slowest step, and with it the ring, runs at (NCCL's ring bandwidth is
        the minimum over the ring's links: ``src/graph/search.cc``); a ring
        over two zones crosses the boundary twice, once each way, on two node
        pairs, so both crossings run in parallel at the inter-zone link."""
        nodes = list(nodes)
        slowest = min(self.node_inter_gbps(n) for n in nodes)
        if len({self.nodes[n].zone for n in nodes}) > 1:
            slowest = min(slowest, self.inter_zone_bandwidth_gbps)
        return slowest

    def link_gbps(self, a: int, b: int) -> float:
        """Bandwidth between devices ``a`` and ``b`` in Gbit/s (per direction)."""
        if self.bandwidth_matrix_gbps is not None:
            if a == b:
                return float("inf")
            return self.bandwidth_matrix_gbps[a][b]
        da, db = self.devices[a], self.devices[b]
        if a == b:
            return float("inf")
        if da.node == db.node:
            return self.nodes[da.node].intra_bandwidth_gbps
        return self.network_gbps((da.node, db.node))

    def bandwidth_bytes_per_s(self, a: int, b: int) -> float:
        return gbps_to_bytes_per_s(self.link_gbps(a, b))

    def min_bandwidth_bytes_per_s(self, group: Sequence[int]) -> float:
        """Slowest link inside a group: what a flat ring all-reduce runs at (AMP eq. 3)."""
        if len(group) < 2:
            return float("inf")
        if self.bandwidth_matrix_gbps is not None:
            return min(self.bandwidth_bytes_per_s(a, b) for i, a in enumerate(group) for b in group[i + 1:])
        # node model: the slowest of each node's fabric (where two of its GPUs
        # are in the group) and, across nodes, the slowest network link involved
        by_node = self.nodes_of(group)
        links = [self.nodes[n].intra_bandwidth_gbps for n, members in by_node.items() if len(members) > 1]
        if len(by_node) > 1:
            links.append(self.network_gbps(by_node))
        return gbps_to_bytes_per_s(min(links))

    def nodes_of(self, group: Iterable[int]) -> dict[int, list[int]]:
        """The group's devices, by node."""
        by_node: dict[int, list[int]] = {}
        for d in group:
            by_node.setdefault(self.devices[d].node, []).append(d)
        return by_node

    def summary(self) -> str:
        """One line such as '3x4 V100-16GB + 1x4 T4 (16 GPUs)'."""
        parts: list[str] = []
        runs: list[list[Any]] = []
        for node in self.nodes:
            key = (node.num_gpus, node.gpu.name)
            if runs and runs[-1][0] == key:
                runs[-1][1] += 1
            else:
                runs.append([key, 1])
        for (count, gpu), repeat in runs:
            parts.append(f"{repeat}x{count} {gpu}")
        unit = "CPU processes" if all(d.gpu.catalog_name == "CPU" for d in self.devices) else "GPUs"
        return f"{' + '.join(parts)} ({self.num_devices} {unit})"
