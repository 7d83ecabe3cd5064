"""Checkpoint and resume for any training script: the collective save and restore.

Both are called by **every rank**, under any launcher, and keep the IO on the global
master (the launching guide's rule)::

    hpc.save_checkpoint("ckpt", step, model=model, optimizer=opt, scheduler=sched,
                        sampler=sampler, epoch=epoch, batch=batch, keep=3)
    restored = hpc.restore_checkpoint("ckpt", model=model, optimizer=opt,
                                      scheduler=sched, sampler=sampler)

:func:`save_checkpoint` gathers what each rank keeps of its own on the master (RNG states
always, buffers such as BatchNorm's running statistics when they differ across ranks, the
script's ``rank_extra``; :mod:`hpc.checkpoint.ranks`), which writes ``ckpt-<step>.pt``
atomically (temporary file, fsync,
rename, a ``.sha256`` sidecar; :mod:`hpc.checkpoint.files`) and keeps the newest
``keep``. :func:`restore_checkpoint` lets the master choose the newest file that loads
(a truncated or corrupt newer one is skipped with a warning and renamed
``ckpt-<step>.pt.unloadable``, out of keep-N's count), broadcasts its path, and
every rank loads it with ``torch.load(weights_only=True)`` into the model, optimizer,
scheduler and sampler and gets its own RNG states, buffers and ``rank_extra`` back. A
checkpoint written by another number of ranks is refused unless
``allow_world_change=True``: the sampler's partition and the per-rank states depend on it. The directory must be on a filesystem every
node sees.

``hpc pretrain``, ``hpc search`` and ``hpc tune`` save and restore through the same
functions (:func:`save_checkpoint`, :func:`load_states`; which checkpoint a restore
uses: :mod:`hpc.checkpoint.choose`).
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any, Optional, Union

import torch
from torch import nn

from hpc.checkpoint import asyncsave
from hpc.checkpoint.choose import agree_on_checkpoint, check_world_size, choose_newest
from hpc.checkpoint.files import checkpoint_path, restore_rng
from hpc.checkpoint.sharded import load_sharded, save_sharded
from hpc.checkpoint.ranks import PER_RANK, gather_rank_states, model_state_for, rank_extra_for
from hpc.checkpoint.staging import stage_bytes
from hpc.checkpoint.storage import preflight_once
from hpc.checkpoint.writer import write_checkpoint
from hpc.errors import CheckpointError
from hpc.sync.agree import broadcast_object, world
from hpc.track import runid
from hpc.watchdog import tracker

__all__ = ["save_checkpoint", "restore_checkpoint", "Restored", "load_states",
           "projected_bytes", "FORMAT"]

logger = logging.getLogger(__name__)

#: Version of the checkpoint layout.
FORMAT = 1
#: Keys of a checkpoint that ``extra`` may not replace.
RESERVED = ("format", "step", "epoch", "batch", "world_size", "model", "optimizer",
            "scheduler", "sampler", *PER_RANK)
PathLike = Union[str, Path]


def _unwrap(model: nn.Module) -> nn.Module:
    """The module inside DDP and ``torch.compile`` (in either order), so the checkpoint's
    keys carry neither ``module.`` nor ``_orig_mod.`` and a plain model loads them."""
    while True:
        if isinstance(model, nn.parallel.DistributedDataParallel):
            model = model.module
        elif isinstance(getattr(model, "_orig_mod", None), nn.Module):  # OptimizedModule
            model = model._orig_mod  # type: ignore[assignment]
        else:
            return model


def projected_bytes(model: nn.Module, optimizer: Optional[torch.optim.Optimizer]) -> int:
    """The tensor bytes a checkpoint of ``model`` and ``optimizer`` will hold, for the
    storage pre-flight: an optimizer without state yet (before its first step) counts as
    two moments per weight, Adam's."""
    weights = stage_bytes(_unwrap(model).state_dict())
    if optimizer is None:
        return weights
    return stage_bytes(optimizer.state_dict()) if optimizer.state else weights + 2 * weights


def _rebuilding_ddp(model: nn.Module) -> Optional[nn.Module]:
    """The DDP wrapper in ``model``'s chain that will still rebuild its buckets, if any.

    DDP (``find_unused_parameters=False``, or ``static_graph``) reduces its first
    iteration in one bucket of every parameter in ``parameters()`` order and then
    rebuilds the buckets in the order the gradients became ready. A resumed run's first
    step is such a first iteration, where the uninterrupted run already used the
    rebuilt layout; a ring all-reduce over 3 or more ranks sums each element in an
    order set by its offset in the bucket, so that one step rounds differently.
    ``bench/ddp_bucket_order.py`` measures it.
    """
    while True:
        if isinstance(model, nn.parallel.DistributedDataParallel):
            rebuilds = model.static_graph or not model.find_unused_parameters
            done = getattr(model, "_has_rebuilt_buckets", False)
            return model if rebuilds and not done else None
        inner = getattr(model, "_orig_mod", None)
        if not isinstance(inner, nn.Module):
            return None
        model = inner


