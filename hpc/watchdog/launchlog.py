"""What the launchers print when ranks fail: the one parser of their output.

* srun's ``srun: error: node3: tasks 4-5: Killed`` lines (:class:`SrunExit`,
  :func:`srun_exits`), and whether srun had already cancelled the step
  (``Terminating StepId``) when it printed them;
* under torchrun, the root cause of an agent's failure summary (``ChildFailedError``);
* under Open MPI's mpirun, its ``noticed that process rank 2 ... exited on signal 9``;
* slurmstepd's ``*** JOB 12 ON node1 CANCELLED AT ... DUE TO TIME LIMIT ***``
  (:func:`cancellations`);
* rank lists in srun's own form, ``0-2,5`` (:func:`compact_ranks`).

``hpc first-failure`` (:mod:`hpc.watchdog.failure`) and ``hpc supervise`` read the same
lines through it.
"""

from __future__ import annotations

import dataclasses
import re
import signal
from collections.abc import Iterable, Sequence

__all__ = ["ExitParser", "SrunExit", "cancellations", "compact_ranks", "srun_exits"]

#: srun's line of tasks that ended badly (``Killed``, ``Exited with exit code 1``).
_SRUN_ERROR = re.compile(r"srun: error: (?P<node>[\w.-]+): tasks? (?P<tasks>[\d,\-]+): "
                         r"(?P<what>.+)")
#: slurmstepd's banner of a cancelled job or step, with its reason if any.
_STEPD = re.compile(r"\*\*\* (?:JOB|STEP) [\d.]+ ON \S+ CANCELLED AT \S+(?P<why>.*?)\*\*\*")
#: srun cancelling the step itself: the task lines after it are its doing.
_CANCEL = re.compile(r"srun: .*(?:Terminating|Force Terminated) (?:StepId|job step)")
#: torchrun's failure summary (``ChildFailedError``), one field a line, after srun's label.
_TORCHRUN_FIELD = re.compile(r"^(?:(?P<label>\d+): )?\s+(?P<key>host|rank|exitcode)\s+: "
                             r"(?P<value>\S+)")
#: Open MPI's mpirun on a rank killed by a signal (help-orterun.txt).
_OMPI_SIGNAL = re.compile(r"noticed that process rank (?P<rank>\d+) with PID \d+ on node "
                          r"(?P<node>[\w.-]+) exited on signal (?P<sig>\d+)")
_TORCHRUN_ROOT = re.compile(r"^(?:(?P<label>\d+): )?Root Cause \(first observed failure\)")


