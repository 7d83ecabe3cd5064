"""Checkpoint files: atomic save, keep-last-K, verified load with fallback, RNG states.

The file layer under :mod:`hpc.checkpoint.resume` (the collective save/restore a training
script calls) and ``hpc pretrain``/``search``/``tune``; no collectives here.

Files are ``ckpt-<step:08d>.pt`` in a checkpoint directory, each with a
``ckpt-<step:08d>.pt.sha256`` sidecar in ``sha256sum`` format (``sha256sum -c`` checks
it). A save writes a temporary file in the same directory, flushes and fsyncs it,
renames it over the final name and fsyncs the directory, so a crash leaves either the
old set of files or the new one, never a half-written ``.pt``. A writer killed mid-write
(SIGKILL) leaves its hidden temporary file; the next save removes it.

Loading uses ``torch.load(weights_only=True)``: checkpoints hold tensors and plain
Python values only (RNG states included, see :func:`capture_rng`). A save therefore loads
its temporary file back by that same rule before the rename (memory-mapped: the
unpickling is checked, the tensor bytes are not read; :mod:`hpc.checkpoint.loadable`),
and refuses a payload the loader would refuse, naming the value (a numpy scalar, a
``Path``, a ``Namespace``): such a file would be skipped by every resume. A newest checkpoint that is truncated, corrupt or
fails its checksum is skipped with a warning and the previous one is used; a run resuming from its own directory also sets the skipped
files aside (``ckpt-<step>.pt.unloadable``) so keep-N never counts them.
"""

from __future__ import annotations

import hashlib
import logging
import os
import pickle
import random
import re
import socket
import time
from pathlib import Path
from typing import Any, Callable, Optional, Union

import numpy as np
import torch

from hpc.checkpoint.loadable import check_loads, unpickler_reason
from hpc.errors import CheckpointError

__all__ = ["save_atomic", "list_checkpoints", "prune", "load_checkpoint", "load_latest",
           "set_aside", "remove_stale_temps", "checkpoint_path", "capture_rng",
           "restore_rng", "sha256_file", "fsync_dir", "pid_alive", "UNLOADABLE", "STALE_TMP_S"]

logger = logging.getLogger(__name__)

_NAME = re.compile(r"^ckpt-(\d{8,})\.pt$")
#: Suffix of a checkpoint a resume skipped (:func:`set_aside`).
UNLOADABLE = ".unloadable"
#: ``.<name>.tmp-<host>-<pid>`` (``.<name>.tmp-<pid>`` before the host was added).
_TMP = re.compile(r"^\.(?P<name>.+)\.tmp-(?:(?P<host>.+)-)?(?P<pid>\d+)$")
#: A temporary file untouched this long is stale even when its owner cannot be asked.
STALE_TMP_S = 300.0
PathLike = Union[str, Path]


def checkpoint_path(directory: PathLike, step: int) -> Path:
    """The file name of the checkpoint taken after global step ``step``."""
    return Path(directory) / f"ckpt-{step:08d}.pt"


