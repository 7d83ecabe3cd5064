"""Which checkpoint a restore uses: the newest complete one, agreed on every rank.

The master looks (:func:`choose_newest`: the newest checkpoint of either format that loads
or verifies; newer broken ones skipped and set aside), every rank gets its choice and
loads it (:func:`agree_on_checkpoint`), and :func:`check_world_size` tells whether it
fits this run's number of ranks. :func:`hpc.restore_checkpoint` and ``hpc pretrain``,
``search``, ``tune`` restore through them.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Callable, Optional

from hpc.checkpoint import asyncsave
from hpc.checkpoint.files import load_latest, set_aside
from hpc.checkpoint.shardfiles import is_sharded, list_sharded, verify_sharded
from hpc.errors import CheckpointError
from hpc.sync.agree import all_true, broadcast_object, world

__all__ = ["agree_on_checkpoint", "choose_newest", "check_world_size", "Chooser"]

logger = logging.getLogger(__name__)

#: ``choose() -> (path, error, payload)``, called on the global master only.
Chooser = Callable[[], "tuple[Optional[str], Optional[str], Optional[dict[str, Any]]]"]


def agree_on_checkpoint(choose: Chooser) -> tuple[Optional[str], Optional[dict[str, Any]]]:
    """(path, payload) on every rank: the master's choice, loaded by each (collective).

    ``choose`` runs on rank 0 only and returns ``(path, error, payload)``; ``(None,
    None)`` comes back when there is nothing to resume from, ``(path, None)`` for a
    sharded checkpoint (:func:`hpc.checkpoint.sharded.load_sharded` loads it).

    Raises:
        CheckpointError: on every rank, when the master's choice failed or a rank could
            not load the file it chose (it is not on a shared filesystem).
    """
    from hpc.checkpoint.files import load_checkpoint

    asyncsave.settle()  # a save in flight is the newest checkpoint
    rank, _ = world()
    path, error, payload = choose() if rank == 0 else (None, None, None)
    path, error = broadcast_object((path, error))
    if error is not None:
        raise CheckpointError(error)
    if path is None:
        return None, None
    if is_sharded(path):  # collective, into the objects: the caller's load_sharded
        return path, None
    failure: Optional[CheckpointError] = None
    if payload is None:
        try:
            payload = load_checkpoint(path)
        except CheckpointError as e:
            failure = e
    if not all_true(failure is None) or payload is None:
        raise CheckpointError(
            f"rank {rank} could not use checkpoint {path} chosen by rank 0"
            + (f": {str(failure).splitlines()[0]}" if failure else " (another rank failed)")
            + ".\nEvery rank loads the file the master chose.\n"
            "HINT: put the checkpoint directory on a filesystem every node mounts (home "
            "or project space, not node-local /tmp).") from failure
    return path, payload


def choose_newest(directory: Path, *, set_aside_skipped: bool
                  ) -> tuple[Optional[str], Optional[str], Optional[dict[str, Any]]]:
    """On the master: ``(path, error, payload)`` of the newest complete checkpoint in
    ``directory`` of either format (payload ``None`` for a sharded one), ``(None, None,
    None)`` when there is none. A newer one that is incomplete or corrupt is skipped with
    a warning (and set aside with ``set_aside_skipped``)."""
    error, found = None, None
    try:
        found = load_latest(directory, set_aside_skipped=set_aside_skipped)
    except CheckpointError as e:  # no single file loads: a sharded one may
        error = str(e)
    newest = int(found[1]["step"]) if found else -1
    for candidate in reversed(list_sharded(directory)):
        if int(candidate.name[5:-4]) <= newest:
            break
        try:
            verify_sharded(candidate)
        except CheckpointError as e:
            logger.warning("skipping checkpoint %s: %s", candidate.name,
                           str(e).splitlines()[0])
            if set_aside_skipped:
                set_aside(candidate)
            continue
        return str(candidate), None, None
    if found is not None:
        return str(found[0]), None, found[1]
    return None, error, None


def check_world_size(payload: dict[str, Any], path: str, world: int, allowed: bool,
                     hint: str) -> bool:
    """True when ``payload`` was written by ``world`` ranks; False when not but ``allowed``.

    Raises:
        CheckpointError: the world size differs and ``allowed`` is false (``hint`` says
            how to allow it).
    """
    saved = int(payload.get("world_size", world))
    if saved == world:
        return True
    if allowed:
        return False
    raise CheckpointError(
        f"checkpoint {path} was written by {saved} ranks but this run has {world}.\n"
        "The sampler's partition, the per-rank RNG streams and the steps per epoch "
        "depend on the world size, so the resume would not be exact.\n"
        f"HINT: relaunch with {saved} ranks, or {hint} to continue from its weights anyway.")
