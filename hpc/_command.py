"""The kit every command shares: one entry shape, config flags, the error line.

Every subcommand module provides ``add_parser(subparsers)``, registering a parser whose
``func`` default is its private handler ``_run(args) -> int``, and
``main = subcommand(add_parser)``, so ``python -m hpc.pretrain.cli ARGS`` is
``hpc pretrain ARGS``. The stage commands (``hpc pretrain``/``search``/``tune``) build
their flags from their config dataclass (:func:`add_fields`, :func:`config_from_args`)
and register through :func:`add_stage_parser`; their life (guard, init, stage, the one
ending after a stop) is :func:`hpc.preempt.stage.run_stage`.

The rooms with a command import this kit; it imports none of them (the failure mark of
:func:`handle` is the watchdog's, below every room with a command). The dispatcher
(:mod:`hpc.cli.main`) names the command modules in its table and is imported by none.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import typing
from collections.abc import Callable, Sequence
from typing import Any, Optional

__all__ = ["add_fields", "add_stage_parser", "add_tracker_flags", "config_from_args",
           "handle", "run_subcommand", "subcommand"]


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
    return handle(args)


def subcommand(add_parser: Callable[[Any], None]) -> Callable[[Sequence[str] | None], int]:
    """The ``main(argv=None) -> int`` of a subcommand module: :func:`run_subcommand`.

    In the module, after ``add_parser``: ``main = subcommand(add_parser)``.
    """

    def main(argv: Sequence[str] | None = None) -> int:
        return run_subcommand(add_parser, argv)

    main.__doc__ = (f"``python -m {add_parser.__module__} ARGS``: the same as the ``hpc`` "
                    "subcommand with ARGS.")
    return main


def handle(args: argparse.Namespace) -> int:
    """Run the parsed command's handler; an :class:`~hpc.errors.HPCError` becomes its
    message and status 1.

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
        from hpc.watchdog.marks import mark_exception

        mark_exception(e)
        os.write(2, f"hpc {args.command}: {type(e).__name__}: {e}\n".encode(errors="replace"))
        if envvars.value("HPC_TRACEBACK"):
            raise
        return 1


def add_fields(p: argparse.ArgumentParser, cls: Any, helps: dict[str, str]) -> None:
    """One ``--flag`` per field named in ``helps``: the field's type and default."""
    defaults, types = cls(), typing.get_type_hints(cls)
    for name, text in helps.items():
        kind = types[name]
        args = [a for a in typing.get_args(kind) if a is not type(None)]
        kind = args[0] if args else kind
        default = getattr(defaults, name)
        metavar = name.split("_")[-1].upper() if kind is str else None
        p.add_argument("--" + name.replace("_", "-"), type=kind, default=default,
                       metavar=metavar, help=f"{text} (default {default})")


def add_tracker_flags(p: argparse.ArgumentParser) -> None:
    """``--tensorboard``, ``--wandb [PROJECT]`` and ``--mlflow [EXPERIMENT]``: the
    config fields every stage shares (:mod:`hpc.track`)."""
    a = p.add_argument
    a("--tensorboard", action=argparse.BooleanOptionalAction, default=None,
      help="TensorBoard event files in OUT/tensorboard/<run id> (default: on when the "
      "tensorboard package is installed)")
    a("--wandb", nargs="?", const="torch-hpc", default=None, metavar="PROJECT",
      help="report to W&B (project default torch-hpc), one W&B run per run id, resumed "
      "after a requeue; WANDB_MODE=offline keeps it on disk")
    a("--mlflow", nargs="?", const="torch-hpc", default=None, metavar="EXPERIMENT",
      help="report to MLflow (experiment default torch-hpc) at MLFLOW_TRACKING_URI, one "
      "MLflow run per run id")


def add_stage_parser(sub: Any, name: str, help: str, doc: Optional[str], epilog: str,
                     build: Callable[[argparse.ArgumentParser], None],
                     run: Callable[[argparse.Namespace], int]) -> None:
    """Register the stage command ``name`` (its module's ``add_parser``; imports no torch).

    Args:
        sub: The ``hpc`` subparsers.
        name: The command.
        help: Its line in ``hpc --help``.
        doc: Its description (the module docstring).
        epilog: Its examples.
        build: Adds its flags.
        run: Its handler.
    """
    p = sub.add_parser(name, help=help, description=doc, epilog=epilog,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    build(p)
    add_tracker_flags(p)
    p.set_defaults(func=run)


def config_from_args(cls: Any, args: argparse.Namespace) -> Any:
    """The ``cls`` config a parsed command line describes (its fields, by name)."""
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in vars(args).items() if k in names})
