"""The smallest complete torch-hpc training script: every step a user script needs.

The same file runs under every launcher, unchanged::

    hpc run --nproc 2 -- python docs/examples/train_minimal.py --out runs/minimal
    torchrun --nproc-per-node 2 docs/examples/train_minimal.py
    srun -N2 --ntasks-per-node=2 python docs/examples/train_minimal.py
    mpirun -np 4 python docs/examples/train_minimal.py

``tests/integration/test_docs_examples.py`` runs it under ``hpc run --nproc 2``.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import hpc

logger = logging.getLogger("train_minimal")


def digest(model: nn.Module) -> str:
    """A short hash of all weights: equal on every rank when the ranks are in sync."""
    h = hashlib.sha256()
    for t in model.state_dict().values():
        h.update(t.detach().cpu().numpy().tobytes())
    return h.hexdigest()[:12]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--out", default=None, help="directory for the model (master only)")
    args = parser.parse_args()

    # [init]
    info = hpc.init_torch()       # detect the launcher, bind the GPU, init torch.distributed
    hpc.setup_logging(info)       # INFO on local masters, WARNING+ on the other ranks
    dev = hpc.device()            # cuda:<local rank> under nccl, else cpu
    # [/init]

    # [model]
    torch.manual_seed(1000 + info.rank)  # a per-rank stream (dropout, augmentation...)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1)).to(dev)
    before = digest(model)               # differs between ranks: different random init
    hpc.sync_model(model)                # broadcast the master's weights to every rank
    print(f"rank {info.rank}: init {before} -> synced {digest(model)}", flush=True)
    # [/model]

    # [data]
    g = torch.Generator().manual_seed(0)  # the same dataset on every rank
    x = torch.randn(512, 8, generator=g)
    data = TensorDataset(x, x.sum(1, keepdim=True))
    sampler = DistributedSampler(data, num_replicas=info.world_size, rank=info.rank,
                                 shuffle=True, seed=0)  # a disjoint shard per rank
    loader = DataLoader(data, batch_size=32, sampler=sampler)
    # [/data]

    # [loop]
    opt = torch.optim.SGD(model.parameters(), lr=0.02)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)          # a new shuffle each epoch, the same on all ranks
        for xb, yb in loader:
            loss = nn.functional.mse_loss(model(xb.to(dev)), yb.to(dev))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            hpc.sync_gradients(model)     # average .grad over ranks, as DDP would
            opt.step()
        logger.info("epoch %d: loss %.4f", epoch, loss.item())  # once per node
    # [/loop]

    # [io]
    print(f"rank {info.rank}: final {digest(model)}", flush=True)  # equal on all ranks
    if hpc.is_master() and args.out:      # one writer: no clobbered files
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        torch.save(model.state_dict(), out / "model.pt")
        logger.info("saved %s", out / "model.pt")
    hpc.barrier()                         # nobody exits while the master still writes
    # [/io]
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
