"""The progress file: the newest checkpoint of a supervised step, as the ranks report it.

It lives with its writer (every save on the global master) and has a public reader for
the batch host.

``hpc supervise`` (:mod:`hpc.supervise.supervisor`) exports ``HPC_PROGRESS_FILE`` to the
step it runs; :func:`hpc.save_checkpoint` (and so ``hpc pretrain``) writes the step and
path of each checkpoint it put in place there, on the global master, atomically. The
supervisor reads it after a failure: the step a restart resumes from, and whether the
attempt made progress (a newer checkpoint than the attempt started with).

This module imports nothing of the package but :mod:`hpc.envvars`: ranks and the batch
shell both use it.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional

from hpc import envvars

__all__ = ["Progress", "note_checkpoint", "read_progress"]


@dataclass(frozen=True)
class Progress:
    """The newest checkpoint a step reported."""

    step: int
    path: str
    time: float


def note_checkpoint(step: int, path: os.PathLike[str] | str,
                    environ: Optional[Mapping[str, str]] = None) -> None:
    """Record ``path`` (the checkpoint after ``step``) in ``HPC_PROGRESS_FILE``, if set.

    Never raises: a supervisor that cannot see progress only counts the attempt as one
    without (``OSError`` is swallowed)."""
    target = envvars.value("HPC_PROGRESS_FILE", environ)
    if not target:
        return
    target = Path(target)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps({"step": int(step), "path": str(path), "time": time.time()}))
        os.replace(tmp, target)
    except OSError:
        tmp.unlink(missing_ok=True)


def read_progress(path: os.PathLike[str] | str) -> Optional[Progress]:
    """The progress recorded in ``path``, or None (no checkpoint yet, or unreadable)."""
    try:
        data = json.loads(Path(path).read_text())
        return Progress(int(data["step"]), str(data["path"]), float(data["time"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None
