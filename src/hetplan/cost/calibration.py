"""A calibration: the cost model's free physical rates, fitted to the user's
own measured steps (``hetplan calibrate``) and applied with ``--calibration``.

The analytic model takes its rates from datasheets and published runs
(``cost/constants.py``). On a user's cluster the GPUs may be power capped,
the driver or kernel library older, the network shared: the same formulas
hold, at other rates. A calibration scales those rates, never a run's result:

* ``compute_scale[gpu]``: measured ÷ modelled time of the work on GPUs of that
  type (layer forward, backward and recomputation, and the optimizer step);
* ``bandwidth_scale["intra"]`` / ``["inter"]``: achieved ÷ modelled bandwidth
  of the links inside a node and between nodes (every collective and every
  pipeline transfer that crosses them);
* ``latency_scale``: measured ÷ modelled fixed time per collective (the
  NCCL latency model of ``comm.collective_latency``; gloo's is far larger);
* ``op_bandwidth_scale`` / ``op_latency_scale`` (``"allgather"``,
  ``"reduce_scatter"``): that collective's bandwidth and latency relative to
  the all-reduce's. NCCL's rings run all three at one bus bandwidth, the
  model's assumption; gloo's all-gather and reduce-scatter are slower
  algorithms (a profile measured 4.7 and 3.0 Gb/s against 7.8). Set from a
  profile's measured curves, never fitted.

A calibration is fitted on step times of whole plans (AMP §3.3's real trials
give them); which parameters the plans can tell apart is reported by the fit
(``hetplan.app.calibrate``). File format (JSON)::

    {"format": "hetplan-calibration", "version": 1,
     "compute_scale": {"A100-80GB": 1.12}, "bandwidth_scale": {"intra": 0.9, "inter": 0.7},
     "latency_scale": 2.0, "source": "hetplan calibrate trials.json (5 plans)"}
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Mapping

from hetplan.cluster.spec import ClusterSpec
from hetplan.errors import HetplanError
from hetplan.io.fields import mapping, number, text, whole
from hetplan.io.userfiles import read_json
from hetplan.cost.constants import COLLECTIVE_BANDWIDTH_EFFICIENCY
from hetplan.cost.comm import collective_latency

CALIBRATION_FORMAT = "hetplan-calibration"
CALIBRATION_VERSION = 1
LINK_CLASSES = ("intra", "inter")
SHARDING_OPS = ("allgather", "reduce_scatter")  # the kernel's names (cost/kernel.COLLECTIVES)
_PROFILE_OPS = {"all_gather": "allgather", "reduce_scatter": "reduce_scatter"}  # hetplan profile's names
# A scale outside this range is a broken measurement, not a slow GPU: the
# slowest real rate hetplan models (a power-capped GPU, gloo over loopback)
# is within 100x of the datasheet's.
SCALE_RANGE = (1e-3, 1e3)


@dataclass(frozen=True)
class Calibration:
    """Factors on the cost model's rates (see the module docstring); 1 = as modelled."""

    compute_scale: Mapping[str, float] = field(default_factory=dict)
    bandwidth_scale: Mapping[str, float] = field(default_factory=dict)
    latency_scale: float = 1.0
    source: str = ""
    op_bandwidth_scale: Mapping[str, float] = field(default_factory=dict)
    op_latency_scale: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name, table in (("op_bandwidth_scale", self.op_bandwidth_scale),
                            ("op_latency_scale", self.op_latency_scale)):
            for op, value in table.items():
                if op not in SHARDING_OPS:
                    raise HetplanError(f"calibration {name}: unknown collective {op!r}; use {', '.join(SHARDING_OPS)}")
                _check_scale(f"calibration {name}[{op!r}]", value)
        for gpu, value in self.compute_scale.items():
            _check_scale(f"calibration compute_scale[{gpu!r}]", value)
        for link, value in self.bandwidth_scale.items():
            if link not in LINK_CLASSES:
                raise HetplanError(f"calibration bandwidth_scale: unknown link class {link!r}; "
                                   f"use {', '.join(LINK_CLASSES)}")
            _check_scale(f"calibration bandwidth_scale[{link!r}]", value)
        _check_scale("calibration latency_scale", self.latency_scale)

    def op_bandwidth(self, kind: str) -> float:
        """Bandwidth of collective ``kind`` relative to the all-reduce's (1 for the all-reduce)."""
        return float(self.op_bandwidth_scale.get(kind, 1.0))

    def op_latency(self, kind: str) -> float:
        return float(self.op_latency_scale.get(kind, 1.0))

    def compute(self, gpu: str) -> float:
        """Factor on the time of work on a GPU of type ``gpu``."""
        return float(self.compute_scale.get(gpu, 1.0))

    def bandwidth(self, link: str) -> float:
        return float(self.bandwidth_scale.get(link, 1.0))

    def to_dict(self) -> dict[str, Any]:
        return {"format": CALIBRATION_FORMAT, "version": CALIBRATION_VERSION,
                "compute_scale": dict(sorted(self.compute_scale.items())),
                "bandwidth_scale": dict(sorted(self.bandwidth_scale.items())),
                "latency_scale": self.latency_scale, "source": self.source,
                **({"op_bandwidth_scale": dict(sorted(self.op_bandwidth_scale.items()))}
                   if self.op_bandwidth_scale else {}),
                **({"op_latency_scale": dict(sorted(self.op_latency_scale.items()))} if self.op_latency_scale else {})}

    def describe(self) -> str:
        """One line for report headers."""
        parts = [f"compute {gpu} x{v:.3g}" for gpu, v in sorted(self.compute_scale.items())]
        parts += [f"{link} bandwidth x{v:.3g}" for link, v in sorted(self.bandwidth_scale.items())]
        if self.latency_scale != 1.0:
            parts.append(f"latency x{self.latency_scale:.3g}")
        parts += [f"{op} bandwidth x{v:.3g} of all-reduce's" for op, v in sorted(self.op_bandwidth_scale.items())]
        return ", ".join(parts) or "identity"


