"""Metis device groups and the stage-mapping prunings (Metis §4.1, §4.2.2)."""

from __future__ import annotations

import pytest

from hetplan.cluster.io import load_cluster
from hetplan.cluster.spec import ClusterSpec, NodeSpec
from hetplan.errors import HetplanError
from hetplan.search.metis.groups import (
    MappingEnumerator,
    cut_mapping,
    distinct_permutations,
    enumerate_device_groups,
    group_signature,
    merge_smallest,
    min_group_size,
    node_sequences,
    size_multisets,
    stage_mappings,
)


def _cluster(*nodes: tuple[str, int], name: str = "test") -> ClusterSpec:
    return ClusterSpec(name, tuple(NodeSpec(gpu, n, 126.0, name=f"{gpu}-{i}") for i, (gpu, n) in enumerate(nodes)),
                       16.0)


def test_paper_example_six_groups_of_power_of_two_size() -> None:
    """§2.2: nodes 2xV and 2xT give (V), (T), (V,V), (T,T), (V,T), (V,V,T,T)."""
    groups = enumerate_device_groups(_cluster(("V100", 2), ("T4", 2)), sizes=[1, 2, 4])
    kinds = sorted(tuple(sorted(g.gpu_counts)) for g in groups)
    assert len(groups) == 6
    assert (("T4", 1), ("V100-16GB", 1)) in kinds
    assert (("T4", 2), ("V100-16GB", 2)) in kinds


def test_uneven_nodes_form_one_v100_plus_three_t4() -> None:
    """§4.1: one V100 in one node and three T4 in another make a group (V,T,T,T)."""
    groups = enumerate_device_groups(_cluster(("V100", 1), ("T4", 3)))
    four = [g for g in groups if g.size == 4]
    assert len(four) == 1
    assert dict(four[0].gpu_counts) == {"V100-16GB": 1, "T4": 3}
    assert four[0].is_hetero and four[0].num_nodes == 2


def test_groups_deduplicated_by_size_types_and_nodes() -> None:
    cluster = _cluster(("T4", 2), ("T4", 2), ("T4", 1))
    groups = enumerate_device_groups(cluster)
    signatures = [g.signature for g in groups]
    assert len(signatures) == len(set(signatures))
    # two GPUs from one 2-GPU node, from two 2-GPU nodes, or a 2-GPU node's GPU + the 1-GPU node differ
    two = [g for g in groups if g.size == 2]
    assert len(two) == 3
    # picking from node 0 or node 1 (interchangeable) is one group
    assert group_signature(cluster, [0, 1]) == group_signature(cluster, [2, 3])


def test_lower_bound_on_group_size_is_a_float_rule() -> None:
    assert min_group_size(16, 4, 0.5) == pytest.approx(2.0)
    assert min_group_size(16, 4, 0.25) == pytest.approx(3.0)
    assert min_group_size(16, 4, 1.0) == 0.0
    sizes = [1, 2, 4, 8, 16]
    assert all(min(m) >= 3 for m in size_multisets(16, 4, sizes, min_group_size(16, 4, 0.25)))
    assert any(min(m) == 2 for m in size_multisets(16, 4, sizes, min_group_size(16, 4, 0.5)))
    # a fractional var changes the search (the authors' integer parsing could not express it)
    cluster = load_cluster("metis-t4-v100-16")
    count = {var: sum(1 for s in range(1, 17) for _ in stage_mappings(cluster, s, var, 4)) for var in (0.3, 0.45, 0.5)}
    assert count[0.3] < count[0.45] <= count[0.5]


def test_bad_var_is_a_clear_error() -> None:
    cluster = load_cluster("metis-t4-v100-4")
    with pytest.raises(HetplanError, match="var"):
        list(stage_mappings(cluster, 2, var=1.5))


def test_merge_smallest_matches_the_paper_example() -> None:
    """§4.2.2: g1..g4 of one GPU and g5 of two, length 3 -> (g1,g2), (g3,g4), g5: 3 orderings."""
    units = merge_smallest([1, 1, 1, 1, 2], 3)
    assert sorted(units) == [(1, 1), (1, 1), (2,)]
    assert len(list(distinct_permutations(units))) == 3


def test_permutation_length_limits_the_orderings() -> None:
    sizes = [1, 1, 2, 2, 4, 8]
    for limit in (2, 3, 4, 6):
        units = merge_smallest(sizes, limit)
        assert len(units) <= limit
        assert sorted(s for u in units for s in u) == sorted(sizes)


def test_mappings_use_every_gpu_once_and_are_distinct() -> None:
    cluster = load_cluster("metis-uneven-c")
    for s in range(1, 5):
        keys = set()
        for mapping in stage_mappings(cluster, s, var=0.5, max_permute_len=4):
            used = [d for g in mapping.groups for d in g.devices]
            assert sorted(used) == list(range(cluster.num_devices))
            assert mapping.key not in keys
            keys.add(mapping.key)


def test_unpruned_enumeration_is_a_superset() -> None:
    cluster = load_cluster("metis-t4-v100-8")
    for s in (2, 3, 4):
        pruned = {m.key for m in stage_mappings(cluster, s, 0.4, 4)}
        full = {m.key for m in stage_mappings(cluster, s, 1.0, 64)}
        assert pruned <= full
        assert len(full) >= len(pruned)


def test_node_sequences_are_sorted_not_hash_ordered() -> None:
    cluster = load_cluster("metis-p100-t4-8")
    seqs = node_sequences(cluster)
    assert len(seqs) == 2
    first_types = [cluster.nodes[seq[0]].gpu.name for seq in seqs]
    assert first_types == sorted(first_types)


def test_node_aligned_cut_on_uneven_nodes() -> None:
    """Fig. 5: 1x1 A + 1x1 B + 1x2 B can be cut into three node-sized groups."""
    cluster = load_cluster("metis-uneven-a")
    sizes = {tuple(len(cluster.node_devices(n)) for n in seq) for seq in node_sequences(cluster)}
    assert sizes  # every sequence lays out all nodes
    found = False
    for seq in node_sequences(cluster):
        order = tuple(len(cluster.node_devices(n)) for n in seq)
        mapping = cut_mapping(cluster, seq, order)
        if all(g.num_nodes == 1 for g in mapping.groups):
            found = True
    assert found
    enumerated = [m for m in MappingEnumerator(cluster, 0.5, 4).mappings(3)]
    assert any(all(g.num_nodes == 1 for g in m.groups) for m in enumerated)