def _note_ddp_rebuild(model: nn.Module, size: int, path: str) -> None:
    """Say once, from the master, why this DDP resume is not bitwise (3+ ranks)."""
    if size < 3 or _rebuilding_ddp(model) is None:
        return
    logger.info(
        "resumed into a DistributedDataParallel that rebuilds its gradient buckets after "
        "its first iteration: the first step after %s reduces its gradients in DDP's "
        "first-iteration layout (one bucket), where an uninterrupted run uses the "
        "rebuilt one, and over %d ranks the sums round differently; the run continues "
        "from the checkpoint but is not bitwise equal to an uninterrupted one.\n"
        "HINT: construct it with DistributedDataParallel(..., "
        "find_unused_parameters=True), which keeps one bucket layout from the start, "
        "for a bitwise resume (docs/preemptible.md).", Path(path).name, size)


def save_checkpoint(directory: PathLike, step: int, *, model: nn.Module,
                    optimizer: Optional[torch.optim.Optimizer] = None,
                    scheduler: Any = None, sampler: Any = None, epoch: int = 0,
                    batch: int = 0, keep: int = 3,
                    extra: Optional[dict[str, Any]] = None,
                    rank_extra: Optional[dict[str, Any]] = None,
                    blocking: bool = True, sharded: bool = False) -> Path:
    """Checkpoint the state after ``step`` (collective: call it on every rank).

    The global master writes ``directory/ckpt-<step>.pt`` atomically with its checksum
    and deletes all but the newest ``keep``; the others only send what is their own
    (:mod:`hpc.checkpoint.ranks`): RNG states, and their buffers when these differ
    across ranks (BatchNorm under ``hpc.sync_gradients``). Returns after the file is in
    place, on every rank.

    Args:
        directory: Checkpoint directory (created; on a filesystem every node sees).
        step: Global steps done; names the file.
        model: Its ``state_dict`` (a DDP wrapper is unwrapped): the master's weights,
            and each rank's own buffers when they differ across ranks.
        optimizer: Saved when given.
        scheduler: Saved when given (anything with ``state_dict``).
        sampler: Saved when given: its epoch, position and layout (a
            ``DistributedSampler`` or :class:`~hpc.checkpoint.sampler.ResumableSampler`).
        epoch: The epoch of the *next* step.
        batch: Batches of ``epoch`` already done (0 at an epoch boundary).
        keep: Checkpoints kept (0: all).
        extra: More values stored at the top level of the file, e.g.
            ``{"best_acc": 0.97}``: what ``torch.load(weights_only=True)`` loads, i.e.
            tensors, ``None``/bool/int/float/complex/str/bytes, list/tuple/dict/set,
            ``torch.dtype``/``device``/``Size`` and classes registered with
            ``torch.serialization.add_safe_globals``. Not numpy scalars or arrays,
            ``Path``, ``argparse.Namespace`` or other classes: store ``float(x)``,
            ``str(path)``, ``vars(ns)``. The master's only: every rank gets its values
            back.
        rank_extra: This rank's own values (the same rules as ``extra``), e.g. its
            loss history: each rank gets its own back as ``Restored.rank_extra``.
        blocking: ``False``: return once the state is copied aside (into shared
            memory, :mod:`hpc.checkpoint.asyncsave`); a writer process writes the file
            while training goes on. The next save, :func:`~hpc.wait_for_checkpoint`
            and the end of the process wait for it; its errors are raised there.
        sharded: Write ``directory/ckpt-<step>.dcp/`` in PyTorch's distributed-checkpoint
            layout instead, every rank its share of the weights and optimizer state
            (:mod:`hpc.checkpoint.sharded`); :func:`restore_checkpoint` loads it at any
            world size, ``torch.distributed.checkpoint`` without hpc. Synchronous only.

    Raises:
        CheckpointError: on every rank, when the master could not write the file, or
            when ``weights_only=True`` would refuse it (a value in ``extra``, or in a
            state dict, of a type it does not load; the message names it). Then
            nothing is written and no older checkpoint is deleted. Also when the
            previous asynchronous save failed (raised by this call, before it saves).
        ValueError: ``extra`` uses a reserved key, or ``keep`` is negative.
    """
    clash = sorted(set(extra or ()) & set(RESERVED))
    if sharded and not blocking:
        raise ValueError("save_checkpoint: sharded=True is synchronous only.\nHINT: pass "
                         "blocking=True (every rank writes its share meanwhile), or "
                         "sharded=False for an asynchronous single-file save.")
    if clash or keep < 0:
        raise ValueError(f"save_checkpoint: extra keys {clash} are reserved ({RESERVED})"
                         if clash else f"save_checkpoint: keep={keep} is negative.\n"
                         "HINT: keep=0 keeps every checkpoint.")
    asyncsave.settle()  # the previous save first: at most one in flight
    preflight_once(directory, lambda: projected_bytes(model, optimizer))  # the first save here
    rank, size = world()
    states = gather_rank_states(_unwrap(model), rank_extra)
    path = checkpoint_path(directory, step)
    payload = None
    if rank == 0:
        payload = _payload(path, step, epoch, batch, size, model, optimizer, scheduler,
                           sampler, extra, states)
    if sharded:
        meta = {k: v for k, v in (payload or {}).items() if k not in ("model", "optimizer")}
        return save_sharded(directory, step, model=model, optimizer=optimizer, meta=meta,
                            keep=keep)
    if not blocking:
        asyncsave.start_save(payload, path, step, keep, rank)
        return path
    error = None
    if payload is not None:
        with tracker.aside():  # the others wait for it: not a straggler (hpc.health)
            error = write_checkpoint(payload, path, step, keep)
    error = broadcast_object(error)
    if error is not None:
        raise CheckpointError(error)
    return path


