"""The one shape of a stage command: ``hpc pretrain``, ``hpc search``, ``hpc tune``.

:func:`add_fields` turns a config dataclass's fields into flags and
:func:`config_from_args` reads them back; :func:`run_stage` runs a stage: the
warning-signal guard first, the config validated, ``init_torch``, logging into the
output directory, the stage, then the requeue after an agreed stop. Exit codes (the same
on every rank): 0 completed or stopped cleanly, 2 a bad command line, 1 an error in the
stage (the process is then marked as failing, so its exit aborts the process group
instead of destroying it), 75 stopped and requeued.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

__all__ = ["add_fields", "add_stage_parser", "add_tracker_flags", "config_from_args",
           "run_stage"]

logger = logging.getLogger(__name__)

#: ``progress(result, cfg) -> (position, stop position or None, checkpoint path)``.
Progress = Callable[[Any, Any], "tuple[int, Optional[int], Any]"]


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


def run_stage(command: str, cls: Any, args: argparse.Namespace,
              stage: Callable[..., Any], log_file: Callable[[Any], Optional[Path]],
              progress: Progress) -> int:
    """Run one stage command; return the exit status.

    Args:
        command: The command's name, for messages.
        cls: The config dataclass; its fields are read from ``args``.
        args: The parsed command line (with ``log_level``).
        stage: ``stage(cfg, stop_requested=guard) -> result``; ``result.status`` is
            ``completed``, ``stopped`` or anything else for a failed run.
        log_file: The log file the global master writes for ``cfg`` (None: none).
        progress: Where the stage stopped, its limit and its checkpoint.
    """
    from hpc.errors import HPCError
    from hpc.preempt.requeue import stopped_by_request
    from hpc.preempt.stop import AgreedStop

    try:  # first: the warning signal must not kill a rank that is still importing torch
        stop = AgreedStop()  # installs the guard
    except HPCError as e:
        print(f"hpc {command}: {e}", file=sys.stderr)
        return 2
    cfg = config_from_args(cls, args)
    try:
        cfg.validate()
    except ValueError as e:
        print(f"hpc {command}: {e}", file=sys.stderr)
        return 2
    import hpc

    info = hpc.init_torch(seed=cfg.seed)
    hpc.setup_logging(info, level=getattr(logging, args.log_level), log_file=log_file(cfg))
    try:
        result = stage(cfg, stop_requested=stop.guard)  # agreed inside the loop
    except (HPCError, ValueError, FileNotFoundError, TypeError) as e:
        from hpc.watchdog.marks import mark_exception

        logger.error("%s", e)
        logger.debug("%s failed", command, exc_info=True)
        mark_exception(e)  # the rank's mark says what failed (hpc first-failure, supervise)
        return 1
    position, limit, checkpoint = progress(result, cfg)
    if stopped_by_request(result.status, position, limit):
        code = stop.exit_code(position, checkpoint, stopped=True)
        if code:  # 75 after a requeue: Slurm's SIGTERM to the job must not kill the exit
            from hpc.preempt.requeue import close_before_failing_exit

            close_before_failing_exit()
        return code
    if result.status not in ("completed", "stopped"):
        return _failing(f"{command} {result.status}")
    return 0


def _failing(reason: str) -> int:
    """Exit status 1, the process marked as failing: its exit aborts the process group."""
    from hpc.watchdog.marks import note_failure

    note_failure(reason)
    return 1
