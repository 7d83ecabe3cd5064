"""Why a supervised step failed: the host's fault (restart without it) or the program's.

Pure: :func:`classify` reads the evidence ``hpc supervise`` gathered after the step
ended (srun's exit lines, the ranks' failure marks, the Slurm state of the step's nodes)
and returns a :class:`Verdict`. The rules, in order; the first that applies decides:

1. exit status 0: ``completed``; 75 (every rank's agreed exit after a requeue):
   ``requeued``; both end the supervision as they are.
2. a host of the step is DOWN, failed or not responding (``sinfo``: ``down*``,
   ``idle*``, ``fail``), or did not answer on slurmd's port for a while
   (:data:`UNREACHABLE`): **infrastructure**, that host.
3. ranks that srun saw ``Out Of Memory`` before it cancelled the step (the OOM killer:
   the cgroup's or the node's memory limit): **application**, no culprit: the program
   asked for more memory than it has, on any host; never a strike.
4. ranks that srun saw ``Killed`` (or dead of another signal) before it cancelled the
   step, and that wrote no failure mark of their own (a peer's watchdog report naming
   them as stuck is not theirs): a process that never ran Python's exit (SIGKILL
   from outside, the node's crash): **infrastructure**, their host(s). A rank of ours that
   fails writes a mark first; srun's ``Terminated`` lines after its ``Terminating StepId``
   are the cancellation it did itself, never evidence.
5. the watchdog's marks: ranks its reports name as having "never entered" a collective
   the others waited in (whichever rank's mark carries the report), **all on one host**
   of several: **infrastructure**, that host (a frozen or cut-off
   node); stuck ranks on several hosts are the program's own hang.
6. the first failure by the marks (:func:`hpc.watchdog.failure.first_failure`) is a rank
   that lost a peer (:data:`hpc.watchdog.failure.PEER_LOST`: "Connection closed by
   peer", "Connection reset", a gloo/NCCL timeout): **infrastructure**, the host the
   message names when it names one of the step's hosts (by name or address), else no
   culprit (relaunch on the same hosts).
7. anything else (a Python exception, a non-zero ``sys.exit``, srun's "Exited with exit
   code"): **application**: no restart.

The supervisor adds one more (:mod:`hpc.supervise.plan`): the same infrastructure verdict
twice at the same checkpoint step is the program's (it fails where it is, not where it
runs).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Optional

from hpc.errors import EXIT_REQUEUED
from hpc.watchdog.failure import PEER_LOST
from hpc.watchdog.launchlog import SrunExit, compact_ranks
from hpc.watchdog.marks import GENERIC_MESSAGE

__all__ = ["Evidence", "Mark", "Verdict", "classify", "COMPLETED", "REQUEUED",
           "INFRASTRUCTURE", "APPLICATION", "UNREACHABLE"]

COMPLETED, REQUEUED, INFRASTRUCTURE, APPLICATION = (
    "completed", "requeued", "infrastructure", "application")

#: Slurm node states (sinfo %T) that mean the host is gone; ``*`` = not responding.
_GONE = ("down", "fail", "failing", "unknown", "future", "power_down", "powering_down")
#: The state the supervisor gives a host that did not answer on slurmd's port for
#: :data:`hpc.supervise.hosts.UNREACHABLE_S` seconds (a cut link, a dead node), long
#: before Slurm's own ``SlurmdTimeout`` (300 s by default) marks it not responding.
UNREACHABLE = "unreachable"
#: The watchdog's words for a stuck rank: ``rank 2 (node2, pid 41) never entered``.
_STUCK = re.compile(r"\brank (\d+)(?: \(([^,()\s]+), pid \d+\))? never entered")
_ADDRESS = re.compile(r"\[?(\d{1,3}(?:\.\d{1,3}){3})\]?")


@dataclass(frozen=True)
class Mark:
    """One rank's failure mark (:mod:`hpc.watchdog.marks`)."""

    time: float
    message: str
    host: str = ""


@dataclass(frozen=True)
class Evidence:
    """What the supervisor saw of one attempt.

    Attributes:
        returncode: srun's exit status (``-9`` when the supervisor had to kill it).
        exits: srun's task error lines, in its order.
        marks: Rank -> its failure mark.
        hosts: The step's hosts, in rank order.
        states: Host -> its Slurm state (``sinfo -o %T``), for the step's hosts.
        addresses: Host -> its IP address (to read "peer [10.0.0.3]" messages).
    """

    returncode: int
    exits: Sequence[SrunExit] = ()
    marks: Mapping[int, Mark] = field(default_factory=dict)
    hosts: Sequence[str] = ()
    states: Mapping[str, str] = field(default_factory=dict)
    addresses: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Verdict:
    """The decision's input: what failed, whose fault, the evidence in words."""

    kind: str
    culprits: tuple[str, ...] = ()
    evidence: str = ""

    @property
    def restartable(self) -> bool:
        return self.kind == INFRASTRUCTURE


def gone(state: str) -> bool:
    """True for a Slurm node state that means the host is lost to the job."""
    s = state.lower()
    return s == UNREACHABLE or s.endswith("*") or s.rstrip("*~#$@^-+").split("+")[0] in _GONE


