"""The ``hpc`` command: ``env``, ``run``, ``demo`` and the subcommands of other modules.

Each subcommand module provides ``add_parser(subparsers)`` which registers a parser
whose ``func`` default is ``(args) -> int``.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence
from typing import Optional

__all__ = ["main", "SUBCOMMANDS"]

logger = logging.getLogger(__name__)

#: Subcommand -> module contributing it, imported lazily (none imports torch at import).
SUBCOMMANDS = {"env": "hpc.cli.env", "demo": "hpc.cli.demo", "pretrain": "hpc.pretrain.cli",
               "submit": "hpc.submit.cli"}


def _cmd_run(args: argparse.Namespace) -> int:
    from hpc.launch import run

    cmd = list(args.cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    try:
        return run(cmd, args.nproc, prefix=not args.no_prefix, port=args.port)
    except ValueError as e:
        print(f"hpc run: {e}", file=sys.stderr)
        return 2


def _unavailable(name: str, error: Exception) -> int:
    print(f"hpc: {name} cannot be imported: {error!r}\n"
          "HINT: reinstall torch-hpc with the extra this command needs, e.g. "
          "pip install 'torch-hpc[submit,pretrain]'.", file=sys.stderr)
    return 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hpc", description="torch-hpc: run one PyTorch script under any launcher.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    p = sub.add_parser("run", help="start N local ranks of a command (no scheduler needed)",
                       description="Start N ranks of CMD on this host with torchrun-style "
                       "variables; stop all ranks and exit non-zero when one fails.")
    p.add_argument("--nproc", "-n", type=int, default=1, help="number of ranks (default 1)")
    p.add_argument("--port", type=int, default=None,
                   help="master port (default: MASTER_PORT or a free port)")
    p.add_argument("--no-prefix", action="store_true", help="do not prefix output lines")
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="-- CMD [ARGS...]")
    p.set_defaults(func=_cmd_run)
    for command, name in SUBCOMMANDS.items():
        try:
            module = importlib.import_module(name)
        except Exception as e:  # one broken subcommand must not take down the others
            logger.debug("subcommand module %s unavailable: %s", name, e)
            broken = sub.add_parser(command, help=f"(unavailable: {e})")
            broken.set_defaults(func=lambda _a, n=name, e=e: _unavailable(n, e))
            continue
        module.add_parser(sub)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the ``hpc`` console script."""
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
