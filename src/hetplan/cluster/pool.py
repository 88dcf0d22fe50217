"""Pools: the GPUs a team can get (``hetplan choose --pool``), and the cluster
of one allocation from them.

Format (every key is checked; an unknown key is an error, never ignored)::

    name: two-zones
    zones:                               # every zone an offer names
      a: {egress_usd_per_gb: 0.01}       # $ per GB that leaves the zone
      b: {egress_usd_per_gb: 0.01}
    inter_zone_bandwidth_gbps: 8.7       # the link between zones (needed with 2+ zones)
    gpu_types: {...}                     # optional: GPUs the catalog lacks, as in cluster files
    offers:
      - gpu: A100-40GB                   # a catalog name or a gpu_types name
        gpus_per_node: 8
        nodes: 4                         # at most this many nodes of this offer
        zone: a
        price_per_gpu_hour: 1.8
        intra_node_bandwidth_gbps: 2400
        inter_node_bandwidth_gbps: 48    # the node's network inside its zone
        name: a100-a                     # optional (default GPU@zone), unique

An allocation takes ``counts[i]`` nodes of offer ``i``. Its cluster's nodes
keep their offer's NIC and carry its zone, and the cluster the pool's
``inter_zone_bandwidth_gbps``: a link between two nodes of one zone runs at the
slower NIC, one between zones also at most at the inter-zone link
(``ClusterSpec.link_gbps``), and the cost kernel prices each collective and
pipeline send by the links its group uses (``cost/comm.py``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Any, Mapping, Sequence

from hetplan.cluster.catalog import GPUSpec, get_gpu, normalise_gpu_name
from hetplan.cluster.io import gpu_types_from_dict
from hetplan.cluster.spec import ClusterSpec, NodeSpec
from hetplan.errors import HetplanError
from hetplan.io import fields
from hetplan.io.argtypes import MAX_PRICE_PER_GPU_HOUR
from hetplan.io.userfiles import read_yaml
from hetplan.limits import MAX_GPUS, MAX_GPUS_PER_NODE, MAX_NODES, check_at_most

_TOP_KEYS = ("name", "description", "zones", "inter_zone_bandwidth_gbps", "gpu_types", "offers")
_ZONE_KEYS = ("egress_usd_per_gb",)
_OFFER_KEYS = ("gpu", "gpus_per_node", "nodes", "zone", "price_per_gpu_hour", "intra_node_bandwidth_gbps",
               "inter_node_bandwidth_gbps", "name")
_OFFER_REQUIRED = _OFFER_KEYS[:-1]
# Offers in one pool: every allocation is one count per offer, so their number
# is the product of (nodes + 1) over offers; 16 offers of one node each are
# already 65,536 allocations. A team comparing more kinds of GPU-zone pairs
# than that is better served by two pools.
MAX_OFFERS = 16
# $ per GB leaving a zone: clouds charge $0.01-0.12 between regions and up to
# ~$0.2 to the internet (AWS/GCP/Azure data-transfer price lists, 2025); $1000
# per GB is a typo.
MAX_EGRESS_USD_PER_GB = 1000


@dataclass(frozen=True)
class Offer:
    """Up to ``nodes`` nodes of one shape, in one zone, at one price."""

    name: str
    gpu: GPUSpec
    gpus_per_node: int
    nodes: int
    zone: str
    price_per_gpu_hour: float
    intra_node_bandwidth_gbps: float
    inter_node_bandwidth_gbps: float


@dataclass(frozen=True)
class Pool:
    """What can be had: zones (egress $/GB out of each), the link between
    zones, and offers of nodes."""

    name: str
    description: str
    egress_usd_per_gb: Mapping[str, float]
    inter_zone_bandwidth_gbps: float
    offers: tuple[Offer, ...]

    @property
    def gpu_types(self) -> tuple[str, ...]:
        """The offers' GPU type names, each once, in offer order."""
        return tuple(dict.fromkeys(o.gpu.name for o in self.offers))

    def with_prices(self, prices: Mapping[str, float]) -> Pool:
        """The pool with other prices per GPU-hour (a what-if): by GPU type,
        ``*`` for every offer; a type no offer has is an error."""
        known = {normalise_gpu_name(name): name for name in self.gpu_types}
        unknown = [name for name in prices if name != "*" and normalise_gpu_name(name) not in known]
        if unknown:
            raise HetplanError(f"--price names {', '.join(unknown)}, which no offer of pool {self.name!r} has; "
                               f"its GPU types are {', '.join(self.gpu_types)}")
        by_type = {normalise_gpu_name(name): price for name, price in prices.items() if name != "*"}
        offers = tuple(replace(o, price_per_gpu_hour=by_type.get(normalise_gpu_name(o.gpu.name),
                                                                 prices.get("*", o.price_per_gpu_hour)))
                       for o in self.offers)
        return replace(self, offers=offers)


