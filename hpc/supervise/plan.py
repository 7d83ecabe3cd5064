"""What ``hpc supervise`` does next: the hosts of the next attempt, and when to give up.

Pure: :func:`decide` takes the verdict of the attempt that just failed and the
supervision's state, and returns a :class:`Decision`:

- an application failure ends the job (no retry);
- the same infrastructure verdict twice at the same checkpoint step (its evidence read
  without the host names: the same ranks killed the same way) is the program's (it fails
  where it is, not where it runs): ends the job, and strikes no host;
- the budget: each restart costs 1, a restart after an attempt that wrote no new
  checkpoint costs 2 (:data:`NO_PROGRESS_COST`); past ``max_restarts``, or after two
  attempts in a row without progress, the job ends;
- the culprit hosts are excluded for the rest of the job; the next attempt runs on the
  first ``nodes`` hosts of the allocation not excluded (spares fill in, in allocation
  order); with too few left: on fewer hosts when the program allows a world-size change
  (``elastic``), else ``requeue`` (the job is requeued with the excluded hosts in its
  ``ExcNodeList``, so Slurm places it on healthy nodes).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Optional

from hpc.supervise.verdict import Verdict

__all__ = ["Decision", "State", "decide", "NO_PROGRESS_COST", "NO_PROGRESS_LIMIT"]

#: What a restart costs when the failed attempt wrote no new checkpoint.
NO_PROGRESS_COST = 2
#: Attempts in a row without a new checkpoint that end the job.
NO_PROGRESS_LIMIT = 2

RELAUNCH, END, REQUEUE = "relaunch", "end", "requeue"


@dataclass(frozen=True)
class State:
    """The supervision so far.

    Attributes:
        allocation: The job's hosts, in Slurm's order.
        nodes: Hosts each attempt runs on.
        max_restarts: The restart budget.
        elastic: The program may resume on fewer hosts.
        excluded: Hosts left out for the rest of the job.
        spent: Budget used.
        stalled: Attempts in a row that wrote no new checkpoint.
        last: ``(verdict evidence without its hosts, checkpoint step)`` of the previous
            failure, for the "same failure at the same step" rule.
    """

    allocation: tuple[str, ...]
    nodes: int
    max_restarts: int = 3
    elastic: bool = False
    excluded: tuple[str, ...] = ()
    spent: int = 0
    stalled: int = 0
    last: Optional[tuple[str, Optional[int]]] = None

    def usable(self) -> list[str]:
        return [h for h in self.allocation if h not in self.excluded]

    def hosts(self) -> list[str]:
        """The hosts of the next attempt (fewer than ``nodes`` only under elastic)."""
        return self.usable()[:self.nodes]


@dataclass(frozen=True)
class Decision:
    """``action`` (relaunch, end, requeue), the hosts of a relaunch, and why in words."""

    action: str
    hosts: tuple[str, ...] = ()
    why: str = ""
    state: State = field(default=None)  # type: ignore[assignment]
    #: The failure turned out to be the program's (the same at the same step on another
    #: host): no host is struck.
    program: bool = False


def decide(state: State, verdict: Verdict, progressed: bool,
           step: Optional[int]) -> Decision:
    """The next step after an attempt that failed with ``verdict``.

    Args:
        state: The supervision so far.
        verdict: The failed attempt's verdict.
        progressed: The attempt wrote a checkpoint newer than the one it started from.
        step: The newest checkpoint's step (None: none yet), where a relaunch resumes.
    """
    if not verdict.restartable:
        return Decision(END, why=f"{verdict.kind} failure: no restart", state=state)
    signature = (_without_hosts(verdict), step)
    stalled = 0 if progressed else state.stalled + 1
    spent = state.spent + (1 if progressed else NO_PROGRESS_COST)
    excluded = tuple(dict.fromkeys((*state.excluded, *verdict.culprits)))
    new = replace(state, excluded=excluded, spent=spent, stalled=stalled, last=signature)
    if stalled >= NO_PROGRESS_LIMIT:
        return Decision(END, why=f"{stalled} attempts in a row wrote no new checkpoint "
                        "(no-progress limit)", state=new)
    if state.last == signature:
        return Decision(END, why="the same failure at the same checkpoint step twice, on "
                        "another host: the program's, not a host's (no strike)",
                        state=replace(state, stalled=stalled, spent=spent), program=True)
    if spent > state.max_restarts:
        return Decision(END, why=f"restart budget spent ({spent} > --max-restarts "
                        f"{state.max_restarts}; an attempt without a new checkpoint costs "
                        f"{NO_PROGRESS_COST})", state=new)
    hosts = new.hosts()
    if len(hosts) < state.nodes and not state.elastic:
        return Decision(REQUEUE, why=f"{len(hosts)} healthy hosts left of the {state.nodes} "
                        "the step needs and no spare: requeueing without "
                        f"{','.join(excluded)}", state=new)
    if not hosts:
        return Decision(END, why="no healthy host left", state=new)
    return Decision(RELAUNCH, tuple(hosts), state=new)


def _without_hosts(verdict: Verdict) -> str:
    """The verdict's evidence with its culprit hosts blanked: a fault that follows the
    program (the same ranks killed at the same step) reads the same on every host."""
    text = verdict.evidence
    for host in verdict.culprits:
        text = text.replace(host, "*")
    return text


def spares(allocation: Sequence[str], nodes: int) -> list[str]:
    """The allocation's hosts past the first ``nodes``: the spares."""
    return list(allocation[nodes:])