def _payload(path: Path, step: int, epoch: int, batch: int, size: int, model: nn.Module,
             optimizer: Any, scheduler: Any, sampler: Any, extra: Optional[dict[str, Any]],
             states: Optional[dict[str, Any]]) -> dict[str, Any]:
    """The master's checkpoint: the states, the position, ``extra``."""
    payload = {**(extra or {}), "format": FORMAT, "step": int(step),
               "epoch": int(epoch), "batch": int(batch), "world_size": size,
               "model": _unwrap(model).state_dict(), **(states or {})}
    if "run_id" not in payload and runid.current() is not None:
        payload["run_id"] = runid.current()  # the run this checkpoint belongs to
    if optimizer is not None:
        payload["optimizer"] = optimizer.state_dict()
    if scheduler is not None:
        payload["scheduler"] = scheduler.state_dict()
    if sampler is not None:
        payload["sampler"] = _sampler_state(sampler)
        _warn_unresumable(sampler, epoch, batch, path)
    return payload


#: Sampler types already warned about by :func:`_warn_unresumable` (once per process).
_WARNED: set[type] = set()


def _warn_unresumable(sampler: Any, epoch: int, batch: int, path: Path) -> None:
    """Warn at the first mid-epoch save with a sampler that cannot skip batches: the
    restore refuses that file (:func:`hpc.checkpoint.sampler.position_sampler`), and a
    warning now beats an error at the preemption's resume."""
    kind = type(sampler)
    if not batch or hasattr(sampler, "resume_at") or kind in _WARNED:
        return
    _WARNED.add(kind)
    logger.warning(
        "checkpoint %s is taken after batch %d of epoch %d with a %s, which always starts "
        "an epoch at its first sample: restore_checkpoint will refuse this file (those "
        "batches would run twice).\nHINT: use hpc.ResumableSampler(dataset, batch_size=...) "
        "instead of %s, or checkpoint only at epoch ends (batch=0).",
        path.name, batch, epoch, kind.__name__, kind.__name__)


def _sampler_state(sampler: Any) -> dict[str, Any]:
    own = sampler.state_dict() if hasattr(sampler, "state_dict") else {}
    return {**own, "epoch": int(getattr(sampler, "epoch", 0)),
            "num_replicas": int(getattr(sampler, "num_replicas", 1)),
            "seed": int(getattr(sampler, "seed", 0))}


@dataclasses.dataclass
class Restored:
    """Where a restored run continues (the same on every rank).

    Attributes:
        path: The checkpoint loaded.
        step: Global steps done when it was written.
        epoch: The epoch of the next step.
        batch: Batches of ``epoch`` already done (the sampler skips them).
        world_size: Ranks that wrote it.
        payload: The whole file, ``extra`` values included (the master's).
        run_id: The run's :func:`hpc.run_id` stored at the save, if one was settled
            (give it to :func:`hpc.open_trackers` as ``restored=``).
        rank_extra: This rank's own ``rank_extra`` as it saved it; ``{}`` when none was
            saved or the world size changed (then ``payload["rank_extra"]`` holds the
            saved ranks', by rank).
    """

    path: str
    step: int
    epoch: int
    batch: int
    world_size: int
    payload: dict[str, Any]
    rank_extra: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def run_id(self) -> Optional[str]:
        """The :func:`hpc.run_id` settled when it was saved (``None``: none was)."""
        value = self.payload.get("run_id")
        return str(value) if value is not None else None


