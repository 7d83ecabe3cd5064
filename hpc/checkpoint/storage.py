"""Storage pre-flight: is the checkpoint directory one directory, with room, on every node?

A checkpoint saved to a node-local directory (``/tmp``, ``/dev/shm``, ``$TMPDIR`` on a
compute node) is lost to a restart on other nodes, and a full filesystem fails a save
hours in. :func:`preflight` finds both in well under a second, before the first save:

1. the global master creates the directory and writes a token file ``.hpc-storage-<hex>``
   that every rank must read back (one that cannot sees another directory: its node's);
2. every rank's ``os.statvfs`` there: :data:`SPACE_FACTOR` x ``need_bytes`` and
   :data:`MIN_INODES` inodes free (inodes only where the filesystem counts them);
3. the master times one ``fsync`` of the token file and warns above :data:`FSYNC_WARN_S`.

Collective (one ``broadcast_object``, one ``all_gather_object``); without a process group
it checks the one process. A failure raises :class:`~hpc.errors.CheckpointError` with the
same message on every rank. :func:`preflight_once` runs it once per directory.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, NamedTuple, Optional

from hpc.errors import CheckpointError
from hpc.sync.agree import broadcast_object, gather_objects, world

__all__ = ["FSYNC_WARN_S", "MIN_INODES", "SPACE_FACTOR", "StorageReport", "preflight",
           "preflight_once"]

logger = logging.getLogger(__name__)

#: A slower fsync on the master, in seconds, is worth a warning (every save waits for one).
FSYNC_WARN_S = 1.0
#: Free bytes needed, in checkpoints: the atomic save writes the new file beside the old.
SPACE_FACTOR = 2
#: Free inodes needed (a save creates the checkpoint, its temporary and its ``.sha256``).
MIN_INODES = 16
#: Pauses (seconds) between a rank's reads of the token: NFS may show a new file late.
_RETRIES = (0.0, 0.05, 0.1, 0.2, 0.4)

_CHECKED: set[str] = set()


@dataclass(frozen=True)
class StorageReport:
    """What :func:`preflight` found, the same on every rank.

    Attributes:
        path: The checked directory (absolute).
        need_bytes: The size of one checkpoint, as the caller gave it.
        free_bytes: The least free space any host sees there.
        fsync_s: Seconds one ``fsync`` of a small file took on the master.
        hosts: The hosts checked, in the order of their first rank.
    """

    path: str
    need_bytes: int
    free_bytes: int
    fsync_s: float
    hosts: tuple[str, ...]


class _View(NamedTuple):
    """One rank's view of the directory: ``unseen`` says why it missed the token."""

    host: str
    rank: int
    unseen: str
    free: int
    inodes: int  # -1: the filesystem does not count inodes (btrfs, some NFS servers)


def preflight(directory: os.PathLike[str] | str, need_bytes: int) -> StorageReport:
    """Check that ``directory`` is one directory on every rank, with room for a save of
    ``need_bytes`` bytes; the global master creates it if missing. Collective: call it on
    every rank (or in a single process). Returns the :class:`StorageReport`, equal on
    every rank.

    Raises:
        CheckpointError: On every rank, with one message: the master cannot write there,
            a rank does not read the master's token file, or a host has less than
            :data:`SPACE_FACTOR` x ``need_bytes`` or :data:`MIN_INODES` inodes free.
    """
    path = Path(os.path.abspath(os.fspath(directory)))
    rank = world()[0]
    token, fsync_s, failure = broadcast_object(_write_token(path) if rank == 0 else None)
    if failure:
        raise CheckpointError(failure)
    try:
        views: list[_View] = gather_objects(_look(path, token))
    finally:
        if rank == 0:
            with contextlib.suppress(OSError):
                (path / f".hpc-storage-{token}").unlink()
    problem = _unseen(path, views) or _short(path, need_bytes, views)
    if problem:
        raise CheckpointError(problem)
    report = StorageReport(str(path), int(need_bytes), min(v.free for v in views), fsync_s,
                           tuple(dict.fromkeys(v.host for v in views)))
    if rank == 0:
        logger.info("storage pre-flight: %s is one directory on %d host(s), %s free, "
                    "fsync %.4f s", os.fspath(directory), len(report.hosts),
                    _size(report.free_bytes), fsync_s)
        if fsync_s > FSYNC_WARN_S:
            logger.warning(
                "storage pre-flight: one fsync in %s took %.2f s (over %g s).\nEvery "
                "checkpoint save waits for at least one: the filesystem is overloaded or "
                "slow for small writes.\nHINT: save less often, or to a faster filesystem "
                "(a scratch or flash tier).", path, fsync_s, FSYNC_WARN_S)
    return report


