"""Interface discovery on the real 2-node test cluster (issue 15, part 4).

node2 gets a second interface for the module (a veth pair ``hpcd15a``/``hpcd15b``
inside its network namespace, ``hpcd15a`` on 10.201.0.0/24, removed afterwards; no
``dummy`` device: the sandbox kernel here has none), so that node2 has two interfaces to
choose from; a wrong one would make gloo advertise an address node1 cannot reach. eth0
comes first there, so a "first interface" rule would pass that test too: in
:func:`test_the_interface_on_the_masters_subnet_wins_over_the_first_one` the master is
on a link added after eth0 (10.203.0.0/24 between node1 and node2), which only the
"on the master's subnet" rule picks. One test also makes node2's hostname resolve to 127.0.1.1
(a private mount namespace with another /etc/hosts for that task only), the classic
Debian ``/etc/hosts`` that makes a multi-node gloo job connect to itself.

Run::

    flock /tmp/hpc-heavy.lock timeout 900 python -m pytest -m slurm tests/integration/test_network.py
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers.paths import script
from tests.helpers.requires import require
from tests.helpers.slurm import require_slurm, run, slurm_env

pytestmark = pytest.mark.slurm

SECOND, PEER, SECOND_IP = "hpcd15a", "hpcd15b", "10.201.0.12/24"
PROBE = [sys.executable, script("net_probe.py")]


def _ip(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", "-n", "hpc-node2", *args], check=False, capture_output=True,
                          text=True, timeout=20)


@pytest.fixture(scope="module", autouse=True)
def second_interface() -> Iterator[None]:
    """node2 with a second, up interface on a subnet of its own."""
    require_slurm()
    require("ip", "iproute2")
    if _ip("link", "show").returncode != 0:
        pytest.skip("no network namespace hpc-node2 (bin/hpc-testcluster up makes it)")
    _ip("link", "del", SECOND)
    for args in (("link", "add", SECOND, "type", "veth", "peer", "name", PEER),
                 ("addr", "add", SECOND_IP, "dev", SECOND), ("link", "set", PEER, "up"),
                 ("link", "set", SECOND, "up")):
        done = _ip(*args)
        assert done.returncode == 0, done.stderr
    try:
        yield
    finally:
        _ip("link", "del", SECOND)  # its peer goes with it


def _lines(out: str) -> dict[int, dict[str, str]]:
    found = {}
    for line in out.splitlines():
        if "net rank=" in line:
            fields = dict(kv.split("=", 1) for kv in line.split("net ", 1)[1].split())
            found[int(fields["rank"])] = fields
    return found


def test_the_interface_that_reaches_the_master_is_pinned(job: str, tmp_path: Path) -> None:
    proc = run(["srun", "-N2", "--ntasks-per-node=1", *PROBE], job, tmp_path, slurm_env())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ranks = _lines(proc.stdout)
    assert sorted(ranks) == [0, 1], proc.stdout
    assert ranks[1]["host"] == "node2" and SECOND in ranks[1]["ifaces"].split(","), ranks
    for r in ranks.values():
        assert r["sum"] == "3"
        assert r["GLOO_SOCKET_IFNAME"] == r["NCCL_SOCKET_IFNAME"] == "eth0", r


def test_print_mode_sets_nothing_and_a_hand_set_interface_wins(job: str, tmp_path: Path) -> None:
    proc = run(["srun", "-N2", "--ntasks-per-node=1", *PROBE], job, tmp_path,
               slurm_env(HPC_NETWORK="print", NCCL_SOCKET_IFNAME="eth0"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ranks = _lines(proc.stdout)
    assert {r["GLOO_SOCKET_IFNAME"] for r in ranks.values()} == {"-"}, ranks
    assert {r["NCCL_SOCKET_IFNAME"] for r in ranks.values()} == {"eth0"}
    printed = re.findall(r"reachable over (\S+) only; to pin it: export (.*)", proc.stderr)
    assert printed == [("eth0", "GLOO_SOCKET_IFNAME=eth0")] * 2, proc.stderr


def _bad_hosts(tmp: Path) -> list[str]:
    """The command prefix that runs node2's task with node2 -> 127.0.1.1 in /etc/hosts."""
    hosts = tmp / "hosts.node2-loopback"
    hosts.write_text("127.0.0.1 localhost\n127.0.1.1 node2\n10.200.0.11 node1\n"
                     "::ffff:10.200.0.11 node1\n")
    wrapper = tmp / "loopback-node2.sh"
    wrapper.write_text(
        '#!/bin/sh\nif [ "$(hostname)" = node2 ]; then\n'
        '  exec unshare --mount sh -c \'mount --bind "$0" /etc/hosts && exec "$@"\' '
        f'{hosts} "$@"\nfi\nexec "$@"\n')
    wrapper.chmod(0o755)
    return [str(wrapper)]


