"""Which networks the nodes share, and which interface reaches the master.

Gloo and NCCL connect every rank to every other over one interface per node. Left
alone, gloo binds to the address the hostname resolves to, and NCCL to the first
interface it likes; both go wrong in ways that only show as a hang in
``init_process_group`` or the first collective (pytorch/pytorch#8672):

* the hostname resolves to ``127.0.1.1`` (Debian's default ``/etc/hosts``): gloo
  advertises a loopback address, and peers on other nodes that connect to it reach their
  own loopback ("Gloo connectFullMesh failed ... Connection refused");
* the nodes have no network in common (or only a bridge such as ``docker0`` that holds
  the same address on every node).

The pre-flight (:mod:`hpc.bootstrap.preflight`) publishes what :func:`local_report`
sees on each node to the store, and rank 0 runs :func:`check` on every node's report.
Before that, :func:`interface_env` returns ``GLOO_SOCKET_IFNAME``/``NCCL_SOCKET_IFNAME``
when they are unset and exactly one interface of this node is on the master's subnet;
:func:`hpc.init_torch` exports them (:mod:`hpc.bootstrap.distributed` writes the
environment) before the pre-flight and ``init_process_group``.

``HPC_NETWORK`` chooses: ``set`` (default) sets the variables, ``print`` only prints
the ``export`` line on each node's local rank 0, ``off`` skips discovery and checks.

Addresses are the primary IPv4 address of each interface that is up (Linux
``SIOCGIFADDR``/``SIOCGIFNETMASK`` ioctls; nothing to install); IPv6-only networks are
not checked.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import struct
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from hpc.errors import LaunchEnvironmentError

__all__ = ["IFNAME_VARS", "MODES", "Address", "addresses", "check", "choose",
           "interface_env", "local_report", "mode"]

logger = logging.getLogger(__name__)

#: The variables that name the interface gloo and NCCL use between nodes.
IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
#: Values of ``HPC_NETWORK``.
MODES = ("set", "print", "off")

#: ``(interface, IPv4 address, prefix length)``.
Address = tuple[str, str, int]

_SIOCGIFFLAGS, _SIOCGIFADDR, _SIOCGIFNETMASK = 0x8913, 0x8915, 0x891B
_IFF_UP, _IFF_LOOPBACK = 0x1, 0x8


def mode(environ: Mapping[str, str]) -> str:
    """``HPC_NETWORK`` (default ``set``).

    Raises:
        LaunchEnvironmentError: not one of :data:`MODES`.
    """
    value = environ.get("HPC_NETWORK", "set") or "set"
    if value not in MODES:
        raise LaunchEnvironmentError(
            f"HPC_NETWORK={value!r} is not one of {', '.join(MODES)}.\n"
            "It says what the pre-flight does about the network interface.\n"
            "HINT: set (pin GLOO_SOCKET_IFNAME/NCCL_SOCKET_IFNAME when one interface "
            "reaches the master), print (only print it) or off (no network checks).")
    return value


def addresses() -> list[Address]:
    """This host's non-loopback IPv4 addresses, one per interface that is up."""
    try:
        import fcntl
    except ImportError:  # not POSIX
        return []
    found: list[Address] = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            req = struct.pack("256s", name.encode()[:15])
            try:
                flags = struct.unpack("H", fcntl.ioctl(s.fileno(), _SIOCGIFFLAGS, req)[16:18])[0]
                if not flags & _IFF_UP or flags & _IFF_LOOPBACK:
                    continue
                addr = socket.inet_ntoa(fcntl.ioctl(s.fileno(), _SIOCGIFADDR, req)[20:24])
                mask = socket.inet_ntoa(fcntl.ioctl(s.fileno(), _SIOCGIFNETMASK, req)[20:24])
            except OSError:  # no IPv4 address on it
                continue
            found.append((name, addr, ipaddress.IPv4Network(f"0.0.0.0/{mask}").prefixlen))
    return found


def _resolve(host: str | None) -> str | None:
    if not host:
        return None
    try:
        return socket.gethostbyname(host)
    except OSError:
        return None


def choose(addrs: Sequence[Address], master_ip: str | None) -> str | None:
    """The one interface whose subnet holds ``master_ip``; None when none or several do,
    or when the master is this host's loopback (a single-node run)."""
    if master_ip is None or ipaddress.ip_address(master_ip).is_loopback:
        return None
    target = ipaddress.ip_address(master_ip)
    names = {name for name, addr, prefix in addrs
             if target in ipaddress.ip_interface(f"{addr}/{prefix}").network}
    return names.pop() if len(names) == 1 else None


