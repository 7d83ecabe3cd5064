"""Taking checkpoints of a running pretrain job, and putting a job back where it stopped.

A checkpoint (``<out>/checkpoints/ckpt-<step>.pt``) holds everything an exact resume
needs: model, optimizer and scheduler state, the global step, the position (epoch and
batch within it) of the next step, the configuration and world size, the last
validation accuracies, and every rank's RNG states (python, numpy, torch CPU, CUDA)
gathered on the master. The architecture draws need no state: they are re-derived from
``(seed, rank, step)``, and the data order from ``(seed, epoch)``.

The master chooses the checkpoint (skipping corrupt ones with a warning, and in the run's
own directory setting them aside so keep-N does not count them) and broadcasts
its path; every rank then loads that file, so the run directory must be on a filesystem
every node sees (as it is for any Slurm job writing to ``$HOME`` or a project space).

The generic parts (atomic write, RNG gathering, agreeing on a file, the world-size
refusal) are :mod:`hpc.checkpoint.resume`'s, the ones a user's own script calls; this module
keeps only pretrain's layout (config, val_acc), its resume modes and ``--elastic``.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

import hpc
from hpc.checkpoint.files import list_checkpoints, load_checkpoint
from hpc.checkpoint.choose import agree_on_checkpoint, check_world_size, choose_newest
from hpc.checkpoint.resume import (
    FORMAT,
    load_states,
    projected_bytes,
    save_checkpoint,
)
from hpc.checkpoint.sharded import load_sharded
from hpc.checkpoint.shardfiles import is_sharded, list_sharded, verify_sharded
from hpc.checkpoint.storage import preflight_once
from hpc.errors import CheckpointError
from hpc.pretrain.config import EXACTNESS_FIELDS, SPACE_FIELDS, PretrainConfig
from hpc.pretrain.space import derive_seed

__all__ = ["Position", "restore", "save", "set_determinism", "FORMAT"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class Position:
    """Where the loop starts: after ``step`` steps, at batch ``batch`` of ``epoch``."""

    path: Optional[str] = None
    step: int = 0
    epoch: int = 0
    batch: int = 0
    val_acc: list[float] = dataclasses.field(default_factory=list)
    #: The checkpoint's :func:`hpc.run_id` (``None``: a fresh start or an older checkpoint).
    run_id: Optional[str] = None


def set_determinism(enabled: bool) -> None:
    """cuDNN's switches for a bitwise-exact resume (``PretrainConfig.deterministic``):
    deterministic algorithms, no autotuner; ``False`` allows non-deterministic ones
    and leaves the autotuner as the script set it."""
    torch.backends.cudnn.deterministic = enabled
    torch.backends.cudnn.benchmark = False if enabled else torch.backends.cudnn.benchmark


def save(cfg: PretrainConfig, run_dir: Optional[Path], model: nn.Module,
         optimizer: torch.optim.Optimizer, scheduler: Any, *, step: int, epoch: int,
         batch: int, val_acc: list[float], blocking: bool = True,
         sharded: bool = False) -> Optional[str]:
    """Checkpoint the state after ``step`` (collective: gathers every rank's RNG).

    ``epoch``/``batch`` are the position of the *next* step. Only the global master
    writes; it keeps the newest ``cfg.keep`` checkpoints. Returns the path (on every
    rank), or ``None`` when there is no run directory. ``blocking=False``: written by the
    writer process (:mod:`hpc.checkpoint.asyncsave`) while training goes on; ``sharded``:
    every rank writes its share (:mod:`hpc.checkpoint.sharded`), synchronously. The
    run's :func:`hpc.run_id`, settled by then, goes in too (``save_checkpoint`` stores
    it) for a resume to adopt.
    """
    if run_dir is None:
        return None
    path = save_checkpoint(run_dir / "checkpoints", step, model=model, optimizer=optimizer,
                           scheduler=scheduler, epoch=epoch, batch=batch, keep=cfg.keep,
                           extra={"seed": cfg.seed, "config": cfg.to_dict(),
                                  "val_acc": [float(a) for a in val_acc]},
                           blocking=blocking or sharded, sharded=sharded)
    return str(path)


def _choose(cfg: PretrainConfig, run_dir: Optional[Path]
            ) -> tuple[Optional[str], Optional[str], Optional[dict[str, Any]]]:
    """(path, error, payload) on the master: which checkpoint to resume from, if any."""
    ckpt_dir = run_dir / "checkpoints" if run_dir is not None else None
    if cfg.resume == "never":
        held = [*list_checkpoints(ckpt_dir), *list_sharded(ckpt_dir)] if ckpt_dir else []
        if held:
            return None, (
                f"{ckpt_dir} already holds {len(held)} checkpoints "
                "and resume='never' would overwrite them.\n"
                "HINT: pass --resume auto to continue that run, or a new --out "
                "directory to start over."), None
        return None, None, None
    target = ckpt_dir if cfg.resume == "auto" else Path(cfg.resume)
    if target is None or (cfg.resume == "auto" and not target.is_dir()):
        return None, None, None
    try:
        if is_sharded(target):
            verify_sharded(target)
            return str(target), None, None
        if target.is_dir():  # set aside only in the run's own directory: it saves there
            own = ckpt_dir is not None and target.resolve() == ckpt_dir.resolve()
            found = choose_newest(target, set_aside_skipped=own)
            if found[0] is None and found[1] is None and cfg.resume != "auto":
                return None, f"no checkpoint in {target}.\nHINT: check --resume.", None
            return found
        return str(target), None, load_checkpoint(target)
    except CheckpointError as e:
        return None, str(e), None


def restore(cfg: PretrainConfig, run_dir: Optional[Path], model: nn.Module,
            optimizer: torch.optim.Optimizer, scheduler: Any, rank: int, world: int,
            steps_per_epoch: int, ranks: Optional[int] = None) -> Position:
    """Load the checkpoint to resume from (if any) into the given objects, on every rank.

    ``ranks``: the ranks the schedule is made for (``virtual_ranks``; default ``world``).
    A checkpoint of the same schedule resumes exactly on another number of processes
    (the RNG streams reseeded from ``(seed, rank, step)``: exact for a model whose
    forward draws no random numbers).

    Raises:
        CheckpointError: on every rank, when the chosen checkpoint cannot be used: none
            loads, a rank cannot read it, it holds another supernet (``SPACE_FIELDS``),
            or the schedule's ranks changed without ``cfg.elastic``.
    """
    ranks = ranks or world
    if run_dir is not None:  # where it saves: one directory with room, before step 1
        preflight_once(run_dir / "checkpoints",
                       lambda: projected_bytes(model, optimizer))
    path, payload = agree_on_checkpoint(lambda: _choose(cfg, run_dir))
    if path is None:
        return Position()
    if payload is None:  # sharded: the weights and optimizer state go in place now
        payload = load_sharded(path, model=model, optimizer=optimizer)
    saved_cfg = payload.get("config", {})
    _check_space(saved_cfg, cfg, path)
    _warn_config_changes(saved_cfg, cfg)
    saved_world = int(payload.get("world_size", world))
    saved_ranks = schedule_ranks(payload, world)
    same = check_world_size({"world_size": saved_ranks}, path, ranks, cfg.elastic,
                            f"pass --virtual-ranks {saved_ranks} (on any number of processes "
                            "that divides it) for the same run, or --elastic")
    load_states(payload, model=model, optimizer=optimizer, scheduler=scheduler,
                per_rank=same and saved_world == world, path=path)
    step, epoch, batch = int(payload["step"]), int(payload["epoch"]), int(payload["batch"])
    if not same:
        batch = _continue_elastic(cfg, path, payload, optimizer, scheduler, rank, ranks,
                                  steps_per_epoch)
    elif saved_world != world:  # the same schedule on other processes
        hpc.seed_everything(derive_seed(cfg.seed, rank, step))
        if rank == 0:
            logger.info("resuming the %d-rank schedule of %s, written by %d process(es), "
                        "on %d: the same run (RNG streams reseeded from (seed, rank, step), "
                        "which a forward without random numbers does not read)", ranks,
                        path, saved_world, world)
    if rank == 0:
        logger.info("resumed from %s: step %d done, next: epoch %d batch %d", path, step,
                    epoch + 1, batch)
    return Position(path=path, step=step, epoch=epoch, batch=batch,
                    val_acc=[float(a) for a in payload.get("val_acc", [])],
                    run_id=payload.get("run_id"))


def _continue_elastic(cfg: PretrainConfig, path: str, payload: dict[str, Any],
                      optimizer: torch.optim.Optimizer, scheduler: Any, rank: int,
                      world: int, steps_per_epoch: int) -> int:
    """The batch to continue at after the schedule's ranks changed (``cfg.elastic``
    only; ``world``: this run's, virtual ones included).

    Keeps the sample count of the interrupted epoch, moves the LR schedule to that
    position and reseeds this rank's RNG streams from ``(seed, rank, step)``.
    """
    step, epoch, batch = int(payload["step"]), int(payload["epoch"]), int(payload["batch"])
    saved_world = schedule_ranks(payload, world)
    saved_batch = int(payload.get("config", {}).get("batch_size", cfg.batch_size))
    consumed = batch * saved_world * saved_batch
    batch = min(consumed // (world * cfg.batch_size), steps_per_epoch)
    position = epoch * steps_per_epoch + batch
    scheduler.last_epoch = position
    for group, base in zip(optimizer.param_groups, scheduler.base_lrs):
        group["lr"] = base * scheduler.lr_lambdas[0](position)
    hpc.seed_everything(derive_seed(cfg.seed, rank, step))
    if rank == 0:
        logger.warning(
            "world size changed %d -> %d: resuming from %s NOT exactly: epoch %d "
            "continues at batch %d/%d (same sample count), schedule at step %d of %d, "
            "RNG streams reseeded from (seed, rank, step)", saved_world, world, path,
            epoch + 1, batch, steps_per_epoch, position, cfg.epochs * steps_per_epoch)
    return batch


def schedule_ranks(payload: dict[str, Any], world: int) -> int:
    """The ranks a checkpoint's schedule was made for: its ``virtual_ranks``, else the
    processes that wrote it (``world`` when it does not say)."""
    saved = payload.get("config", {}).get("virtual_ranks")
    return int(saved or payload.get("world_size", world))


def _check_space(saved: dict[str, Any], cfg: Any, path: str) -> None:
    """Refuse (on every rank) a checkpoint whose supernet is not this run's: other
    ``--ops`` or ``--width`` (its weights belong to another space, or do not fit)."""
    if not isinstance(cfg, PretrainConfig):
        return
    theirs = PretrainConfig.from_dict({k: saved[k] for k in SPACE_FIELDS if k in saved})
    changed = [f"--{k} {getattr(theirs, k)} (this run: {getattr(cfg, k)})"
               for k in SPACE_FIELDS if getattr(theirs, k) != getattr(cfg, k)]
    if changed:
        raise CheckpointError(
            f"checkpoint {path} holds a supernet of {', '.join(changed)}.\n"
            "Its weights belong to that search space: continuing them in another one "
            "would not be a resume of this run.\n"
            f"HINT: resume with {' '.join(c.split(' (')[0] for c in changed)}, or start "
            "a new run (another --out, or --no-resume).")


def _warn_config_changes(saved: dict[str, Any], cfg: PretrainConfig) -> None:
    current = cfg.to_dict()
    changed = [f"{k}: {saved[k]!r} -> {current[k]!r}" for k in EXACTNESS_FIELDS
               if k in saved and saved[k] != current[k]]
    if changed and (not dist.is_initialized() or dist.get_rank() == 0):
        logger.warning("resuming with changed settings (%s): the continuation is not "
                       "exact", "; ".join(changed))
