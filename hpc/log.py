"""Rank-aware logging: one call, made by entry points, never at import.

Local masters (local rank 0 of each node) log INFO and above to the console; other
ranks WARNING and above, so a 64-GPU job prints each line once per node and errors from
every rank. Every line carries a ``[rank r/w host]`` prefix; the global master alone
writes the optional log file.
"""

from __future__ import annotations

import logging
import socket
import sys
from pathlib import Path
from typing import Optional, Union

from hpc.environments import DistInfo

__all__ = ["setup_logging", "RankFilter"]

_HANDLERS: list[logging.Handler] = []


class RankFilter(logging.Filter):
    """Adds ``record.rankinfo`` = ``rank r/w host`` to every record."""

    def __init__(self, info: DistInfo) -> None:
        super().__init__()
        self.prefix = f"rank {info.rank}/{info.world_size} {socket.gethostname()}"

    def filter(self, record: logging.LogRecord) -> bool:
        record.rankinfo = self.prefix
        return True


def setup_logging(info: Optional[DistInfo] = None, level: int = logging.INFO,
                  log_file: Optional[Union[str, Path]] = None,
                  logger_name: str = "") -> logging.Logger:
    """Configure console (and, on the global master, file) logging for this rank.

    Args:
        info: The layout (default: :func:`hpc.info`).
        level: Console level on local masters; other ranks use ``max(level, WARNING)``.
        log_file: Written by global rank 0 only, at ``level``.
        logger_name: Logger to configure (default: the root logger).

    Calling it again replaces the handlers it added before.
    """
    if info is None:
        from hpc.bootstrap.distributed import info as current

        info = current()
    root = logging.getLogger(logger_name)
    for h in _HANDLERS:
        root.removeHandler(h)
    _HANDLERS.clear()
    fmt = logging.Formatter("%(asctime)s [%(rankinfo)s] %(levelname)s %(name)s: %(message)s",
                            datefmt="%H:%M:%S")
    rank_filter = RankFilter(info)
    console = logging.StreamHandler(sys.stderr)
    console.setLevel(level if info.local_rank == 0 else max(level, logging.WARNING))
    _HANDLERS.append(console)
    if log_file is not None and info.rank == 0:
        Path(log_file).parent.mkdir(parents=True, exist_ok=True)
        file_handler = logging.FileHandler(log_file)
        file_handler.setLevel(level)
        _HANDLERS.append(file_handler)
    for h in _HANDLERS:
        h.setFormatter(fmt)
        h.addFilter(rank_filter)
        root.addHandler(h)
    root.setLevel(min(level, logging.WARNING))
    return root
