"""The network checks rank 0 runs on every node's report (pure)."""

from __future__ import annotations

from typing import Any

from hpc.bootstrap import network

# node2 of the test cluster with a second interface (as the cluster test gives it)
NODE2 = [("eth0", "10.200.0.12", 24), ("hpcx0", "10.201.0.12", 24)]


def _node(host: str, addrs: list[tuple[str, str, int]], resolved: str | None = None,
          by_hand: bool = False, **ifnames: str) -> dict[str, Any]:
    return {"host": host, "resolved": resolved or (addrs[0][1] if addrs else None),
            "addrs": addrs, "ifnames": ifnames, "by_hand": by_hand}


def test_loopback_hostname_on_a_multi_node_gloo_run() -> None:
    nodes = [_node("node1", [("eth0", "10.200.0.11", 24)]),
             _node("node2", NODE2, resolved="127.0.1.1")]
    err = network.check(nodes, "gloo")
    assert err is not None
    assert "node2 -> 127.0.1.1" in str(err) and "GLOO_SOCKET_IFNAME" in str(err)
    assert "HINT:" in str(err) and "node2: eth0 10.200.0.12" in str(err)
    assert network.check(nodes, "nccl") is None  # NCCL does not use the hostname
    nodes[1]["ifnames"] = {"GLOO_SOCKET_IFNAME": "eth0"}  # pinned: fixed
    assert network.check(nodes, "gloo") is None


def test_single_node_is_never_checked() -> None:
    one = [_node("node1", [], resolved="127.0.1.1"), _node("node1", [], resolved="127.0.1.1")]
    assert network.check(one, "gloo") is None


def test_nodes_that_reach_each_other_through_routers_are_not_refused() -> None:
    """No subnet holds every node, yet they work: routed subnets, cloud VMs whose NIC
    has a /32 address (the gateway routes), IPv6-only nodes (no IPv4 address at all)."""
    routed = [_node("node1", [("eth0", "10.1.0.11", 24)]),
              _node("node2", [("eth1", "10.2.0.12", 24)])]
    cloud = [_node("vm-a", [("ens4", "10.128.0.2", 32)]),
             _node("vm-b", [("ens4", "10.128.0.3", 32)])]
    ipv6 = [_node("node1", [], resolved="fd00::11"), _node("node2", [], resolved="fd00::12")]
    for nodes in (routed, cloud, ipv6):
        for backend in ("gloo", "cpu:gloo,cuda:nccl", "nccl", None):
            assert network.check(nodes, backend) is None, (nodes, backend)


def test_the_same_address_on_every_node_is_refused() -> None:
    """A bridge such as docker0 holds 172.17.0.1 on every node: a peer that connects to
    the address a node advertises reaches its own copy."""
    docker = ("docker0", "172.17.0.1", 16)
    nodes = [_node("a", [docker]), _node("b", [docker])]  # the host names resolve to it
    err = network.check(nodes, "gloo")
    assert err is not None
    text = str(err)
    assert "172.17.0.1" in text and "a, b" in text and "gloo" in text, text
    assert "HINT:" in text and "GLOO_SOCKET_IFNAME" in text, text
    # a distinct address per node beside it: gloo advertises those, docker0 is harmless
    nodes = [_node("a", [("eth0", "10.0.0.1", 24), docker]),
             _node("b", [("eth0", "10.1.0.1", 24), docker])]
    assert network.check(nodes, "cpu:gloo,cuda:nccl") is None


def test_nccl_on_an_interface_with_the_same_address_on_every_node_is_refused() -> None:
    """Vagrant/VirtualBox nodes: eth0 is the NAT interface, 10.0.2.15 on every VM, and
    NCCL takes the first interface that is not docker/lo/virbr (NVIDIA/nccl
    src/misc/socket.cc, ncclFindInterfaces) unless NCCL_SOCKET_IFNAME names one."""
    nat = ("eth0", "10.0.2.15", 24)
    nodes = [_node("vm1", [nat, ("eth1", "192.168.56.11", 24)], resolved="192.168.56.11"),
             _node("vm2", [nat, ("eth1", "192.168.56.12", 24)], resolved="192.168.56.12")]
    assert network.check(nodes, "gloo") is None  # gloo binds to the host name's address
    err = network.check(nodes, "cpu:gloo,cuda:nccl")
    assert err is not None
    text = str(err)
    assert "10.0.2.15" in text and "eth0" in text and "NCCL" in text, text
    assert "NCCL_SOCKET_IFNAME=eth1" in text, text  # the one with distinct addresses
    for n in nodes:
        n["ifnames"] = {"NCCL_SOCKET_IFNAME": "eth1"}
    assert network.check(nodes, "cpu:gloo,cuda:nccl") is None
    # a hand-set interface is checked too: the same address there is just as broken
    for n in nodes:
        n["ifnames"] = {"GLOO_SOCKET_IFNAME": "eth0"}
        n["by_hand"] = True
    assert "10.0.2.15" in str(network.check(nodes, "gloo"))


