"""Interface discovery: the choice of interface and the network checks (pure parts)."""

from __future__ import annotations

import socket
from typing import Any

import pytest

from hpc.bootstrap import network
from hpc.errors import LaunchEnvironmentError

# node2 of the test cluster with a second interface (as the cluster test gives it)
NODE2 = [("eth0", "10.200.0.12", 24), ("hpcx0", "10.201.0.12", 24)]


def _node(host: str, addrs: list[tuple[str, str, int]], resolved: str | None = None,
          by_hand: bool = False, **ifnames: str) -> dict[str, Any]:
    return {"host": host, "resolved": resolved or (addrs[0][1] if addrs else None),
            "addrs": addrs, "ifnames": ifnames, "by_hand": by_hand}


def test_choose_the_one_interface_on_the_masters_subnet() -> None:
    assert network.choose(NODE2, "10.200.0.11") == "eth0"
    assert network.choose(NODE2, "10.201.0.5") == "hpcx0"
    assert network.choose(NODE2, "10.200.0.12") == "eth0"  # the master node itself


def test_choose_nothing_when_routed_ambiguous_or_local() -> None:
    assert network.choose(NODE2, "192.168.1.1") is None  # routed: not one on-link interface
    both = [("eth0", "10.0.0.2", 16), ("eth1", "10.0.1.2", 24)]
    assert network.choose(both, "10.0.1.9") is None  # two interfaces reach it
    assert network.choose(NODE2, "127.0.0.1") is None  # single node
    assert network.choose(NODE2, None) is None


def test_interface_env_returns_only_unset_variables() -> None:
    env = {"NCCL_SOCKET_IFNAME": "ib0"}
    assert network.interface_env("10.200.0.11", env, addrs=NODE2) == {
        "GLOO_SOCKET_IFNAME": "eth0"}
    assert env == {"NCCL_SOCKET_IFNAME": "ib0"}  # returned, not written
    assert network.interface_env("10.200.0.11", {}, addrs=NODE2) == {
        "GLOO_SOCKET_IFNAME": "eth0", "NCCL_SOCKET_IFNAME": "eth0"}
    both = {"GLOO_SOCKET_IFNAME": "eth1", "NCCL_SOCKET_IFNAME": "ib0"}
    assert network.interface_env("10.200.0.11", both, addrs=NODE2) == {}  # both set
    # an empty value counts as unset, as before
    assert network.interface_env("10.200.0.11", {"GLOO_SOCKET_IFNAME": ""},
                                 addrs=NODE2) == {"GLOO_SOCKET_IFNAME": "eth0",
                                                  "NCCL_SOCKET_IFNAME": "eth0"}
    assert network.interface_env("192.168.1.1", {}, addrs=NODE2) == {}  # routed


def test_interface_env_print_mode_prints_on_local_rank_0_and_returns_nothing(
        capsys: pytest.CaptureFixture[str]) -> None:
    env: dict[str, str] = {}
    assert network.interface_env("10.200.0.11", env, 0, "print", addrs=NODE2) == {}
    assert env == {}
    assert "export GLOO_SOCKET_IFNAME=eth0 NCCL_SOCKET_IFNAME=eth0" in capsys.readouterr().err
    assert network.interface_env("10.200.0.11", env, 1, "print", addrs=NODE2) == {}
    assert capsys.readouterr().err == ""
    assert network.interface_env("10.200.0.11", env, 0, "off", addrs=NODE2) == {}


def test_nccl_keeps_its_own_choice_when_an_ib_interface_is_up() -> None:
    """The master on eth0's subnet (the management NIC) must not pin NCCL to eth0 when
    ib0 is up: NCCL takes ib* by itself, and over its socket transport (IPoIB, no RDMA
    in a container) every inter-node byte would move to the slow NIC. Gloo, which
    binds to the host name otherwise, is still pinned to the interface of the master."""
    addrs = [("eth0", "10.1.0.12", 16), ("ib0", "10.2.0.12", 16)]
    assert network.interface_env("10.1.0.11", {}, addrs=addrs) == {
        "GLOO_SOCKET_IFNAME": "eth0"}
    assert network.interface_env("10.1.0.11", {"GLOO_SOCKET_IFNAME": "eth0"},
                                 addrs=addrs) == {}
    # the master on ib0's subnet: both pinned to ib0, what NCCL would take anyway
    assert network.interface_env("10.2.0.11", {}, addrs=addrs) == {
        "GLOO_SOCKET_IFNAME": "ib0", "NCCL_SOCKET_IFNAME": "ib0"}


def test_nccl_is_not_pinned_to_a_slower_link_than_another_interface() -> None:
    """RoCE NICs have Ethernet names; /sys/class/net/*/speed tells them from the 1 Gb/s
    management port. Unknown or equal speeds (veths, the test cluster) pin as before."""
    addrs = [("eno1", "10.1.0.12", 16), ("ens1f0np0", "10.3.0.12", 16)]
    fast = {"eno1": 1000, "ens1f0np0": 100000}
    assert network.interface_env("10.1.0.11", {}, addrs=addrs, speeds=fast) == {
        "GLOO_SOCKET_IFNAME": "eno1"}
    for speeds in ({}, {"eno1": 10000, "ens1f0np0": 10000}, {"ens1f0np0": 100000}):
        assert network.interface_env("10.1.0.11", {}, addrs=addrs, speeds=speeds) == {
            "GLOO_SOCKET_IFNAME": "eno1", "NCCL_SOCKET_IFNAME": "eno1"}, speeds


def test_print_mode_says_that_nccl_keeps_its_choice(capsys: pytest.CaptureFixture[str]) -> None:
    addrs = [("eth0", "10.1.0.12", 16), ("ib0", "10.2.0.12", 16)]
    assert network.interface_env("10.1.0.11", {}, 0, "print", addrs=addrs) == {}
    err = capsys.readouterr().err
    assert "to pin it: export GLOO_SOCKET_IFNAME=eth0" in err, err
    assert "NCCL_SOCKET_IFNAME=eth0" not in err and "ib0" in err, err


def test_mode_refuses_unknown_values() -> None:
    assert network.mode({}) == "set"
    with pytest.raises(LaunchEnvironmentError, match="HPC_NETWORK='auto' is not one of"):
        network.mode({"HPC_NETWORK": "auto"})


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


def test_addresses_of_this_host_are_real() -> None:
    found = network.addresses()
    for name, addr, prefix in found:
        assert name in {n for _, n in socket.if_nameindex()}
        assert not addr.startswith("127.") and 0 < prefix <= 32
    report = network.local_report({"GLOO_SOCKET_IFNAME": "x"}, {})
    assert report["host"] == socket.gethostname() and report["by_hand"]
    assert not network.local_report({"GLOO_SOCKET_IFNAME": "x"},
                                    {"GLOO_SOCKET_IFNAME": "x"})["by_hand"]


def test_a_host_name_that_does_not_resolve_is_loopback_to_gloo() -> None:
    """torch's gloo falls back to 127.0.0.1 when the host name resolves to no usable
    address ("Unable to resolve hostname to a (local) address")."""
    nodes = [_node("node1", [("eth0", "10.200.0.11", 24)]), _node("node2", NODE2)]
    nodes[1]["resolved"] = None
    err = network.check(nodes, "gloo")
    assert err is not None and "node2 -> (does not resolve)" in str(err), err
    assert network.check(nodes, "nccl") is None
