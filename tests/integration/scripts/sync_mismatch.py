"""Ranks hold different models: sync_model / sync_gradients must fail fast and clearly.

``--what model`` calls ``hpc.sync_model``; ``--what grads`` calls ``hpc.sync_gradients``
after a backward pass; ``--what backward`` calls ``GradSync.backward``. Rank
``ODD_RANK`` (last rank by default) builds its second layer with 17 outputs instead of
16. The ModelMismatchError is not caught: the traceback and non-zero exit are what a
user sees.
"""

from __future__ import annotations

import argparse
import os

import torch
from torch import nn

import hpc

ap = argparse.ArgumentParser()
ap.add_argument("--what", choices=("model", "grads", "backward"), default="model")
args = ap.parse_args()
info = hpc.init_torch(backend="gloo", timeout=600)  # a hang would outlast the test
odd = int(os.environ.get("ODD_RANK", info.world_size - 1))
width = 17 if info.rank == odd else 16
net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, width), nn.Linear(width, 2))
if args.what == "model":
    hpc.sync_model(net)
else:
    loss = net(torch.randn(4, 8)).sum()
    if args.what == "grads":
        loss.backward()
        hpc.sync_gradients(net)
    else:
        hpc.GradSync(net).backward(loss)
print("UNREACHABLE: no error raised", flush=True)
