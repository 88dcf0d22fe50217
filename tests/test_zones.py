"""Zones: a link between nodes of two zones runs at the inter-zone bandwidth,
a link inside a zone at the nodes' NICs (``ClusterSpec.link_gbps``,
``cost/comm.py``), each collective and pipeline send priced by the links of
its own group. The numbers below are the kernel's formulas worked by hand."""

from __future__ import annotations

from dataclasses import replace

import pytest
import yaml

from hetplan.app.replan import slowed_cluster
from hetplan.app.workload import WorkloadOptions, load_workload
from hetplan.cluster.io import cluster_from_dict, dump_cluster_yaml
from hetplan.cluster.spec import ClusterSpec, NodeSpec
from hetplan.cost.constants import COLLECTIVE_BANDWIDTH_EFFICIENCY
from hetplan.cost.model import CostModel
from hetplan.plan.workload import Workload
from hetplan.search.baselines.uniform import uniform_plan

NIC_GBPS = 48.0  # the issue-35 pool's network inside a zone (Sailor's data)
ZONE_GBPS = 8.7  # and between its zones


def bytes_per_s(gbps: float) -> float:
    return gbps * 1e9 / 8


def two_zones(zones: tuple[str, ...] = ("a", "a", "b", "b"), inter_zone: float = ZONE_GBPS) -> ClusterSpec:
    """Four nodes of 2 A100s (zones a, a, b, b unless told), 48 Gbps NICs."""
    nodes = tuple(NodeSpec("A100-40GB", 2, 2400, NIC_GBPS, name=f"n{i}", zone=zone) for i, zone in enumerate(zones))
    return ClusterSpec("zones", nodes, 0.0, description="four nodes in two zones",
                       inter_zone_bandwidth_gbps=inter_zone if any(zones) else 0.0)


@pytest.fixture(scope="module")
def tiny() -> Workload:
    return load_workload(WorkloadOptions(model="tiny-gpt", global_batch=16))


def test_pipeline_boundary_between_zones_runs_at_the_inter_zone_link(tiny):
    """pp4 x tp2, one stage per node: the boundary from node 1 (zone a) to
    node 2 (zone b) sends at 8.7 Gbps, the two inside a zone at 48. Each
    boundary is 2 streams between one pair of nodes, sharing their link:
    (1/2 of the bytes) x 2 / link."""
    workload = replace(tiny, cluster=two_zones())
    plan = uniform_plan(workload, dp=1, tp=2, pp=4, micro_batch_per_replica=1)
    model = CostModel(workload)
    sent = [float(model.kernel.arrays.output_bytes[s.layers[-1]]) * plan.micro_batch_size for s in plan.stages[:-1]]
    links = [NIC_GBPS, ZONE_GBPS, NIC_GBPS]
    assert model.p2p_times(plan) == pytest.approx([b / bytes_per_s(g) for b, g in zip(sent, links)], rel=1e-12)


def test_data_parallel_group_spanning_zones_runs_at_the_inter_zone_link(tiny):
    """All-reduce of M bytes over one GPU on each of N nodes is a ring over the
    nodes: 2(N-1)/N x M at the slowest link, which is the inter-zone link once
    the nodes span zones (the ring crosses twice, in parallel) and the NIC
    inside one; the all-to-all between two zones sends 1/2 of M over it."""
    kernel = CostModel(replace(tiny, cluster=two_zones())).kernel
    nic, zone = (bytes_per_s(g) * COLLECTIVE_BANDWIDTH_EFFICIENCY for g in (NIC_GBPS, ZONE_GBPS))
    assert kernel.collective_rate("allreduce", (0, 2)) == pytest.approx(1 / nic, rel=1e-12)  # nodes 0, 1: zone a
    assert kernel.collective_rate("allreduce", (4, 6)) == pytest.approx(1 / nic, rel=1e-12)  # nodes 2, 3: zone b
    assert kernel.collective_rate("allreduce", (0, 4)) == pytest.approx(1 / zone, rel=1e-12)  # a and b
    assert kernel.collective_rate("allreduce", (0, 2, 4, 6)) == pytest.approx(2 * 3 / (4 * zone), rel=1e-12)
    assert kernel.collective_rate("allreduce", (0, 2, 4, 6), 2) == pytest.approx(2 * 2 * 3 / (4 * zone), rel=1e-12)
    assert kernel.collective_rate("alltoall", (0, 2)) == pytest.approx(1 / (2 * nic), rel=1e-12)
    assert kernel.collective_rate("alltoall", (0, 4)) == pytest.approx(1 / (2 * zone), rel=1e-12)


def test_zones_move_only_the_traffic_that_crosses_them(tiny):
    """dp4 x tp2 over the four nodes: the gradient all-reduce crosses zones,
    so the plan syncs slower than with no zones; pp2 x dp2 x tp2 keeps each
    stage's dp group in one zone and costs exactly as with no zones but for
    its one boundary. Nodes all in one zone cost exactly as no zones."""
    plain = CostModel(replace(tiny, cluster=two_zones(("",) * 4)))
    zoned = CostModel(replace(tiny, cluster=two_zones()))
    one_zone = CostModel(replace(tiny, cluster=two_zones(("a",) * 4)))
    spanning = uniform_plan(zoned.workload, dp=4, tp=2, pp=1, micro_batch_per_replica=1)
    piped = uniform_plan(zoned.workload, dp=2, tp=2, pp=2, micro_batch_per_replica=1)
    assert zoned.estimate(spanning).dp_sync_s > plain.estimate(spanning).dp_sync_s
    assert zoned.estimate(piped).dp_sync_s == plain.estimate(piped).dp_sync_s
    assert zoned.p2p_times(piped)[0] == pytest.approx(plain.p2p_times(piped)[0] * NIC_GBPS / ZONE_GBPS, rel=1e-12)
    for plan in (spanning, piped):
        assert one_zone.estimate(plan) == plain.estimate(plan)


def test_cluster_file_keeps_zones():
    cluster = two_zones()
    again = cluster_from_dict(yaml.safe_load(dump_cluster_yaml(cluster)))
    assert again == cluster and [n.zone for n in again.nodes] == ["a", "a", "b", "b"]
    assert again.link_gbps(0, 4) == ZONE_GBPS and again.link_gbps(0, 2) == NIC_GBPS


def test_replan_keeps_the_zones_links_in_its_matrix():
    """replan's cluster of a slowed GPU reads its device matrix off
    ``link_gbps``: the nodes keep their zones and every link its bandwidth."""
    cluster = two_zones()
    slowed = slowed_cluster(cluster, {0: 2.0})
    assert [n.zone for n in slowed.nodes] == ["a", "a", "a", "b", "b"]  # node 0 cut into runs of one GPU type
    assert all(slowed.link_gbps(a, b) == cluster.link_gbps(a, b) for a in range(8) for b in range(8) if a != b)
