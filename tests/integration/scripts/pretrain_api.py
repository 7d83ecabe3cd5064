"""Drive :func:`hpc.pretrain.pretrain` through its Python API, as a user script would.

Modes (one per test):

* ``custom``: a user-defined search space (the one in docs/pretrain.md) with check_sync.
* ``stop``: the default supernet; ``--stop-rank`` asks to stop on its ``--stop-at``-th
  step (that rank only: the loop must agree across ranks and checkpoint).
* ``desync``: a supernet whose rank 1 mutates a buffer the loop does not synchronise;
  check_sync must fail the run (shows the identical-weights check can fail).

Rank 0 prints one ``RESULT {json}`` line.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import torch
from torch import nn

import hpc
from hpc.pretrain import PretrainConfig, StopFlag, Supernet, pretrain


# [space]
class MLPSpace(nn.Module):
    """A user search space: one hidden layer whose width is searched."""

    widths = (16, 32, 64)

    def __init__(self, in_features: int = 64, num_classes: int = 10) -> None:
        super().__init__()
        self.hidden = nn.ModuleList(nn.Linear(in_features, w) for w in self.widths)
        self.head = nn.ModuleList(nn.Linear(w, num_classes) for w in self.widths)

    def sample(self, generator: torch.Generator) -> int:
        return int(torch.randint(len(self.widths), (1,), generator=generator))

    def forward(self, x: torch.Tensor, arch: int) -> torch.Tensor:
        return self.head[arch](torch.relu(self.hidden[arch](x.flatten(1))))
# [/space]


class DriftingSupernet(Supernet):
    """Rank 1 bumps a non-BatchNorm buffer each forward: ranks drift apart."""

    def __init__(self) -> None:
        super().__init__(width=16)
        self.register_buffer("drift", torch.zeros(1))

    def forward(self, x: torch.Tensor, arch: Any) -> torch.Tensor:  # type: ignore[override]
        if hpc.get_rank() == 1 and self.training:
            self.drift += 1
        return super().forward(x, arch)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=("custom", "stop", "desync"))
    p.add_argument("--out", required=True)
    p.add_argument("--stop-rank", type=int, default=1)
    p.add_argument("--stop-at", type=int, default=5)
    p.add_argument("--epochs", type=int, default=2)
    args = p.parse_args()
    cfg = PretrainConfig(epochs=args.epochs, batch_size=64, width=16, val_archs=2,
                         recal_samples=128, progress=False, out=args.out,
                         check_sync=args.mode != "stop")
    info = hpc.init_torch(seed=cfg.seed)
    space: Any = None
    stop = None
    if args.mode == "custom":
        space = MLPSpace()
    elif args.mode == "desync":
        space = DriftingSupernet()
    else:
        flag, calls = StopFlag(), [0]

        def stop_requested() -> bool:
            calls[0] += 1
            if info.rank == args.stop_rank and calls[0] >= args.stop_at:
                flag.request()
            return flag()

        stop = stop_requested
    result = pretrain(cfg, space=space, stop_requested=stop)
    if info.rank == 0:
        print("RESULT " + json.dumps(result.to_dict()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
