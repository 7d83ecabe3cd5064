"""Which network set-ups are known to hang: the checks rank 0 runs on every node's report.

Every rank advertises to its peers the address gloo or NCCL binds to on its node
(:func:`advertised`: gloo's ``GLOO_SOCKET_IFNAME`` or what the hostname resolves to,
NCCL's :func:`nccl_address`), and every peer connects to it; a wrong one shows only as a
hang in ``init_process_group`` or the first collective. :func:`check` refuses what is
known to break:

* the hostname resolves to ``127.0.1.1`` (Debian's default ``/etc/hosts``), or to
  nothing (gloo then takes ``127.0.0.1``): gloo advertises a loopback address, and peers
  on other nodes that connect to it reach their own loopback ("Gloo connectFullMesh
  failed ... Connection refused");
* the address gloo or NCCL advertises is held by another node too (a bridge such as
  ``docker0``, or a NAT interface such as VirtualBox's ``10.0.2.15`` on every node): a
  peer that connects to it reaches its own copy;
* a node cannot connect to the address the master advertises (see below).

Nodes need not share a subnet: routed subnets, cloud NICs with ``/32`` addresses and
IPv6-only nodes work. Every rank reaches the master's store before the checks run,
which proves ``MASTER_ADDR``; where the master advertises another address that is not
on a subnet of the node, that node's local rank 0 probes it (:func:`probe_targets`
says what to probe, a pure function of the reports). Links between two other nodes
are not checked.

The pre-flight (:mod:`hpc.bootstrap.preflight`) publishes what
:func:`hpc.bootstrap.interfaces.local_report` sees on each node to the store, and
rank 0 runs :func:`check` on every node's report; ``HPC_NETWORK=off``
(:func:`hpc.bootstrap.interfaces.mode`) skips them. Everything here is a pure function
of those reports.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping, Sequence
from typing import Any

from hpc.bootstrap.backend import parse_backend
from hpc.bootstrap.interfaces import Address
from hpc.errors import LaunchEnvironmentError

__all__ = ["advertised", "check", "nccl_address", "note", "probe_targets"]


def _uses(backend: str | None) -> tuple[bool, bool]:
    """(gloo, NCCL): which of the two ``backend`` runs (None: gloo, as an unknown
    backend is checked for gloo's sake only)."""
    if backend is None:
        return True, False
    try:
        names = set(parse_backend(backend).values())
    except ValueError:
        return True, False
    return "gloo" in names, "nccl" in names


def _address_of(report: Mapping[str, Any], iface: str) -> str | None:
    return next((a for n, a, _ in report["addrs"] if n == iface), None)


def _nccl_matches(spec: str, name: str) -> bool:
    """Whether ``NCCL_SOCKET_IFNAME=spec`` selects interface ``name``: prefixes, ``^``
    to exclude, ``=`` for exact names, ``:port`` ignored (NCCL's ``matchIfList``)."""
    exclude = spec.startswith("^")
    spec = spec[1:] if exclude else spec
    exact = spec.startswith("=")
    spec = spec[1:] if exact else spec
    prefixes = [p.split(":")[0] for p in spec.split(",") if p]
    hit = any(name == p if exact else name.startswith(p) for p in prefixes)
    return hit != exclude


#: NCCL's own order of interfaces when ``NCCL_SOCKET_IFNAME`` is unset.
_NCCL_ORDER = ("ib", "^docker,lo,virbr", "docker", "lo", "virbr")


def nccl_address(report: Mapping[str, Any]) -> tuple[str, str] | None:
    """``(interface, address)`` NCCL's bootstrap binds to on the node of ``report``:
    the first interface ``NCCL_SOCKET_IFNAME`` selects, or else the first ``ib*``, then
    the first that is not ``docker*``/``lo``/``virbr*`` (NVIDIA/nccl ``ncclFindInterfaces``;
    IPv4 addresses come first there too). None when nothing matches."""
    spec = report["ifnames"].get("NCCL_SOCKET_IFNAME", "")
    for rule in (spec,) if len(spec) > 1 else _NCCL_ORDER:
        for name, addr, _ in report["addrs"]:
            if _nccl_matches(rule, name):
                return name, addr
    return None


def advertised(report: Mapping[str, Any], backend: str | None
               ) -> list[tuple[str, str | None, str]]:
    """``(gloo|NCCL, interface or None, address)`` that the node of ``report`` advertises
    to its peers: gloo's interfaces of ``GLOO_SOCKET_IFNAME`` or else what the hostname
    resolves to (interface None), NCCL's :func:`nccl_address`."""
    gloo, nccl = _uses(backend)
    out: list[tuple[str, str | None, str]] = []
    if gloo:
        named = [n for n in report["ifnames"].get("GLOO_SOCKET_IFNAME", "").split(",") if n]
        if named:
            out += [("gloo", n, a) for n in named if (a := _address_of(report, n))]
        elif report["resolved"]:
            out.append(("gloo", None, report["resolved"]))
    if nccl and (found := nccl_address(report)):
        out.append(("NCCL", *found))
    return out


def _on_link(addr: str, addrs: Sequence[Address]) -> bool:
    """True when ``addr`` is on a subnet (wider than one address) of ``addrs``."""
    ip = ipaddress.ip_address(addr)
    return any(p < ip.max_prefixlen and ip in ipaddress.ip_interface(f"{a}/{p}").network
               for _, a, p in addrs if ipaddress.ip_address(a).version == ip.version)


def probe_targets(here: Mapping[str, Any], master: Mapping[str, Any], reached: str | None,
                  backend: str | None) -> list[dict[str, Any]]:
    """The master's addresses this node must probe before init (pure).

    An address the master advertises (:func:`advertised`) needs no probe where this node
    already reached it (``reached``: the address its store connection went to, which
    proves ``MASTER_ADDR``), where it is on one of this node's subnets, or where
    :func:`check` refuses it without one (loopback, an address this node holds too).

    Args:
        here: This node's :func:`~hpc.bootstrap.interfaces.local_report`.
        master: The master's :func:`~hpc.bootstrap.interfaces.local_report`.
        reached: The master address this node connected the store to (None: unknown).
        backend: This rank's backend.

    Returns:
        ``{"for": "gloo"|"NCCL", "addr": address, "iface": master's interface or None}``
        for each address to probe; empty on the master's own node.
    """
    if here["host"] == master["host"]:
        return []
    own = {a for _, a, _ in here["addrs"]}
    targets = []
    for what, iface, addr in advertised(master, backend):
        if (ipaddress.ip_address(addr).is_loopback or addr in own or addr == reached
                or _on_link(addr, here["addrs"])):
            continue
        targets.append({"for": what, "addr": addr, "iface": iface})
    return targets


def _var(what: str) -> str:
    return "GLOO_SOCKET_IFNAME" if what == "gloo" else "NCCL_SOCKET_IFNAME"


def _loopback_error(bad: list[Mapping[str, Any]], nodes: int) -> LaunchEnvironmentError:
    first = bad[0]
    fix = ", ".join(f"{r['host']}: {n} {a}" for r in bad for n, a, _ in r["addrs"][:2])
    shown = ", ".join(f"{r['host']} -> {r['resolved'] or '(does not resolve)'}"
                      for r in bad[:8])
    return LaunchEnvironmentError(
        f"on this {nodes}-node run the hostname of {len(bad)} node(s) resolves to a "
        f"loopback address: {shown}.\n"
        "With GLOO_SOCKET_IFNAME unset, gloo binds to the address of the hostname (to "
        "127.0.0.1 when it does not resolve) and advertises it to the other nodes, whose "
        "connections to it then reach their own loopback: init_process_group fails after "
        "minutes (\"Gloo connectFullMesh failed ... Connection refused, "
        "remote=[127.0.1.1]\") or hangs.\n"
        f"HINT: export GLOO_SOCKET_IFNAME=<the interface that reaches the other nodes> "
        f"({fix or 'see ip addr'}), or make /etc/hosts on {first['host']} name its "
        "network address instead of 127.x.")


def _distinct_interfaces(nodes: Sequence[Mapping[str, Any]]) -> list[str]:
    """Interfaces every node has, each with an address no other node holds."""
    names = [n for n, _, _ in nodes[0]["addrs"]]
    out = []
    for name in names:
        found = [_address_of(r, name) for r in nodes]
        if all(found) and len(set(found)) == len(found):
            out.append(name)
    return out


def _shared_error(what: str, iface: str | None, addr: str, hosts: list[str],
                  nodes: Sequence[Mapping[str, Any]]) -> LaunchEnvironmentError:
    var = _var(what)
    if iface is None:
        where = "what the hostname resolves to"
    elif what == "gloo" or any(r["ifnames"].get(var) for r in nodes):
        where = f"{var}={iface}"
    else:
        where = f"{iface}, the interface NCCL takes when {var} is unset"
    good = [n for n in _distinct_interfaces(nodes) if n != iface]
    fix = f"{var}={good[0]}" if good else f"{var}=<an interface whose address differs per node>"
    extra = (", or make /etc/hosts on each node name its own network address"
             if what == "gloo" and not iface else "")
    shown = ", ".join(hosts[:8]) + (f" and {len(hosts) - 8} more" if len(hosts) > 8 else "")
    return LaunchEnvironmentError(
        f"the {what} address {addr} ({where}) is held by {len(hosts)} nodes of this run: "
        f"{shown}.\n"
        f"{'Gloo' if what == 'gloo' else 'NCCL'} advertises one address per rank and every "
        "peer connects to it; an address that several nodes hold (a bridge such as "
        "docker0, a NAT interface such as VirtualBox's 10.0.2.15) leads each peer to its "
        "own copy, and init_process_group fails (\"Connection refused\") or hangs.\n"
        f"HINT: export {fix} on every node{extra}, or HPC_NETWORK=off to skip these checks.")


def _shared_address(nodes: Sequence[Mapping[str, Any]], backend: str | None
                    ) -> LaunchEnvironmentError | None:
    """The error for an address one node advertises and another node holds too."""
    held: dict[str, set[str]] = {}  # address -> hosts holding or advertising it
    for r in nodes:
        for _, addr, _ in r["addrs"]:
            held.setdefault(addr, set()).add(r["host"])
        for _, _, addr in advertised(r, backend):
            held.setdefault(addr, set()).add(r["host"])
    for r in nodes:
        for what, iface, addr in advertised(r, backend):
            hosts = held.get(addr, set())
            if len(hosts) > 1 and not ipaddress.ip_address(addr).is_loopback:
                order = [n["host"] for n in nodes if n["host"] in hosts]
                return _shared_error(what, iface, addr, order, nodes)
    return None


def _probe_error(master: Mapping[str, Any], failed: list[tuple[Mapping[str, Any], dict[str, Any]]]
                 ) -> LaunchEnvironmentError:
    node, probe = failed[0]
    what, iface, addr = probe["for"], probe.get("iface"), probe["addr"]
    where = f"{iface} on {master['host']}" if iface else f"the hostname of {master['host']}"
    others = f" (and {len(failed) - 1} more node(s))" if len(failed) > 1 else ""
    reached = probe.get("reached")
    via = next((n for n, a, _ in master["addrs"] if a == reached), None)
    store = f" (it reached the store at {reached})" if reached else ""
    fix = (f"export {_var(what)}={via} (the interface of {reached}, which the others "
           "reach) on every node" if via else
           f"export {_var(what)}=<an interface of {master['host']} the other nodes reach>")
    return LaunchEnvironmentError(
        f"{node['host']} cannot reach the master's {what} address {addr} ({where}) at port "
        f"{probe.get('port')}: {probe['error']}{others}{store}.\n"
        f"{'Gloo' if what == 'gloo' else 'NCCL'} on {master['host']} advertises that "
        "address and every peer connects to it: init_process_group would fail or hang.\n"
        f"HINT: {fix}, fix the route or firewall from {node['host']} to {addr}, or "
        "HPC_NETWORK=off to skip these checks.")


def check(reports: Sequence[Mapping[str, Any]], backend: str | None
          ) -> LaunchEnvironmentError | None:
    """On rank 0: the error for a multi-node run whose network is known to break, else
    None (pure).

    ``reports`` are the :func:`~hpc.bootstrap.interfaces.local_report` of each node, the
    master's first, with the ``probes`` of :func:`probe_targets` and their outcome
    (``error``: None when the address answered); ``backend`` the ranks' backend (gloo's
    checks apply when gloo is part of it, or unknown; NCCL's when it is part of it).
    """
    by_host: dict[str, Mapping[str, Any]] = {}
    for r in reports:
        by_host.setdefault(r["host"], r)
    if len(by_host) < 2:
        return None
    nodes = list(by_host.values())
    gloo, _ = _uses(backend)
    if gloo:
        bad = [r for r in nodes if not r["ifnames"].get("GLOO_SOCKET_IFNAME") and (
            not r["resolved"] or ipaddress.ip_address(r["resolved"]).is_loopback)]
        if bad:
            return _loopback_error(bad, len(nodes))
    shared = _shared_address(nodes, backend)
    if shared is not None:
        return shared
    failed = [(r, p) for r in nodes[1:] for p in r.get("probes", ()) if p.get("error")]
    return _probe_error(nodes[0], failed) if failed else None


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


def note(reports: Sequence[Mapping[str, Any]]) -> str | None:
    """What rank 0 logs (INFO) of a multi-node run that :func:`check` passed although
    no IPv4 subnet holds every node (routed subnets, /32 NICs, IPv6 only); else None."""
    nodes = list({r["host"]: r for r in reports}.values())
    if len(nodes) < 2 or _common_networks(nodes):
        return None
    probes = sum(len(r.get("probes", ())) for r in nodes)
    probed = f", and {probes} other address(es) of the master answered" if probes else ""
    return (f"network: the {len(nodes)} nodes share no IPv4 subnet (routed, /32 or IPv6 "
            f"only): not refused; every node reached the master's store{probed}; the "
            "links between the other nodes are not checked")