def preflight_once(directory: os.PathLike[str] | str,
                   need_bytes: Callable[[], int]) -> Optional[StorageReport]:
    """:func:`preflight` at the first call for ``directory`` in this process, else ``None``.

    ``need_bytes()`` gives the checkpoint's size; it is called only when the check runs
    (every save calls this: the size is not computed again each time).

    Collective, like :func:`preflight`: every rank calls it with the same arguments. The
    key is the absolute path as written, not with symlinks resolved (they may differ
    between nodes), so every rank's cache stays the same. A failed check is not cached.
    """
    key = os.path.abspath(os.fspath(directory))
    if key in _CHECKED:
        return None
    report = preflight(directory, need_bytes())
    _CHECKED.add(key)
    return report


def _host() -> str:
    """This node's name, as every other message of hpc names it (the log prefix)."""
    return socket.gethostname()


def _write_token(path: Path) -> tuple[str, float, str]:
    """On the master: create ``path``, write and fsync a token file there: (token, fsync
    seconds, the failure's message or "")."""
    token = secrets.token_hex(8)
    file = path / f".hpc-storage-{token}"
    try:
        path.mkdir(parents=True, exist_ok=True)
        with open(file, "w", encoding="ascii") as f:
            f.write(token)
            f.flush()
            start = time.perf_counter()
            os.fsync(f.fileno())
            return token, time.perf_counter() - start, ""
    except OSError as e:
        with contextlib.suppress(OSError):  # a full disk: created, not written
            file.unlink()
        return token, 0.0, (
            f"checkpoint directory {path}: the global master (rank 0 on {_host()}) cannot "
            f"create or write a file there: {e}.\nA checkpoint needs a directory the job's "
            "user can write, with room.\nHINT: pass a directory you own, with free space, "
            "on a filesystem every node mounts.")


def _look(path: Path, token: str) -> _View:
    """This rank's view of ``path``: did it read ``token``, how much room is there."""
    unseen = ""
    for pause in _RETRIES:
        time.sleep(pause)
        try:
            got = (path / f".hpc-storage-{token}").read_text(encoding="ascii", errors="replace")
            unseen = "" if got == token else f"read {got[:20]!r}"
        except OSError as e:
            unseen = e.strerror or str(e)
        if not unseen:
            break
    free, inodes = 0, -1
    with contextlib.suppress(OSError):  # missing here: reported as unseen
        st = os.statvfs(path)
        free, inodes = st.f_bavail * st.f_frsize, (st.f_favail if st.f_files else -1)
    return _View(_host(), world()[0], unseen, free, inodes)


def _unseen(path: Path, views: list[_View]) -> str:
    """The message naming the ranks that did not read the master's token, or ""."""
    bad: dict[str, list[_View]] = {}
    for v in views:
        if v.unseen:
            bad.setdefault(v.unseen, []).append(v)
    if not bad:
        return ""
    where = "; ".join(f"{', '.join(dict.fromkeys(v.host for v in vs))} "
                      f"({_ranks([v.rank for v in vs])}: {why})" for why, vs in bad.items())
    return (f"checkpoint directory {path} is not the same directory on every node: the "
            f"global master ({views[0].host}) wrote a file there that these ranks cannot "
            f"read: {where}.\nThe directory is node-local: /tmp, /dev/shm and $TMPDIR on a "
            "compute node are not shared, so a checkpoint saved there is lost to a restart "
            "on other nodes.\nHINT: put the checkpoints on a filesystem every node mounts "
            "(home, project or scratch space).")


def _short(path: Path, need_bytes: int, views: list[_View]) -> str:
    """The message naming the hosts short of space or inodes there, or ""."""
    need, lines = SPACE_FACTOR * need_bytes, []
    for host in dict.fromkeys(v.host for v in views):
        free = min(v.free for v in views if v.host == host)
        inodes = min(v.inodes for v in views if v.host == host)
        if free < need:
            lines.append(f"{host}: {_size(free)} free, needs {_size(need)}")
        elif 0 <= inodes < MIN_INODES:
            lines.append(f"{host}: {inodes} inodes free, needs {MIN_INODES}")
    if not lines:
        return ""
    return (f"checkpoint directory {path} has too little room: {'; '.join(lines)}.\n"
            f"A save needs {_size(need)} ({SPACE_FACTOR} x the {_size(need_bytes)} "
            "checkpoint: the new file is written beside the previous one before the "
            f"rename) and {MIN_INODES} free inodes.\nHINT: free space or files there, keep "
            "fewer checkpoints, or use a larger filesystem.")


def _ranks(ranks: list[int]) -> str:
    """``[1, 2, 3, 5]`` -> ``"ranks 1-3,5"``; ``[2]`` -> ``"rank 2"``."""
    runs: list[list[int]] = []
    for r in sorted(ranks):
        if runs and r == runs[-1][1] + 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    text = ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
    return ("rank " if len(ranks) == 1 else "ranks ") + text


def _size(n: float) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"
