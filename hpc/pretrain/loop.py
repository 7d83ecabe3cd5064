"""The pretraining loop: supernet training without DDP, checkpoints and exact resume.

Per step, on every rank: draw this rank's architecture from ``(seed, rank, step)``,
forward and backward it on this rank's batch, :func:`hpc.sync_gradients`, optimizer and
LR-scheduler step, then one small all_reduce (:class:`~hpc.pretrain.reduce.StepReducer`)
that carries the step's metrics, the stop-request flag and the BatchNorm statistics.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

import hpc
from hpc.pretrain import resume as resume_mod
from hpc.pretrain.config import PretrainConfig
from hpc.pretrain.data import PretrainData, epoch_batches, load_data, steps_per_epoch, val_shard
from hpc.pretrain.evaluate import validate
from hpc.pretrain.reduce import StepReducer, check_identical
from hpc.pretrain.runlog import MetricsWriter, plot_metrics, write_json
from hpc.pretrain.space import VAL_STREAM, Supernet, arch_generator, derive_seed

__all__ = ["pretrain", "PretrainResult", "StopFlag"]

logger = logging.getLogger(__name__)


class StopFlag:
    """A "checkpoint now and stop at the next step boundary" request.

    Pass it as ``stop_requested``; call :meth:`request` from anywhere (a signal handler,
    another thread). Only assignment happens in :meth:`request`, so it is safe in a
    signal handler: ``signal.signal(signal.SIGUSR1, flag.request)``. The loop checks it
    once per step and agrees across ranks, so a request on any single rank stops all.
    """

    def __init__(self) -> None:
        self.requested = False

    def request(self, *_: Any) -> None:
        """Ask the loop to stop (signature fits ``signal.signal`` handlers)."""
        self.requested = True

    def __call__(self) -> bool:
        return self.requested


@dataclasses.dataclass
class PretrainResult:
    """What :func:`pretrain` returns (identical on every rank).

    Attributes:
        status: ``completed`` (all epochs ran) or ``stopped`` (a stop request or
            ``max_steps``; a checkpoint of that step was written).
        step: Global steps done (optimizer steps since the start of the run).
        epoch: Epochs fully done.
        val_acc: Accuracy of each validated sub-network at the last validation.
        val_archs: The validated architectures (same order as ``val_acc``).
        train_loss: Mean training loss of the last epoch run in this process.
        samples_per_s: Global training samples per second (train steps only).
        train_time_s: Seconds spent in training steps in this process.
        resumed_from: Checkpoint this process resumed from, if any.
        checkpoint: Last checkpoint written, if any.
        sync_checks: Steps verified identical across ranks (``check_sync``).
        world_size: Ranks of this run.
    """

    status: str
    step: int
    epoch: int
    val_acc: list[float]
    val_archs: list[Any]
    train_loss: Optional[float]
    samples_per_s: float
    train_time_s: float
    resumed_from: Optional[str] = None
    checkpoint: Optional[str] = None
    sync_checks: int = 0
    world_size: int = 1

    @property
    def val_acc_best(self) -> Optional[float]:
        """Best validated sub-network's accuracy."""
        return max(self.val_acc) if self.val_acc else None

    @property
    def val_acc_mean(self) -> Optional[float]:
        """Mean accuracy of the validated sub-networks."""
        return sum(self.val_acc) / len(self.val_acc) if self.val_acc else None

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form (written to ``result.json``)."""
        out = dataclasses.asdict(self)
        out.update(val_acc_best=self.val_acc_best, val_acc_mean=self.val_acc_mean)
        return out


def _cosine(total: int) -> Callable[[int], float]:
    return lambda s: 0.5 * (1.0 + math.cos(math.pi * min(s, total) / total))


def _optimizer(cfg: PretrainConfig, model: nn.Module) -> torch.optim.Optimizer:
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    return torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum,
                           weight_decay=cfg.weight_decay, nesterov=cfg.momentum > 0)


def _progress(enabled: bool, total: int, initial: int, desc: str) -> Any:
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, initial=initial, desc=desc, file=sys.stderr, leave=True,
                dynamic_ncols=True, mininterval=0.5 if sys.stderr.isatty() else 5.0)


def pretrain(config: Optional[PretrainConfig] = None, space: Optional[nn.Module] = None,
             data: Optional[PretrainData] = None, *,
             stop_requested: Optional[Callable[[], bool]] = None) -> PretrainResult:
    """Pretrain a weight-sharing supernet on every rank of the current launch.

    Collective: call it on every rank (it calls :func:`hpc.init_torch`, which is a no-op
    when you already did). The global master writes ``config.out``; local masters log.

    Args:
        config: The run's settings (default :class:`PretrainConfig`).
        space: A search space following :class:`~hpc.pretrain.space.SearchSpace` (an
            ``nn.Module`` with ``sample(generator)`` and ``forward(x, arch)``); default
            a :class:`~hpc.pretrain.space.Supernet` sized for ``data``. Its master's
            weights are broadcast to all ranks.
        data: Train/val tensors (default: ``config.data`` or scikit-learn's digits).
        stop_requested: Polled once per step on every rank; when it returns True on any
            rank, every rank stops after the current step, a checkpoint is written and
            the result has ``status="stopped"`` (e.g. a :class:`StopFlag`).

    Returns:
        A :class:`PretrainResult`, the same on every rank.

    Raises:
        CheckpointError: Resuming failed (no loadable checkpoint, or the world size
            changed without ``config.elastic``).
        ValueError: Invalid configuration or data.
    """
    cfg = config or PretrainConfig()
    cfg.validate()
    info = hpc.init_torch(seed=cfg.seed)
    rank, world, dev = info.rank, info.world_size, hpc.device()
    run_dir = Path(cfg.out) if cfg.out else None
    if cfg.setup_logging:
        hpc.setup_logging(info, log_file=run_dir / "pretrain.log" if run_dir else None)
    data = (data or load_data(cfg.data, cfg.seed, cfg.val_fraction)).to(dev)
    if space is None:
        space = Supernet(data.in_channels, data.num_classes, width=cfg.width)
    space.to(dev)
    hpc.sync_model(space)
    n_train = int(data.x_train.shape[0])
    spe = steps_per_epoch(n_train, world, cfg.batch_size)
    if spe < 1:
        raise ValueError(
            f"batch_size={cfg.batch_size} x {world} ranks exceeds the {n_train} training "
            "samples: an epoch would have no step.\n"
            f"HINT: use --batch-size {max(1, n_train // world)} or fewer.")
    total_steps = cfg.epochs * spe
    optimizer = _optimizer(cfg, space)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _cosine(total_steps))

    pos = resume_mod.restore(cfg, run_dir, space, optimizer, scheduler, rank, world, spe)
    if pos.path is None:
        hpc.seed_everything(derive_seed(cfg.seed, rank))  # per-rank streams (dropout etc.)
    step, start_epoch, batch_start = pos.step, pos.epoch, pos.batch
    is_master = rank == 0
    metrics = None
    if is_master and run_dir is not None:
        run_dir.mkdir(parents=True, exist_ok=True)
        write_json(run_dir / "config.json", {
            **cfg.to_dict(), "world_size": world, "steps_per_epoch": spe,
            "total_steps": total_steps, "data_name": data.name, "n_train": n_train,
            "n_val": int(data.x_val.shape[0]), "space": type(space).__qualname__,
            "resumed_from": pos.path})
        metrics = MetricsWriter(run_dir / "metrics.csv",
                                resume_step=step if pos.path else None)

    archs = [space.sample(arch_generator(cfg.seed, VAL_STREAM, i))
             for i in range(cfg.val_archs)]
    describe = getattr(space, "describe", str)
    shard = val_shard(int(data.x_val.shape[0]), world, rank).to(dev)
    x_val, y_val = data.x_val[shard], data.y_val[shard]
    recal_n = min(cfg.recal_samples, n_train) // world * world
    recal = torch.randperm(n_train, generator=torch.Generator().manual_seed(
        derive_seed(cfg.seed, VAL_STREAM)))[:recal_n]
    recal_x = data.x_train[recal[rank::world].to(dev)]
    reducer = StepReducer(space, dev)
    show = cfg.progress and info.local_rank == 0
    val_acc: list[float] = pos.val_acc
    train_time, run_steps, sync_checks, last_ckpt = 0.0, 0, 0, None
    status, epoch_loss, epochs_done = "completed", None, start_epoch
    started = time.perf_counter()
    space.train()

    def checkpoint(next_epoch: int, next_batch: int) -> Optional[str]:
        if metrics is not None:
            metrics.flush()
        return resume_mod.save(cfg, run_dir, space, optimizer, scheduler, step=step,
                               epoch=next_epoch, batch=next_batch, world=world,
                               val_acc=val_acc)

    for epoch in range(start_epoch, cfg.epochs):
        batches = epoch_batches(n_train, world, rank, cfg.seed, epoch, cfg.batch_size,
                                start=batch_start)
        done_before, batch_start = spe - len(batches), 0
        bar = _progress(show, spe, done_before, f"epoch {epoch + 1}/{cfg.epochs}")
        loss_sum, loss_n, stop = 0.0, 0, False
        # One host-to-device copy per epoch, not one per step.
        order = torch.stack(batches).to(dev) if batches else batches
        for i, idx in enumerate(order):
            t0 = time.perf_counter()
            step += 1
            arch = space.sample(arch_generator(cfg.seed, rank, step))
            xb, yb = data.x_train[idx], data.y_train[idx]
            optimizer.zero_grad(set_to_none=True)
            out = space(xb, arch)
            loss = F.cross_entropy(out, yb, label_smoothing=cfg.label_smoothing)
            loss.backward()
            hpc.sync_gradients(space)
            optimizer.step()
            lr = optimizer.param_groups[0]["lr"]
            scheduler.step()
            local_stop = bool(stop_requested()) if stop_requested is not None else False
            stats = reducer(loss.detach() * yb.numel(), (out.argmax(1) == yb).sum(),
                            yb.numel(), local_stop)
            train_time += time.perf_counter() - t0
            run_steps += 1
            loss_sum, loss_n = loss_sum + stats.loss, loss_n + 1
            if cfg.check_sync:
                check_identical(space, step)
                sync_checks += 1
            if metrics is not None:
                metrics.add([{"step": step, "epoch": epoch + 1, "split": "train",
                              "loss": stats.loss, "acc": stats.acc, "lr": lr,
                              "samples": stats.samples,
                              "elapsed_s": round(time.perf_counter() - started, 3)}])
            if bar is not None:
                bar.set_postfix(loss=f"{stats.loss:.3f}", acc=f"{stats.acc:.3f}",
                                refresh=False)
                bar.update(1)
            epoch_end = done_before + i + 1 == spe
            stop = stats.stop or (cfg.max_steps is not None and step >= cfg.max_steps)
            if epoch_end:
                if bar is not None:
                    bar.close()
                    bar = None
                epoch_loss, epochs_done = loss_sum / max(loss_n, 1), epoch + 1
                last = epoch + 1 == cfg.epochs
                if last or (cfg.val_every and (epoch + 1) % cfg.val_every == 0):
                    _, val_acc = validate(space, x_val, y_val, archs, recal_x)
                    if metrics is not None:
                        metrics.add([{"step": step, "epoch": epoch + 1, "split": "val",
                                      "acc_best": max(val_acc),
                                      "acc_mean": sum(val_acc) / len(val_acc)}])
                sps = run_steps * world * cfg.batch_size / max(train_time, 1e-9)
                logger.info("epoch %d/%d step %d: train loss %.4f | val acc best %s mean "
                            "%s (%d sub-nets) | lr %.4g | %.0f samples/s", epoch + 1,
                            cfg.epochs, step, epoch_loss,
                            f"{max(val_acc):.4f}" if val_acc else "-",
                            f"{sum(val_acc) / len(val_acc):.4f}" if val_acc else "-",
                            len(archs), lr, sps)
            if epoch_end or stop or (cfg.ckpt_every and step % cfg.ckpt_every == 0):
                last_ckpt = (checkpoint(epoch + 1, 0) if epoch_end
                             else checkpoint(epoch, done_before + i + 1))
                if is_master and epoch_end and run_dir is not None:
                    plot_metrics(run_dir / "metrics.csv", run_dir / "metrics.png")
            if stop:
                break
        if bar is not None:
            bar.close()
        if stop:
            status = "stopped"
            logger.info("stopping at step %d (%s); checkpoint %s", step,
                        "stop requested" if stats.stop else f"max_steps={cfg.max_steps}",
                        last_ckpt)
            break

    if metrics is not None:
        metrics.flush()
    result = PretrainResult(
        status=status, step=step, epoch=epochs_done, val_acc=val_acc,
        val_archs=[list(a) if isinstance(a, tuple) else a for a in archs],
        train_loss=epoch_loss,
        samples_per_s=run_steps * world * cfg.batch_size / max(train_time, 1e-9),
        train_time_s=train_time, resumed_from=pos.path, checkpoint=last_ckpt,
        sync_checks=sync_checks, world_size=world)
    if is_master and run_dir is not None:
        write_json(run_dir / "result.json", {**result.to_dict(), "val_arch_names": [
            describe(a) for a in archs]})
    if val_acc:
        logger.info("pretrain %s at step %d: val acc best %.4f mean %.4f; %.0f samples/s "
                    "over %d ranks%s", status, step, result.val_acc_best,
                    result.val_acc_mean, result.samples_per_s, world,
                    f"; run dir {run_dir}" if run_dir else "")
    return result
