"""Which rank failed first: the one rule, for the batch host, the login node and ``hpc run``.

Each rank marks the moment its failure began (:mod:`hpc.watchdog.marks`); the launchers
print which tasks ended and how (:mod:`hpc.watchdog.launchlog`). Ranks that fail
*because* a peer died ("Connection closed by peer") fail later, so the earliest mark is
the root cause, as in torchrun's error files; a peer killed by a signal (SIGKILL, the
OOM killer) has no mark to date its death, and :func:`first_failure` names it before
the ranks that only lost it (:data:`PEER_LOST`). :func:`describe_failure` and
:func:`first_by_marks` say it in one line for ``hpc first-failure``, the sbatch
templates and ``hpc submit --wait``.
"""

from __future__ import annotations

import dataclasses
import re
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from hpc.watchdog.launchlog import SrunExit, cancellations, compact_ranks, srun_exits
from hpc.watchdog.marks import GENERIC_MESSAGE, marked, origin, read_mark

__all__ = ["PEER_LOSS_WINDOW", "PEER_LOST", "FirstFailure", "describe_failure",
           "first_by_marks", "first_failure", "lost_a_peer"]

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


@dataclasses.dataclass(frozen=True)
class FirstFailure:
    """The rank whose failure began first (see :func:`first_failure`).

    Attributes:
        rank: The rank.
        began: When its failure began (``time.time()``).
        message: Its mark's message (:data:`~hpc.watchdog.marks.GENERIC_MESSAGE` when
            it said nothing more).
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
    :data:`~hpc.watchdog.marks.GENERIC_MESSAGE` (an exception, the watchdog's "stuck"
    verdict): it may still be running. A candidate's failure began at its mark,
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
    for rank in sorted(set(marked(directory) if ranks is None else ranks) | set(failed)):
        mark = read_mark(directory, rank)
        if rank not in failed and (mark is None or mark[1] == GENERIC_MESSAGE):
            continue
        times = [t for t in (mark[0] if mark else None, failed.get(rank)) if t is not None]
        if not times:
            continue
        began = min(times)
        if best is None or began < best.began:
            host, pid = origin(directory, rank)
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


def _ranks(tasks: str) -> str:
    """``0-2,5`` -> ``ranks 0-2,5``, ``3`` -> ``rank 3``."""
    word = "ranks" if ("," in tasks or "-" in tasks) else "rank"
    return f"{word} {tasks}"


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
            found.append(f"{_ranks(compact_ranks(e.ranks))} on {e.host}: {e.what}")
            exits.append(e)
        found.extend(f"slurm: {c}" for c in cancellations(lines))
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
