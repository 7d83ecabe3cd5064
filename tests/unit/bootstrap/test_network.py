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


def test_no_common_network() -> None:
    nodes = [_node("node1", [("eth0", "10.200.0.11", 24)]),
             _node("node2", [("eth1", "10.9.0.2", 24)])]
    err = network.check(nodes, "gloo")
    assert err is not None and "share no network" in str(err)
    assert "node1 has eth0 10.200.0.11/24; node2 has eth1 10.9.0.2/24" in str(err)
    nodes[1]["by_hand"] = True  # the user chose the interface: trusted
    nodes[1]["ifnames"] = {"GLOO_SOCKET_IFNAME": "eth1", "NCCL_SOCKET_IFNAME": "eth1"}
    assert network.check(nodes, "gloo") is None


def test_a_bridge_with_the_same_address_on_every_node_is_no_common_network() -> None:
    docker = ("docker0", "172.17.0.1", 16)
    nodes = [_node("a", [("eth0", "10.0.0.1", 24), docker]),
             _node("b", [("eth0", "10.1.0.1", 24), docker])]
    assert "share no network" in str(network.check(nodes, "gloo"))
    nodes[1]["addrs"].append(("ib0", "10.2.0.2", 24))
    nodes[0]["addrs"].append(("ib0", "10.2.0.1", 24))
    assert network.check(nodes, "gloo") is None  # ib0's subnet is shared


def test_addresses_of_this_host_are_real() -> None:
    found = network.addresses()
    for name, addr, prefix in found:
        assert name in {n for _, n in socket.if_nameindex()}
        assert not addr.startswith("127.") and 0 < prefix <= 32
    report = network.local_report({"GLOO_SOCKET_IFNAME": "x"}, {})
    assert report["host"] == socket.gethostname() and report["by_hand"]
    assert not network.local_report({"GLOO_SOCKET_IFNAME": "x"},
                                    {"GLOO_SOCKET_IFNAME": "x"})["by_hand"]
