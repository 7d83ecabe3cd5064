"""Failure marks, written in every rank: when did this rank start failing, and why.

A launcher that sets ``HPC_ERROR_DIR`` (``hpc run`` does) learns, for each rank, the
moment its failure began (an uncaught exception, or the start of the exit of a process
that :func:`note_failure` marked as failing), written before the rank's sockets close,
as ``$HPC_ERROR_DIR/<rank>.json``. A rank that did not fail (a clean end, or the agreed
exit 75 after a requeue) leaves no mark. A process cannot see its own exit status at
exit, so :func:`install` has ``sys.exit`` note a failing status when it is called
(``sys.exit(3)`` marks; ``raise SystemExit(3)`` or ``os._exit`` do not: the launcher's
own report of that rank, srun's ``task N: Exited``, counts).

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

The readers (:func:`read_mark`, :func:`marked`, :func:`origin`) serve the processes
that judge the marks: :mod:`hpc.watchdog.failure` (which rank failed first) and
``hpc supervise``.
"""

from __future__ import annotations

import atexit
import faulthandler
import json
import os
import socket
import sys
import time
import traceback
from pathlib import Path
from types import TracebackType
from typing import Any

from hpc import envvars
from hpc.errors import EXIT_REQUEUED

__all__ = ["GENERIC_MESSAGE", "failed", "install", "mark_exception", "marked",
           "note_failure", "origin", "read_mark", "watch", "write_mark"]

#: The message of a mark written at the exit of a process marked as failing
#: (:func:`note_failure`) that said nothing more (no uncaught exception).
GENERIC_MESSAGE = "exited with a non-zero code"

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


def origin(directory: str, rank: int) -> tuple[str, int]:
    """``(host, pid)`` where ``rank`` ran, from its JSON mark; ``("", 0)`` when unknown
    (no mark, or only a faulthandler file)."""
    try:
        data = json.loads((Path(directory) / f"{rank}.json").read_text())
        return str(data.get("host", "")), int(data.get("pid", 0))
    except (OSError, ValueError):
        return "", 0


def marked(directory: str) -> set[int]:
    """Ranks with a mark (or a faulthandler file) in ``directory``."""
    try:
        names = os.listdir(directory)
    except OSError:
        return set()
    return {int(stem) for stem, _, ext in (n.partition(".") for n in names)
            if stem.isdigit() and ext in ("json", "fault")}
