"""One id per training run, the same on every rank and after every requeue or resume.

A preempted, requeued and resumed job is one training run to its user, so its trackers
must see one run. :func:`run_id` gives that run one id:

* created by the global master at the run's first start, as ``<date>-<time>-<6 hex>``
  (sortable, and a valid W&B run id), and written atomically to ``<directory>/run_id``;
* read back from that file by every later attempt: a requeue, an in-job restart by
  ``hpc supervise``, a resume from a checkpoint in that directory;
* new only when the caller says the run is new (``new=True``: ``hpc pretrain
  --no-resume``) or the directory is new;
* agreed on every rank: the master's id is broadcast when torch.distributed is up.

``hpc pretrain`` and ``hpc tune`` also store the id in every checkpoint and adopt the
checkpoint's id when they resume from one (``known``), so a run resumed with
``--resume PATH`` into another directory keeps its id.
"""

from __future__ import annotations

import os
import re
import secrets
import time
from pathlib import Path
from typing import Optional, Union

from hpc.errors import HPCError

__all__ = ["run_id", "establish", "current", "FILE", "new_id", "write_text_atomic"]

#: The file in the run directory that holds the id.
FILE = "run_id"
_VALID = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_current: Optional[str] = None


def new_id() -> str:
    """A fresh id: ``YYYYmmdd-HHMMSS-`` and 6 random hex digits."""
    return time.strftime("%Y%m%d-%H%M%S-", time.gmtime()) + secrets.token_hex(3)


def current() -> Optional[str]:
    """The id settled in this process, or ``None`` (no collective; ``save_checkpoint``
    stores it in every checkpoint)."""
    return _current


def _read(path: Path) -> Optional[str]:
    if not path.is_file():
        return None
    text = path.read_text().strip()
    if not _VALID.match(text):
        raise HPCError(
            f"{path} holds {text[:80]!r}, which is not a run id (letters, digits, '-' and "
            "'_', at most 64).\nHINT: delete the file to start a new run id, or restore it "
            "from the run's checkpoint.")
    return text


def write_text_atomic(path: Path, text: str) -> None:
    """``text`` in ``path`` through a temporary file and a rename (the run id here, the
    W&B sink's step mark): a reader sees the old file or the new one, never a part."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def _master_id(directory: Path, new: bool, known: Optional[str]) -> str:
    """The master's decision: ``known`` (a checkpoint's), the file's, or a new id."""
    path = directory / FILE
    if known is not None:
        if not _VALID.match(known):
            raise HPCError(f"the checkpoint's run id {known!r} is not a run id.\n"
                           "HINT: the checkpoint was not written by torch-hpc.")
        value = known
    else:
        value = None if new else _read(path)
        value = value or new_id()
    if _read(path) != value:
        write_text_atomic(path, value + "\n")
    return value


def establish(directory: Union[str, Path], *, new: bool = False,
              known: Optional[str] = None) -> str:
    """Settle the run's id in ``directory`` on every rank (collective when distributed).

    Args:
        directory: The run directory (shared by every node); only the master touches it.
        new: This is a new run: replace the directory's id.
        known: The id of the checkpoint being resumed (master's value): it wins.

    Returns:
        The id, the same on every rank; later :func:`run_id` calls without a directory
        return it.
    """
    global _current
    from hpc.sync.agree import broadcast_object, world  # torch only when called

    rank = world(None)[0]
    result: Union[str, BaseException]
    try:
        result = _master_id(Path(directory), new, known) if rank == 0 else ""
    except (OSError, HPCError) as e:
        result = e
    result = broadcast_object(result)
    if isinstance(result, HPCError):
        raise HPCError(str(result)) from result
    if isinstance(result, BaseException):
        raise HPCError(f"the run id could not be written in {directory}: {result}.\n"
                       "HINT: the run directory must be writable by the global "
                       "master.") from result
    _current = result
    return result


def run_id(directory: Union[str, Path, None] = None, *, new: bool = False) -> str:
    """This training run's id: the same on every rank, after every requeue and resume.

    Collective on its first call with a ``directory`` (when torch.distributed is
    initialized): call it on every rank, after :func:`hpc.init_torch`.

    Args:
        directory: The run's directory, on a filesystem every node sees (your checkpoint
            directory will do). The id is read from ``<directory>/run_id`` or created
            there. ``None``: the id this process settled already (``hpc pretrain`` and
            ``hpc tune`` settle theirs).
        new: Start a new run: replace the directory's id (a fresh start of your script
            that does not resume).

    Raises:
        HPCError: ``directory`` is ``None`` and no id was settled in this process, or the
            file holds something that is not a run id.

    Example::

        restored = hpc.restore_checkpoint("ckpt", model=model, optimizer=opt)
        rid = hpc.run_id("ckpt", new=restored is None and not args.resume)
        wandb.init(project="mine", id=rid, resume="allow")  # on the master only
    """
    if directory is not None:
        return establish(directory, new=new)
    if _current is None:
        raise HPCError(
            "hpc.run_id() was called without a directory before any run id was settled "
            "in this process.\nHINT: call hpc.run_id(DIR) once on every rank with your "
            "run's directory (e.g. your checkpoint directory).")
    return _current
