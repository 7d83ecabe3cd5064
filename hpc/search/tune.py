"""Fine-tuning the searched sub-network as a plain model, with DDP (``hpc tune``).

The supernet could not use :class:`~torch.nn.parallel.DistributedDataParallel`: every
rank trained a different path each step, so most parameters were unused on a rank
(DDP then needs ``find_unused_parameters=True``, a graph traversal every step, and its
buckets wait for gradients that never come), and the ranks' autograd graphs differed
(DDP assumes one graph). The exported sub-network is a *static* network: the same
operations on every rank and every step, every parameter used — exactly what DDP is
built for, with gradient all-reduce overlapped with the backward pass.

Flow, on every rank: read ``SEARCH/search.json``, load the supernet at the checkpoint
the search used, recalibrate the winner's BatchNorm statistics with the search's fixed
images, :func:`~hpc.search.export.extract` it (so before fine-tuning it scores what
the search measured), wrap it in DDP and train with SGD and a per-step cosine schedule
on the pretrain run's data. Checkpoints, resume and the warning signal follow pretrain's
rules (:mod:`hpc.pretrain.resume`). The master writes ``OUT/tune.json``, ``metrics.csv``,
``metrics.png`` and ``model.pt`` (:func:`hpc.search.export.load_model` reads it).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

import hpc
from hpc.pretrain import resume as resume_mod
from hpc.pretrain.data import epoch_batches, steps_per_epoch, val_shard
from hpc.pretrain.evaluate import recalibrate_bn
from hpc.pretrain.runlog import MetricsWriter, plot_metrics, write_json
from hpc.track.tracker import check_available, for_stage
from hpc.pretrain.space import derive_seed
from hpc.search.config import TuneConfig
from hpc.search.export import SubNet, count_params, extract, save_model
from hpc.search.trained import LoadedRun, load_run, recal_images
from hpc.sync.agree import world

__all__ = ["TuneResult", "evaluate_model", "tune"]

logger = logging.getLogger(__name__)

#: Stream of the from-scratch initialisation (pretrain uses ranks >= 0, -1; search -2).
SCRATCH_STREAM = -3


@dataclasses.dataclass
class TuneResult:
    """What :func:`tune` returns (identical on every rank).

    Attributes:
        status: ``completed`` or ``stopped`` (stop request or ``max_steps``).
        arch: The tuned architecture; ``arch_name`` its readable name.
        params: Its parameter count.
        val_acc_before: Validation accuracy of the exported model before training.
        val_acc: Validation accuracy at the end; ``val_loss`` its loss.
        step: Global steps done; ``epoch`` epochs done.
        from_scratch: Whether the weights started fresh instead of from the supernet.
        world_size: Ranks of this run.
        checkpoint: Last checkpoint written.
        run_id: The tune run's :func:`hpc.run_id`.
        samples_per_s: Global training samples per second in this process.
    """

    status: str
    arch: list[int]
    arch_name: str
    params: int
    val_acc_before: float
    val_acc: float
    val_loss: float
    step: int
    epoch: int
    from_scratch: bool
    world_size: int
    checkpoint: Optional[str]
    samples_per_s: float
    run_id: Optional[str] = None


@torch.no_grad()
def evaluate_model(net: nn.Module, x: Tensor, y: Tensor, batch_size: int = 1024
                   ) -> tuple[float, float]:
    """(loss, accuracy) of ``net`` on ``(x, y)``, each rank scoring its shard, reduced."""
    rank, size = world()
    idx = val_shard(int(x.shape[0]), size, rank).to(x.device)
    xs, ys = x[idx], y[idx]
    sums = torch.zeros(3, dtype=torch.float64, device=x.device)
    was_training = net.training
    net.eval()
    for start in range(0, xs.shape[0], batch_size):
        out = net(xs[start:start + batch_size])
        yb = ys[start:start + batch_size]
        sums += torch.stack([F.cross_entropy(out, yb, reduction="sum").double(),
                             (out.argmax(1) == yb).sum().double(),
                             torch.tensor(float(yb.numel()), dtype=torch.float64,
                                          device=x.device)])
    net.train(was_training)
    if size > 1:
        dist.all_reduce(sums)
    total = max(float(sums[2]), 1.0)
    return float(sums[0]) / total, float(sums[1]) / total


def _read_search(cfg: TuneConfig) -> dict[str, Any]:
    found = json.loads((Path(cfg.search) / "search.json").read_text())
    if not found.get("best"):
        raise ValueError(f"{cfg.search}/search.json has no best sub-network (the search "
                         "evaluated nothing).\nHINT: rerun hpc search with looser "
                         "constraints.")
    return found


def _build(cfg: TuneConfig, found: dict[str, Any], run: LoadedRun) -> SubNet:
    """The winner, exported from the supernet (BN recalibrated) or freshly initialised."""
    arch = tuple(found["best"]["arch"])
    if cfg.from_scratch:
        space = run.space
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(derive_seed(cfg.seed, SCRATCH_STREAM))
            net = SubNet(arch, in_channels=space.stem[0].in_channels,
                         num_classes=space.head.out_features,
                         width=space.stem[0].out_channels, ops=space.candidates)
        return net.to(hpc.device())
    recal = recal_images(run, found["settings"].get("recal_samples", cfg.recal_samples))
    if recal.shape[0]:
        recalibrate_bn(run.space, arch, recal, reduce=False)
    return extract(run.space, arch)


def _cosine(total: int) -> Callable[[int], float]:
    return lambda s: 0.5 * (1.0 + math.cos(math.pi * min(s, total) / total))


def _sync_buffers(net: nn.Module) -> None:
    """Rank 0's BatchNorm statistics everywhere (DDP syncs them only at forward)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        for b in net.buffers():
            dist.broadcast(b, 0)


