"""Validation of sampled sub-networks, with per-sub-network BatchNorm recalibration.

A supernet's BatchNorm running statistics are shared by every sub-network that uses
the layer, but each sub-network feeds the layer a different activation distribution.
Evaluating with the shared statistics therefore underrates most sub-networks (on digits,
some score 10-20% instead of 96%). As in Single-Path One-Shot NAS (Guo et al., 2020),
each sub-network's statistics are recomputed before it is scored: the BatchNorm layers
are reset, a fixed set of training images is forwarded in train mode (no gradients),
the statistics are averaged across ranks, the sub-network is scored, and the saved
statistics are put back — validation never changes the training state, so resume stays
exact.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from hpc.sync.agree import world

__all__ = ["validate", "recalibrate_bn", "batchnorms"]


def batchnorms(module: nn.Module) -> list[nn.modules.batchnorm._BatchNorm]:
    """BatchNorm layers of ``module`` that track running statistics."""
    return [m for m in module.modules()
            if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats]


@torch.no_grad()
def recalibrate_bn(space: nn.Module, arch: Any, x: Tensor, chunk: int = 256,
                   reduce: bool = True) -> None:
    """Recompute BatchNorm statistics for ``arch`` from this rank's images ``x``.

    Every rank must pass the same number of images; the statistics (a cumulative
    average over the chunks) are then averaged across ranks with one all_reduce.
    ``reduce=False`` keeps them local (each rank recalibrating its own sub-network
    from all the images, as :mod:`hpc.search.search` does).
    """
    layers = batchnorms(space)
    momenta = [m.momentum for m in layers]
    for m in layers:
        m.reset_running_stats()
        m.momentum = None  # cumulative average over the recalibration chunks
    space.train()
    try:
        for start in range(0, x.shape[0], chunk):
            space(x[start:start + chunk], arch)
    finally:
        for m, momentum in zip(layers, momenta):
            m.momentum = momentum
    if reduce and world()[1] > 1 and layers:
        stats = [t for m in layers for t in (m.running_mean, m.running_var)]
        flat = torch.cat([t.reshape(-1) for t in stats])
        dist.all_reduce(flat)
        flat /= world()[1]
        off = 0
        for t in stats:
            t.copy_(flat[off:off + t.numel()].view_as(t))
            off += t.numel()


@torch.no_grad()
def validate(space: nn.Module, x: Tensor, y: Tensor, archs: Sequence[Any],
             recal_x: Optional[Tensor] = None,
             batch_size: int = 1024, reduce: bool = True
             ) -> tuple[list[float], list[float]]:
    """Loss and accuracy of each sub-network in ``archs`` on ``(x, y)``, over all ranks.

    Each rank passes its own shard (:func:`hpc.pretrain.data.val_shard`); the sums are
    all-reduced once, so every sample counts exactly once and every rank gets the same
    numbers. With ``recal_x`` (this rank's recalibration images, the same count on every
    rank) each sub-network's BatchNorm statistics are recalibrated first and restored
    afterwards. The model is left in train mode with its statistics unchanged.
    ``reduce=False`` makes no collective at all: this rank scores ``archs`` on the
    ``(x, y)`` it was given (the whole validation set, in search).
    """
    layers = batchnorms(space)
    saved = [{k: v.clone() for k, v in m.state_dict().items()} for m in layers]
    sums = torch.zeros(len(archs), 3, dtype=torch.float64, device=x.device)
    try:
        for i, arch in enumerate(archs):
            if recal_x is not None and recal_x.shape[0] > 0:
                recalibrate_bn(space, arch, recal_x, reduce=reduce)
            space.eval()
            for start in range(0, x.shape[0], batch_size):
                xb, yb = x[start:start + batch_size], y[start:start + batch_size]
                out = space(xb, arch)
                sums[i, 0] += F.cross_entropy(out, yb, reduction="sum").double()
                sums[i, 1] += (out.argmax(1) == yb).sum().double()
                sums[i, 2] += yb.numel()
    finally:
        for m, state in zip(layers, saved):
            m.load_state_dict(state)
        space.train()
    if reduce and world()[1] > 1:
        dist.all_reduce(sums)
    total = sums[:, 2].clamp(min=1)
    return (sums[:, 0] / total).tolist(), (sums[:, 1] / total).tolist()