def load_states(payload: dict[str, Any], *, model: nn.Module,
                optimizer: Optional[torch.optim.Optimizer] = None, scheduler: Any = None,
                per_rank: bool = True, path: str = "") -> None:
    """Put a checkpoint's states into the given objects.

    ``per_rank`` (the same world size): this rank's own RNG states and buffers; else
    the master's buffers and the RNG left as it is (:mod:`hpc.checkpoint.ranks`). A
    sharded checkpoint's ``meta`` holds no ``"model"``: its weights and optimizer state
    are already in place (:func:`~hpc.checkpoint.sharded.load_sharded`).
    """
    rank = world()[0]
    if "model" in payload:  # the single file: the master's weights, each rank's buffers
        _unwrap(model).load_state_dict(model_state_for(payload, rank, per_rank, path))
        objects = (("optimizer", optimizer), ("scheduler", scheduler))
    else:  # sharded: load_sharded put the weights and the optimizer state in place
        own = model_state_for({**payload, "model": {}}, rank, per_rank, path)
        if own:
            _unwrap(model).load_state_dict(own, strict=False)
        objects = (("scheduler", scheduler),)
    for name, obj in objects:
        if obj is not None:
            if name not in payload:
                raise CheckpointError(f"the checkpoint holds no {name} state.\nHINT: "
                                      f"pass {name}= to save_checkpoint too, or not here.")
            obj.load_state_dict(payload[name])
    if per_rank:
        restore_rng(payload["rng"][rank])


def restore_checkpoint(directory: PathLike, *, model: nn.Module,
                       optimizer: Optional[torch.optim.Optimizer] = None,
                       scheduler: Any = None, sampler: Any = None,
                       allow_world_change: bool = False) -> Optional[Restored]:
    """Load the newest usable checkpoint of ``directory`` on every rank (collective).

    Returns ``None`` (and changes nothing) when there is none yet: a fresh start.

    Args:
        directory: What :func:`save_checkpoint` wrote to.
        model: Loaded with the saved weights (a DDP wrapper is unwrapped).
        optimizer: Loaded when given.
        scheduler: Loaded when given.
        sampler: Moved to the saved epoch, and past the batches already done
            (:class:`~hpc.checkpoint.sampler.ResumableSampler`).
        allow_world_change: Continue from a checkpoint of another number of ranks: the
            states are loaded, the RNG is not restored and the sampler resumes at the
            same sample count; not exact.

    Raises:
        CheckpointError: on every rank: no file in ``directory`` loads, a rank cannot
            read the chosen one, or the world size changed without
            ``allow_world_change``.
    """
    directory = Path(directory)
    preflight_once(directory, lambda: projected_bytes(model, optimizer))  # before step 1

    path, payload = agree_on_checkpoint(
        lambda: choose_newest(directory, set_aside_skipped=True))  # we save here next
    if path is None:
        return None
    if payload is None:  # sharded
        payload = load_sharded(path, model=model, optimizer=optimizer)
    rank, size = world()
    same = check_world_size(payload, path, size, allow_world_change,
                            "pass allow_world_change=True")
    load_states(payload, model=model, optimizer=optimizer, scheduler=scheduler,
                per_rank=same, path=path)
    epoch, batch = int(payload["epoch"]), int(payload["batch"])
    saved_world = int(payload["world_size"])
    if not same:
        batch = batch * saved_world // size
        if rank == 0:
            logger.warning("world size changed %d -> %d: resuming from %s NOT exactly "
                           "(RNG not restored; epoch %d continues at batch %d)",
                           saved_world, size, path, epoch, batch)
    if sampler is not None:
        from hpc.checkpoint.sampler import position_sampler

        position_sampler(sampler, epoch, batch, payload.get("sampler"), path)
    if rank == 0:
        logger.info("resumed from %s: step %d done; next: batch %d of epoch %d (both counted "
                    "from 0)", path, int(payload["step"]), batch, epoch)
        _note_ddp_rebuild(model, size, path)
    return Restored(path=path, step=int(payload["step"]), epoch=epoch, batch=batch,
                    world_size=saved_world, payload=payload,
                    rank_extra=rank_extra_for(payload, rank, same))
