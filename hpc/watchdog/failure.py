"""Failure marks: when did this rank start failing, and why.

A launcher that sets ``HPC_ERROR_DIR`` (``hpc run`` does) learns, for each rank, the
moment its failure began (an uncaught exception, or the start of the exit of a process
that :func:`note_failure` marked as failing), written before the rank's sockets close.
Ranks that fail *because* a peer died ("Connection closed by peer") fail later, so the
earliest mark is the root cause, as in torchrun's error files; a peer killed by a signal
(SIGKILL, the OOM killer) has no mark to date its death, and :func:`first_failure`
names it before the ranks that only lost it (:data:`PEER_LOST`). A rank that did not fail
(a clean end, or the agreed exit 75 after a requeue) leaves no mark. A process cannot
see its own exit status at exit, so :func:`install` has ``sys.exit`` note a failing
status when it is called (``sys.exit(3)`` marks; ``raise SystemExit(3)`` or ``os._exit``
do not: the launcher's own report of that rank, srun's ``task N: Exited``, counts).

A rank killed by a signal runs no Python at all: an NCCL watchdog timeout calls
``std::abort()`` (SIGABRT) from a C++ thread. For that case :func:`install` points
:mod:`faulthandler` at ``$HPC_ERROR_DIR/<rank>.fault``: the C-level handler writes the
Python stacks there before the process dies, and :func:`read_mark` takes the file's
modification time as the mark (a process that enabled faulthandler itself keeps its
own file).

:func:`failed` tells the teardown whether this process is failing (an uncaught
exception, or :func:`note_failure` from an entry point that returns a non-zero status),
so that it aborts the process group instead of destroying it: on torch >= 2.6
``destroy_process_group()`` flushes pending NCCL work and can hang a rank whose peers
are gone (pytorch/pytorch#141510).
"""

from __future__ import annotations

import atexit
import dataclasses
import faulthandler
import json
import os
import re
import signal
import socket
import sys
import time
import traceback
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

from hpc import envvars
from hpc.errors import EXIT_REQUEUED

__all__ = ["GENERIC_MESSAGE", "PEER_LOSS_WINDOW", "PEER_LOST", "FirstFailure",
           "describe_failure", "failed", "first_by_marks", "first_failure", "install",
           "lost_a_peer", "mark_exception", "note_failure", "read_mark", "SrunExit",
           "srun_exits", "watch", "write_mark"]

#: The message of a mark written at the exit of a process marked as failing
#: (:func:`note_failure`) that said nothing more (no uncaught exception).
GENERIC_MESSAGE = "exited with a non-zero code"

#: What a rank says when it only lost a peer (its own code is not at fault): gloo's and
#: NCCL's words for a connection a dead peer closed, a backend timeout.
PEER_LOST = re.compile(r"Connection closed by peer|Connection reset by peer|Broken pipe|"
                       r"[Cc]onnection refused|Socket Timeout|timed out|[Tt]imeout|"
                       r"NCCL communicator was aborted|ProcessGroupGloo.*(?:failed|error)",
                       re.S)
#: Seconds after a rank's lost-peer mark within which a rank seen to die of a signal, with
#: no mark of its own, is the peer it lost (:func:`first_failure`): the mark comes
#: moments after the death (the watchdog's report adds its ``ANSWER_WAIT``), the
#: launcher may see the death a little later on a loaded host.
PEER_LOSS_WINDOW = 5.0

_INSTALLED: dict[str, bool] = {}
_FAILED: dict[str, str] = {}
#: Open file objects faulthandler writes into (must outlive the process).
_FAULT_FILES: list[Any] = []
_MARK_PATH: list[Path] = []


def note_failure(reason: str = "failed") -> None:
    """Mark this process as failing (an entry point about to return non-zero)."""
    _FAILED.setdefault("reason", reason)


def failed() -> bool:
    """True once an uncaught exception reached ``sys.excepthook`` or
    :func:`note_failure` was called."""
    return bool(_FAILED)


def watch() -> None:
    """Note uncaught exceptions for :func:`failed` (idempotent, chains the hook)."""
    if _INSTALLED.get("<watch>"):
        return
    _INSTALLED["<watch>"] = True
    previous = sys.excepthook

    def hook(kind: type[BaseException], exc: BaseException,
             tb: TracebackType | None) -> None:
        note_failure(kind.__name__)
        previous(kind, exc, tb)

    sys.excepthook = hook