def _ranks(ranks: Sequence[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + compact_ranks(sorted(ranks))


def _signal_deaths(e: Evidence, stuck: Mapping[str, Sequence[int]]) -> dict[str, list[int]]:
    """Host -> ranks srun saw die of a signal before it cancelled, without a mark of their
    own (the watchdog's report that names a rank as stuck is its peers' word, not its)."""
    reported = {r for ranks in stuck.values() for r in ranks}
    out: dict[str, list[int]] = {}
    for x in e.exits:
        if x.after_cancel or not x.by_signal:
            continue
        dead = [r for r in x.ranks if r not in e.marks or r in reported]
        if dead:
            out.setdefault(x.host, []).extend(dead)
    return out


def _stuck(e: Evidence) -> dict[str, list[int]]:
    """Host -> the ranks the watchdog's reports name as never having entered a collective
    (``rank 2 (node2, pid 41) never entered ...``), in any rank's mark: the waiters' marks
    repeat the reporter's sentence, so only the ranks it names count, not the markers."""
    named: dict[int, str] = {}
    in_own_mark: set[int] = set()  # named stuck in its own mark: the reporter wrote it
    for rank, m in e.marks.items():
        for s in _STUCK.finditer(m.message):
            r = int(s[1])
            if r == rank:
                in_own_mark.add(r)
            host = s[2] or (m.host if r == rank else "")
            if host:
                named.setdefault(r, host)
    out: dict[str, list[int]] = {}
    for r, host in sorted(named.items()):
        # A named rank that marked its own failure first (an exception, an exit) failed
        # in its code; the others only saw it gone. Its mark names it stuck when the
        # reporter wrote it for a rank that could not (killed, frozen).
        if r not in e.marks or r in in_own_mark:
            out.setdefault(host, []).append(r)
    return out


def _peer_host(message: str, e: Evidence) -> Optional[str]:
    by_address = {a: h for h, a in e.addresses.items()}
    for m in _ADDRESS.finditer(message):
        if m[1] in by_address:
            return by_address[m[1]]
    return next((h for h in e.hosts if re.search(rf"\b{re.escape(h)}\b", message)), None)


def _first_mark(e: Evidence) -> Optional[tuple[int, Mark]]:
    said = [(m.time, r, m) for r, m in e.marks.items() if m.message != GENERIC_MESSAGE]
    return (min(said)[1], min(said)[2]) if said else None


def classify(e: Evidence) -> Verdict:
    """The :class:`Verdict` of one attempt (rules in the module's docstring)."""
    if e.returncode == 0:
        return Verdict(COMPLETED)
    if e.returncode == EXIT_REQUEUED:
        return Verdict(REQUEUED, evidence="the ranks requeued the job (exit 75)")
    lost = [h for h in dict.fromkeys(e.hosts) if gone(e.states.get(h, ""))]
    if lost:
        return Verdict(INFRASTRUCTURE, tuple(lost), "; ".join(
            f"{h}: no answer on slurmd's port (node unreachable)" if e.states[h] == UNREACHABLE
            else f"{h}: Slurm state {e.states[h]} (node unreachable)" for h in lost))
    oom = [x for x in e.exits if x.out_of_memory and not x.after_cancel]
    if oom:
        return Verdict(APPLICATION, (), "; ".join(
            f"{x.host}: {_ranks(x.ranks)} Out Of Memory (the OOM killer: the program's "
            "memory, not the host)" for x in oom))
    stuck = _stuck(e)
    killed = _signal_deaths(e, stuck)
    if killed:
        what: dict[str, str] = {}
        for x in e.exits:
            if x.host in killed and not x.after_cancel and x.by_signal:
                what.setdefault(x.host, x.what)
        return Verdict(INFRASTRUCTURE, tuple(killed), "; ".join(
            f"{h}: {_ranks(r)} {what[h]} by a signal, no failure mark" for h, r in killed.items()))
    if len(stuck) == 1 and len(set(e.hosts)) > 1:
        (host, ranks), = stuck.items()
        return Verdict(INFRASTRUCTURE, (host,),
                       f"{host}: {_ranks(ranks)} never entered a collective the others "
                       "waited in (frozen or cut off)")
    first = _first_mark(e)
    if first is not None and not stuck and PEER_LOST.search(first[1].message):
        rank, mark = first
        peer = _peer_host(mark.message, e)
        line = mark.message.strip().splitlines()[-1][:200]
        if peer is not None and peer != mark.host:
            return Verdict(INFRASTRUCTURE, (peer,),
                           f"{peer}: its peers lost it (rank {rank} on {mark.host}: {line})")
        return Verdict(INFRASTRUCTURE, (), f"rank {rank} on {mark.host or '?'} lost a peer, "
                       f"none named: {line}")
    if first is not None:  # "ValueError: what went wrong" (fact, then cause and HINT)
        rank, mark = first
        line = mark.message.strip().splitlines()[0][:300]
        where = f" on {mark.host}" if mark.host else ""
        return Verdict(APPLICATION, (), f"rank {rank}{where}: {line}")
    exited = next((x for x in e.exits if not x.after_cancel), None)
    if exited is not None:
        return Verdict(APPLICATION, (), f"{_ranks(exited.ranks)} on {exited.host}: {exited.what}")
    return Verdict(APPLICATION, (), f"the step exited with status {e.returncode} and left no "
                   "failure mark")
