"""The step's hosts as the supervisor sees them: the allocation, their Slurm states, and
whether they still answer on slurmd's port (:class:`Reachability`).

Runs on the batch host. Each reader asks one source (``scontrol``, ``sinfo``, a TCP
connection) with a time limit and returns an empty answer when it cannot say.
"""

from __future__ import annotations

import math
import re
import socket
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence

__all__ = ["Reachability", "allocation", "addresses", "node_states", "run", "slurmd_port",
           "tasks_per_node", "UNREACHABLE_S", "PROBE_EVERY_S", "CONNECT_S"]

#: Seconds a host may not answer on slurmd's port before the attempt ends without it.
UNREACHABLE_S = 6.0
#: Seconds between two probes of the hosts' slurmd ports.
PROBE_EVERY_S = 2.0
#: One probe's limit (the kernel answers a connection even when slurmd and the host are
#: busy).
CONNECT_S = 1.0


def run(argv: Sequence[str], timeout: float = 30) -> str:
    try:
        return subprocess.run(list(argv), capture_output=True, text=True,
                              timeout=timeout).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ""


def allocation(environ: Mapping[str, str]) -> list[str]:
    """The job's hosts in Slurm's order (``scontrol show hostnames``)."""
    nodelist = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST") or ""
    return run(["scontrol", "show", "hostnames", nodelist]).split() if nodelist else []


def tasks_per_node(environ: Mapping[str, str]) -> int:
    """``SLURM_NTASKS_PER_NODE``, else the first count of ``SLURM_TASKS_PER_NODE``."""
    text = environ.get("SLURM_NTASKS_PER_NODE") or environ.get("SLURM_TASKS_PER_NODE") or "1"
    return int(text.split("(")[0].split(",")[0] or 1)


def node_states(hosts: Sequence[str]) -> dict[str, str]:
    """Host -> its Slurm state (``sinfo -N -o '%N %T'``; ``*`` when not responding)."""
    if not hosts:
        return {}
    out = run(["sinfo", "-h", "-N", "-n", ",".join(hosts), "-o", "%N %T"], timeout=10)
    states = {}
    for line in out.splitlines():
        name, _, state = line.strip().partition(" ")
        if name in hosts:
            states[name] = state.strip()
    return states


def slurmd_port() -> int:
    """slurmd's port (``scontrol show config``: SlurmdPort; 6818 when unknown)."""
    m = re.search(r"^SlurmdPort\s*=\s*(\d+)", run(["scontrol", "show", "config"], timeout=10),
                  re.MULTILINE)
    return int(m[1]) if m else 6818


def _answers(address: str, port: int) -> bool:
    """A TCP connection to ``address:port`` is accepted within :data:`CONNECT_S`."""
    try:
        with socket.create_connection((address, port), timeout=CONNECT_S):
            return True
    except OSError:
        return False


class Reachability:
    """Which of the step's hosts stopped answering on slurmd's port.

    Slurm marks a node that stopped answering only after ``SlurmdTimeout`` (300 s by
    default): until then a cut link leaves the ranks waiting in a collective and srun
    waiting for them. Every :data:`PROBE_EVERY_S` seconds the supervisor opens (and
    closes) one TCP connection to each host's slurmd, which every compute node accepts
    from its peers (Slurm's own fan-out); a host that answers none for
    :data:`UNREACHABLE_S` is lost (a cut link, a dead node, a stopped slurmd).
    """

    def __init__(self, addresses: Mapping[str, str], port: int,
                 answers: Callable[[str, int], bool] = _answers,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.addresses, self.port, self.answers, self.clock = addresses, port, answers, clock
        self.silent_since: dict[str, float] = {}
        self._last = -math.inf

    def unreachable(self) -> list[str]:
        """The hosts silent for :data:`UNREACHABLE_S` or longer (probes at most every
        :data:`PROBE_EVERY_S`)."""
        now = self.clock()
        if now - self._last >= PROBE_EVERY_S:
            self._last = now
            for host, address in self.addresses.items():
                if self.answers(address, self.port):
                    self.silent_since.pop(host, None)
                else:
                    self.silent_since.setdefault(host, now)
        return [h for h, t in self.silent_since.items() if now - t >= UNREACHABLE_S]


def addresses(hosts: Sequence[str]) -> dict[str, str]:
    out = {}
    for h in hosts:
        try:
            out[h] = socket.gethostbyname(h)
        except OSError:
            pass
    return out
