"""The baseline of the pretrain benchmarks: the same supernet loop with no torch-hpc.

One process, no torch.distributed, no gradient sync, no checkpoints: the default
supernet on digits, one random architecture per step, SGD with Nesterov momentum and a
per-step cosine schedule, and the ``loss.item()`` every training loop does for its
progress bar. Used by ``bench/pretrain_throughput.py`` (CPU) and ``bench/gpu_check.py``.
"""

from __future__ import annotations

import math
import time

import torch
import torch.nn.functional as F

from hpc.pretrain.data import load_digits
from hpc.pretrain.space import Supernet

__all__ = ["plain_loop"]


def plain_loop(steps: int, batch_size: int = 32, width: int = 32, lr: float = 0.1,
               device: str = "cpu", seed: int = 0) -> float:
    """Train ``steps`` steps; return samples per second over those steps."""
    torch.manual_seed(seed)
    dev = torch.device(device)
    data = load_digits(seed).to(dev)
    model = Supernet(data.in_channels, data.num_classes, width=width).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=5e-4,
                          nesterov=True)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps)))
    gen = torch.Generator().manual_seed(seed)
    n = data.x_train.shape[0]
    per_epoch = n // batch_size
    elapsed, order = 0.0, torch.empty(0)
    for step in range(steps):
        if step % per_epoch == 0:
            order = torch.randperm(n, device=dev)[:per_epoch * batch_size].view(
                per_epoch, batch_size)
        t0 = time.perf_counter()
        idx = order[step % per_epoch]
        arch = model.sample(gen)
        opt.zero_grad(set_to_none=True)
        out = model(data.x_train[idx], arch)
        loss = F.cross_entropy(out, data.y_train[idx])
        loss.backward()
        opt.step()
        sched.step()
        loss.item()
        elapsed += time.perf_counter() - t0
    return steps * batch_size / elapsed
