"""Sharded checkpoints: every rank writes its share, in PyTorch's distributed-checkpoint
(DCP) layout; loadable at any world size (collective: every rank calls).

Data-parallel ranks hold the same state: each tensor of at least ``SPLIT_BYTES`` is
written in slices, one by each rank (presented to DCP as a DTensor sharded over the
ranks), and DCP's planner gives each smaller one to the rank with the fewest bytes so far:
each rank writes about ``1/N`` of the state where the single-file format
(:mod:`hpc.checkpoint.resume`) has the master write all of it::

    path = save_sharded("ckpt", step, model=model, optimizer=opt, meta=meta, keep=3)
    meta = load_sharded(path, model=model, optimizer=opt)   # any world size

Only tensors go through DCP, which would store any other value as pickled bytes and load
them back with ``weights_only=False``. The rest (``meta``: the step, epoch, scheduler and
sampler states, ``extra``, the gathered per-rank RNG states; and the optimizer's
``param_groups`` values) is the master's ``hpc-meta.pt``, loaded with
``weights_only=True`` like the single-file format, and checked by that rule before the
save completes. The directory, its manifest and its checks are
:mod:`hpc.checkpoint.shardfiles`.

State dicts come from ``torch.distributed.checkpoint.state_dict`` with the optimizer
state flattened (keyed by parameter name): keys are the plain module's (no ``module.``
of DDP, no ``_orig_mod.`` of ``torch.compile``), FSDP2 (``fully_shard``) parameters are
DTensors, and a checkpoint loads at any world size, FSDP2 or not. Buffers that differ
across ranks (BatchNorm under ``hpc.sync_gradients``) are saved as the master's; each
rank's own belong in ``meta`` (:func:`hpc.checkpoint.ranks.gather_rank_states`).
"""

from __future__ import annotations

import logging
import os
import shutil
import warnings
from pathlib import Path
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
from torch import nn

from hpc.checkpoint.ranks import buffers_digest
from hpc.checkpoint.shardfiles import (
    META, SHARDED_FORMAT, Digests, list_sharded, prune_sharded, put_in_place,
    remove_stale_dirs, shard_digests, sharded_path, temp_dir, verify_sharded)
from hpc.errors import CheckpointError
from hpc.sync.agree import broadcast_object, gather_objects, same_on_all_ranks, world
from hpc.watchdog import tracker

#: The sharded format's API in one place: :func:`save_sharded` and :func:`load_sharded`
#: here, the directory functions of :mod:`hpc.checkpoint.shardfiles` with them.
__all__ = ["save_sharded", "load_sharded", "sharded_path", "verify_sharded",
           "list_sharded"]

logger = logging.getLogger(__name__)

PathLike = Union[str, Path]


def _state_dicts(model: nn.Module, optimizer: Optional[torch.optim.Optimizer]
                 ) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, Any]]]:
    """(tensors, objects): the model's and optimizer's flattened state dicts, split into
    what goes through DCP and what goes into ``hpc-meta.pt``."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions, get_model_state_dict, get_state_dict)

    options = StateDictOptions(flatten_optimizer_state_dict=True)
    if optimizer is None:
        parts = {"model": get_model_state_dict(model, options=options)}
    else:
        msd, osd = get_state_dict(model, optimizer, options=options)
        parts = {"model": msd, "optim": osd}
    tensors = {part: {k: v for k, v in sd.items() if isinstance(v, torch.Tensor)}
               for part, sd in parts.items()}
    objects = {part: {k: v for k, v in sd.items() if not isinstance(v, torch.Tensor)}
               for part, sd in parts.items()}
    return tensors, objects


def _masters_buffers(model: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Replace, in ``tensors`` (not in the model), buffers that differ across ranks by
    the master's: DCP would keep one rank's silently. One ``all_reduce`` when they
    agree (DDP's broadcast buffers, a model without buffers)."""
    ptrs = {b.data_ptr() for b in model.buffers() if b.numel()}
    keys = [k for k, v in tensors.items()
            if type(v) is torch.Tensor and v.numel() and v.data_ptr() in ptrs]
    if world()[1] == 1 or same_on_all_ranks(buffers_digest({k: tensors[k] for k in keys})):
        return
    for key in keys:
        tensors[key] = tensors[key].detach().clone()
        dist.broadcast(tensors[key], src=0)


#: A replicated CPU tensor this large is written in N slices, one by each rank.
SPLIT_BYTES = 1 << 20
_MESH: dict[int, Any] = {}