@pytest.mark.skipif(shutil.which("unshare") is None, reason="util-linux unshare missing")
def test_hostname_resolving_to_loopback(job: str, tmp_path: Path) -> None:
    wrap = _bad_hosts(tmp_path)
    refused = run(["srun", "-N2", "--ntasks-per-node=1", *wrap, *PROBE], job, tmp_path,
                  slurm_env(HPC_NETWORK="print"))
    assert refused.returncode != 0
    assert "the hostname of 1 node(s) resolves to a loopback address: node2 -> 127.0.1.1" \
        in refused.stderr, refused.stderr
    assert "HINT: export GLOO_SOCKET_IFNAME=" in refused.stderr
    assert "rank 1: rank 0 aborted start-up" in refused.stderr  # node2 ends too
    # 4 ranks: rank 0 and 1 connect to node2's ranks at the address gloo advertises
    # for them, 127.0.1.1 without the pin ("Gloo connectFullMesh failed ... Connection
    # refused, remote=[127.0.1.1]", see docs/troubleshooting.md); pinned, it works
    fixed = run(["srun", "-N2", "--ntasks-per-node=2", *wrap, *PROBE], job, tmp_path,
                slurm_env())
    assert fixed.returncode == 0, fixed.stdout + fixed.stderr
    ranks = _lines(fixed.stdout)
    assert sorted(ranks) == [0, 1, 2, 3] and {r["sum"] for r in ranks.values()} == {"10"}
    assert {r["GLOO_SOCKET_IFNAME"] for r in ranks.values()} == {"eth0"}


#: node1 and node2 joined by a veth pair on two subnets of their own, each with a route to
#: the other's: a routed path, as between two racks (the namespaces share only eth0's).
ROUTED = {"hpc-node1": ("hpcr25a", "10.202.1.11/24", "10.202.2.0/24"),
          "hpc-node2": ("hpcr25b", "10.202.2.12/24", "10.202.1.0/24")}


def _ipn(ns: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", "-n", ns, *args], check=False, capture_output=True,
                          text=True, timeout=20)


def _veth(ends: dict[str, tuple[str, str, str | None]]) -> Iterator[None]:
    """A veth pair joining node1 and node2: ``{namespace: (device, address, route or
    None)}``; removed afterwards (with either end the pair goes)."""
    (a, _, _), (b, _, _) = ends.values()
    _ipn("hpc-node1", "link", "del", a)
    done = subprocess.run(["ip", "link", "add", a, "type", "veth", "peer", "name", b],
                          check=False, capture_output=True, text=True, timeout=20)
    assert done.returncode == 0, done.stderr
    try:
        for ns, (dev, addr, route) in ends.items():
            moved = subprocess.run(["ip", "link", "set", dev, "netns", ns], check=False,
                                   capture_output=True, text=True, timeout=20)
            assert moved.returncode == 0, moved.stderr
            steps = [("addr", "add", addr, "dev", dev), ("link", "set", dev, "up")]
            if route:
                steps.append(("route", "add", route, "dev", dev))
            for args in steps:
                done = _ipn(ns, *args)
                assert done.returncode == 0, done.stderr
        yield
    finally:
        _ipn("hpc-node1", "link", "del", a)
        subprocess.run(["ip", "link", "del", a], check=False, capture_output=True, timeout=20)


@pytest.fixture
def routed_link() -> Iterator[None]:
    """The :data:`ROUTED` link."""
    yield from _veth(ROUTED)


#: node1 and node2 on one more subnet of their own, added after eth0: the master's
#: address there is reachable over that link only.
DIRECT = {"hpc-node1": ("hpcs30a", "10.203.0.11/24", None),
          "hpc-node2": ("hpcs30b", "10.203.0.12/24", None)}


