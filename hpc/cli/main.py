"""The ``hpc`` command: the table of subcommands, the parser built from it, and ``main``.

Every subcommand lives in the module :data:`SUBCOMMANDS` names, which provides
``add_parser(subparsers)``: it registers a parser whose ``func`` default is the private
handler ``_run(args) -> int``. Each such module also has ``main = subcommand(add_parser)``,
so ``python -m hpc.cli.demo ARGS`` is ``hpc demo ARGS``.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["SUBCOMMANDS", "build_parser", "main", "run_subcommand", "subcommand"]

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


def run_subcommand(add_parser: Callable[[Any], None],
                   argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` as the one subcommand ``add_parser`` registers, and run it.

    The ``main(argv)`` of every subcommand module: ``python -m hpc.cli.demo ARGS`` parses
    and runs exactly as ``hpc demo ARGS`` (same parser, same ``prog`` in messages).

    Args:
        add_parser: The subcommand module's ``add_parser(subparsers)``.
        argv: Arguments after the subcommand name (default ``sys.argv[1:]``).

    Returns:
        The handler's exit status.
    """
    parser = argparse.ArgumentParser(prog="hpc")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    add_parser(sub)
    (command,) = sub.choices
    args = parser.parse_args([command, *(sys.argv[1:] if argv is None else argv)])
    return _handle(args)


def subcommand(add_parser: Callable[[Any], None]) -> Callable[[Sequence[str] | None], int]:
    """The ``main(argv=None) -> int`` of a subcommand module: :func:`run_subcommand`.

    In the module, after ``add_parser``: ``main = subcommand(add_parser)``.
    """

    def main(argv: Sequence[str] | None = None) -> int:
        return run_subcommand(add_parser, argv)

    main.__doc__ = (f"``python -m {add_parser.__module__} ARGS``: the same as the ``hpc`` "
                    "subcommand with ARGS.")
    return main


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``hpc`` console script."""
    args = build_parser().parse_args(argv)
    return _handle(args)


def _handle(args: argparse.Namespace) -> int:
    """Run the handler; an :class:`~hpc.errors.HPCError` becomes its message and status 1.

    The message (fact, cause, HINT) is written in ONE write, without a traceback: under
    ``srun --kill-on-bad-exit`` the step is cancelled as soon as a task exits non-zero and
    srun may drop what it had not yet forwarded, so a traceback written line by line lost
    its last line, the one that says what is wrong. ``HPC_TRACEBACK=1`` shows it after.
    """
    from hpc.errors import HPCError

    try:
        return int(args.func(args) or 0)
    except HPCError as e:
        from hpc import envvars
        from hpc.watchdog import marks

        marks.mark_exception(e)
        os.write(2, f"hpc {args.command}: {type(e).__name__}: {e}\n".encode(errors="replace"))
        if envvars.value("HPC_TRACEBACK"):
            raise
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
