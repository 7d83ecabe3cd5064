"""This node's interfaces, and the one gloo and NCCL are pinned to.

Gloo and NCCL connect every rank to every other over one interface per node. Left
alone, gloo binds to the address the hostname resolves to, and NCCL to the first
interface it likes (``ib*`` first, then any but ``docker*``/``lo``/``virbr*``; NVIDIA/nccl
``src/misc/socket.cc``); both go wrong in ways that only show as a hang in
``init_process_group`` or the first collective (pytorch/pytorch#8672).

:func:`interface_env` returns ``GLOO_SOCKET_IFNAME``/``NCCL_SOCKET_IFNAME`` when they
are unset and exactly one interface of this node is on the master's subnet (NCCL's only
where no ``ib*`` interface or faster link is up: NCCL's own choice is better there);
:func:`hpc.init_torch` exports them (:mod:`hpc.bootstrap.distributed` writes the
environment) before the pre-flight and ``init_process_group``. The pre-flight
(:mod:`hpc.bootstrap.preflight`) then publishes what :func:`local_report` sees on each
node, for the checks of :mod:`hpc.bootstrap.network`.

``HPC_NETWORK`` chooses: ``set`` (default) sets the variables, ``print`` only prints
the ``export`` line on each node's local rank 0, ``off`` skips discovery and checks.

Addresses are the primary IPv4 address of each interface that is up (Linux
``SIOCGIFADDR``/``SIOCGIFNETMASK`` ioctls; nothing to install); what the hostname
resolves to may be IPv6, as gloo takes it (the first ``getaddrinfo`` address this host
can bind).
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import struct
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from hpc import envvars

__all__ = ["IFNAME_VARS", "MODES", "Address", "addresses", "choose", "interface_env",
           "link_speeds", "local_report", "mode", "nccl_keeps_its_choice"]

logger = logging.getLogger(__name__)

#: The variables that name the interface gloo and NCCL use between nodes.
IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
#: Values of ``HPC_NETWORK`` (the table of :mod:`hpc.envvars` holds them).
MODES = envvars.VARIABLES["HPC_NETWORK"].choices

#: ``(interface, IPv4 address, prefix length)``.
Address = tuple[str, str, int]

_SIOCGIFFLAGS, _SIOCGIFADDR, _SIOCGIFNETMASK = 0x8913, 0x8915, 0x891B
_IFF_UP, _IFF_LOOPBACK = 0x1, 0x8


def mode(environ: Mapping[str, str]) -> str:
    """``HPC_NETWORK`` (default ``set``).

    Raises:
        LaunchEnvironmentError: not one of :data:`MODES`.
    """
    return str(envvars.value("HPC_NETWORK", environ))


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


def link_speeds(names: Sequence[str]) -> dict[str, int]:
    """Link speed (Mb/s) of each interface in ``names`` that reports one
    (``/sys/class/net/<name>/speed``, Linux); virtual or down links are left out."""
    speeds = {}
    for name in names:
        try:
            with open(f"/sys/class/net/{name}/speed", encoding="ascii") as fh:
                value = int(fh.read().strip())
        except (OSError, ValueError):
            continue
        if value > 0:
            speeds[name] = value
    return speeds


def nccl_keeps_its_choice(name: str, addrs: Sequence[Address],
                          speeds: Mapping[str, int]) -> str | None:
    """Why ``NCCL_SOCKET_IFNAME`` must not be pinned to ``name`` (pure), or None.

    NCCL takes ``ib*`` interfaces first by itself (IPoIB); pinning it to another
    interface because that one is on the master's subnet moves its socket traffic
    (containers without RDMA, IPoIB) to the management NIC. The same holds for an
    interface whose link (``speeds``, Mb/s) is faster than ``name``'s.
    """
    if name.startswith("ib"):
        return None
    ib = next((n for n, _, _ in addrs if n.startswith("ib")), None)
    if ib is not None:
        return f"{ib} is up and NCCL takes ib* interfaces first"
    mine = speeds.get(name, 0)
    faster = max(((speeds.get(n, 0), n) for n, _, _ in addrs if n != name), default=(0, ""))
    if mine > 0 and faster[0] > mine:
        return (f"{faster[1]} links at {faster[0]} Mb/s, {name} at {mine} Mb/s; export "
                f"NCCL_SOCKET_IFNAME={faster[1]} if the nodes reach each other over it")
    return None


def interface_env(master_addr: str | None, environ: Mapping[str, str],
                  local_rank: int = 0, how: str = "set",
                  addrs: Sequence[Address] | None = None,
                  speeds: Mapping[str, int] | None = None) -> dict[str, str]:
    """The unset :data:`IFNAME_VARS` of ``environ``, each naming the one interface that
    reaches the master: what the caller exports (``environ`` is left alone).

    ``NCCL_SOCKET_IFNAME`` stays unset where NCCL's own choice is better
    (:func:`nccl_keeps_its_choice`: an ``ib*`` interface, or a faster link, is up).

    Args:
        master_addr: The master's host name or address.
        environ: The variables as they are now (a set one is never replaced).
        local_rank: This rank on its node: local rank 0 prints under ``print``.
        how: :func:`mode`'s value: under ``print`` nothing is returned and local rank 0
            prints the ``export`` line instead; under ``off`` nothing happens.
        addrs: This host's addresses (default :func:`addresses`).
        speeds: Link speeds in Mb/s (default :func:`link_speeds` of this host when
            ``addrs`` is the default too, else none known).

    Returns:
        Variable -> interface; empty when none or several interfaces reach the master.
    """
    unset = [v for v in IFNAME_VARS if not environ.get(v)]
    if how == "off" or not unset:
        return {}
    master_ip = _resolve(master_addr)
    live = addrs is None
    addrs = addresses() if addrs is None else addrs
    name = choose(addrs, master_ip)
    if name is None:
        return {}
    pins = dict.fromkeys(unset, name)
    kept = None
    if "NCCL_SOCKET_IFNAME" in pins:
        if speeds is None:
            speeds = link_speeds([n for n, _, _ in addrs]) if live else {}
        kept = nccl_keeps_its_choice(name, addrs, speeds)
    if kept:
        del pins["NCCL_SOCKET_IFNAME"]
    line = " ".join(f"{k}={v}" for k, v in pins.items())
    todo = f"to pin it: export {line}" if pins else "nothing to pin"
    note = f" (NCCL_SOCKET_IFNAME left to NCCL: {kept})" if kept else ""
    if how == "print":
        if local_rank == 0:
            print(f"hpc: the master {master_addr} ({master_ip}) is reachable over {name} "
                  f"only; {todo}{note}", file=sys.stderr, flush=True)
        return {}
    logger.info("network: master %s (%s) is reachable over %s only: %s%s", master_addr,
                master_ip, name, f"set {line}" if pins else "nothing to set", note)
    return pins


def _hostname_address(host: str) -> str | None:
    """The address gloo binds to for ``host`` (torch's ``createDefaultDevice``): the
    first ``getaddrinfo`` result this host can bind; None when there is none (gloo then
    falls back to ``127.0.0.1``)."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return None
    for family, stype, proto, _, sockaddr in infos:
        try:
            with socket.socket(family, stype, proto) as s:
                s.bind(sockaddr)
                return str(sockaddr[0])
        except OSError:
            continue
    return None


def local_report(environ: Mapping[str, str], pinned: Mapping[str, str] | None = None
                 ) -> dict[str, Any]:
    """What rank 0 checks of this node: hostname, what it resolves to (as gloo resolves
    it), addresses, the interface variables as this rank will use them, and whether the
    user set any (``pinned``: those :func:`interface_env` returned, and the caller set)."""
    host = socket.gethostname()
    ifnames = {v: environ[v] for v in IFNAME_VARS if environ.get(v)}
    return {"host": host, "resolved": _hostname_address(host), "addrs": addresses(),
            "ifnames": ifnames, "by_hand": any(v not in (pinned or {}) for v in ifnames)}