def _check_scale(where: str, value: Any) -> float:
    value = number(where, value)
    low, high = SCALE_RANGE
    if not low <= value <= high:
        raise HetplanError(f"{where} = {value:g} is outside [{low:g}, {high:g}]: a measurement is broken")
    return value


def calibration_from_dict(data: Any, where: str = "calibration") -> Calibration:
    """A Calibration from its JSON form, every field checked."""
    fields = mapping(where, data, ("format", "version", "compute_scale", "bandwidth_scale", "latency_scale",
                                   "source", "op_bandwidth_scale", "op_latency_scale"), required=("format",))
    if text(f"{where} format", fields["format"]) != CALIBRATION_FORMAT:
        raise HetplanError(f"{where}: format must be {CALIBRATION_FORMAT!r}, got {fields['format']!r}")
    version = whole(f"{where} version", fields.get("version", CALIBRATION_VERSION))
    if version != CALIBRATION_VERSION:
        raise HetplanError(f"{where}: version {version} is not supported (this hetplan reads {CALIBRATION_VERSION})")
    compute = {text(f"{where} compute_scale key", k, None): _check_scale(f"{where} compute_scale[{k!r}]", v)
               for k, v in _object(f"{where} compute_scale", fields.get("compute_scale", {})).items()}
    bandwidth = {text(f"{where} bandwidth_scale key", k, LINK_CLASSES): _check_scale(
        f"{where} bandwidth_scale[{k!r}]", v)
        for k, v in _object(f"{where} bandwidth_scale", fields.get("bandwidth_scale", {})).items()}
    latency = _check_scale(f"{where} latency_scale", fields.get("latency_scale", 1.0))
    ops = {name: {text(f"{where} {name} key", k, SHARDING_OPS): _check_scale(f"{where} {name}[{k!r}]", v)
                  for k, v in _object(f"{where} {name}", fields.get(name, {})).items()}
           for name in ("op_bandwidth_scale", "op_latency_scale")}
    return Calibration(compute, bandwidth, latency, text(f"{where} source", fields.get("source", "")),
                       ops["op_bandwidth_scale"], ops["op_latency_scale"])


def _object(where: str, value: Any) -> Mapping[str, Any]:
    if not isinstance(value, dict):
        raise HetplanError(f"{where} must be a mapping, got {value!r}")
    return value


def read_calibration(path: str | os.PathLike[str]) -> Calibration:
    """The calibration in a file written by ``hetplan calibrate``."""
    return calibration_from_dict(read_json(path, "calibration"), f"calibration {os.fspath(path)}")


def calibrated_cluster(cluster: ClusterSpec, calibration: Calibration | None) -> ClusterSpec:
    """``cluster`` with its link bandwidths scaled (the kernel costs comm on
    this copy; the workload keeps the cluster as the user described it). The
    inter-zone link is a network link: it takes the network's factor."""
    if calibration is None:
        return cluster
    intra, inter = calibration.bandwidth("intra"), calibration.bandwidth("inter")
    if intra == 1.0 and inter == 1.0:
        return cluster
    nodes = tuple(dataclasses.replace(n, intra_bandwidth_gbps=n.intra_bandwidth_gbps * intra,
                                      inter_bandwidth_gbps=n.inter_bandwidth_gbps * inter) for n in cluster.nodes)
    matrix = cluster.bandwidth_matrix_gbps
    if matrix is not None:
        node_of = [d.node for d in cluster.devices]
        matrix = tuple(tuple(b * (intra if node_of[i] == node_of[j] else inter) for j, b in enumerate(row))
                       for i, row in enumerate(matrix))
    return dataclasses.replace(cluster, nodes=nodes, inter_bandwidth_gbps=cluster.inter_bandwidth_gbps * inter,
                               bandwidth_matrix_gbps=matrix,
                               inter_zone_bandwidth_gbps=cluster.inter_zone_bandwidth_gbps * inter)


