"""The pretraining loop: supernet training without DDP, checkpoints and exact resume.

Per step, on every rank: draw this rank's architecture from ``(seed, rank, step)``,
forward and backward it on this rank's batch, :func:`hpc.sync_gradients`, optimizer and
LR-scheduler step, then one small all_reduce (:class:`~hpc.pretrain.reduce.StepReducer`)
that carries the step's metrics, the stop-request flag and the BatchNorm statistics.

With ``virtual_ranks`` the schedule (architectures, batches, sandwich roles) is that of
``virtual_ranks`` ranks, and each process plays ``virtual_ranks / world`` consecutive ones
in turn: each from the same BatchNorm statistics, their gradients and statistics summed
locally, then scaled and synced as one rank's.
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
from torch import nn

import hpc
from hpc.checkpoint.asyncsave import wait_for_checkpoint
from hpc.health.step import StepHealth
from hpc.pretrain import resume as resume_mod
from hpc.pretrain.config import PretrainConfig
from hpc.pretrain.data import PretrainData, epoch_batches, load_data, steps_per_epoch, val_shard
from hpc.pretrain.evaluate import validate
from hpc.pretrain.learn import StepLearner, played_by, virtual_ranks
from hpc.pretrain.reduce import StepReducer, StepStats, check_identical
from hpc.pretrain.runlog import MetricsWriter, plot_metrics, write_json
from hpc.pretrain.sampling import check_space
from hpc.pretrain.space import VAL_STREAM, Supernet, arch_generator, derive_seed
from hpc.track.tracker import check_available, for_stage

__all__ = ["pretrain", "PretrainResult"]

logger = logging.getLogger(__name__)


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
        run_id: The run's :func:`hpc.run_id` (``None`` without a run directory).
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
    run_id: Optional[str] = None

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
    run = _Run(cfg, space, data)
    run.resume()
    run.open_outputs()
    run.prepare_validation()
    run.train(stop_requested)
    return run.finish()


class _Run:
    """One call of :func:`pretrain`: its fixed setup, its progress, and its phases.

    The phases run in this order, every one on every rank: ``__init__`` (setup),
    :meth:`resume`, :meth:`open_outputs`, :meth:`prepare_validation`, :meth:`train`
    (epochs of steps, each epoch ending with validation and a checkpoint) and
    :meth:`finish`.
    """

    def __init__(self, cfg: PretrainConfig, space: Optional[nn.Module],
                 data: Optional[PretrainData]) -> None:
        """Setup: init, logging, data on the device, the synced model, optimizer, schedule."""
        self.cfg = cfg
        check_available(cfg.tensorboard, cfg.wandb, cfg.mlflow)  # before init: every rank
        self.info = info = hpc.init_torch(seed=cfg.seed)
        resume_mod.set_determinism(cfg.deterministic)
        self.rank, self.world, self.dev = info.rank, info.world_size, hpc.device()
        self.run_dir = run_dir = Path(cfg.out) if cfg.out else None
        if cfg.setup_logging:
            hpc.setup_logging(info, log_file=run_dir / "pretrain.log" if run_dir else None)
        self.data = data = (data or load_data(cfg.data, cfg.seed, cfg.val_fraction)).to(self.dev)
        if space is None:
            space = Supernet(data.in_channels, data.num_classes, width=cfg.width,
                             ops=cfg.op_names())
        check_space(space, cfg.sampling, cfg.distill)
        space.to(self.dev)
        hpc.sync_model(space)
        self.space = space
        self.n_train = n_train = int(data.x_train.shape[0])
        self.ranks = ranks = virtual_ranks(cfg, self.world)
        #: The virtual ranks this process plays, in order (its own rank without them).
        self.mine = played_by(self.rank, self.world, ranks)
        self.spe = steps_per_epoch(n_train, ranks, cfg.batch_size)
        if self.spe < 1:
            raise ValueError(
                f"batch_size={cfg.batch_size} x {ranks} ranks exceeds the {n_train} "
                "training samples: an epoch would have no step.\n"
                f"HINT: use --batch-size {max(1, n_train // ranks)} or fewer.")
        self.total_steps = cfg.epochs * self.spe
        self.optimizer = _optimizer(cfg, space)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer,
                                                           _cosine(self.total_steps))
        self.is_master = self.rank == 0
        self.metrics: Optional[MetricsWriter] = None
        self.run_id: Optional[str] = None
        self.val_acc: list[float] = []
        self.train_time, self.run_steps, self.sync_checks = 0.0, 0, 0
        self.last_ckpt: Optional[str] = None
        self.status = "completed"
        self.epoch_loss: Optional[float] = None
        self.started = 0.0

    def resume(self) -> None:
        """Resume: load the checkpoint to continue from, or seed this rank's own streams."""
        cfg = self.cfg
        self.pos = pos = resume_mod.restore(cfg, self.run_dir, self.space, self.optimizer,
                                            self.scheduler, self.rank, self.world, self.spe,
                                            ranks=self.ranks)
        if pos.path is None:
            hpc.seed_everything(derive_seed(cfg.seed, self.rank))  # per-rank streams (dropout etc.)
        self.step, self.start_epoch, self.batch_start = pos.step, pos.epoch, pos.batch
        self.epochs_done, self.val_acc = pos.epoch, pos.val_acc

    def open_outputs(self) -> None:
        """The run's id (every rank), then the master's run directory: ``config.json``,
        the metrics file and the trackers (:mod:`hpc.track`)."""
        run_dir, data, pos = self.run_dir, self.data, self.pos
        if run_dir is None:
            return
        trackers = for_stage(run_dir, self.cfg, resume_step=pos.step if pos.path else None,
                             known_id=pos.run_id, config=self.cfg.to_dict())
        self.run_id = trackers.run_id
        if not self.is_master:
            return
        write_json(run_dir / "config.json", {
            **self.cfg.to_dict(), "world_size": self.world, "ranks": self.ranks,
            "torch_threads": torch.get_num_threads(),  # bitwise runs need the same count
            "steps_per_epoch": self.spe,
            "total_steps": self.total_steps, "data_name": data.name, "n_train": self.n_train,
            "n_val": int(data.x_val.shape[0]), "space": type(self.space).__qualname__,
            "resumed_from": pos.path, "run_id": self.run_id})
        self.metrics = MetricsWriter(run_dir / "metrics.csv",
                                     resume_step=self.step if pos.path else None,
                                     trackers=trackers)

    def prepare_validation(self) -> None:
        """The validated architectures, this rank's validation shard and BN-recal images."""
        cfg, data, rank, world, dev = self.cfg, self.data, self.rank, self.world, self.dev
        self.archs = [self.space.sample(arch_generator(cfg.seed, VAL_STREAM, i))
                      for i in range(cfg.val_archs)]
        self.describe = getattr(self.space, "describe", str)
        shard = val_shard(int(data.x_val.shape[0]), world, rank).to(dev)
        self.x_val, self.y_val = data.x_val[shard], data.y_val[shard]
        recal_n = min(cfg.recal_samples, self.n_train) // world * world
        recal = torch.randperm(self.n_train, generator=torch.Generator().manual_seed(
            derive_seed(cfg.seed, VAL_STREAM)))[:recal_n]
        self.recal_x = data.x_train[recal[rank::world].to(dev)]

    def train(self, stop_requested: Optional[Callable[[], bool]]) -> None:
        """The epoch loop, from the resumed position to the last epoch or a stop."""
        self.reducer = StepReducer(self.space, self.dev, ranks=self.ranks)
        self.learner = StepLearner(self.cfg, self.space, self.data, self.rank, self.world,
                                   self.reducer.buffers)
        self.health = StepHealth(self.rank, self.world, model=self.space,
                                 optimizer=self.optimizer, run_dir=self.run_dir)
        self.show = self.cfg.progress and self.info.local_rank == 0
        self.started = time.perf_counter()
        self.space.train()
        for epoch in range(self.start_epoch, self.cfg.epochs):
            if self._epoch(epoch, stop_requested):
                break

    def _epoch(self, epoch: int, stop_requested: Optional[Callable[[], bool]]) -> bool:
        """Run the rest of ``epoch``; True when the run stops here (checkpoint written)."""
        cfg, spe = self.cfg, self.spe
        batches = [epoch_batches(self.n_train, self.ranks, v, cfg.seed, epoch,
                                 cfg.batch_size, start=self.batch_start) for v in self.mine]
        done_before, self.batch_start = spe - len(batches[0]), 0
        bar = _progress(self.show, spe, done_before, f"epoch {epoch + 1}/{cfg.epochs}")
        loss_sum, loss_n, stop = 0.0, 0, False
        # One host-to-device copy per epoch, not one per step: (steps, virtual, batch).
        order = (torch.stack([torch.stack(b) for b in batches], 1).to(self.dev)
                 if batches[0] else [])
        for i, idxs in enumerate(order):
            stats, lr = self._step(idxs, stop_requested)
            loss_sum, loss_n = loss_sum + stats.loss, loss_n + 1
            self._record(epoch, stats, lr, bar)
            epoch_end = done_before + i + 1 == spe
            stop = stats.stop or (cfg.max_steps is not None and self.step >= cfg.max_steps)
            if epoch_end:
                if bar is not None:
                    bar.close()
                    bar = None
                self._end_epoch(epoch, loss_sum / max(loss_n, 1), lr)
            if epoch_end or stop or (cfg.ckpt_every and self.step % cfg.ckpt_every == 0):
                last = stop or (epoch_end and epoch + 1 == cfg.epochs)
                self._checkpoint_after(epoch, done_before + i + 1, epoch_end,
                                       blocking=last or not cfg.ckpt_async)
                self.health.skip()  # validation and the checkpoint are not a step
            if stop:
                break
        if bar is not None:
            bar.close()
        if stop:
            self.status = "stopped"
            logger.info("stopping at step %d (%s); checkpoint %s", self.step,
                        "stop requested" if stats.stop else f"max_steps={cfg.max_steps}",
                        self.last_ckpt)
        return stop

    def _step(self, idxs: torch.Tensor, stop_requested: Optional[Callable[[], bool]]
              ) -> tuple[StepStats, float]:
        """One optimizer step on this process's batches ``idxs`` (one per rank it plays):
        the step's reduced stats and its LR."""
        optimizer = self.optimizer
        t0 = time.perf_counter()
        self.step += 1
        optimizer.zero_grad(set_to_none=True)
        loss_sum, right, count = self.learner(self.step, idxs)
        optimizer.step()
        lr = optimizer.param_groups[0]["lr"]
        self.scheduler.step()
        local_stop = bool(stop_requested()) if stop_requested is not None else False
        health = self.health
        health.boundary(self.step)
        due = health.due(self.step)
        stats = self.reducer(loss_sum, right, count, local_stop,
                             health.row() if due else None)
        if due and stats.rows is not None:
            health.receive(self.step, stats.rows)
        self.train_time += time.perf_counter() - t0
        self.run_steps += 1
        return stats, lr

    def _record(self, epoch: int, stats: StepStats, lr: float, bar: Any) -> None:
        """After a step: the sync check, the metrics row and the progress bar."""
        if self.cfg.check_sync:
            check_identical(self.space, self.step)
            self.sync_checks += 1
        if self.metrics is not None:
            self.metrics.add([{"step": self.step, "epoch": epoch + 1, "split": "train",
                               "loss": stats.loss, "acc": stats.acc, "lr": lr,
                               "samples": stats.samples,
                               "elapsed_s": round(time.perf_counter() - self.started, 3)}])
        if bar is not None:
            bar.set_postfix(loss=f"{stats.loss:.3f}", acc=f"{stats.acc:.3f}", refresh=False)
            bar.update(1)

    def _end_epoch(self, epoch: int, epoch_loss: float, lr: float) -> None:
        """The last step of ``epoch`` is done: validate when due, log the summary."""
        cfg, val_acc = self.cfg, self.val_acc
        self.epoch_loss, self.epochs_done = epoch_loss, epoch + 1
        if epoch + 1 == cfg.epochs or (cfg.val_every and (epoch + 1) % cfg.val_every == 0):
            val_acc = self._validate(epoch)
        logger.info("epoch %d/%d step %d: train loss %.4f | val acc best %s mean "
                    "%s (%d sub-nets) | lr %.4g | %.0f samples/s", epoch + 1,
                    cfg.epochs, self.step, epoch_loss,
                    f"{max(val_acc):.4f}" if val_acc else "-",
                    f"{sum(val_acc) / len(val_acc):.4f}" if val_acc else "-",
                    len(self.archs), lr, self.samples_per_s)

    def _validate(self, epoch: int) -> list[float]:
        """Validate every architecture of :meth:`prepare_validation` (collective)."""
        _, self.val_acc = validate(self.space, self.x_val, self.y_val, self.archs,
                                   self.recal_x)
        val_acc = self.val_acc
        if self.metrics is not None:
            self.metrics.add([{"step": self.step, "epoch": epoch + 1, "split": "val",
                               "acc_best": max(val_acc),
                               "acc_mean": sum(val_acc) / len(val_acc)}])
        return val_acc

    def _checkpoint_after(self, epoch: int, next_batch: int, epoch_end: bool,
                          blocking: bool) -> None:
        """Checkpoint the state after this step; at an epoch end, also plot the metrics."""
        if self.metrics is not None:
            self.metrics.flush()
        next_epoch, next_batch = (epoch + 1, 0) if epoch_end else (epoch, next_batch)
        self.last_ckpt = resume_mod.save(
            self.cfg, self.run_dir, self.space, self.optimizer, self.scheduler,
            step=self.step, epoch=next_epoch, batch=next_batch,
            val_acc=self.val_acc, blocking=blocking, sharded=self.cfg.ckpt_sharded)
        if self.is_master and epoch_end and self.run_dir is not None:
            plot_metrics(self.run_dir / "metrics.csv", self.run_dir / "metrics.png")

    @property
    def samples_per_s(self) -> float:
        """Global training samples per second over this process's training steps."""
        return self.run_steps * self.ranks * self.cfg.batch_size / max(self.train_time, 1e-9)

    def finish(self) -> PretrainResult:
        """Finish: flush the metrics, write ``result.json`` (master), log the outcome."""
        wait_for_checkpoint()  # an asynchronous one in flight (none after a last save)
        if self.metrics is not None:
            self.metrics.close(self.status)
        archs, run_dir = self.archs, self.run_dir
        result = PretrainResult(
            status=self.status, step=self.step, epoch=self.epochs_done, val_acc=self.val_acc,
            val_archs=[list(a) if isinstance(a, tuple) else a for a in archs],
            train_loss=self.epoch_loss, samples_per_s=self.samples_per_s,
            train_time_s=self.train_time, resumed_from=self.pos.path,
            checkpoint=self.last_ckpt, sync_checks=self.sync_checks, world_size=self.world,
            run_id=self.run_id)
        if self.is_master and run_dir is not None:
            write_json(run_dir / "result.json", {**result.to_dict(), "val_arch_names": [
                self.describe(a) for a in archs]})
        if self.val_acc:
            logger.info("pretrain %s at step %d: val acc best %.4f mean %.4f; %.0f "
                        "samples/s over %d ranks%s%s", self.status, self.step,
                        result.val_acc_best, result.val_acc_mean, result.samples_per_s,
                        self.ranks, f" on {self.world} processes"
                        if self.ranks != self.world else "",
                        f"; run dir {run_dir}" if run_dir else "")
        return result
