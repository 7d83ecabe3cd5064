"""sync_model / sync_gradients are no-ops without torch.distributed and at world size 1."""

from __future__ import annotations

import sys

import torch
from torch import nn

import hpc


def snapshot(net: nn.Module) -> list[torch.Tensor]:
    return [t.detach().clone() for t in list(net.parameters()) + list(net.buffers())]


def run(label: str) -> str:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 2), nn.Linear(2, 2))
    net[:3](torch.randn(8, 4)).sum().backward()  # the last layer stays unused
    before = snapshot(net)
    grads = [None if p.grad is None else p.grad.clone() for p in net.parameters()]
    hpc.sync_model(net, reduce_parameters=True, reduce_buffers=True)
    hpc.sync_gradients(net)
    if not all(torch.equal(a, b) for a, b in zip(before, snapshot(net))):
        return f"{label}: sync_model changed a tensor"
    for g, p in zip(grads, net.parameters()):
        if (g is None) != (p.grad is None) or (g is not None and not torch.equal(g, p.grad)):
            return f"{label}: sync_gradients changed a gradient"
    return ""


err = run("not initialised")
if not err:
    info = hpc.init_torch(backend="gloo")
    err = run(f"world size {info.world_size}")
print(f"RESULT {'FAIL ' + err if err else 'ok'}", flush=True)
sys.exit(1 if err else 0)