def sha256_file(path: PathLike) -> str:
    """Hex SHA-256 of a file's bytes."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def fsync_dir(directory: Path) -> None:
    """fsync a directory, so a rename or removal in it survives a crash."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # pragma: no cover - e.g. platforms without directory fds
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this host (another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


def _is_stale(match: re.Match[str], path: Path, now: float) -> bool:
    host, pid = match.group("host"), int(match.group("pid"))
    if host == socket.gethostname():
        if pid == os.getpid():
            return False  # ours: a save of this process may be writing it
        if not pid_alive(pid):
            return True
    try:
        return now - path.stat().st_mtime > STALE_TMP_S
    except FileNotFoundError:  # its writer renamed or removed it meanwhile
        return False


def remove_stale_temps(directory: PathLike, also: tuple[str, ...] = ()) -> list[Path]:
    """Delete temporary files of checkpoints whose writer died mid-write; return them.

    A SIGKILL (the end of a preemption's grace time) runs no clean-up and leaves
    ``.ckpt-<step>.pt.tmp-<host>-<pid>`` at the size written so far. Stale: written on
    this host by a process that is gone, or not modified for :data:`STALE_TMP_S`
    (a writer on another node cannot be asked; a live writer keeps its file fresh).
    Only temporary files of checkpoints and their sidecars, and of the names in
    ``also``, are considered: other files in the directory are never touched.
    """
    directory = Path(directory)
    ours = {*also, *(n + ".sha256" for n in also)}
    removed, now = [], time.time()
    try:
        entries = list(directory.iterdir())
    except FileNotFoundError:
        return []
    for path in entries:
        m = _TMP.match(path.name)
        if not m:
            continue
        name = m.group("name")
        if not (name in ours or _NAME.match(name.removesuffix(".sha256"))):
            continue
        if _is_stale(m, path, now):
            try:
                size = path.stat().st_size
                path.unlink()
            except FileNotFoundError:
                continue
            removed.append(path)
            logger.info("removed %s (%.0f MiB), left by pid %s on %s killed mid-write",
                        path.name, size / 2**20, m.group("pid"), m.group("host") or "?")
    return removed


def _write_atomic(path: Path, write: Any,
                  check: Optional[Callable[[Path], None]] = None) -> None:
    """Write through a temporary file; ``check(tmp)`` may refuse it before the rename."""
    tmp = path.with_name(f".{path.name}.tmp-{socket.gethostname()}-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        if check is not None:
            check(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def save_atomic(obj: Any, path: PathLike) -> Path:
    """``torch.save(obj)`` to ``path`` atomically, then its ``.sha256`` sidecar.

    Temporary files a killed writer left (:func:`remove_stale_temps`) are removed
    first. Before the rename the temporary file is loaded back with
    ``torch.load(weights_only=True, mmap=True)``, the rule every resume applies; a
    refused payload is never put in place. The sidecar is written after the checkpoint
    is in place; a checkpoint without one (a crash in between) is still loadable, it is
    just not checksum-verified.

    Raises:
        CheckpointError: ``weights_only=True`` would refuse the file (the message names
            the value, e.g. ``['best_acc'] is a numpy.float64``); nothing is written.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(path.parent, also=(path.name,))  # first: frees their space
    _write_atomic(path, lambda f: torch.save(obj, f),
                  lambda tmp: check_loads(tmp, obj, path.name))
    line = f"{sha256_file(path)}  {path.name}\n".encode()
    _write_atomic(path.with_name(path.name + ".sha256"), lambda f: f.write(line))
    return path


def list_checkpoints(directory: PathLike) -> list[Path]:
    """Checkpoint files in ``directory``, oldest (lowest step) first."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in directory.iterdir()
             if (m := _NAME.match(p.name)) and p.is_file()]
    return [p for _, p in sorted(found)]


def prune(directory: PathLike, keep: int) -> list[Path]:
    """Delete all but the newest ``keep`` checkpoints (and sidecars); return the deleted."""
    old = list_checkpoints(directory)[:-keep] if keep > 0 else []
    for path in old:
        path.unlink(missing_ok=True)
        path.with_name(path.name + ".sha256").unlink(missing_ok=True)
    return old


def load_checkpoint(path: PathLike) -> dict[str, Any]:
    """Verify (when a sidecar exists) and load one checkpoint on the CPU.

    Raises:
        CheckpointError: the file is missing, fails its checksum, or cannot be read
            (truncated, corrupt, or holding objects ``weights_only`` refuses).
    """
    path = Path(path)
    sidecar = path.with_name(path.name + ".sha256")
    try:
        if sidecar.is_file():
            expected = sidecar.read_text().split()[0]
            actual = sha256_file(path)
            if actual != expected:
                raise CheckpointError(
                    f"{path} has SHA-256 {actual[:16]}... but {sidecar.name} records "
                    f"{expected[:16]}...: the file changed after it was written "
                    "(truncated or corrupted).\n"
                    "HINT: delete it to resume from the previous checkpoint.")
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except CheckpointError:
        raise
    except Exception as e:  # zip/pickle/OS errors: all mean "unusable"
        reason = unpickler_reason(e) if isinstance(e, pickle.UnpicklingError) else e
        raise CheckpointError(
            f"cannot load checkpoint {path}: {type(e).__name__}: {reason}.\n"
            "It is truncated, corrupt, or holds objects weights_only=True refuses.\n"
            "HINT: delete it to resume from the previous checkpoint.") from e
    if not isinstance(payload, dict) or "step" not in payload:
        raise CheckpointError(
            f"{path} holds a {type(payload).__name__} without a 'step', not an hpc "
            "checkpoint.\nHINT: point at a file written by hpc.save_checkpoint or "
            "hpc pretrain.")
    return payload


def set_aside(path: PathLike) -> Optional[Path]:
    """Rename a checkpoint that does not load (and its sidecar) to ``<name>.unloadable``.

    No listing matches the new name, so the next save's keep-N no longer counts it as
    one of the newest (it would push out the older file the run resumed from) and the
    next resume does not try it again; the bytes stay for a look. Returns the new path,
    or ``None`` (with a warning) when the rename failed.
    """
    path = Path(path)
    target = path.with_name(path.name + UNLOADABLE)
    sidecar = path.with_name(path.name + ".sha256")
    try:
        os.replace(path, target)
        if sidecar.is_file():
            os.replace(sidecar, sidecar.with_name(sidecar.name + UNLOADABLE))
    except OSError as e:
        logger.warning("could not set aside %s (%s): keep-N counts it as a checkpoint "
                       "until it is deleted", path, e)
        return None
    fsync_dir(path.parent)
    logger.warning("set aside as %s (it does not load; rename it back to try it again)",
                   target.name)
    return target


def load_latest(directory: PathLike, *, set_aside_skipped: bool = False
                ) -> Optional[tuple[Path, dict[str, Any]]]:
    """The newest loadable checkpoint in ``directory`` (``None`` when there is none).

    Unusable newer checkpoints are skipped with a warning naming the file and the error.

    Args:
        directory: The checkpoint directory.
        set_aside_skipped: Also :func:`set_aside` the skipped files once an older one
            loaded: what a run resuming from its *own* directory passes, before it
            saves there again. A reader of another run's directory leaves it alone,
            and when none loads nothing is renamed (the next attempt must not become
            a silent fresh start).

    Raises:
        CheckpointError: checkpoints exist but none of them loads.
    """
    candidates = list_checkpoints(directory)
    errors, skipped = [], []
    for path in reversed(candidates):
        try:
            payload = load_checkpoint(path)
        except CheckpointError as e:
            first = str(e).splitlines()[0]
            errors.append(first)
            skipped.append(path)
            logger.warning("skipping checkpoint %s: %s; falling back to the previous one",
                           path.name, first)
            continue
        if set_aside_skipped:
            for bad in skipped:
                set_aside(bad)
        return path, payload
    if errors:
        raise CheckpointError(
            f"none of the {len(candidates)} checkpoints in {directory} loads: "
            + "; ".join(errors) + ".\n"
            "HINT: start over in a fresh directory (hpc pretrain: --resume never and a "
            "new --out), or delete the broken files.")
    return None


def capture_rng() -> dict[str, Any]:
    """This process's python, numpy, torch CPU and CUDA RNG states as plain values."""
    version, mt, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "python": {"version": version, "state": torch.tensor(mt, dtype=torch.int64),
                   "gauss": gauss},
        "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)),
                  "pos": int(pos), "has_gauss": int(has_gauss), "cached": float(cached)},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
        # the rank's own GPU (hpc.init_torch bound it): what a resume with another
        # number of visible devices per process restores
        state["cuda_current"] = torch.cuda.get_rng_state(torch.cuda.current_device())
    return state


def restore_rng(state: dict[str, Any]) -> None:
    """Inverse of :func:`capture_rng` (CUDA states only when this process has CUDA)."""
    py = state["python"]
    random.setstate((int(py["version"]), tuple(int(v) for v in py["state"].tolist()),
                     py["gauss"]))
    npst = state["numpy"]
    np.random.set_state((npst["kind"], npst["keys"].numpy().astype(np.uint32),
                         int(npst["pos"]), int(npst["has_gauss"]), float(npst["cached"])))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        _restore_cuda_rng(state)


def _restore_cuda_rng(state: dict[str, Any]) -> None:
    """All devices' states when as many are visible as were saved; else the saved
    rank's own device state into this rank's current device (one GPU per rank: e.g.
    saved seeing the node's 4 GPUs, resumed with ``--gpus-per-task=1``)."""
    states = state["cuda"]
    if len(states) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(states)
    elif "cuda_current" in state:
        torch.cuda.set_rng_state(state["cuda_current"], torch.cuda.current_device())
        logger.debug("CUDA RNG: %d saved devices, %d visible: restored the rank's own "
                     "device state into cuda:%d", len(states), torch.cuda.device_count(),
                     torch.cuda.current_device())
    else:  # a checkpoint written before the per-rank state was saved
        logger.warning("checkpoint holds %d CUDA RNG states but %d devices are "
                       "visible; CUDA RNG not restored", len(states),
                       torch.cuda.device_count())
