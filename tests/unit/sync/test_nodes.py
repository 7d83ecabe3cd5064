"""The pure half of the node-by-node exchange: who is on which node, and when it applies."""

from __future__ import annotations

from hpc.sync._nodes import Topology, hierarchy_problem, topology_of


def test_nodes_are_numbered_by_their_first_rank_and_keep_rank_order() -> None:
    topo = topology_of(["b:1", "a:1", "b:1", "a:1", "c:2", "c:2"])
    assert topo.nodes == ((0, 2), (1, 3), (4, 5))
    assert [topo.node_of(r) for r in range(6)] == [0, 1, 0, 1, 2, 2]
    assert [topo.local_of(r) for r in range(6)] == [0, 0, 1, 1, 0, 1]


def test_same_host_name_with_another_dev_shm_is_another_node() -> None:
    assert topology_of(["h:5", "h:6"]).nodes == ((0,), (1,))


def test_applies_to_two_or_more_nodes_with_the_same_two_or_more_ranks() -> None:
    assert hierarchy_problem(Topology(((0, 1), (2, 3)))) is None
    assert hierarchy_problem(Topology(((0, 1, 2), (3, 4, 5), (6, 7, 8)))) is None


def test_does_not_apply_and_says_why() -> None:
    assert "one node" in hierarchy_problem(Topology(((0, 1, 2, 3),)))
    assert "one rank per node" in hierarchy_problem(Topology(((0,), (1,), (2,))))
    uneven = hierarchy_problem(Topology(((0, 1), (2,))))
    assert "different numbers of ranks (2, 1)" in uneven