def test_nccl_prefers_ib_interfaces_as_nccl_does() -> None:
    report = _node("n", [("eth0", "10.1.0.12", 16), ("docker0", "172.17.0.1", 16),
                         ("ib0", "10.2.0.12", 16)])
    assert network.nccl_address(report) == ("ib0", "10.2.0.12")
    report["addrs"] = report["addrs"][:2]
    assert network.nccl_address(report) == ("eth0", "10.1.0.12")
    report["ifnames"] = {"NCCL_SOCKET_IFNAME": "^eth"}
    assert network.nccl_address(report) == ("docker0", "172.17.0.1")
    report["ifnames"] = {"NCCL_SOCKET_IFNAME": "=eth"}  # exact name: none
    assert network.nccl_address(report) is None


def test_the_master_is_probed_only_where_nothing_shows_it_reachable() -> None:
    master = _node("node1", [("eth0", "10.200.0.11", 24)])
    here = _node("node2", NODE2)
    # on-link, or the address the store was reached at: nothing to probe
    assert network.probe_targets(here, master, "10.200.0.11", "gloo") == []
    assert network.probe_targets(here, master, None, "cpu:gloo,cuda:nccl") == []
    assert network.probe_targets(master, master, None, "gloo") == []  # same node
    routed = _node("node1", [("eth0", "10.1.0.11", 24)])
    cloud = _node("vm-b", [("ens4", "10.128.0.3", 32)])
    assert network.probe_targets(cloud, routed, None, "gloo") == [
        {"for": "gloo", "addr": "10.1.0.11", "iface": None}]
    assert network.probe_targets(cloud, routed, "10.1.0.11", "gloo") == []  # reached
    assert network.probe_targets(cloud, routed, None, "nccl") == [
        {"for": "NCCL", "addr": "10.1.0.11", "iface": "eth0"}]
    v6 = _node("node1", [], resolved="fd00::11")
    assert network.probe_targets(_node("node2", [], resolved="fd00::12"), v6, None,
                                 "gloo") == [{"for": "gloo", "addr": "fd00::11", "iface": None}]
    # loopback or the node's own address: check() refuses those without a probe
    assert network.probe_targets(cloud, _node("node1", [], resolved="127.0.1.1"), None,
                                 "gloo") == []
    assert network.probe_targets(_node("b", [("docker0", "172.17.0.1", 16)]),
                                 _node("a", [("docker0", "172.17.0.1", 16)]), None,
                                 "gloo") == []


def test_a_failed_probe_of_the_master_is_refused() -> None:
    master = _node("node1", [("eth0", "10.200.0.11", 24), ("hpcr1", "10.202.1.11", 24)],
                   GLOO_SOCKET_IFNAME="hpcr1")
    node2 = _node("node2", NODE2, GLOO_SOCKET_IFNAME="eth0")
    node2["probes"] = [{"for": "gloo", "addr": "10.202.1.11", "iface": "hpcr1",
                        "port": 29500, "error": "[Errno 101] Network is unreachable"}]
    err = network.check([master, node2], "gloo")
    assert err is not None
    text = str(err)
    assert "node2 cannot reach the master's gloo address 10.202.1.11 (hpcr1 on node1)" \
        in text, text
    assert "Network is unreachable" in text and "HINT:" in text, text
    node2["probes"][0]["error"] = None  # reached: trusted
    assert network.check([master, node2], "gloo") is None


def test_a_host_name_that_does_not_resolve_is_loopback_to_gloo() -> None:
    """torch's gloo falls back to 127.0.0.1 when the host name resolves to no usable
    address ("Unable to resolve hostname to a (local) address")."""
    nodes = [_node("node1", [("eth0", "10.200.0.11", 24)]), _node("node2", NODE2)]
    nodes[1]["resolved"] = None
    err = network.check(nodes, "gloo")
    assert err is not None and "node2 -> (does not resolve)" in str(err), err
    assert network.check(nodes, "nccl") is None
