"""Wrong ``users=`` passed to sync_gradients must fail fast with a clear error.

``--case omit``: the last rank's own row leaves out a parameter it has a gradient for
(caught on that rank, before any collective). ``--case differ``: every rank's own row
is right, but the ranks disagree about another rank's row (caught on every rank by the
first call's check). The HPCError is not caught: the traceback and exit are what a
user sees.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

import hpc

ap = argparse.ArgumentParser()
ap.add_argument("--case", choices=("omit", "differ"), default="omit")
args = ap.parse_args()
info = hpc.init_torch(backend="gloo", timeout=600)  # a hang would outlast the test
ws, rank = info.world_size, info.rank
torch.manual_seed(0)
net = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 2))
net(torch.randn(4, 8)).sum().backward()  # every rank uses every parameter
users = [list(net.parameters()) for _ in range(ws)]
if args.case == "omit" and rank == ws - 1:
    users[rank] = users[rank][1:]          # leaves out '0.weight'
if args.case == "differ":
    other = (rank + 1) % ws
    users[other] = users[other][: 2 + rank]  # each rank imagines another rank differently
hpc.sync_gradients(net, users)
print("UNREACHABLE: no error raised", flush=True)
