"""Writing one checkpoint file, and the writer process of asynchronous saves.

:func:`write_checkpoint` is the master's whole file step of a save (the atomic write with
its load-back check and checksum, the note for ``hpc supervise``, keep-N): the
synchronous save runs it in the master, an asynchronous one in the writer process that
:mod:`hpc.checkpoint.asyncsave` starts as ``python -m hpc.checkpoint.writer``: a process,
not a thread, so the pickling and hashing do not hold the training loop's GIL, and not a
``multiprocessing`` child, whose start would import the user's unguarded script again.

The writer reads ``(stage directory, skeleton, path, step, keep)`` requests from one
pipe, rebuilds the payload from the shared-memory stage
(:func:`hpc.checkpoint.staging.rebuild`), writes it and answers ``(error or None,
seconds)`` on the other pipe. It ends at the end of its input, and with its parent
(``PR_SET_PDEATHSIG``): a writer killed mid-write leaves a temporary file the next save
removes, never a partial checkpoint. It ignores SIGTERM, SIGINT, SIGHUP and SIGUSR1/2:
Slurm signals every process of a step at a preemption, and the save in flight must end
before the agreed stop writes the last checkpoint.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Optional

from hpc.errors import CheckpointError

__all__ = ["write_checkpoint", "main"]

logger = logging.getLogger(__name__)


def write_checkpoint(payload: dict[str, Any], path: Path, step: int, keep: int
                     ) -> Optional[str]:
    """Write ``payload`` to ``path`` atomically, note it, prune to ``keep``: the error
    text (fact, cause, HINT), or None."""
    from hpc.checkpoint.files import prune, save_atomic
    from hpc.checkpoint.progress import note_checkpoint

    try:
        save_atomic(payload, path)  # loads it back by the resume's rule first
        note_checkpoint(step, path)  # for hpc supervise: where a restart resumes
        removed = prune(path.parent, keep)
        logger.debug("saved %s (removed %s)", path, [p.name for p in removed])
    except CheckpointError as e:  # a value weights_only=True refuses, named
        return str(e)
    except Exception as e:  # disk full, permissions, unpicklable extra
        return (
            f"rank 0 could not write checkpoint {path}: {type(e).__name__}: {e}"
            f"{_space(payload, path.parent)}.\n"
            "The run continues from the previous checkpoint if it is restarted.\n"
            "HINT: check free space and permissions of the directory, and that "
            "extra= holds only tensors and plain Python values.")
    return None


def _space(payload: dict[str, Any], directory: Path) -> str:
    """`` (its tensors: N MiB; M MiB free there)``: torch.save says "unexpected pos" for
    a full disk."""
    from hpc.checkpoint.staging import stage_bytes

    try:
        st = os.statvfs(directory)
    except OSError:
        return ""
    return (f" (its tensors: {stage_bytes(payload) / 2**20:.1f} MiB; "
            f"{st.f_bavail * st.f_frsize / 2**20:.1f} MiB free there)")


def _die_with_parent(parent: int) -> None:
    """SIGKILL this process when ``parent`` ends (Linux); end now if it already has."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # pragma: no cover - not Linux
        pass
    if os.getppid() != parent:
        sys.exit(0)


def main(argv: list[str]) -> int:
    """``python -m hpc.checkpoint.writer <parent pid> <read fd> <write fd>``."""
    import torch

    from hpc.checkpoint.staging import rebuild

    _die_with_parent(int(argv[0]))
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, signal.SIG_IGN)  # a preemption's signals are the ranks' to act on
    torch.set_num_threads(1)  # copies and a hash: leave the cores to training
    requests = Connection(int(argv[1]), writable=False)
    answers = Connection(int(argv[2]), readable=False)
    cache: dict[str, Any] = {}
    while True:
        try:
            directory, skeleton, path, step, keep = requests.recv()
        except EOFError:
            return 0
        started = time.perf_counter()
        try:
            payload = rebuild(skeleton, Path(directory), cache)
            error = write_checkpoint(payload, Path(path), step, keep)
        except Exception as e:  # a stage file gone: the master ended the stage
            error = (f"the checkpoint writer could not read the staged state for {path}: "
                     f"{type(e).__name__}: {e}.\nHINT: report this as a bug.")
        payload = None
        answers.send((error, time.perf_counter() - started))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