def mark_exception(exc: BaseException) -> None:
    """Note ``exc`` as this process's failure and, under :func:`install`, mark the rank
    with its message (the excepthook does; so does an entry point that reports the
    exception itself instead of letting it reach the hook)."""
    note_failure(type(exc).__name__)
    if not _MARK_PATH:
        return
    try:
        _write(_MARK_PATH[-1], "".join(traceback.format_exception_only(type(exc), exc)).strip())
    except OSError:
        pass


def _write(path: Path, message: str, when: float | None = None,
           origin: tuple[str, int] | None = None) -> None:
    if path.exists():
        return
    host, pid = origin or (socket.gethostname(), os.getpid())
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"time": time.time() if when is None else when,
                               "message": message[-4000:], "host": host, "pid": pid}))
    os.replace(tmp, path)


def write_mark(directory: str, rank: int, message: str, when: float | None = None,
               origin: tuple[str, int] | None = None) -> None:
    """Mark ``rank`` as failing since ``when`` (default now), unless it has a mark.

    The watchdog's reporter marks a stuck rank with the moment it stopped making
    progress, which precedes the timeouts of the ranks that waited for it; ``origin``
    is that rank's ``(host, pid)`` (default: this process's, for a rank marking itself),
    so the mark names where the culprit ran, not where the reporter runs.
    """
    try:
        _write(Path(directory) / f"{rank}.json", message, when, origin)
    except OSError:
        pass


def _mark_failing_exit(path: Path) -> None:
    """At exit: the generic mark, if this process is failing (:func:`failed`)."""
    if failed():
        try:
            _write(path, GENERIC_MESSAGE)
        except OSError:
            pass


def _noting_exit(real: Any, clean: tuple[int, ...]) -> Any:
    """``sys.exit`` that first notes a failing status (not 0/None, not one of ``clean``):
    atexit cannot see the exit code, but the call can."""
    def exit(status: object = None) -> Any:  # noqa: A001 - it replaces sys.exit
        if status not in (None, 0, *clean):
            note_failure(f"sys.exit({status!r})")
        return real(status)

    exit._hpc_noting = True  # type: ignore[attr-defined]
    return exit


