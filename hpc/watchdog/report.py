"""The stuck-rank report: which ranks never entered the collective the others wait in.

Pure functions over what every rank contributed through the pre-flight store (see
:mod:`hpc.watchdog.monitor`): its collective progress (:class:`~hpc.watchdog.tracker.Progress`),
host and pid, and, when its watchdog answered, where its main thread is and its stack.
For collectives on a GPU the progress is the device's (:mod:`hpc.watchdog.device`): a
rank whose host queued a collective that its GPU never reached did not enter it.
"""

from __future__ import annotations

import sys
import threading
import time
import traceback
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["compose", "culprits", "main_stack", "target", "where"]

#: Frames under these directories are skipped when saying where a rank "is".
_LIBRARY_DIRS = tuple(str(Path(p).resolve()) for p in (
    Path(__file__).parents[1],  # hpc/
    Path(threading.__file__).parent,  # the standard library
))


def _is_library(filename: str) -> bool:
    resolved = str(Path(filename).resolve()) if filename and not filename.startswith("<") else ""
    return bool(resolved) and (resolved.startswith(_LIBRARY_DIRS)
                               or "site-packages" in resolved or "dist-packages" in resolved)


def main_stack(limit: int = 12) -> list[traceback.FrameSummary]:
    """The main thread's stack, innermost last (at most ``limit`` frames)."""
    frame = sys._current_frames().get(threading.main_thread().ident or -1)
    return list(traceback.extract_stack(frame, limit=limit)) if frame is not None else []


def where(stack: Sequence[traceback.FrameSummary]) -> str:
    """``file.py:LINE in FUNC`` of the innermost frame of the user's own code."""
    frames = [f for f in stack if not _is_library(f.filename)] or list(stack)
    if not frames:
        return "an unknown place (no Python frame)"
    f = frames[-1]
    return f"{Path(f.filename).name}:{f.lineno} in {f.name}"


def target(entries: Mapping[int, Mapping[str, Any]]) -> tuple[int, str]:
    """The collective the job waits in: the highest sequence number entered, its op."""
    seq = max((int(e.get("entered", 0)) for e in entries.values()), default=0)
    op = next((str(e.get("op")) for e in entries.values()
               if int(e.get("entered", 0)) == seq and e.get("op")), "collective")
    return seq, op


def culprits(entries: Mapping[int, Mapping[str, Any]]) -> list[int]:
    """Ranks that never entered :func:`target`'s collective (``entered`` behind)."""
    seq, _ = target(entries)
    return sorted(r for r, e in entries.items() if int(e.get("entered", 0)) < seq)


def _who(rank: int, e: Mapping[str, Any]) -> str:
    return f"rank {rank} ({e.get('host', '?')}, pid {e.get('pid', '?')})"


def _last(e: Mapping[str, Any], now: float) -> str:
    entered, completed = int(e.get("entered", 0)), int(e.get("completed", 0))
    queued = int(e.get("queued", entered))
    behind = (f"; its host queued up to #{queued}, which its GPU has not reached"
              if queued > entered else "")
    last = "its last collective was" if e.get("answered") else \
        "the last collective it published was"
    if entered == 0:
        return ("it entered no collective" if e.get("answered") else
                "it published no collective yet") + behind
    state = "completed" if completed >= entered else "still in"
    ago = max(0.0, now - float(e.get("since", now)))
    return f"{last} {e.get('op')} #{entered} ({state}, {ago:.1f}s ago){behind}"


def _culprit_line(rank: int, e: Mapping[str, Any], seq: int, op: str, now: float) -> str:
    line = f"{_who(rank, e)} never entered {op} #{seq}: {_last(e, now)}; "
    if e.get("answered"):
        return line + f"it is at {e.get('where')}"
    state = f" ({e['process']})" if e.get("process") else ""
    return line + f"its watchdog did not answer{state}"


def _ranks(ranks: Sequence[int]) -> str:
    shown = ", ".join(map(str, ranks[:16]))
    return shown + (f" ... ({len(ranks)} ranks)" if len(ranks) > 16 else "")


def compose(kind: str, reporter: int, entries: Mapping[int, Mapping[str, Any]],
            error: str = "", now: float | None = None) -> str:
    """The report text: fact (who never entered what) -> cause -> ``HINT:``.

    Args:
        kind: ``"timeout"`` (a collective timed out), ``"failure"`` (it failed, e.g. a
            peer died) or ``"warning"`` (no progress for ``HPC_HANG_TIMEOUT``).
        reporter: The rank writing the report.
        entries: Rank -> what it contributed (``entered``, ``completed``, ``op``,
            ``since``, ``host``, ``pid``, ``answered``, ``where``, ``stack``, ``process``).
        error: The error the collective raised on ``reporter``.
        now: ``time.time()`` of the report (default: now).
    """
    now = time.time() if now is None else now
    seq, op = target(entries)
    stuck = culprits(entries)
    waiting = sorted(r for r, e in entries.items() if int(e.get("entered", 0)) >= seq)
    what = {"timeout": "timed out", "failure": "failed",
            "warning": "has made no progress"}.get(kind, kind)
    head = f"{op} #{seq} {what} (reported by rank {reporter})"
    if stuck:
        head += ": " + "; ".join(
            f"{_who(r, entries[r])} never entered it" for r in stuck[:4])
        head += " ..." if len(stuck) > 4 else ""
    lines = [head + "."]
    lines += [_culprit_line(r, entries[r], seq, op, now) for r in stuck]
    for r in stuck:
        stack = entries[r].get("stack")
        if stack:
            lines.append(f"stack of rank {r}:\n" + "\n".join(
                "    " + s for s in str(stack).rstrip().splitlines()))
    lines.append(f"waiting in {op} #{seq}: rank(s) {_ranks(waiting)}.")
    if error:
        lines.append(f"error on rank {reporter}: {error.strip().splitlines()[0]}")
    if stuck:
        lines.append("The ranks above stopped making progress before the collective "
                     "(a rank stuck in its own code, a data loader, a skipped collective, "
                     "a dead or stopped process); the others only waited for them.")
        lines.append("HINT: look at the named rank's stack and host first; a rank that "
                     "did not answer is stopped, dead or stuck outside Python.")
    else:
        lines.append("Every rank entered it: the network or a backend stalled, not the "
                     "ranks' own code.")
        lines.append("HINT: check the network between the waiting ranks' hosts and "
                     "GLOO_SOCKET_IFNAME/NCCL_SOCKET_IFNAME; rerun with a longer timeout "
                     "to tell a slow link from a dead one.")
    return "\n".join(lines)
