"""A preemptible training script: own model, optimizer, scheduler and sampler.

A stop signal (Slurm's warning signal, SIGTERM of a preemption, ``scancel --signal``,
``kill -USR2`` to ``hpc run`` or to any one rank) stops every rank after the same step,
the master checkpoints, the job is requeued (exit 75) and the next run resumes exactly
where this one stopped: the final weights are bitwise equal to an uninterrupted run's::

    hpc run --nproc 2 -- python docs/examples/train_preemptible.py --out runs/mine
    sbatch --requeue slurm/pretrain.sbatch python docs/examples/train_preemptible.py --out runs/mine

It reports to TensorBoard (when installed; ``--wandb PROJECT``, ``--mlflow EXPERIMENT``
too) under one run id for all its attempts, one point per step (``docs/tracking.md``).

``tests/integration/test_docs_examples.py`` runs it under ``hpc run --nproc 2`` with a
USR2 to one rank and a resume; ``tests/integration/test_preemption.py`` under sbatch
with a real partition preemption. See ``docs/preemptible.md``.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
from pathlib import Path

import hpc

# [guard]
stop = hpc.AgreedStop()  # first: a signal while torch still imports must not kill us
# [/guard]

import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

logger = logging.getLogger("train_preemptible")


def digest(model: nn.Module) -> str:
    """SHA-256 of every weight and buffer: equal runs give equal digests."""
    h = hashlib.sha256()
    for name, t in model.state_dict().items():
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def dataset(n: int = 4096, features: int = 32, classes: int = 10) -> TensorDataset:
    """Synthetic classification data, the same on every rank (seeded generator)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, features, generator=g)
    w = torch.randn(features, classes, generator=g)
    return TensorDataset(x, (x @ w + 0.5 * torch.randn(n, classes, generator=g)).argmax(1))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", required=True, help="run directory (checkpoints/ inside)")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--ckpt-every", type=int, default=20, help="also checkpoint every N")
    parser.add_argument("--wandb", metavar="PROJECT", help="also report to this W&B project")
    parser.add_argument("--mlflow", metavar="EXPERIMENT", help="also report to MLflow")
    args = parser.parse_args()

    # [setup]
    info = hpc.init_torch(seed=0)
    hpc.setup_logging(info)
    print(f"rank {info.rank}: pid {os.getpid()}", flush=True)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 10))
    hpc.sync_model(model)
    data = dataset()
    sampler = hpc.ResumableSampler(data, batch_size=args.batch_size, seed=0)
    # generator=: the loader's per-epoch seed does not draw from the global RNG
    loader = DataLoader(data, batch_size=args.batch_size, sampler=sampler, drop_last=True,
                        generator=torch.Generator())
    steps_per_epoch = len(loader)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, args.epochs * steps_per_epoch)
    # [/setup]

    # [restore]
    ckpt = Path(args.out) / "checkpoints"
    states = dict(model=model, optimizer=opt, scheduler=sched, sampler=sampler)
    restored = hpc.restore_checkpoint(ckpt, **states)  # None: a fresh start
    step, start = (restored.step, restored.epoch) if restored else (0, 0)
    # [/restore]

    # [track]
    # One run id for every attempt (kept in --out); trackers open on the master only.
    trackers = hpc.open_trackers(args.out, restored=restored, wandb=args.wandb,
                                 mlflow=args.mlflow, config=vars(args))
    # [/track]

    # [loop]
    for epoch in range(start, args.epochs):
        sampler.set_epoch(epoch)                  # keeps a resumed epoch's skip
        for batch, (x, y) in enumerate(loader, start=sampler.start_batch):
            loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            hpc.sync_gradients(model)
            opt.step()
            sched.step()
            step += 1
            trackers.log(step, {"train/loss": loss.item(), "train/lr": sched.get_last_lr()[0]})
            # where the next step starts: (epoch, batches done) or the next epoch
            at = (epoch, batch + 1) if batch + 1 < steps_per_epoch else (epoch + 1, 0)
            if stop(step) or step % args.ckpt_every == 0:  # stop(): True on all ranks
                path = hpc.save_checkpoint(ckpt, step, **states, epoch=at[0], batch=at[1])
                if stop.stopped:
                    print(f"rank {info.rank}: stopped at step {step}", flush=True)
                    trackers.close("stopped")             # the next attempt reopens it
                    stop.requeue_and_exit(step, path)  # 75 requeued, 0 not Slurm, 1 failed
        logger.info("epoch %d/%d step %d: loss %.4f", epoch + 1, args.epochs, step,
                    loss.item())
    hpc.save_checkpoint(ckpt, step, **states, epoch=args.epochs, batch=0)
    trackers.close("completed")
    print(f"rank {info.rank}: done step {step} digest {digest(model)} run {trackers.run_id}",
          flush=True)
    # [/loop]
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
