"""A weight-sharing supernet trained without DDP: each rank runs its own sub-network.

Every step, each rank draws one of three candidate blocks from ``(seed, rank, step)``, so
the ranks use *different* parameters. :func:`hpc.sync_gradients` averages what was
used (a block nobody used keeps ``grad=None``; one used by a single rank is broadcast by
it), so all ranks apply the same update and stay bitwise identical::

    hpc run --nproc 2 -- python docs/examples/train_supernet.py

``tests/integration/test_docs_examples.py`` runs it under ``hpc run --nproc 2``.
"""

from __future__ import annotations

import random

import torch
from torch import nn

import hpc


class Supernet(nn.Module):
    """A stem, three candidate blocks (one is chosen per forward) and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(8, 16)
        self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(3))
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor, choice: int) -> torch.Tensor:
        return self.head(torch.relu(self.blocks[choice](torch.relu(self.stem(x)))))


def main() -> int:
    info = hpc.init_torch(seed=0)         # the same seed everywhere: identical init
    model = Supernet().to(hpc.device())
    hpc.sync_model(model)                 # cheap insurance; required if seeds differ
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(info.rank)  # this rank's data
    for step in range(20):
        choice = random.Random(f"0/{info.rank}/{step}").randrange(3)  # this rank's path
        x = torch.randn(16, 8, generator=g).to(hpc.device())
        loss = nn.functional.mse_loss(model(x, choice), x.sum(1, keepdim=True))
        opt.zero_grad(set_to_none=True)
        loss.backward()                   # only this rank's block gets a .grad
        hpc.sync_gradients(model)         # mean over ranks; unused blocks count as zero
        opt.step()
    used = [i for i, b in enumerate(model.blocks) if b.weight.grad is not None]
    total = sum(float(p.detach().double().sum()) for p in model.parameters())
    print(f"rank {info.rank}: last step blocks with grad {used} checksum {total:.10f}",
          flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
