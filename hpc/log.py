"""Rank-aware logging: one call, made by entry points, never at import.

Local masters (local rank 0 of each node) log INFO and above to the console; other
ranks WARNING and above, so a 64-GPU job prints each line once per node and errors from
every rank. ``console="global"`` (or ``HPC_LOG_CONSOLE=global``) keeps INFO to the
global master alone: each line once per job. Every line carries a ``[rank r/w host]``
prefix, except on the console under ``hpc run``, which prefixes lines itself
(``HPC_RUN_PREFIXED=1``); the global master alone writes the optional log file.

With a run directory (``rank_log_dir=``, default ``HPC_LOG_DIR``) every rank also writes
all its lines at ``level`` to ``rank<r>.log`` there (appended to across requeues), so a
warning of rank 37 is found without searching the interleaved console output.

The documented scripts call ``setup_logging`` *after* ``init_torch``, so the start-up's
INFO lines (``network: master ... reachable over eth0``, ``initialised slurm rank ...``)
would have had nowhere to go. While nothing is configured (no handler on the root or
``hpc`` logger), ``init_torch`` holds its ``hpc.*`` records (:func:`held_until_setup`) and
the first ``setup_logging`` replays them through its handlers, with their own times,
before any line of the script. Warnings are printed at once as before (Python's
last-resort handler) and replayed only to the files. A script that configures logging
otherwise (``logging.basicConfig`` before ``init_torch``) gets the records live, as ever.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

from hpc import envvars
from hpc.environments import DistInfo

__all__ = ["CONSOLE_CHOICES", "RankFilter", "held_until_setup", "setup_logging"]

#: Who logs INFO to the console: every node's local master, or the global master only.
CONSOLE_CHOICES = envvars.VARIABLES["HPC_LOG_CONSOLE"].choices

_HANDLERS: list[logging.Handler] = []
#: ``hpc.*`` records of an ``init_torch`` that ran before logging was set up, for the
#: first :func:`setup_logging` to replay; at most :data:`_HELD_MAX`.
_HELD: list[logging.LogRecord] = []
_HELD_MAX = 500
_PACKAGE = "hpc"


class _Holder(logging.Handler):
    """Keeps records for :func:`setup_logging`; shows at once those that would have
    been shown without it (Python's last resort: WARNING and above on stderr)."""

    def __init__(self, shown: int) -> None:
        super().__init__(logging.INFO)
        self.shown = shown

    def emit(self, record: logging.LogRecord) -> None:
        last = logging.lastResort
        if last is not None and record.levelno >= max(self.shown, last.level):
            last.handle(record)
            record.hpc_shown = True  # replayed to files only
        if len(_HELD) < _HELD_MAX:
            _HELD.append(record)


@contextmanager
def held_until_setup() -> Iterator[None]:
    """Hold the ``hpc.*`` INFO records of the block for the next :func:`setup_logging`,
    when no logging is configured (no handler on the root or ``hpc`` logger); else a
    no-op. ``init_torch`` runs inside it."""
    root, package = logging.getLogger(), logging.getLogger(_PACKAGE)
    if root.handlers or package.handlers:
        yield
        return
    holder, level = _Holder(package.getEffectiveLevel()), package.level
    package.addHandler(holder)
    if package.getEffectiveLevel() > logging.INFO:
        package.setLevel(logging.INFO)
    try:
        yield
    finally:
        package.removeHandler(holder)
        package.setLevel(level)


def _replay(handlers: list[logging.Handler], console: logging.Handler,
            logger_name: str) -> None:
    """Hand the held records to the new handlers, each at its own level, once."""
    held = [r for r in _HELD if not logger_name or r.name == logger_name
            or r.name.startswith(logger_name + ".")]
    _HELD.clear()
    for record in held:
        for h in handlers:
            if record.levelno >= h.level and not (
                    h is console and getattr(record, "hpc_shown", False)):
                h.handle(record)


class RankFilter(logging.Filter):
    """Adds ``record.rankinfo`` = ``rank r/w host`` to every record."""

    def __init__(self, info: DistInfo) -> None:
        super().__init__()
        self.prefix = f"rank {info.rank}/{info.world_size} {socket.gethostname()}"

    def filter(self, record: logging.LogRecord) -> bool:
        record.rankinfo = self.prefix
        return True


def _console_level(info: DistInfo, level: int, console: str | None,
                   environ: Mapping[str, str]) -> int:
    """The console level of this rank (``console`` or ``HPC_LOG_CONSOLE``)."""
    choice = console or envvars.value("HPC_LOG_CONSOLE", environ)
    if choice not in CONSOLE_CHOICES:
        raise ValueError(f"console output {choice!r} (HPC_LOG_CONSOLE or console=) is not "
                         f"one of {', '.join(CONSOLE_CHOICES)}.\nHINT: 'local' logs INFO on "
                         "each node's local rank 0, 'global' on global rank 0 only.")
    chief = info.rank == 0 if choice == "global" else info.local_rank == 0
    return level if chief else max(level, logging.WARNING)


def setup_logging(info: DistInfo | None = None, level: int = logging.INFO,
                  log_file: str | Path | None = None,
                  logger_name: str = "", console: str | None = None,
                  environ: Mapping[str, str] | None = None,
                  rank_log_dir: str | Path | None = None) -> logging.Logger:
    """Configure console (and, on the global master, file) logging for this rank.

    Args:
        info: The layout (default: :func:`hpc.info`).
        level: Console level on the ranks chosen by ``console``; other ranks use
            ``max(level, WARNING)``.
        log_file: Written by global rank 0 only, at ``level``.
        logger_name: Logger to configure (default: the root logger).
        console: ``"local"`` (each node's local rank 0, the default) or ``"global"``
            (global rank 0 only); default ``HPC_LOG_CONSOLE`` or ``"local"``.
        environ: Variables to read (default ``os.environ``).
        rank_log_dir: Every rank writes ``rank<r>.log`` there, at ``level`` (default
            ``HPC_LOG_DIR``; ``""``: no per-rank files).

    Calling it again replaces the handlers it added before. The first call after an
    ``init_torch`` that ran without logging replays that start-up's records first
    (:func:`held_until_setup`).

    Raises:
        ValueError: ``console`` (or ``HPC_LOG_CONSOLE``) is not in :data:`CONSOLE_CHOICES`.
    """
    env = os.environ if environ is None else environ
    if info is None:
        from hpc import roles

        info = roles.info()
    console_level = _console_level(info, level, console, env)
    root = logging.getLogger(logger_name)
    for h in _HANDLERS:
        root.removeHandler(h)
        h.close()  # the log files
    _HANDLERS.clear()
    fmt = logging.Formatter("%(asctime)s [%(rankinfo)s] %(levelname)s %(name)s: %(message)s",
                            datefmt="%H:%M:%S")
    # hpc run prefixes every line with [rank r] already: one prefix is enough.
    console_fmt = logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s",
                                    datefmt="%H:%M:%S") \
        if envvars.value("HPC_RUN_PREFIXED", env) else fmt
    rank_filter = RankFilter(info)
    console_handler = logging.StreamHandler(sys.stderr)
    console_handler.setLevel(console_level)
    console_handler.setFormatter(console_fmt)
    _HANDLERS.append(console_handler)
    if log_file is not None and info.rank == 0:
        Path(log_file).parent.mkdir(parents=True, exist_ok=True)
        file_handler = logging.FileHandler(log_file)
        file_handler.setLevel(level)
        file_handler.setFormatter(fmt)
        _HANDLERS.append(file_handler)
    per_rank = (envvars.value("HPC_LOG_DIR", env) or "") if rank_log_dir is None else rank_log_dir
    if per_rank:
        Path(per_rank).mkdir(parents=True, exist_ok=True)
        rank_handler = logging.FileHandler(Path(per_rank) / f"rank{info.rank}.log")
        rank_handler.setLevel(level)
        rank_handler.setFormatter(fmt)
        _HANDLERS.append(rank_handler)
    for h in _HANDLERS:
        h.addFilter(rank_filter)
        root.addHandler(h)
    root.setLevel(min(level, logging.WARNING))
    _replay(_HANDLERS, console_handler, logger_name)  # init_torch's lines, first
    return root