@pytest.fixture
def direct_link() -> Iterator[None]:
    """The :data:`DIRECT` link."""
    yield from _veth(DIRECT)


def test_the_interface_on_the_masters_subnet_wins_over_the_first_one(
        job: str, tmp_path: Path, direct_link: None) -> None:
    """MASTER_ADDR on the added link: each node pins its end of it, not eth0, which
    comes first in both nodes' interface lists (a "first interface" rule would pin eth0)."""
    master = DIRECT["hpc-node1"][1].split("/")[0]
    proc = run(["srun", "-N2", "--ntasks-per-node=1", *PROBE], job, tmp_path,
               slurm_env(MASTER_ADDR=master, MASTER_PORT="29731"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ranks = _lines(proc.stdout)
    assert sorted(ranks) == [0, 1] and {r["sum"] for r in ranks.values()} == {"3"}, ranks
    for r, (dev, _, _) in zip((0, 1), DIRECT.values()):
        names = ranks[r]["ifaces"].split(",")
        assert names.index("eth0") < names.index(dev), names  # eth0 is the first one
        assert ranks[r]["GLOO_SOCKET_IFNAME"] == ranks[r]["NCCL_SOCKET_IFNAME"] == dev, ranks


def _gloo_over_routed_link(tmp: Path) -> list[str]:
    """The command prefix that exports GLOO_SOCKET_IFNAME=<this node's end of the link>."""
    wrapper = tmp / "gloo-routed.sh"
    (a, _, _), (b, _, _) = ROUTED.values()
    wrapper.write_text(
        '#!/bin/sh\ncase "$(hostname)" in\n'
        f'  node1) export GLOO_SOCKET_IFNAME={a} ;;\n  node2) export GLOO_SOCKET_IFNAME={b} ;;\n'
        'esac\nexec "$@"\n')
    wrapper.chmod(0o755)
    return [str(wrapper)]


def _logged(tmp: Path) -> list[str]:
    """net_probe.py with hpc's INFO lines on stderr (the probe says what it probed)."""
    wrapper = tmp / "net_probe_logged.py"
    wrapper.write_text(
        "import logging, runpy\n"
        "logging.basicConfig(level=logging.WARNING, format='%(levelname)s %(message)s')\n"
        "logging.getLogger('hpc').setLevel(logging.INFO)\n"
        f"runpy.run_path({PROBE[1]!r}, run_name='__main__')\n")
    return [sys.executable, str(wrapper)]


def test_gloo_over_a_routed_link_is_probed_and_runs(job: str, tmp_path: Path,
                                                     routed_link: None) -> None:
    """The master advertises 10.202.1.11, on no subnet of node2 and not MASTER_ADDR:
    node2 probes it (through its route), and gloo runs over the routed link."""
    proc = run(["srun", "-N2", "--ntasks-per-node=1", *_gloo_over_routed_link(tmp_path),
                *_logged(tmp_path)], job, tmp_path, slurm_env())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ranks = _lines(proc.stdout)
    assert [ranks[r]["GLOO_SOCKET_IFNAME"] for r in (0, 1)] == ["hpcr25a", "hpcr25b"], ranks
    assert {r["sum"] for r in ranks.values()} == {"3"}
    assert "probed the master's gloo address 10.202.1.11 (hpcr25a on node1): it answers" \
        in proc.stderr, proc.stderr


def test_a_master_address_a_node_cannot_reach_is_refused_at_once(
        job: str, tmp_path: Path, routed_link: None) -> None:
    """Without node2's route back, gloo on node2 could not connect to the address rank 0
    advertises; the pre-flight says so on every rank instead of init_process_group."""
    done = _ipn("hpc-node2", "route", "del", ROUTED["hpc-node2"][2])
    assert done.returncode == 0, done.stderr
    start = time.monotonic()
    proc = run(["srun", "-N2", "--ntasks-per-node=1", *_gloo_over_routed_link(tmp_path),
                *PROBE], job, tmp_path, slurm_env())
    took = time.monotonic() - start
    assert proc.returncode != 0, proc.stdout + proc.stderr
    assert "node2 cannot reach the master's gloo address 10.202.1.11 (hpcr25a on node1)" \
        in proc.stderr, proc.stderr
    assert "Network is unreachable" in proc.stderr
    assert "rank 1: rank 0 aborted start-up" in proc.stderr  # node2 ends too
    assert took < 30, took
