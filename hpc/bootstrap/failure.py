"""Failure marks: when did this rank start failing, and why.

A launcher that sets ``HPC_ERROR_DIR`` (``hpc run`` does) learns, for each rank, the
moment its failure began (an uncaught exception, or the start of a non-zero exit),
written before the rank's sockets close. Ranks that fail *because* a peer died
("Connection closed by peer") fail later, so the earliest mark is the root cause, as in
torchrun's error files.
"""

from __future__ import annotations

import atexit
import json
import os
import sys
import time
import traceback
from pathlib import Path
from types import TracebackType
from typing import Optional

__all__ = ["install", "read_mark"]

_INSTALLED: dict[str, bool] = {}


def _write(path: Path, message: str) -> None:
    if path.exists():
        return
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"time": time.time(), "message": message[-4000:]}))
    os.replace(tmp, path)


def install(rank: int, environ: Optional[dict[str, str]] = None) -> None:
    """Record when this rank began to fail under ``$HPC_ERROR_DIR/<rank>.json``.

    Idempotent; a no-op unless the launcher set ``HPC_ERROR_DIR``.
    """
    directory = (environ or os.environ).get("HPC_ERROR_DIR")
    if not directory or _INSTALLED.get(directory):
        return
    _INSTALLED[directory] = True
    path = Path(directory) / f"{rank}.json"
    previous = sys.excepthook

    def hook(kind: type[BaseException], exc: BaseException, tb: Optional[TracebackType]) -> None:
        try:
            _write(path, "".join(traceback.format_exception_only(kind, exc)).strip())
        except OSError:
            pass
        previous(kind, exc, tb)

    sys.excepthook = hook
    # SystemExit(3) never reaches the excepthook and atexit cannot see the exit code:
    # mark the start of every exit; the launcher reads marks of failed ranks only.
    # Registered after the teardown handler, so it runs before the group is destroyed.
    atexit.register(_write, path, "exited with a non-zero code")


def read_mark(directory: str, rank: int) -> Optional[tuple[float, str]]:
    """``(time, message)`` of ``rank``'s failure mark, if it wrote one."""
    try:
        data = json.loads((Path(directory) / f"{rank}.json").read_text())
        return float(data["time"]), str(data["message"])
    except (OSError, ValueError, KeyError):
        return None