def link_calibration_from_profile(profile: Any, cluster: ClusterSpec) -> Calibration | None:
    """The bandwidth and latency factors under which the cost model's
    all-reduce over the profiled group matches the one ``hetplan profile``
    measured (its alpha-beta fit), for each link class it measured. None when
    the profile measured no all-reduce (an old or Metis profile)."""
    bandwidth: dict[str, float] = {}
    latency: list[float] = []
    fits = list(getattr(profile, "fits", ()))
    for fit in fits:
        if fit.op != "all_reduce" or fit.link not in LINK_CLASSES or fit.ranks < 2:
            continue
        group = _profiled_group(cluster, fit.link, fit.ranks)
        if group is None:
            continue
        modelled_gbps = (cluster.nodes[0].intra_bandwidth_gbps if fit.link == "intra"
                         else cluster.node_inter_gbps(0)) * COLLECTIVE_BANDWIDTH_EFFICIENCY
        if fit.busbw_gbps > 0 and modelled_gbps > 0:
            bandwidth[fit.link] = _clamp(fit.busbw_gbps / modelled_gbps)
        modelled_latency = collective_latency(cluster, group, "allreduce")
        if fit.alpha_s > 0 and modelled_latency > 0:
            latency.append(fit.alpha_s / modelled_latency)
    if not bandwidth and not latency:
        return None
    op_bandwidth, op_latency = _sharding_ops(fits)
    return Calibration({}, bandwidth, _clamp(max(latency)) if latency else 1.0,
                       "links from the profile's measured collectives", op_bandwidth, op_latency)


def _sharding_ops(fits: list[Any]) -> tuple[dict[str, float], dict[str, float]]:
    """All-gather and reduce-scatter against the all-reduce on the same group
    (``Calibration.op_bandwidth_scale``): bus bandwidth and latency ratios."""
    reference = {(f.link, f.ranks): f for f in fits if f.op == "all_reduce"}
    bandwidth: dict[str, float] = {}
    latency: dict[str, float] = {}
    for fit in fits:
        kind, ref = _PROFILE_OPS.get(fit.op), reference.get((fit.link, fit.ranks))
        if kind is None or ref is None or fit.link != "intra":
            continue
        if fit.busbw_gbps > 0 and ref.busbw_gbps > 0:
            bandwidth[kind] = _clamp(fit.busbw_gbps / ref.busbw_gbps)
        if fit.alpha_s > 0 and ref.alpha_s > 0:
            latency[kind] = _clamp(fit.alpha_s / ref.alpha_s)
    return bandwidth, latency


def _profiled_group(cluster: ClusterSpec, link: str, ranks: int) -> tuple[int, ...] | None:
    """Devices like the ones the profile measured: ``ranks`` GPUs of the first
    node (intra), or the first GPU of ``ranks`` nodes (inter)."""
    if link == "intra":
        return tuple(range(ranks)) if cluster.nodes[0].num_gpus >= ranks else None
    if len(cluster.nodes) < ranks:
        return None
    firsts, start = [], 0
    for node in cluster.nodes[:ranks]:
        firsts.append(start)
        start += node.num_gpus
    return tuple(firsts)


def _clamp(value: float) -> float:
    return min(max(value, SCALE_RANGE[0]), SCALE_RANGE[1])


def merged(base: Calibration | None, override: Calibration | None) -> Calibration | None:
    """``override``'s factors where it has them (a fitted calibration), ``base``'s
    elsewhere (the profile's measured links)."""
    if base is None or override is None:
        return override or base
    return Calibration({**base.compute_scale, **override.compute_scale},
                       {**base.bandwidth_scale, **override.bandwidth_scale},
                       override.latency_scale if override.latency_scale != 1.0 else base.latency_scale,
                       "; ".join(s for s in (base.source, override.source) if s),
                       {**base.op_bandwidth_scale, **override.op_bandwidth_scale},
                       {**base.op_latency_scale, **override.op_latency_scale})


def effective_calibration(profile: Any, cluster: ClusterSpec, given: Calibration | None) -> Calibration | None:
    """What the kernel applies: the given calibration (``--calibration`` or
    the cluster file's), over the links a profile measured."""
    if profile is None:
        return given
    return merged(link_calibration_from_profile(profile, cluster), given)
