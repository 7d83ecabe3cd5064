"""This node's interfaces and the choice of interface (pure parts, and this host's own)."""

from __future__ import annotations

import socket

import pytest

from hpc.bootstrap import interfaces
from hpc.errors import LaunchEnvironmentError

# node2 of the test cluster with a second interface (as the cluster test gives it)
NODE2 = [("eth0", "10.200.0.12", 24), ("hpcx0", "10.201.0.12", 24)]


def test_choose_the_one_interface_on_the_masters_subnet() -> None:
    assert interfaces.choose(NODE2, "10.200.0.11") == "eth0"
    assert interfaces.choose(NODE2, "10.201.0.5") == "hpcx0"
    assert interfaces.choose(NODE2, "10.200.0.12") == "eth0"  # the master node itself


def test_choose_nothing_when_routed_ambiguous_or_local() -> None:
    assert interfaces.choose(NODE2, "192.168.1.1") is None  # routed: not one on-link interface
    both = [("eth0", "10.0.0.2", 16), ("eth1", "10.0.1.2", 24)]
    assert interfaces.choose(both, "10.0.1.9") is None  # two interfaces reach it
    assert interfaces.choose(NODE2, "127.0.0.1") is None  # single node
    assert interfaces.choose(NODE2, None) is None


def test_interface_env_returns_only_unset_variables() -> None:
    env = {"NCCL_SOCKET_IFNAME": "ib0"}
    assert interfaces.interface_env("10.200.0.11", env, addrs=NODE2) == {
        "GLOO_SOCKET_IFNAME": "eth0"}
    assert env == {"NCCL_SOCKET_IFNAME": "ib0"}  # returned, not written
    assert interfaces.interface_env("10.200.0.11", {}, addrs=NODE2) == {
        "GLOO_SOCKET_IFNAME": "eth0", "NCCL_SOCKET_IFNAME": "eth0"}
    both = {"GLOO_SOCKET_IFNAME": "eth1", "NCCL_SOCKET_IFNAME": "ib0"}
    assert interfaces.interface_env("10.200.0.11", both, addrs=NODE2) == {}  # both set
    # an empty value counts as unset, as before
    assert interfaces.interface_env("10.200.0.11", {"GLOO_SOCKET_IFNAME": ""},
                                    addrs=NODE2) == {"GLOO_SOCKET_IFNAME": "eth0",
                                                     "NCCL_SOCKET_IFNAME": "eth0"}
    assert interfaces.interface_env("192.168.1.1", {}, addrs=NODE2) == {}  # routed


def test_interface_env_print_mode_prints_on_local_rank_0_and_returns_nothing(
        capsys: pytest.CaptureFixture[str]) -> None:
    env: dict[str, str] = {}
    assert interfaces.interface_env("10.200.0.11", env, 0, "print", addrs=NODE2) == {}
    assert env == {}
    assert "export GLOO_SOCKET_IFNAME=eth0 NCCL_SOCKET_IFNAME=eth0" in capsys.readouterr().err
    assert interfaces.interface_env("10.200.0.11", env, 1, "print", addrs=NODE2) == {}
    assert capsys.readouterr().err == ""
    assert interfaces.interface_env("10.200.0.11", env, 0, "off", addrs=NODE2) == {}


def test_nccl_keeps_its_own_choice_when_an_ib_interface_is_up() -> None:
    """The master on eth0's subnet (the management NIC) must not pin NCCL to eth0 when
    ib0 is up: NCCL takes ib* by itself, and over its socket transport (IPoIB, no RDMA
    in a container) every inter-node byte would move to the slow NIC. Gloo, which
    binds to the host name otherwise, is still pinned to the interface of the master."""
    addrs = [("eth0", "10.1.0.12", 16), ("ib0", "10.2.0.12", 16)]
    assert interfaces.interface_env("10.1.0.11", {}, addrs=addrs) == {
        "GLOO_SOCKET_IFNAME": "eth0"}
    assert interfaces.interface_env("10.1.0.11", {"GLOO_SOCKET_IFNAME": "eth0"},
                                    addrs=addrs) == {}
    # the master on ib0's subnet: both pinned to ib0, what NCCL would take anyway
    assert interfaces.interface_env("10.2.0.11", {}, addrs=addrs) == {
        "GLOO_SOCKET_IFNAME": "ib0", "NCCL_SOCKET_IFNAME": "ib0"}


def test_nccl_is_not_pinned_to_a_slower_link_than_another_interface() -> None:
    """RoCE NICs have Ethernet names; /sys/class/net/*/speed tells them from the 1 Gb/s
    management port. Unknown or equal speeds (veths, the test cluster) pin as before."""
    addrs = [("eno1", "10.1.0.12", 16), ("ens1f0np0", "10.3.0.12", 16)]
    fast = {"eno1": 1000, "ens1f0np0": 100000}
    assert interfaces.interface_env("10.1.0.11", {}, addrs=addrs, speeds=fast) == {
        "GLOO_SOCKET_IFNAME": "eno1"}
    for speeds in ({}, {"eno1": 10000, "ens1f0np0": 10000}, {"ens1f0np0": 100000}):
        assert interfaces.interface_env("10.1.0.11", {}, addrs=addrs, speeds=speeds) == {
            "GLOO_SOCKET_IFNAME": "eno1", "NCCL_SOCKET_IFNAME": "eno1"}, speeds


def test_print_mode_says_that_nccl_keeps_its_choice(capsys: pytest.CaptureFixture[str]) -> None:
    addrs = [("eth0", "10.1.0.12", 16), ("ib0", "10.2.0.12", 16)]
    assert interfaces.interface_env("10.1.0.11", {}, 0, "print", addrs=addrs) == {}
    err = capsys.readouterr().err
    assert "to pin it: export GLOO_SOCKET_IFNAME=eth0" in err, err
    assert "NCCL_SOCKET_IFNAME=eth0" not in err and "ib0" in err, err


def test_mode_refuses_unknown_values() -> None:
    assert interfaces.mode({}) == "set"
    with pytest.raises(LaunchEnvironmentError, match="HPC_NETWORK='auto' is not one of"):
        interfaces.mode({"HPC_NETWORK": "auto"})


def test_addresses_of_this_host_are_real() -> None:
    found = interfaces.addresses()
    for name, addr, prefix in found:
        assert name in {n for _, n in socket.if_nameindex()}
        assert not addr.startswith("127.") and 0 < prefix <= 32
    report = interfaces.local_report({"GLOO_SOCKET_IFNAME": "x"}, {})
    assert report["host"] == socket.gethostname() and report["by_hand"]
    assert not interfaces.local_report({"GLOO_SOCKET_IFNAME": "x"},
                                       {"GLOO_SOCKET_IFNAME": "x"})["by_hand"]
