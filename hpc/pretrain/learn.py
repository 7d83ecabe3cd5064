"""What one process learns in one pretraining step: its sub-networks, their losses, and
the gradient sync.

Each process plays one rank of the step's schedule, or ``virtual_ranks / world``
consecutive ones (``PretrainConfig.virtual_ranks``): the sub-networks, batches and sandwich
roles are those of ``virtual_ranks`` ranks whatever the number of processes. A process
playing several runs them one after the other, each from the step's BatchNorm
statistics (as on a process of its own); their gradients accumulate in order and are
scaled by ``1 / k`` before the sync, their statistics are summed, and the step's reducer
divides by ``virtual_ranks`` (:class:`~hpc.pretrain.reduce.StepReducer`).

Bitwise: two ranks' sums do not depend on the order (``a + b == b + a``), so
``--virtual-ranks 2`` on 1 process is bitwise the 2-process run, with the same torch
thread count per process (a convolution's sums depend on it) and a space whose forward
draws no random numbers (the RNG streams are per process). With more virtual ranks the
process boundaries change the order of the sums: equal within float rounding.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import hpc
from hpc.pretrain import sampling
from hpc.pretrain.config import PretrainConfig
from hpc.pretrain.data import PretrainData

__all__ = ["StepLearner", "virtual_ranks", "played_by"]

logger = logging.getLogger(__name__)


def virtual_ranks(cfg: PretrainConfig, world: int) -> int:
    """The ranks the schedule is made for: ``cfg.virtual_ranks``, a multiple of ``world``."""
    ranks = cfg.virtual_ranks or world
    if ranks % world:
        raise ValueError(
            f"virtual_ranks={ranks} is not a multiple of the {world} processes of this "
            "launch, so they cannot share the virtual ranks evenly.\n"
            f"HINT: launch {ranks} processes or a divisor of it, or pass "
            f"--virtual-ranks {world * max(1, round(ranks / world))}.")
    return ranks


def played_by(rank: int, world: int, ranks: int) -> range:
    """The virtual ranks process ``rank`` plays, in order."""
    per = ranks // world
    return range(rank * per, (rank + 1) * per)


class StepLearner:
    """Forward, backward and gradient sync of this process's ranks at one step.

    Args:
        cfg: The run's settings (sampling, distillation, label smoothing, virtual ranks).
        space: The supernet, identical on every process.
        data: The training tensors, on the model's device.
        rank, world: This process and the number of processes.
        buffers: The BatchNorm buffers the step's reducer averages (restored before
            each virtual rank, left holding their sum).
    """

    def __init__(self, cfg: PretrainConfig, space: nn.Module, data: PretrainData,
                 rank: int, world: int, buffers: list[Tensor]) -> None:
        self.cfg, self.space, self.data = cfg, space, data
        self.rank, self.world = rank, world
        self.ranks = virtual_ranks(cfg, world)
        self.mine = played_by(rank, world, self.ranks)
        self.buffers = buffers
        self.grad_sync = hpc.GradSync(space)
        if cfg.overlap and len(self.mine) > 1 and rank == 0:
            logger.warning("--overlap is off for this run: each process plays %d ranks and "
                           "syncs once after all their backward passes (same results)",
                           len(self.mine))

    def archs(self, step: int, ranks: range) -> list[Any]:
        """The sub-networks the (virtual) ``ranks`` train at ``step``."""
        cfg = self.cfg
        return [sampling.arch_for(self.space, cfg.sampling, cfg.seed, v, self.ranks, step)
                for v in ranks]

    def users(self, step: int, mine: list[Any]) -> Optional[list[list[nn.Parameter]]]:
        """Every process's used parameters this step, when the space can tell
        (``used_parameters``): archs are a pure function of (seed, rank, step), so the
        sync skips its agreement round. None otherwise (the sync exchanges them)."""
        used = getattr(self.space, "used_parameters", None)
        if used is None or self.world < 2:
            return None
        rows = []
        for r in range(self.world):
            theirs = mine if r == self.rank else self.archs(
                step, played_by(r, self.world, self.ranks))
            rows.append(list({id(p): p for a in theirs for p in used(a)}.values()))
        return rows

    def loss(self, arch: Any, idx: Tensor) -> tuple[Tensor, Tensor, int]:
        """Forward ``arch`` on batch ``idx`` (after the teacher under ``distill``): the
        loss, the number right and the batch size."""
        cfg, space = self.cfg, self.space
        xb, yb = self.data.x_train[idx], self.data.y_train[idx]
        teacher = None
        if cfg.distill and arch != (largest := space.largest()):
            with torch.no_grad():
                teacher = space(xb, largest)
        out = space(xb, arch)
        if teacher is None:
            loss = F.cross_entropy(out, yb, label_smoothing=cfg.label_smoothing)
        else:
            loss = sampling.distill_loss(out, teacher, yb, temperature=cfg.distill_temperature,
                                         weight=cfg.distill_weight,
                                         label_smoothing=cfg.label_smoothing)
        return loss, (out.argmax(1) == yb).sum(), yb.numel()

    def __call__(self, step: int, idxs: Tensor) -> tuple[Tensor, Tensor, int]:
        """Learn step ``step`` on this process's batches ``idxs`` (one per rank it plays),
        gradients synced: the summed ``loss x batch``, number right and batch size."""
        archs = self.archs(step, self.mine)
        users = self.users(step, archs)
        if len(archs) == 1:
            loss, right, n = self.loss(archs[0], idxs[0])
            if self.cfg.overlap:
                self.grad_sync.backward(loss, users=users)
            else:
                loss.backward()
                self.grad_sync.sync(users)
            return loss.detach() * n, right, n
        loss_sum, right, n = self._accumulate(archs, idxs)
        scale = 1.0 / len(archs)
        for p in self.space.parameters():
            if p.grad is not None:
                p.grad.mul_(scale)
        self.grad_sync.sync(users)
        return loss_sum, right, n

    def _accumulate(self, archs: list[Any], idxs: Tensor) -> tuple[Tensor, Tensor, int]:
        """Backward of each virtual rank in turn, each from the step's BatchNorm
        statistics; the buffers end as the sum of theirs."""
        bufs = self.buffers
        start = [b.clone() for b in bufs]
        loss_sum, right, count = self._backward(archs[0], idxs[0])
        summed = [b.clone() for b in bufs]
        for arch, idx in zip(archs[1:], idxs[1:]):
            for b, s0 in zip(bufs, start):
                b.copy_(s0)
            loss, r, n = self._backward(arch, idx)  # gradients add in order: g_0 + g_1 + ...
            for acc, b in zip(summed, bufs):
                acc.add_(b)
            loss_sum, right, count = loss_sum + loss, right + r, count + n
        for b, acc in zip(bufs, summed):
            b.copy_(acc)
        return loss_sum, right, count

    def _backward(self, arch: Any, idx: Tensor) -> tuple[Tensor, Tensor, int]:
        """:meth:`loss` and its backward: ``loss x batch``, number right, batch size."""
        loss, right, n = self.loss(arch, idx)
        loss.backward()
        return loss.detach() * n, right, n