def pool_from_dict(data: Any, source: str = "pool") -> Pool:
    """Build a Pool from parsed YAML, checking every field."""
    top = fields.mapping(source, data, _TOP_KEYS, ("zones", "offers"))
    zones = _zones(source, top["zones"])
    custom = gpu_types_from_dict(top["gpu_types"], source) if top.get("gpu_types") is not None else {}
    raw = fields.listing(f"{source}: offers", top["offers"], MAX_OFFERS)
    if not raw:
        raise HetplanError(f"{source}: 'offers' is empty; list at least one offer of nodes")
    offers = tuple(_offer(f"{source}: offers[{i}]", entry, zones, custom) for i, entry in enumerate(raw))
    _check_names(source, offers)
    _check_size(source, offers)
    used = {o.zone for o in offers}
    inter = 0.0
    if "inter_zone_bandwidth_gbps" in top:
        inter = fields.number(f"{source}: inter_zone_bandwidth_gbps", top["inter_zone_bandwidth_gbps"])
    elif len(used) > 1:
        raise HetplanError(f"{source}: offers in {len(used)} zones but no 'inter_zone_bandwidth_gbps'; "
                           "give the bandwidth between zones in Gbit/s")
    name = _one_line(f"{source}: name", top.get("name", os.path.splitext(os.path.basename(source))[0]))
    description = _one_line(f"{source}: description", top.get("description", f"pool from {source}"))
    return Pool(name, description, zones, inter, offers)


def _one_line(where: str, value: Any) -> str:
    text = fields.text(where, value).strip()
    if not text or len(text) > 1000 or not text.isprintable():
        raise HetplanError(f"{where} must be one line of 1 to 1000 printable characters")
    return text


def _zones(source: str, value: Any) -> dict[str, float]:
    """``zones``: name -> egress $/GB."""
    if not isinstance(value, dict) or not value:
        raise HetplanError(f"{source}: 'zones' must be a non-empty mapping of zone names to "
                           "{egress_usd_per_gb: N}")
    zones: dict[str, float] = {}
    for key, entry in value.items():
        name = _one_line(f"{source}: zones key", key if isinstance(key, str) else str(key))
        where = f"{source}: zones.{name}"
        entry = fields.mapping(where, entry, _ZONE_KEYS, _ZONE_KEYS)
        egress = fields.number(f"{where}.egress_usd_per_gb", entry["egress_usd_per_gb"], strict=False)
        check_at_most(f"{where}.egress_usd_per_gb", egress, MAX_EGRESS_USD_PER_GB, "give dollars per GB")
        zones[name] = egress
    return zones


def _offer(where: str, entry: Any, zones: Mapping[str, float], custom: Mapping[str, GPUSpec]) -> Offer:
    """One ``offers`` entry."""
    entry = fields.mapping(where, entry, _OFFER_KEYS, _OFFER_REQUIRED)
    try:
        gpu = get_gpu(_one_line(f"{where}.gpu", entry["gpu"]), custom)
    except HetplanError as exc:
        raise HetplanError(f"{where}.gpu: {exc}") from None
    zone = entry["zone"] if isinstance(entry["zone"], str) else str(entry["zone"])
    if zone not in zones:
        raise HetplanError(f"{where}.zone: {zone!r} is not under 'zones' ({', '.join(zones)}); add it there "
                           "with its egress_usd_per_gb")
    per_node = fields.whole(f"{where}.gpus_per_node", entry["gpus_per_node"], 1, MAX_GPUS_PER_NODE)
    nodes = fields.whole(f"{where}.nodes", entry["nodes"], 1, MAX_NODES)
    price = fields.number(f"{where}.price_per_gpu_hour", entry["price_per_gpu_hour"])
    check_at_most(f"{where}.price_per_gpu_hour", price, int(MAX_PRICE_PER_GPU_HOUR),
                  "give the price of one GPU-hour in dollars")
    intra = fields.number(f"{where}.intra_node_bandwidth_gbps", entry["intra_node_bandwidth_gbps"])
    inter = fields.number(f"{where}.inter_node_bandwidth_gbps", entry["inter_node_bandwidth_gbps"])
    name = _one_line(f"{where}.name", entry.get("name", f"{gpu.name}@{zone}"))
    return Offer(name, gpu, per_node, nodes, zone, price, intra, inter)


