"""A requeued job's ExcNodeList (:mod:`hpc.preempt.exclude`): the pure parts."""

from __future__ import annotations

from hpc.preempt.exclude import excluded_hosts, placeable

FOUR = ["node1", "node2", "node3", "node4"]


def test_the_exclusions_scontrol_prints_are_expanded_ranges_and_all() -> None:
    assert excluded_hosts("(null)") == [] and excluded_hosts("") == []
    assert excluded_hosts("node[3-4]") == ["node3", "node4"]
    assert excluded_hosts("node[1,3],gpu07") == ["node1", "node3", "gpu07"]


def test_a_ranged_exclusion_counts_every_host_it_holds_so_the_job_can_still_run() -> None:
    """A 2-node job on 4 nodes with node[3-4] excluded already: striking node1 would
    leave node2 alone, so node1 stays in. Read as one name, the range kept 4 nodes in the
    count, node1 was excluded too and the requeued job pended for ever."""
    before = excluded_hosts("node[3-4]")
    assert placeable(["node1"], before, FOUR, 2) == ([], ["node1"])
    assert placeable(["node1"], ["node[3-4]"], FOUR, 2) == (["node1"], [])  # the old reading
    assert placeable(["node1"], excluded_hosts("node4"), FOUR, 2) == (["node1"], [])


def test_hosts_are_excluded_in_order_until_the_job_would_not_fit() -> None:
    assert placeable(["node2", "node3", "node1"], [], FOUR, 2) == (["node2", "node3"], ["node1"])
    assert placeable(["node9"], [], FOUR, 4) == (["node9"], [])  # not in the partition
    assert placeable(["node1"], [], [], 2) == (["node1"], [])     # sinfo could not say