class _Tuner:
    """One tune run: the model, its DDP wrapper, optimizer, schedule and position."""

    def __init__(self, cfg: TuneConfig, net: SubNet, run: LoadedRun,
                 stop_requested: Optional[Callable[[], bool]]) -> None:
        info = hpc.info()
        self.cfg, self.net, self.data = cfg, net, run.data
        self.rank, self.world, self.local_rank = info.rank, info.world_size, info.local_rank
        self.dev = hpc.device()
        self.stop_requested = stop_requested
        self.n_train = int(self.data.x_train.shape[0])
        self.spe = steps_per_epoch(self.n_train, self.world, cfg.batch_size)
        if self.spe < 1:
            raise ValueError(
                f"batch_size={cfg.batch_size} x {self.world} ranks exceeds the "
                f"{self.n_train} training samples: an epoch would have no step.\n"
                f"HINT: use --batch-size {max(1, self.n_train // self.world)} or fewer.")
        self.optimizer = torch.optim.SGD(net.parameters(), lr=cfg.lr, momentum=cfg.momentum,
                                         weight_decay=cfg.weight_decay,
                                         nesterov=cfg.momentum > 0)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, _cosine(cfg.epochs * self.spe))
        self.out = cfg.out_dir
        self.pos = resume_mod.restore(cfg, self.out, net, self.optimizer, self.scheduler,
                                      self.rank, self.world, self.spe)
        self.ddp = nn.parallel.DistributedDataParallel(
            net, device_ids=[self.dev.index] if self.dev.type == "cuda" else None) \
            if self.world > 1 else net
        self.step, self.val = self.pos.step, list(self.pos.val_acc)
        self.metrics = None
        trackers = for_stage(self.out, cfg, resume_step=self.step if self.pos.path else None,
                             known_id=self.pos.run_id, config=cfg.to_dict())
        self.run_id = trackers.run_id
        if self.rank == 0:
            self.out.mkdir(parents=True, exist_ok=True)
            self.metrics = MetricsWriter(self.out / "metrics.csv",
                                         resume_step=self.step if self.pos.path else None,
                                         trackers=trackers)
        self.train_time, self.run_steps, self.last_ckpt = 0.0, 0, None
        self.started = time.perf_counter()  # metrics.csv's elapsed_s, as in pretrain

    def train_step(self, idx: Tensor) -> tuple[float, float, bool]:
        """One DDP step; returns the global (loss, accuracy) and the agreed stop flag."""
        xb, yb = self.data.x_train[idx], self.data.y_train[idx]
        self.optimizer.zero_grad(set_to_none=True)
        out = self.ddp(xb)
        loss = F.cross_entropy(out, yb, label_smoothing=self.cfg.label_smoothing)
        loss.backward()
        self.optimizer.step()
        self.scheduler.step()
        stop = bool(self.stop_requested()) if self.stop_requested is not None else False
        flat = torch.stack([loss.detach().double() * yb.numel(),
                            (out.argmax(1) == yb).sum().double(),
                            torch.tensor(float(yb.numel()), dtype=torch.float64,
                                         device=self.dev),
                            torch.tensor(float(stop), dtype=torch.float64, device=self.dev)])
        if self.world > 1:
            dist.all_reduce(flat)
        total, correct, count, flag = flat.tolist()
        return total / count, correct / count, flag > 0

    def checkpoint(self, epoch: int, batch: int) -> None:
        if self.metrics is not None:
            self.metrics.flush()
        self.last_ckpt = resume_mod.save(self.cfg, self.out, self.net, self.optimizer,
                                         self.scheduler, step=self.step, epoch=epoch,
                                         batch=batch, val_acc=self.val)

    def epoch(self, epoch: int, start: int) -> bool:
        """Train one epoch from batch ``start``; True when asked to stop."""
        cfg = self.cfg
        batches = epoch_batches(self.n_train, self.world, self.rank, cfg.seed, epoch,
                                cfg.batch_size, start=start)
        for i, idx in enumerate(batches):
            t0 = time.perf_counter()
            self.step += 1
            lr = self.optimizer.param_groups[0]["lr"]
            loss, acc, stop = self.train_step(idx.to(self.dev))
            self.train_time += time.perf_counter() - t0
            self.run_steps += 1
            if self.metrics is not None:
                self.metrics.add([{"step": self.step, "epoch": epoch + 1, "split": "train",
                                   "loss": loss, "acc": acc, "lr": lr,
                                   "samples": cfg.batch_size * self.world,
                                   "elapsed_s": round(time.perf_counter() - self.started, 3)}])
            stop = stop or (cfg.max_steps is not None and self.step >= cfg.max_steps)
            at_end = start + i + 1 == self.spe
            if at_end:
                _sync_buffers(self.net)
                _, val_acc = evaluate_model(self.net, self.data.x_val, self.data.y_val)
                self.val = [self.val[0] if self.val else val_acc, val_acc]
                if self.metrics is not None:
                    self.metrics.add([{"step": self.step, "epoch": epoch + 1, "split": "val",
                                       "acc_best": val_acc, "acc_mean": val_acc}])
                logger.info("epoch %d/%d step %d: train loss %.4f | val acc %.4f | lr %.4g",
                            epoch + 1, cfg.epochs, self.step, loss, val_acc, lr)
            if at_end or stop or (cfg.ckpt_every and self.step % cfg.ckpt_every == 0):
                self.checkpoint(epoch + 1 if at_end else epoch, 0 if at_end else start + i + 1)
                if at_end and self.rank == 0:
                    plot_metrics(self.out / "metrics.csv", self.out / "metrics.png")
            if stop:
                return True
        return False