def interface_env(master_addr: str | None, environ: Mapping[str, str],
                  local_rank: int = 0, how: str = "set",
                  addrs: Sequence[Address] | None = None) -> dict[str, str]:
    """The unset :data:`IFNAME_VARS` of ``environ``, each naming the one interface that
    reaches the master: what the caller exports (``environ`` is left alone).

    Args:
        master_addr: The master's host name or address.
        environ: The variables as they are now (a set one is never replaced).
        local_rank: This rank on its node: local rank 0 prints under ``print``.
        how: :func:`mode`'s value: under ``print`` nothing is returned and local rank 0
            prints the ``export`` line instead; under ``off`` nothing happens.
        addrs: This host's addresses (default :func:`addresses`).

    Returns:
        Variable -> interface; empty when none or several interfaces reach the master.
    """
    unset = [v for v in IFNAME_VARS if not environ.get(v)]
    if how == "off" or not unset:
        return {}
    master_ip = _resolve(master_addr)
    name = choose(addresses() if addrs is None else addrs, master_ip)
    if name is None:
        return {}
    pins = dict.fromkeys(unset, name)
    line = " ".join(f"{k}={v}" for k, v in pins.items())
    if how == "print":
        if local_rank == 0:
            print(f"hpc: the master {master_addr} ({master_ip}) is reachable over {name} "
                  f"only; to pin it: export {line}", file=sys.stderr, flush=True)
        return {}
    logger.info("network: master %s (%s) is reachable over %s only: set %s",
                master_addr, master_ip, name, line)
    return pins


def local_report(environ: Mapping[str, str], pinned: Mapping[str, str] | None = None
                 ) -> dict[str, Any]:
    """What rank 0 checks of this node: hostname, what it resolves to, addresses, the
    interface variables as this rank will use them, and whether the user set any
    (``pinned``: those :func:`interface_env` returned, and the caller set)."""
    host = socket.gethostname()
    ifnames = {v: environ[v] for v in IFNAME_VARS if environ.get(v)}
    return {"host": host, "resolved": _resolve(host), "addrs": addresses(),
            "ifnames": ifnames, "by_hand": any(v not in (pinned or {}) for v in ifnames)}


def _shown(report: Mapping[str, Any]) -> str:
    addrs = ", ".join(f"{n} {a}/{p}" for n, a, p in report["addrs"]) or "no IPv4 address"
    return f"{report['host']} has {addrs}"


def _loopback_error(bad: list[Mapping[str, Any]], nodes: int) -> LaunchEnvironmentError:
    first = bad[0]
    fix = ", ".join(f"{r['host']}: {n} {a}" for r in bad for n, a, _ in r["addrs"][:2])
    return LaunchEnvironmentError(
        f"on this {nodes}-node run the hostname of {len(bad)} node(s) resolves to a "
        f"loopback address: {', '.join(r['host'] + ' -> ' + str(r['resolved']) for r in bad[:8])}"
        ".\nWith GLOO_SOCKET_IFNAME unset, gloo binds to the address of the hostname and "
        "advertises it to the other nodes, whose connections to it then reach their own "
        "loopback: init_process_group fails after minutes (\"Gloo connectFullMesh failed "
        "... Connection refused, remote=[127.0.1.1]\") or hangs.\n"
        f"HINT: export GLOO_SOCKET_IFNAME=<the interface that reaches the other nodes> "
        f"({fix or 'see ip addr'}), or make /etc/hosts on {first['host']} name its "
        "network address instead of 127.x.")


def _common_error(reports: Sequence[Mapping[str, Any]]) -> LaunchEnvironmentError:
    shown = "; ".join(_shown(r) for r in reports[:8])
    more = f"; and {len(reports) - 8} more node(s)" if len(reports) > 8 else ""
    return LaunchEnvironmentError(
        f"the {len(reports)} nodes of this run share no network: {shown}{more} (no "
        "subnet holds a distinct address of every node).\n"
        "Gloo and NCCL connect every rank to every other over one interface per node; "
        "without a common network they pick interfaces the peers cannot reach (or a "
        "bridge such as docker0 with the same address on every node) and hang in "
        "init_process_group.\n"
        "HINT: run on nodes of one network; if they reach each other through a router, "
        "export GLOO_SOCKET_IFNAME/NCCL_SOCKET_IFNAME on every node (the check trusts "
        "them), or HPC_NETWORK=off to skip these checks.")


def _common_networks(reports: Sequence[Mapping[str, Any]]) -> set[Any]:
    """The subnets in which every node has an address of its own (a subnet where two
    nodes hold the same address, e.g. docker0's 172.17.0.1, does not count)."""
    owners: dict[Any, dict[str, set[str]]] = {}  # subnet -> address -> hosts
    for r in reports:
        for _, addr, prefix in r["addrs"]:
            net = ipaddress.ip_interface(f"{addr}/{prefix}").network
            owners.setdefault(net, {}).setdefault(addr, set()).add(r["host"])
    hosts = {r["host"] for r in reports}
    return {net for net, by_addr in owners.items()
            if all(len(h) == 1 for h in by_addr.values())
            and set().union(*by_addr.values()) == hosts}


def check(reports: Sequence[Mapping[str, Any]], backend: str | None
          ) -> LaunchEnvironmentError | None:
    """On rank 0: the error for a multi-node run whose network is broken, else None.

    ``reports`` are the :func:`local_report` of each node; ``backend`` the ranks'
    backend (the loopback check applies when gloo is part of it, or unknown).
    """
    by_host = {r["host"]: r for r in reports}
    if len(by_host) < 2:
        return None
    nodes = list(by_host.values())
    if backend is None or "gloo" in backend:
        bad = [r for r in nodes if r["resolved"] and ipaddress.ip_address(r["resolved"]).is_loopback
               and not r["ifnames"].get("GLOO_SOCKET_IFNAME")]
        if bad:
            return _loopback_error(bad, len(nodes))
    if any(r["by_hand"] for r in nodes):
        return None  # an interface the user chose: trust it
    if not _common_networks(nodes):
        return _common_error(nodes)
    return None
