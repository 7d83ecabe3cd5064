"""The ``hpc`` command: the table of subcommands, the parser built from it, and ``main``.

Every subcommand lives in the module :data:`SUBCOMMANDS` names, which provides
``add_parser(subparsers)``: it registers a parser whose ``func`` default is the private
handler ``_run(args) -> int``. Each such module also has ``main = subcommand(add_parser)``
(:mod:`hpc._command`, the kit every command shares), so ``python -m hpc.cli.demo ARGS``
is ``hpc demo ARGS``. This dispatcher names the rooms' command modules in its table
(imported when the parser is built) and no room imports it.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence

from hpc._command import handle

__all__ = ["SUBCOMMANDS", "build_parser", "main"]

logger = logging.getLogger(__name__)

#: Subcommand -> module contributing it, imported lazily (none imports torch at import).
SUBCOMMANDS = {"run": "hpc.cli.run", "env": "hpc.cli.env", "demo": "hpc.cli.demo",
               "pretrain": "hpc.pretrain.cli", "search": "hpc.search.search_cli",
               "tune": "hpc.search.tune_cli", "submit": "hpc.submit.cli",
               "first-failure": "hpc.cli.failures", "check": "hpc.check.cli",
               "nodes": "hpc.cli.nodes", "supervise": "hpc.supervise.cli"}


def _unavailable(name: str, error: Exception) -> int:
    print(f"hpc: {name} cannot be imported: {error!r}\n"
          "HINT: reinstall torch-hpc with the extra this command needs, e.g. "
          "pip install 'torch-hpc[submit,pretrain]'.", file=sys.stderr)
    return 1


def build_parser() -> argparse.ArgumentParser:
    """The ``hpc`` parser with every subcommand of :data:`SUBCOMMANDS` (imports no torch)."""
    parser = argparse.ArgumentParser(
        prog="hpc", description="torch-hpc: run one PyTorch script under any launcher.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for command, name in SUBCOMMANDS.items():
        try:
            module = importlib.import_module(name)
        except Exception as e:  # noqa: BLE001 - one broken subcommand must not take down the others
            logger.debug("subcommand module %s unavailable: %s", name, e)
            broken = sub.add_parser(command, help=f"(unavailable: {e})")
            broken.set_defaults(func=lambda _a, n=name, e=e: _unavailable(n, e))
            continue
        module.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``hpc`` console script."""
    args = build_parser().parse_args(argv)
    return handle(args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