def _split_replicated(tensors: dict[str, Any]) -> None:
    """Present each large replicated CPU tensor to DCP as a DTensor sharded over every
    rank, on its first dimension with at least one row per rank: each rank then writes
    its slice. DCP's planner hands out whole items only, so a model of a few large
    tensors (6 of 85 MiB over 4 ranks) would leave one rank a third. A load into full
    tensors (or FSDP2 shards) of any world size reads the slices back."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    rank, size = world()
    if size == 1:
        return
    if size not in _MESH:
        _MESH[size] = init_device_mesh("cpu", (size,))
    for key, t in tensors.items():
        if type(t) is not torch.Tensor or t.device.type != "cpu" \
                or t.numel() * t.element_size() < SPLIT_BYTES:
            continue
        dim = next((d for d, n in enumerate(t.shape) if n >= size), None)
        if dim is None:
            continue
        chunks = t.chunk(size, dim)
        local = chunks[rank] if rank < len(chunks) else t.narrow(dim, 0, 0)
        tensors[key] = DTensor.from_local(local.contiguous(), _MESH[size], [Shard(dim)],
                                          run_check=False, shape=t.shape,
                                          stride=t.stride())


def _dcp_failure(e: BaseException) -> str:
    failures = getattr(e, "failures", None)
    if failures:
        return "; ".join(f"rank {r}: {type(exc).__name__}: {exc}"
                         for r, (exc, _) in sorted(failures.items()))
    return f"{type(e).__name__}: {e}"


def _take_state(model: nn.Module, optimizer: Optional[torch.optim.Optimizer]
                ) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    """(tensors for DCP, objects for ``hpc-meta.pt``) of a save.

    ``get_state_dict`` gives an optimizer without state (before its first step) one, by
    a step at ``lr=0``: undone here (that step would count in Adam's bias correction), and
    only its ``param_groups`` values are saved (``"optim_state": False``).
    """
    fresh = optimizer is not None and not optimizer.state
    tensors, objects = _state_dicts(model, optimizer)
    if fresh:
        optimizer.state.clear()  # type: ignore[union-attr]
        del tensors["optim"]
    return tensors, {**objects, "optim_state": not fresh}


def _open_temp(final: Path, step: int, meta: dict[str, Any], objects: dict[str, Any]
               ) -> tuple[Optional[Path], Optional[str]]:
    """The master's first part of a save: the hidden directory and ``hpc-meta.pt`` in
    it, checked by the ``weights_only=True`` rule. (directory, None) or (None, error)."""
    from hpc.checkpoint.loadable import check_loads

    tmp = None
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_dirs(final.parent)  # first: frees their space
        tmp = temp_dir(final)
        tmp.mkdir()
        record = {"format": SHARDED_FORMAT, "step": int(step), "meta": meta,
                  "objects": objects}
        with open(tmp / META, "wb") as f:
            torch.save(record, f)
            f.flush()
            os.fsync(f.fileno())
        check_loads(tmp / META, record, f"{final.name}/{META}")
        return tmp, None
    except CheckpointError as e:  # a value weights_only=True refuses, named
        error = str(e)
    except Exception as e:  # disk full, permissions, an unpicklable value
        error = (f"rank 0 could not start sharded checkpoint {final}: {type(e).__name__}: "
                 f"{e}.\nNothing was written and no older checkpoint was deleted.\n"
                 "HINT: check free space and permissions of the directory, and that meta "
                 "holds only tensors and plain Python values.")
    if tmp is not None:
        shutil.rmtree(tmp, ignore_errors=True)
    return None, error


def _finish(tmp: Path, final: Path, step: int, keep: int, shards: list[Digests],
            named: set[str]) -> Optional[str]:
    """The master's last part: the manifest and the rename into place
    (:func:`~hpc.checkpoint.shardfiles.put_in_place`), the note for ``hpc supervise``,
    keep-N. The error text, or None."""
    from hpc.checkpoint.progress import note_checkpoint

    try:
        put_in_place(tmp, final, step, shards, named)
        note_checkpoint(step, final)
        removed = prune_sharded(final.parent, keep)
        logger.debug("saved %s (removed %s)", final, [p.name for p in removed])
        return None
    except CheckpointError as e:
        error = str(e)
    except Exception as e:  # disk full, permissions
        error = (f"rank 0 could not complete sharded checkpoint {final}: "
                 f"{type(e).__name__}: {e}.\nThe run continues from the previous "
                 "checkpoint if it is restarted.\nHINT: check free space and permissions "
                 "of the directory.")
    shutil.rmtree(tmp, ignore_errors=True)
    return error


def _dcp(call: str, state: dict[str, Any], path: Path) -> Any:
    """``dcp.save``/``dcp.load`` of ``state`` at ``path`` on every rank (collective):
    its result, or the error text naming each failed rank's exception."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    no_dist = not (dist.is_available() and dist.is_initialized())
    try:
        with warnings.catch_warnings():  # DCP warns at every no_dist call
            warnings.filterwarnings("ignore", "torch.distributed is disabled")
            if call == "save":
                writer = dcp.FileSystemWriter(str(path), overwrite=False)
                return dcp.save(state, storage_writer=writer, no_dist=no_dist)
            return dcp.load(state, checkpoint_id=str(path), no_dist=no_dist)
    except (CheckpointException, Exception) as e:  # CheckpointException: a BaseException
        raise CheckpointError(_dcp_failure(e)) from e


def save_sharded(directory: PathLike, step: int, *, model: nn.Module,
                 optimizer: Optional[torch.optim.Optimizer] = None,
                 meta: dict[str, Any], keep: int) -> Path:
    """Checkpoint ``model`` and ``optimizer`` after ``step``, each rank writing its share
    (collective: call it on every rank).

    Args:
        directory: Checkpoint directory (created; on a filesystem every node sees).
        step: Global steps done; names ``ckpt-<step:08d>.dcp``.
        model: Plain, DDP, ``torch.compile``d or FSDP2 (``fully_shard``); saved under
            the plain module's keys.
        optimizer: Saved when given.
        meta: The master's values beside the tensors (rank 0's is saved; other ranks may
            pass ``{}``): what :func:`load_sharded` returns. The single-file payload
            without ``"model"``/``"optimizer"``; loaded with ``weights_only=True``, so
            tensors and plain Python values only.
        keep: Sharded checkpoints kept in ``directory`` (0: all).

    Returns:
        The checkpoint's directory, complete (:func:`verify_sharded`), on every rank.

    Raises:
        CheckpointError: on every rank, when a rank could not take its state or write
            its shard, or the master could not write ``hpc-meta.pt`` (a ``meta`` value
            ``weights_only=True`` refuses is named) or the manifest. Nothing is put in
            place and no older checkpoint is deleted; a hidden temporary directory may
            stay, which the next save removes.
        ValueError: ``keep`` is negative.
    """
    if keep < 0:
        raise ValueError(f"save_sharded: keep={keep} is negative.\n"
                         "HINT: keep=0 keeps every checkpoint.")
    rank, _ = world()
    final = sharded_path(directory, step)
    tensors: dict[str, dict[str, Any]] = {}
    objects: dict[str, Any] = {}
    tmp, error = None, None
    try:
        tensors, objects = _take_state(model, optimizer)
    except Exception as e:  # e.g. an optimizer built before fully_shard
        error = (f"rank {rank} could not take the state dicts for {final}: "
                 f"{type(e).__name__}: {e}.\nHINT: pass the model and the optimizer the "
                 "training loop steps (build the optimizer after wrapping the model).")
    if rank == 0 and error is None:
        with tracker.aside():  # the others wait for it: not a straggler (hpc.health)
            tmp, error = _open_temp(final, step, meta, objects)
    started = gather_objects((error, None if tmp is None else str(tmp)))
    _agree_or_discard([e for e, _ in started], tmp)
    tmp = Path(started[0][1])
    _masters_buffers(model, tensors["model"])
    for part in tensors.values():
        _split_replicated(part)
    named: set[str] = set()
    try:
        written = _dcp("save", tensors, tmp)
        named = {info.relative_path for info in written.storage_data.values()}
        error, shards = None, shard_digests(tmp, rank)
    except (CheckpointError, OSError) as e:
        error, shards = (f"rank {rank} could not write its shard of sharded checkpoint "
                         f"{final}: {e}.\nNothing was put in place and no older checkpoint "
                         "was deleted.\nHINT: check free space and permissions of the "
                         "directory on every node."), {}
    written_by = gather_objects((error, shards))
    _agree_or_discard([e for e, _ in written_by], tmp if rank == 0 else None)
    if rank == 0:
        with tracker.aside():
            error = _finish(tmp, final, step, keep, [s for _, s in written_by], named)
    error = broadcast_object(error)
    if error is not None:
        raise CheckpointError(error)
    return final


def _agree_or_discard(errors: list[Optional[str]], tmp: Optional[Path]) -> None:
    """Raise the first error on every rank, after removing ``tmp`` (the master's)."""
    first = next((e for e in errors if e is not None), None)
    if first is None:
        return
    if tmp is not None:
        shutil.rmtree(tmp, ignore_errors=True)
    raise CheckpointError(first)


def _read_record(path: Path) -> dict[str, Any]:
    """``hpc-meta.pt``, loaded by the ``weights_only=True`` rule."""
    try:
        record = torch.load(path / META, map_location="cpu", weights_only=True)
        if not {"meta", "objects"} <= set(record):
            raise KeyError(f"it holds {sorted(record)}, not 'meta' and 'objects'")
        return record
    except Exception as e:
        raise CheckpointError(
            f"rank {world()[0]} cannot load {path / META}: {type(e).__name__}: {e}.\n"
            "Every rank reads the checkpoint rank 0 verified.\nHINT: put the checkpoint "
            "directory on a filesystem every node mounts.") from e


def _missing_parts(path: Path, record: dict[str, Any], tensors: dict[str, Any],
                   objects: dict[str, Any]) -> Optional[str]:
    """What the given model/optimizer has that the checkpoint lacks, or the reverse for
    the model (``load_state_dict``'s strict rule): the error text, or None."""
    from torch.distributed.checkpoint import FileSystemReader

    saved = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    if "optim" in tensors and "optim" not in record["objects"]:
        return (f"sharded checkpoint {path} holds no optimizer state.\n"
                "HINT: pass optimizer= to save_sharded too, or not here.")
    parts = ["model", "optim"] if record["objects"].get("optim_state") else ["model"]
    for part in [p for p in parts if p in tensors]:
        have = {k[len(part) + 1:] for k in saved if k.startswith(part + ".")}
        have |= set(record["objects"][part])
        want = set(tensors[part]) | set(objects[part])
        missing = sorted(want - have)
        extra = sorted(have - want) if part == "model" else []
        if missing or extra:
            return (f"sharded checkpoint {path} does not fit the given "
                    f"{'model' if part == 'model' else 'optimizer'}: missing "
                    f"{missing[:5]}{' ...' if len(missing) > 5 else ''}, unexpected "
                    f"{extra[:5]}{' ...' if len(extra) > 5 else ''} ({len(missing)} and "
                    f"{len(extra)}).\nIt was saved from another architecture or optimizer."
                    "\nHINT: build the model and optimizer as the run that saved it did.")
    return None


def load_sharded(path: PathLike, *, model: nn.Module,
                 optimizer: Optional[torch.optim.Optimizer] = None) -> dict[str, Any]:
    """Load a sharded checkpoint into ``model`` and ``optimizer`` at any world size
    (collective: call it on every rank); return its ``meta``.

    Rank 0 verifies every file against the manifest first (:func:`verify_sharded`);
    each rank then reads the tensors it needs through DCP (all of them for a
    replicated model, its shards for FSDP2). The scheduler, sampler, RNG and per-rank
    states in ``meta`` are the caller's to apply.

    Raises:
        CheckpointError: on every rank: the checkpoint is incomplete or corrupt, holds
            other keys than the model and optimizer (missing or unexpected, named), or
            a rank could not read it. After a failure inside DCP's read the model and
            optimizer may hold part of the checkpoint: load another one into them.
    """
    path = Path(path)
    rank, _ = world()
    error = None
    if rank == 0:
        with tracker.aside():
            try:
                verify_sharded(path)
            except CheckpointError as e:
                error = str(e)
    error = broadcast_object(error)
    if error is not None:
        raise CheckpointError(error)
    record: dict[str, Any] = {}
    tensors: dict[str, Any] = {}
    objects: dict[str, Any] = {}
    try:
        record = _read_record(path)
        tensors, objects = _state_dicts(model, optimizer)  # initializes Adam's state
        error = _missing_parts(path, record, tensors, objects)
    except CheckpointError as e:
        error = str(e)
    except Exception as e:  # e.g. an optimizer built before fully_shard
        error = (f"rank {rank} could not prepare to load {path}: {type(e).__name__}: {e}."
                 "\nHINT: pass the model and the optimizer the training loop steps (build "
                 "the optimizer after wrapping the model).")
    _agree_or_discard(gather_objects(error), None)
    through = {k: v for k, v in tensors.items()
               if k == "model" or record["objects"].get("optim_state")}
    try:
        _dcp("load", through, path)
    except CheckpointError as e:
        raise CheckpointError(
            f"could not load sharded checkpoint {path}: {e}.\nEvery rank reads the files "
            "rank 0 verified.\nHINT: put the checkpoint directory on a filesystem every "
            "node mounts.") from e
    _apply(model, optimizer, tensors, objects, record["objects"])
    return record["meta"]


def _apply(model: nn.Module, optimizer: Optional[torch.optim.Optimizer],
           tensors: dict[str, Any], objects: dict[str, Any], saved: dict[str, Any]) -> None:
    """Put the loaded tensors and the saved non-tensor values into the objects (the
    dicts are theirs afterwards)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions, set_model_state_dict, set_state_dict)

    options = StateDictOptions(flatten_optimizer_state_dict=True)
    states = {part: {**tensors[part], **{k: saved[part].get(k, v)
                                          for k, v in objects[part].items()}}
              for part in tensors}
    if optimizer is None:
        set_model_state_dict(model, states["model"], options=options)
        return
    set_state_dict(model, optimizer, model_state_dict=states["model"],
                   optim_state_dict=states["optim"], options=options)
    if not saved.get("optim_state", True):
        optimizer.state.clear()  # saved before its first step: fresh, as it was
