"""A user's preemptible script, written from docs/preemptible.md: a small CNN with
BatchNorm and dropout, Adam + StepLR, gradient accumulation, ``AgreedStop(every=4)``
and a shuffled ``ResumableSampler``; gradients averaged by ``hpc.sync_gradients`` or DDP.

``--kill-at STEP --kill-rank R``: rank R sends itself SIGTERM after optimizer step STEP
(a preemption that reaches one rank only); every rank stops at the next agreed step and
the master checkpoints. Rerun without them to resume. Each rank prints
``rank R: done step S digest D history H`` at the end: D hashes its weights and buffers
(BatchNorm's running statistics are each rank's own under sync_gradients), H its own
loss history, kept across the resume in ``rank_extra``.

Usage: resume_exact.py --out DIR [--sync grads|ddp] [--ddp default|find_unused]
                       [--kill-at N --kill-rank R]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import signal
from pathlib import Path

import hpc

stop = hpc.AgreedStop(every=4)  # first: a signal while torch imports must not kill us

import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

ACCUM = 2  # micro-batches per optimizer step


def digest(obj: object) -> str:
    h = hashlib.sha256()
    if isinstance(obj, nn.Module):
        for name, t in obj.state_dict().items():
            h.update(name.encode())
            h.update(t.detach().cpu().contiguous().numpy().tobytes())
    else:
        h.update(repr(obj).encode())
    return h.hexdigest()[:16]


def dataset(n: int = 1024) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 1, 8, 8, generator=g)
    return TensorDataset(x, (x.mean((1, 2, 3)) * 4 + torch.randn(n, generator=g)).gt(0).long())


def cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Dropout(0.2),
        nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
        nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(32, 16), nn.ReLU(), nn.Dropout(0.1),
        nn.Linear(16, 2))


def wrap(model: nn.Module, how: str) -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel as DDP

    # find_unused_parameters=True: DDP keeps its first bucket layout (docs/preemptible.md)
    return DDP(model, find_unused_parameters=how == "find_unused")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", required=True)
    parser.add_argument("--sync", choices=("grads", "ddp"), default="grads")
    parser.add_argument("--ddp", default="default",
                        choices=("default", "find_unused"))
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--kill-at", type=int, default=0)
    parser.add_argument("--kill-rank", type=int, default=1)
    args = parser.parse_args()

    info = hpc.init_torch(seed=0)
    hpc.setup_logging(info)
    model = cnn()
    if args.sync == "ddp":
        net = wrap(model, args.ddp)
    else:
        hpc.sync_model(model)
        net = model
    data = dataset()
    sampler = hpc.ResumableSampler(data, batch_size=args.batch_size, seed=0)
    loader = DataLoader(data, batch_size=args.batch_size, sampler=sampler, drop_last=True,
                        generator=torch.Generator())
    batches = len(loader)
    assert batches % ACCUM == 0, batches
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.7)
    ckpt = Path(args.out) / "checkpoints"
    states = dict(model=net, optimizer=opt, scheduler=sched, sampler=sampler)
    restored = hpc.restore_checkpoint(ckpt, **states)
    step, start = (restored.step, restored.epoch) if restored else (0, 0)
    history: list[float] = restored.rank_extra["losses"] if restored else []

    for epoch in range(start, args.epochs):
        sampler.set_epoch(epoch)
        net.train()
        for batch, (x, y) in enumerate(loader, start=sampler.start_batch):
            last = (batch + 1) % ACCUM == 0
            if args.sync == "ddp" and not last:
                with net.no_sync():
                    loss = nn.functional.cross_entropy(net(x), y) / ACCUM
                    loss.backward()
            else:
                loss = nn.functional.cross_entropy(net(x), y) / ACCUM
                loss.backward()
            if not last:
                continue
            if args.sync == "grads":
                hpc.sync_gradients(model)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            history.append(round(loss.item(), 6))
            if step == args.kill_at and info.rank == args.kill_rank:
                os.kill(os.getpid(), signal.SIGTERM)
            at = (epoch, batch + 1) if batch + 1 < batches else (epoch + 1, 0)
            if stop(step):
                path = hpc.save_checkpoint(ckpt, step, **states, epoch=at[0], batch=at[1],
                                           rank_extra={"losses": history})
                print(f"rank {info.rank}: stopped at step {step}", flush=True)
                stop.requeue_and_exit(step, path)
    print(f"rank {info.rank}: done step {step} digest {digest(model)} history "
          f"{digest(history)}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