def compact_ranks(ranks: Sequence[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``0-2,5`` (srun's own form)."""
    parts: list[str] = []
    for r in ranks:
        if parts and "-" not in parts[-1].split(",")[-1] and int(parts[-1]) == r - 1:
            parts[-1] = f"{parts[-1]}-{r}"
        elif parts and "-" in parts[-1] and int(parts[-1].split("-")[1]) == r - 1:
            parts[-1] = f"{parts[-1].split('-')[0]}-{r}"
        else:
            parts.append(str(r))
    return ",".join(parts)


def _expand(tasks: str) -> list[int]:
    """``0-2,5`` -> ``[0, 1, 2, 5]``."""
    out: list[int] = []
    for part in tasks.split(","):
        low, _, high = part.partition("-")
        if low.isdigit() and (not high or high.isdigit()):
            out.extend(range(int(low), int(high or low) + 1))
    return out


@dataclasses.dataclass(frozen=True)
class SrunExit:
    """One ``srun: error: node3: tasks 4-5: Killed`` line.

    Attributes:
        host: The node.
        ranks: The tasks (global ranks) it names.
        what: What srun said of them (``Killed``, ``Terminated``, ``Exited with exit
            code 1``).
        after_cancel: True when srun had already cancelled the step (its ``Terminating
            StepId`` line came first): a consequence of the first failure, not a cause.
    """

    host: str
    ranks: tuple[int, ...]
    what: str
    after_cancel: bool = False

    @property
    def by_signal(self) -> bool:
        """The tasks died of a signal (``Killed``, ``Terminated``), not by their own exit."""
        return not self.what.startswith("Exited with exit code")

    @property
    def out_of_memory(self) -> bool:
        """The kernel's OOM killer ended the tasks (srun's ``Out Of Memory``: the step's
        memory limit or the node's RAM): the program's memory, not the host's fault."""
        return self.what.strip().lower() == "out of memory"


def _signal_word(number: str) -> str:
    """``9`` -> ``Killed``: srun's word for a task ended by that signal."""
    return signal.strsignal(int(number)) or f"signal {number}"


class ExitParser:
    """:func:`srun_exits` line by line: :meth:`feed` each line as it comes, read
    :attr:`exits` at any time. Its state is the parser's alone (whether srun cancelled
    the step, a torchrun summary being read): a watcher of a long step (``hpc
    supervise``) keeps no lines and never reads one twice.

    Attributes:
        exits: The exits found so far, in srun's order.
    """

    def __init__(self) -> None:
        self.exits: list[SrunExit] = []
        self.cancelled = False
        self._summary: dict[str, dict[str, str]] = {}  # srun label -> the root cause read

    def feed(self, line: str) -> None:
        """One line of srun's (torchrun's, mpirun's) output."""
        m = _SRUN_ERROR.search(line)
        if m:
            self.exits.append(SrunExit(m["node"], tuple(_expand(m["tasks"])),
                                       m["what"].strip(), self.cancelled))
        elif _CANCEL.search(line):
            self.cancelled = True
        elif (o := _OMPI_SIGNAL.search(line)) is not None:
            self.exits.append(SrunExit(o["node"], (int(o["rank"]),), _signal_word(o["sig"]),
                                       self.cancelled))
        elif (root := _TORCHRUN_ROOT.match(line)) is not None:
            self._summary[root["label"] or ""] = {}
        elif (f := _TORCHRUN_FIELD.match(line)) is not None \
                and (f["label"] or "") in self._summary:
            self._field(f["label"] or "", f["key"], f["value"])

    def _field(self, label: str, key: str, value: str) -> None:
        """A field of a torchrun root cause; its exit code ends it."""
        failure = self._summary[label]
        failure[key] = value
        if key != "exitcode":
            return
        del self._summary[label]
        code = failure["exitcode"]
        if code.startswith("-") and code[1:].isdigit() and failure.get("rank", "").isdigit():
            self.exits.append(SrunExit(failure.get("host", "?").split(".")[0],
                                       (int(failure["rank"]),), _signal_word(code[1:]),
                                       self.cancelled))


def srun_exits(lines: Iterable[str]) -> list[SrunExit]:
    """srun's error lines about tasks, in the order srun printed them (the one parser of
    them: ``hpc first-failure`` and ``hpc supervise`` read the same lines, the latter
    as they come through :class:`ExitParser`).

    Under torchrun a task is a host's agent, and the ranks are its workers: the root cause
    of the agent's failure summary (``host : node2``, ``rank : 3 (local_rank: 1)``,
    ``exitcode : -9``), a worker killed by a signal, is ``SrunExit("node2", (3,),
    "Killed")``. Its other failures are the workers the agent ended itself (SIGTERM).
    Under Open MPI's mpirun, its ``process rank 2 ... on node node2 exited on signal 9``
    is the same."""
    parser = ExitParser()
    for line in lines:
        parser.feed(line)
    return parser.exits


def cancellations(lines: Iterable[str]) -> list[str]:
    """``cancelled DUE TO TIME LIMIT``: slurmstepd's ``*** JOB 12 ON node1 CANCELLED AT
    <time> DUE TO TIME LIMIT ***`` lines that give a reason, in their order (a bare
    ``CANCELLED AT <time> ***`` says nothing more than srun's lines)."""
    out: list[str] = []
    for line in lines:
        s = _STEPD.search(line)
        if s and s["why"].strip():
            out.append(f"cancelled{s['why'].rstrip()}")
    return out
