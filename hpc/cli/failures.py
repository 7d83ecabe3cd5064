"""``hpc first-failure DIR``: which rank failed first, from the failure marks in DIR.

Each rank started by :func:`hpc.init_torch` with ``HPC_ERROR_DIR=DIR`` records there
when and why it began to fail (:mod:`hpc.watchdog.marks`; the rule that reads them is
:mod:`hpc.watchdog.failure`). The sbatch templates in ``slurm/`` run this after a failed
``srun`` so that the job's log names the rank whose failure began first, with host, pid,
time and message, instead of leaving the reader with srun's lines, which come in the
order srun learned of the exits. ``--log FILE`` (the job's output) adds the ranks srun
reported as failed, so a rank that only exited non-zero counts too, and a rank killed by
a signal (no mark) that srun saw first is named. Exit status 0 when a first failure was
found, 1 when none.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from hpc._command import subcommand

__all__ = ["add_parser", "main"]


def _run(args: argparse.Namespace) -> int:
    from hpc.watchdog import failure

    lines = failure.describe_failure([Path(p) for p in args.log], args.dir)
    if not lines:
        print(f"hpc: no failure marks in {args.dir} and no srun errors in the logs",
              file=sys.stderr)
        return 1
    print("\n".join(f"hpc: {line}" for line in lines), file=sys.stderr, flush=True)
    return 0


def add_parser(sub: Any) -> None:
    """Register ``hpc first-failure`` on the ``hpc`` subparsers ``sub``."""
    p = sub.add_parser("first-failure", help="name the rank that failed first (failure marks)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dir", help="the run's HPC_ERROR_DIR")
    p.add_argument("--log", action="append", default=[], metavar="FILE",
                   help="a job output file with srun's 'task N: ...' lines (repeatable)")
    p.set_defaults(func=_run)


main = subcommand(add_parser)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
