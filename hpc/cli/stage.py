"""What the ``hpc search`` and ``hpc tune`` commands share (internal).

:func:`add_fields` turns a config dataclass's fields into flags; :func:`run_stage` is
the one shape of a stage command: the warning-signal guard first, the config validated,
``init_torch``, logging into the output directory, the stage, then the requeue after an
agreed stop, with the exit codes of ``hpc pretrain``.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
import typing
from collections.abc import Callable
from typing import Any, Optional

__all__ = ["add_fields", "run_stage"]

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


def run_stage(command: str, cls: Any, args: argparse.Namespace,
              stage: Callable[..., Any], log_name: str, progress: Progress) -> int:
    """Run one stage command (``hpc search``, ``hpc tune``); return the exit status.

    Args:
        command: The command's name, for messages.
        cls: The config dataclass; its fields are read from ``args``.
        args: The parsed command line.
        stage: ``stage(cfg, stop_requested=guard) -> result``.
        log_name: The log file written into ``cfg.out_dir`` by the global master.
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
    names = {f.name for f in dataclasses.fields(cls)}
    cfg = cls(**{k: v for k, v in vars(args).items() if k in names})
    try:
        cfg.validate()
    except ValueError as e:
        print(f"hpc {command}: {e}", file=sys.stderr)
        return 2
    import hpc

    info = hpc.init_torch(seed=cfg.seed)
    hpc.setup_logging(info, level=getattr(logging, args.log_level),
                      log_file=cfg.out_dir / log_name)
    try:
        result = stage(cfg, stop_requested=stop.guard)  # agreed inside the loop
    except (HPCError, ValueError, FileNotFoundError, TypeError) as e:
        logger.error("%s", e)
        return 1
    position, limit, checkpoint = progress(result, cfg)
    if stopped_by_request(result.status, position, limit):
        return stop.exit_code(position, checkpoint, stopped=True)
    return 0
