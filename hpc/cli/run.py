"""``hpc run``: start N local ranks of a command (the engine is :mod:`hpc.launch`).

Building this parser imports neither torch nor the engine; :func:`hpc.launch.run` is
imported when the command runs.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from hpc._command import subcommand

__all__ = ["add_parser", "main"]


def _run(args: argparse.Namespace) -> int:
    from hpc.launch import run

    cmd = list(args.cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    try:
        return run(cmd, args.nproc, prefix=not args.no_prefix, port=args.port)
    except ValueError as e:
        print(f"hpc run: {e}", file=sys.stderr)
        return 2


def add_parser(sub: Any) -> None:
    """Register ``hpc run`` on the ``hpc`` subparsers ``sub``."""
    p = sub.add_parser("run", help="start N local ranks of a command (no scheduler needed)",
                       description="Start N ranks of CMD on this host with torchrun-style "
                       "variables; stop all ranks and exit non-zero when one fails.")
    p.add_argument("--nproc", "-n", type=int, default=1, help="number of ranks (default 1)")
    p.add_argument("--port", type=int, default=None,
                   help="master port (default: MASTER_PORT or a free port)")
    p.add_argument("--no-prefix", action="store_true", help="do not prefix output lines")
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="-- CMD [ARGS...]")
    p.set_defaults(func=_run)


main = subcommand(add_parser)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