def tune(config: Optional[TuneConfig] = None, *,
         stop_requested: Optional[Callable[[], bool]] = None) -> TuneResult:
    """Fine-tune the best sub-network of a search with DDP, on every rank (collective).

    Args:
        config: The settings (default :class:`~hpc.search.config.TuneConfig`).
        stop_requested: Polled once per step on every rank; True on any rank stops every
            rank after that step with a checkpoint (``status="stopped"``).

    Returns:
        A :class:`TuneResult`, identical on every rank.

    Raises:
        CheckpointError: the supernet checkpoint the search used, or a tune checkpoint
            to resume from, cannot be used.
        ValueError: invalid settings, or a search without a best sub-network.
    """
    cfg = config or TuneConfig()
    cfg.validate()
    check_available(cfg.tensorboard, cfg.wandb, cfg.mlflow)  # every rank, before init
    hpc.init_torch(seed=cfg.seed)
    resume_mod.set_determinism(True)  # bitwise-exact resume on GPUs too, as pretrain
    found = _read_search(cfg)
    run = load_run(found["pretrain"]["run"], found["pretrain"]["checkpoint"])
    net = _build(cfg, found, run)
    _, before = evaluate_model(net, run.data.x_val, run.data.y_val)
    logger.info("tuning %s (%d params) %s: val acc before %.4f", found["best"]["arch_name"],
                count_params(net), "from scratch" if cfg.from_scratch else
                f"from {run.checkpoint}", before)
    t = _Tuner(cfg, net, run, stop_requested)
    t.val = t.val or [before]
    status = "completed"
    for epoch in range(t.pos.epoch, cfg.epochs):
        if t.epoch(epoch, t.pos.batch if epoch == t.pos.epoch else 0):
            status = "stopped"
            break
    if t.metrics is not None:
        t.metrics.close(status)
    _sync_buffers(net)
    loss, acc = evaluate_model(net, run.data.x_val, run.data.y_val)
    result = TuneResult(
        status=status, arch=list(net.arch), arch_name=found["best"]["arch_name"],
        params=count_params(net), val_acc_before=t.val[0], val_acc=acc, val_loss=loss,
        step=t.step, epoch=min(cfg.epochs, t.step // t.spe), from_scratch=cfg.from_scratch,
        world_size=t.world, checkpoint=t.last_ckpt,
        samples_per_s=t.run_steps * t.world * cfg.batch_size / max(t.train_time, 1e-9),
        run_id=t.run_id)
    if t.rank == 0:
        save_model(net, t.out / "model.pt", val_acc=acc, search=str(Path(cfg.search)))
        write_json(t.out / "tune.json", {**dataclasses.asdict(result),
                                         "search_val_acc": found["best"]["val_acc"],
                                         "config": cfg.to_dict()})
    hpc.barrier()  # model.pt and tune.json exist on return, on every rank
    logger.info("tune %s at step %d: val acc %.4f (before %.4f), %d params; %s",
                status, t.step, acc, t.val[0], result.params, t.out)
    return result
