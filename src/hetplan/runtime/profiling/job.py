"""What ``hetplan profile`` measures: the job every process runs, without torch
(the command checks it and prints launch commands on machines without torch)."""

from __future__ import annotations

from dataclasses import dataclass

from hetplan.cluster.spec import ClusterSpec
from hetplan.model.spec import LayerSpec, ModelSpec
from hetplan.profile.db import DATA_PARALLEL_ZERO


@dataclass(frozen=True)
class ProfileJob:
    """What to measure; the same on every process.

    ``comm_max_bytes`` 0 skips the collective curves; ``out`` is where rank 0
    writes the profile when it runs under torchrun (``--worker``).
    """

    spec: ModelSpec
    cluster: ClusterSpec
    tps: tuple[int, ...]
    batches: tuple[int, ...]
    warmup: int = 2
    repeats: int = 5
    comm_max_bytes: int = 0
    seed: int = 0
    timeout_s: float = 1800.0
    out: str = ""


def distinct_layers(spec: ModelSpec) -> list[LayerSpec]:
    """The first layer of each profile_key, in model order."""
    seen: dict[str, LayerSpec] = {}
    for layer in spec.layers:
        seen.setdefault(layer.profile_key, layer)
    return list(seen.values())


def batch_sizes(max_batch: int) -> tuple[int, ...]:
    """1, 2, 4, ... up to ``max_batch`` (itself included)."""
    sizes = []
    b = 1
    while b < max_batch:
        sizes.append(b)
        b *= 2
    return (*sizes, max_batch)


def measurements(job: ProfileJob) -> list[tuple[LayerSpec, int, int]]:
    """(layer, tp, batch) in the order they are measured."""
    return [(layer, tp, b) for tp in job.tps for layer in distinct_layers(job.spec) if layer.supports_tp(tp)
            for b in job.batches]


def chain_layers(spec: ModelSpec) -> list[LayerSpec]:
    """The layers a chain measurement runs, in model order: each layer kind,
    and a repeated kind (a transformer block) twice, so the chain holds every
    hand-over between layers a step has."""
    seen: dict[str, int] = {}
    chain = []
    for layer in spec.layers:
        if seen.get(layer.profile_key, 0) < 2:
            seen[layer.profile_key] = seen.get(layer.profile_key, 0) + 1
            chain.append(layer)
    return chain


def chain_measurements(job: ProfileJob) -> list[tuple[int, int]]:
    """(tp, batch) of each chain measurement: where every layer of the chain takes the TP degree."""
    chain = chain_layers(job.spec)
    return [(tp, b) for tp in job.tps if all(layer.supports_tp(tp) for layer in chain) for b in job.batches]


def data_parallel_measurements(job: ProfileJob) -> list[tuple[LayerSpec, int, int, int]]:
    """(layer, tp, ranks, zero) in the order they are measured: each layer kind
    with parameters, at each TP degree, over data-parallel groups of every
    size from 2 up that fits beside it (the dp degrees a plan can have),
    under ZeRO-0, 2 and 3, at the smallest batch (the wrappers' cost does
    not grow with it)."""
    world = job.cluster.num_devices
    return [(layer, tp, ranks, zero) for tp in job.tps for ranks in range(2, world // tp + 1)
            if world % (tp * ranks) == 0
            for layer in distinct_layers(job.spec) if layer.params > 0 and layer.supports_tp(tp)
            for zero in DATA_PARALLEL_ZERO]


def collective_group_sizes(job: ProfileJob) -> list[int]:
    """Group sizes the curves are measured over: each TP degree and the whole run."""
    world = job.cluster.num_devices
    return sorted({tp for tp in job.tps if tp >= 2} | ({world} if world >= 2 else set()))


def link_class(cluster: ClusterSpec, ranks: int) -> str:
    """"intra" when every group of ``ranks`` consecutive processes lies in one node, else "inter"."""
    nodes = [d.node for d in cluster.devices]
    groups = [nodes[i:i + ranks] for i in range(0, len(nodes), ranks)]
    return "intra" if all(len(set(g)) == 1 for g in groups) else "inter"