def install(rank: int, environ: dict[str, str] | None = None) -> None:
    """Record when this rank began to fail under ``$HPC_ERROR_DIR/<rank>.json``.

    Idempotent; a no-op unless the launcher set ``HPC_ERROR_DIR`` (created if missing:
    the sbatch templates name one per job in the submit directory).
    """
    directory = envvars.value("HPC_ERROR_DIR", environ or os.environ)
    if not directory or _INSTALLED.get(directory):
        return
    _INSTALLED[directory] = True
    try:
        Path(directory).mkdir(parents=True, exist_ok=True)
    except OSError:
        return
    path = Path(directory) / f"{rank}.json"
    _MARK_PATH.append(path)
    previous = sys.excepthook

    def hook(kind: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
        mark_exception(exc)
        previous(kind, exc, tb)

    sys.excepthook = hook
    # SystemExit(3) never reaches the excepthook and atexit cannot see the exit code:
    # mark the start of the exit of a process that noted its failure (hpc's entry points
    # do before they return non-zero), and of no other: a clean run and the agreed exit
    # after a requeue leave no mark. Registered after the teardown handler, so it runs
    # before the group is destroyed.
    atexit.register(_mark_failing_exit, path)
    # sys.exit(3) in a user's script is a failure too (a `raise SystemExit(3)` is not seen):
    # note it at the call; the agreed requeue exit is not one.
    if not getattr(sys.exit, "_hpc_noting", False):
        sys.exit = _noting_exit(sys.exit, (EXIT_REQUEUED,))
    if not faulthandler.is_enabled():
        try:
            fault = open(Path(directory) / f"{rank}.fault", "w")  # noqa: SIM115
        except OSError:
            return
        _FAULT_FILES.append(fault)
        faulthandler.enable(file=fault, all_threads=True)


def read_mark(directory: str, rank: int) -> tuple[float, str] | None:
    """``(time, message)`` of ``rank``'s failure mark, if it wrote one: the JSON mark,
    else a non-empty faulthandler file (a fatal signal such as NCCL's SIGABRT)."""
    try:
        data = json.loads((Path(directory) / f"{rank}.json").read_text())
        return float(data["time"]), str(data["message"])
    except (OSError, ValueError, KeyError):
        pass
    fault = Path(directory) / f"{rank}.fault"
    try:
        text = fault.read_text(errors="replace").strip()
        if text:
            first = text.splitlines()[0]  # "Fatal Python error: Aborted"
            return fault.stat().st_mtime, f"{first} (fatal signal; stacks in {fault})"
    except OSError:
        pass
    return None


@dataclasses.dataclass(frozen=True)
class FirstFailure:
    """The rank whose failure began first (see :func:`first_failure`).

    Attributes:
        rank: The rank.
        began: When its failure began (``time.time()``).
        message: Its mark's message (:data:`GENERIC_MESSAGE` when it said nothing more).
        host: Where it ran, from its mark ("" when unknown).
        pid: Its process id, from its mark (0 when unknown).
        running: True when it is not among the ranks seen to fail (still running, or
            its exit was not reported), and is a candidate by its mark alone.
    """

    rank: int
    began: float
    message: str
    host: str = ""
    pid: int = 0
    running: bool = False


def _origin(directory: str, rank: int) -> tuple[str, int]:
    try:
        data = json.loads((Path(directory) / f"{rank}.json").read_text())
        return str(data.get("host", "")), int(data.get("pid", 0))
    except (OSError, ValueError):
        return "", 0


def _marked(directory: str) -> set[int]:
    """Ranks with a mark (or a faulthandler file) in ``directory``."""
    try:
        names = os.listdir(directory)
    except OSError:
        return set()
    return {int(stem) for stem, _, ext in (n.partition(".") for n in names)
            if stem.isdigit() and ext in ("json", "fault")}


def lost_a_peer(rank: int, message: str) -> bool:
    """True when ``rank``'s failure mark says it only lost a peer (:data:`PEER_LOST`), and
    is not the watchdog's verdict that this rank itself never entered a collective."""
    return bool(PEER_LOST.search(message)) and \
        re.search(rf"\brank {rank} (?:\([^()]*\) )?never entered", message) is None


def first_failure(directory: str, failed: Mapping[int, float | None],
                  ranks: Iterable[int] | None = None,
                  signalled: Iterable[int] = ()) -> FirstFailure | None:
    """The one rule for "which rank failed first": the earliest start of a failure, unless
    that rank only lost a peer the launcher saw killed by a signal.

    Candidates are the ranks seen to fail (``failed``: rank -> when, None when the time
    is unknown, e.g. srun's ``task N: Exited`` lines) and every rank of ``ranks``
    (default: every rank with a mark in ``directory``) whose mark says more than
    :data:`GENERIC_MESSAGE` (an exception, the watchdog's "stuck" verdict): it may
    still be running. A candidate's failure began at its mark,
    or when it was seen to fail if that is earlier. None when no candidate has a time.

    A rank of ``signalled`` (seen to die of a signal the launcher did not send: SIGKILL
    from outside, the OOM killer) ran no Python and has no mark to date its death. When
    the earliest candidate only lost a peer (:func:`lost_a_peer`), such a rank without a
    mark, seen to die no later than :data:`PEER_LOSS_WINDOW` seconds after that mark or
    at an unknown time (srun's lines carry none), is the peer it lost and the first
    failure: the earliest of them by time, else the first in ``signalled``'s order. Its
    ``began`` is when it was seen dead, or the lost-peer mark when that is earlier or the
    death's time is unknown (it died before).
    Used by ``hpc run`` and, through the shared run directory, ``hpc submit --wait``
    and the sbatch templates (``hpc first-failure``).
    """
    best: FirstFailure | None = None
    for rank in sorted(set(_marked(directory) if ranks is None else ranks) | set(failed)):
        mark = read_mark(directory, rank)
        if rank not in failed and (mark is None or mark[1] == GENERIC_MESSAGE):
            continue
        times = [t for t in (mark[0] if mark else None, failed.get(rank)) if t is not None]
        if not times:
            continue
        began = min(times)
        if best is None or began < best.began:
            host, pid = _origin(directory, rank)
            best = FirstFailure(rank, began, mark[1] if mark else GENERIC_MESSAGE, host, pid,
                                rank not in failed)
    if best is None or not lost_a_peer(best.rank, best.message):
        return best
    lost = best.began
    killed = []  # (time unknown, seen dead at, order, rank): the earliest known first
    for order, rank in enumerate(signalled):
        if rank not in failed or read_mark(directory, rank) is not None:
            continue
        seen = failed[rank]
        if seen is None or seen <= lost + PEER_LOSS_WINDOW:
            killed.append((seen is None, lost if seen is None else min(seen, lost), order, rank))
    if not killed:
        return best
    _, began, _, rank = min(killed)
    return FirstFailure(rank, began, GENERIC_MESSAGE)


_SRUN_ERROR = re.compile(r"srun: error: (?P<node>[\w.-]+): tasks? (?P<tasks>[\d,\-]+): "
                         r"(?P<what>.+)")
_STEPD = re.compile(r"\*\*\* (?:JOB|STEP) [\d.]+ ON \S+ CANCELLED AT \S+(?P<why>.*?)\*\*\*")


def _ranks(tasks: str) -> str:
    word = "ranks" if ("," in tasks or "-" in tasks) else "rank"
    return f"{word} {tasks}"


def _compact(ranks: Sequence[int]) -> str:
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


_CANCEL = re.compile(r"srun: .*(?:Terminating|Force Terminated) (?:StepId|job step)")


#: torchrun's failure summary (``ChildFailedError``), one field a line, after srun's label.
_TORCHRUN_FIELD = re.compile(r"^(?:(?P<label>\d+): )?\s+(?P<key>host|rank|exitcode)\s+: "
                             r"(?P<value>\S+)")
#: Open MPI's mpirun on a rank killed by a signal (help-orterun.txt).
_OMPI_SIGNAL = re.compile(r"noticed that process rank (?P<rank>\d+) with PID \d+ on node "
                          r"(?P<node>[\w.-]+) exited on signal (?P<sig>\d+)")
_TORCHRUN_ROOT = re.compile(r"^(?:(?P<label>\d+): )?Root Cause \(first observed failure\)")


def _signal_word(number: str) -> str:
    """``9`` -> ``Killed``: srun's word for a task ended by that signal."""
    return signal.strsignal(int(number)) or f"signal {number}"


def srun_exits(lines: Iterable[str]) -> list[SrunExit]:
    """srun's error lines about tasks, in the order srun printed them (the one parser of
    them: ``hpc first-failure`` and ``hpc supervise`` read the same lines).

    Under torchrun a task is a host's agent, and the ranks are its workers: the root cause
    of the agent's failure summary (``host : node2``, ``rank : 3 (local_rank: 1)``,
    ``exitcode : -9``), a worker killed by a signal, is ``SrunExit("node2", (3,),
    "Killed")``. Its other failures are the workers the agent ended itself (SIGTERM).
    Under Open MPI's mpirun, its ``process rank 2 ... on node node2 exited on signal 9``
    is the same."""
    out: list[SrunExit] = []
    cancelled = False
    summary: dict[str, dict[str, str]] = {}  # srun label -> the root cause being read
    for line in lines:
        m = _SRUN_ERROR.search(line)
        if m:
            out.append(SrunExit(m["node"], tuple(_expand(m["tasks"])), m["what"].strip(),
                                cancelled))
        elif _CANCEL.search(line):
            cancelled = True
        elif (o := _OMPI_SIGNAL.search(line)) is not None:
            out.append(SrunExit(o["node"], (int(o["rank"]),), _signal_word(o["sig"]),
                                cancelled))
        elif (root := _TORCHRUN_ROOT.match(line)) is not None:
            summary[root["label"] or ""] = {}
        elif (f := _TORCHRUN_FIELD.match(line)) is not None and (f["label"] or "") in summary:
            label = f["label"] or ""
            failure = summary[label]
            failure[f["key"]] = f["value"]
            if f["key"] != "exitcode":
                continue
            del summary[label]
            code = failure["exitcode"]
            if code.startswith("-") and code[1:].isdigit() and failure.get("rank", "").isdigit():
                out.append(SrunExit(failure.get("host", "?").split(".")[0],
                                    (int(failure["rank"]),), _signal_word(code[1:]),
                                    cancelled))
    return out


def first_by_marks(marks: str | Path | None, failed: Sequence[int] = (),
                   signalled: Sequence[int] = ()) -> str | None:
    """``rank 1 on node2 (pid 42) at 12:00:01.234: <message>``: the rank whose failure
    began first by the failure marks in ``marks`` (:func:`first_failure` with ``failed``,
    the ranks srun reported in its order, and ``signalled``, those it saw killed by a
    signal before it cancelled the step), or None when there is none.

    None too when the first failure left no mark: srun's first failed rank (killed by a
    signal, SIGKILL or the OOM killer, it ran no Python to write one, and srun saw its
    exit first), or a rank of ``signalled`` whose peers only lost it. srun's line of it
    names it (:func:`describe_failure`).
    """
    first = _first_marked(marks, failed, signalled)
    if first is None or read_mark(str(marks), first.rank) is None:
        return None
    return _by_mark(first)


def _by_mark(first: FirstFailure) -> str:
    where = f" on {first.host}" if first.host else ""
    pid = f" (pid {first.pid})" if first.pid else ""
    when = time.strftime("%H:%M:%S", time.localtime(first.began)) + f"{first.began % 1:.3f}"[1:]
    return f"rank {first.rank}{where}{pid} at {when}: {first.message.splitlines()[-1]}"


def _first_marked(marks: str | Path | None, failed: Sequence[int],
                  signalled: Sequence[int]) -> FirstFailure | None:
    """:func:`first_failure` over srun's failed ranks; None without marks, or when srun's
    first failed rank has no mark and no rank killed by a signal was lost by its peers."""
    if not marks:
        return None
    first = first_failure(str(marks), dict.fromkeys(failed), signalled=signalled)
    if failed and read_mark(str(marks), failed[0]) is None and \
            (first is None or read_mark(str(marks), first.rank) is not None):
        return None
    return first


def describe_failure(logs: Sequence[Path], marks: str | Path | None = None) -> list[str]:
    """``first failure: ...`` and srun's error lines, from the job's output files and
    its failure marks (``marks``: the run's ``HPC_ERROR_DIR``).

    The first failure comes from the marks when there are any: srun prints ``srun:
    error: node2: task 3: Killed`` in the order it learns of the exits, and a rank that
    failed first but took long to exit comes later there. A rank srun saw killed by a
    signal before it cancelled the step has no mark: it is the first failure when the
    earliest mark only lost a peer (:func:`first_failure`), wherever srun listed it.
    Without marks (or when srun's first failed rank has none, see
    :func:`first_by_marks`), srun's first line is taken.
    """
    found: list[str] = []
    exits: list[SrunExit] = []
    for path in logs:
        try:
            text = Path(path).read_text(errors="replace")
        except OSError:
            continue
        lines = text.splitlines()
        for e in srun_exits(lines):
            found.append(f"{_ranks(_compact(e.ranks))} on {e.host}: {e.what}")
            exits.append(e)
        for line in lines:
            s = _STEPD.search(line)
            if s and s["why"].strip():
                found.append(f"slurm: cancelled{s['why'].rstrip()}")
    tasks = [r for e in exits for r in e.ranks]
    signalled = [r for e in exits if e.by_signal and not e.after_cancel for r in e.ranks]
    first = _first_marked(marks, tasks, signalled)
    srun = [f"  srun: {f}" for f in dict.fromkeys(found)]
    if first is not None and read_mark(str(marks), first.rank) is None:
        killed = next(e for e in exits if first.rank in e.ranks)
        head = (f"first failure: rank {first.rank} on {killed.host}: {killed.what} (no mark "
                f"of its own; the earliest failure marks in {marks} only lost a peer)")
        return [head, *srun]
    if first is not None:
        return [f"first failure: {_by_mark(first)} (by the failure marks in {marks})", *srun]
    if found:
        return [f"first failure: {found[0]}", *(f"  then: {f}" for f in dict.fromkeys(found[1:]))]
    return []
