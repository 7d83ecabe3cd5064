"""``python -m hpc.preempt.shield CMD ARGS...``: run a launcher with SIGTERM blocked.

Slurm's preemption sends SIGTERM to every process of the job's steps, the batch step
included: ``mpirun`` and Open MPI's ``orted`` daemons end the whole MPI job on it, before
any rank could checkpoint. A blocked signal mask survives ``exec`` and ``fork``, so the
launcher, its daemons and its ranks all keep the SIGTERM *pending*; each rank's
:class:`~hpc.preempt.guard.PreemptGuard` unblocks it when installed, gets it, and stops
at the agreed step (the batch shell's stop file, ``HPC_STOP_FILE``, is the second way
the ranks learn of it). A process that never installs a guard simply ignores SIGTERM
until Slurm's SIGKILL at the end of the grace time, so use it only for a command whose
ranks install one (``hpc pretrain``, scripts built on :mod:`hpc.preempt.requeue`).

``slurm/mpirun.sbatch`` starts ``mpirun`` through it and names it as Open MPI's launch
agent (``--mca orte_launch_agent``), so the remote ``orted`` gets the same mask.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Sequence

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Block SIGTERM and exec ``argv`` (returns only on an error, with status 2 or 127)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args:
        print("usage: python -m hpc.preempt.shield CMD [ARGS...]  (runs CMD with SIGTERM "
              "blocked)", file=sys.stderr)
        return 2
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        os.execvp(args[0], args)
    except OSError as e:
        print(f"hpc.preempt.shield: cannot run {args[0]!r}: {e}.\nHINT: give the launcher's "
              "full path, or put it on PATH.", file=sys.stderr)
        return 127
    return 0  # pragma: no cover - exec does not return


if __name__ == "__main__":
    sys.exit(main())