def _check_names(source: str, offers: Sequence[Offer]) -> None:
    seen: set[str] = set()
    for i, offer in enumerate(offers):
        if offer.name in seen:
            raise HetplanError(f"{source}: offers[{i}] is named {offer.name!r} like an earlier offer; "
                               "give each offer its own 'name'")
        seen.add(offer.name)


def _check_size(source: str, offers: Sequence[Offer]) -> None:
    """The whole pool within hetplan's cluster limits (the largest allocation is all of it)."""
    check_at_most(f"{source}: nodes of all offers", sum(o.nodes for o in offers), MAX_NODES, "is the pool right?")
    check_at_most(f"{source}: GPUs of all offers", sum(o.nodes * o.gpus_per_node for o in offers), MAX_GPUS,
                  "is the pool right?")


def load_pool(path: str | os.PathLike[str]) -> Pool:
    """Read a pool YAML file; any problem is one HetplanError line."""
    path = os.fspath(path)
    return pool_from_dict(read_yaml(path, "pool file"), source=path)


# --- allocations -------------------------------------------------------------------
def check_counts(pool: Pool, counts: Sequence[int]) -> None:
    """``counts``: one whole number of nodes per offer, within the offer, not all zero."""
    if len(counts) != len(pool.offers):
        raise HetplanError(f"an allocation of pool {pool.name!r} gives one node count per offer "
                           f"({len(pool.offers)}), got {len(counts)}")
    for offer, count in zip(pool.offers, counts):
        if not 0 <= count <= offer.nodes:
            raise HetplanError(f"offer {offer.name!r} has {offer.nodes} nodes; an allocation took {count}")
    if not any(counts):
        raise HetplanError(f"an allocation of pool {pool.name!r} takes no nodes")


def allocation_label(pool: Pool, counts: Sequence[int]) -> str:
    """'2x8 A100-40GB@a + 3x8 V100-16GB@b': the nodes taken from each offer."""
    return " + ".join(f"{n}x{o.gpus_per_node} {o.name}" for o, n in zip(pool.offers, counts) if n)


def allocation_zones(pool: Pool, counts: Sequence[int]) -> tuple[str, ...]:
    """The zone of each node of the allocation's cluster, in node order."""
    return tuple(o.zone for o, n in zip(pool.offers, counts) for _ in range(n))


def allocation_cluster(pool: Pool, counts: Sequence[int]) -> ClusterSpec:
    """The cluster of ``counts[i]`` nodes of each offer ``i``, in offer order,
    each node in its offer's zone (links as the module docstring says)."""
    check_counts(pool, counts)
    zones = set(allocation_zones(pool, counts))
    nodes: list[NodeSpec] = []
    for offer, count in zip(pool.offers, counts):
        nodes += [NodeSpec(offer.gpu, offer.gpus_per_node, offer.intra_node_bandwidth_gbps,
                           offer.inter_node_bandwidth_gbps, name=f"{offer.name}-{k}",
                           price_per_gpu_hour=offer.price_per_gpu_hour, zone=offer.zone)
                  for k in range(count)]
    where = (f"zones {', '.join(sorted(zones))}, {pool.inter_zone_bandwidth_gbps:g} Gbps between them"
             if len(zones) > 1 else f"zone {next(iter(zones))}")
    label = "-".join(f"{n}x{o.name}" for o, n in zip(pool.offers, counts) if n)
    return ClusterSpec(f"{pool.name}-{label}", tuple(nodes), 0.0,
                       description=f"allocation {allocation_label(pool, counts)} of pool {pool.name!r} ({where})",
                       inter_zone_bandwidth_gbps=pool.inter_zone_bandwidth_gbps)
