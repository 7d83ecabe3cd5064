"""The test cluster never reaches beyond this machine, and up/down take turns (issue 25, item 15).

A CI run's exit trap (``down``) once raced the next ``up``: slurmdbd came up with no bridge,
and ``sacctmgr`` sent its connection to ``10.200.0.1:6819`` through the default route. Three
mechanisms of ``bin/hpc-testcluster`` are checked here with real routes and real packets:

* an ``unreachable`` route for 10.200.0.0/24, above the bridge's own, while the cluster lives;
* the script's client calls check the bridge first;
* ``up``/``down`` hold one lock, which no daemon inherits.

The leak tests run in a scratch network namespace that looks like a machine whose bridge is
gone: a veth "uplink" with a default route to a peer namespace, whose packet counter shows
what would have left the machine. The running cluster is not touched.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers.paths import ROOT
from tests.helpers.requires import require
from tests.helpers.slurm import require_slurm

pytestmark = pytest.mark.slurm

SCRIPT = str(ROOT / "bin" / "hpc-testcluster")
SUBNET = "10.200.0.0/24"
LOCK = "/run/lock/hpc-testcluster.lock"
NS, PEER = "hpc-leak", "hpc-leakpeer"


def _sh(*argv: str, timeout: float = 20) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(argv), check=False, capture_output=True, text=True,
                          timeout=timeout)


def _guard_routes() -> list[str]:
    return [line for line in _sh("ip", "route", "show", "type", "unreachable").stdout.splitlines()
            if SUBNET in line.split()]


@pytest.fixture(scope="module", autouse=True)
def cluster() -> None:
    require_slurm()
    require("ip", "iproute2")


@pytest.fixture
def no_bridge() -> Iterator[None]:
    """A namespace like this machine after the bridge went: only a default route out."""
    for ns in (NS, PEER):
        _sh("ip", "netns", "del", ns)
        assert _sh("ip", "netns", "add", ns).returncode == 0
        _sh("ip", "netns", "exec", ns, "sysctl", "-qw", "net.ipv6.conf.all.disable_ipv6=1")
        _sh("ip", "-n", ns, "link", "set", "lo", "up")
    steps = [("ip", "-n", NS, "link", "add", "up0", "type", "veth", "peer", "name", "up1",
              "netns", PEER),
             ("ip", "-n", NS, "addr", "add", "198.51.100.2/24", "dev", "up0"),
             ("ip", "-n", PEER, "addr", "add", "198.51.100.1/24", "dev", "up1"),
             ("ip", "-n", NS, "link", "set", "up0", "up"),
             ("ip", "-n", PEER, "link", "set", "up1", "up"),
             ("ip", "-n", NS, "route", "add", "default", "via", "198.51.100.1")]
    for step in steps:
        out = _sh(*step)
        assert out.returncode == 0, f"{' '.join(step)}: {out.stderr}"
    try:
        yield
    finally:
        for ns in (NS, PEER):
            _sh("ip", "netns", "del", ns)


def _sent() -> int:
    """Packets that left through the default route (the uplink's transmit counter)."""
    out = _sh("ip", "netns", "exec", NS, "cat", "/sys/class/net/up0/statistics/tx_packets")
    return int(out.stdout)


def _connect_in_ns(addr: str, port: int) -> str:
    code = ("import socket,sys\n"
            "s = socket.socket(); s.settimeout(2)\n"
            "try:\n"
            f"    s.connect(({addr!r}, {port})); print('connected')\n"
            "except OSError as e:\n"
            "    print(type(e).__name__, e.errno)\n")
    return _sh("ip", "netns", "exec", NS, "python3", "-c", code).stdout.strip()


def test_guard_route_lives_with_the_cluster_and_does_not_shadow_the_bridge() -> None:
    assert any("metric 4242" in line for line in _guard_routes()), _sh("ip", "route").stdout
    via = _sh("ip", "route", "get", "10.200.0.11").stdout
    assert " dev hpcbr0 " in via, via


def test_without_the_bridge_no_packet_leaves_through_the_default_route(no_bridge: None) -> None:
    # Control: with no guard, a connection to slurmdbd's address goes out of the uplink.
    before = _sent()
    _connect_in_ns("10.200.0.1", 6819)
    leaked = _sent() - before
    assert leaked > 0, "the counter must see a leak when nothing guards the subnet"
    # The guard route exactly as the running cluster has it installed.
    for line in _guard_routes():
        assert _sh("ip", "-n", NS, "route", "add", *line.split()).returncode == 0
    before = _sent()
    answers = [_connect_in_ns(addr, port) for addr, port in
               (("10.200.0.1", 6819), ("10.200.0.1", 6817), ("10.200.0.13", 6818))]
    assert _sent() == before, f"{_sent() - before} packets left through the default route"
    assert answers == ["OSError 113"] * 3, answers   # EHOSTUNREACH, at once


def test_status_without_the_bridge_asks_no_daemon(no_bridge: None) -> None:
    # No guard route in the scratch namespace: only the bridge check stands in the way.
    before = _sent()
    _sh("ip", "netns", "exec", NS, "timeout", "3", "sinfo", timeout=30)
    assert _sent() > before, "control: a bare sinfo there does try the default route"
    before = _sent()
    out = _sh("ip", "netns", "exec", NS, SCRIPT, "status", timeout=60)
    assert out.returncode == 1
    assert "bridge hpcbr0 with 10.200.0.1 is missing" in out.stdout, out.stdout + out.stderr
    assert _sent() == before, out.stdout


def test_up_waits_for_a_running_down_and_no_daemon_keeps_the_lock() -> None:
    holder = subprocess.Popen(["flock", LOCK, "sleep", "4"], start_new_session=True)
    try:
        time.sleep(0.5)
        start = time.monotonic()
        out = _sh(SCRIPT, "up", timeout=120)
        waited = time.monotonic() - start
    finally:
        os.killpg(holder.pid, 9)   # flock and its sleep, which holds the lock too
        holder.wait()
    assert out.returncode == 0, out.stdout + out.stderr
    assert "waiting for another up/down to finish" in out.stdout
    assert "already up and healthy" in out.stdout
    assert waited >= 3.0, f"up returned after {waited:.1f} s while the lock was held"
    free = _sh("flock", "-n", LOCK, "true")
    holders = [pid for pid in os.listdir("/proc") if pid.isdigit()
               and _holds(Path("/proc", pid), LOCK)]
    assert free.returncode == 0 and not holders, f"lock held by pids {holders}"


def _holds(proc: Path, path: str) -> bool:
    try:
        return any(os.readlink(fd) == path for fd in (proc / "fd").iterdir())
    except OSError:
        return False

