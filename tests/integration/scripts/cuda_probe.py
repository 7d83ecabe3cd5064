"""What ``hpc.init_torch()`` does on a GPU: backend, device, a CUDA all_reduce.

``--mode nccl`` (one rank): default init, then an all_reduce (sync and async) and a
broadcast of CUDA tensors, and ``sync_model``/``sync_gradients`` on a CUDA model (no-ops
at world size 1: weights and grads must be untouched). Prints one ``PROBE {json}`` line.

``--mode shared`` (two ranks, one visible GPU): default init must refuse to put both
ranks on the GPU; reaching the line after it prints ``UNREACHABLE``.

Usage: cuda_probe.py --mode nccl|shared
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.distributed as dist
from torch import nn

import hpc


def _nccl_version() -> str:
    try:
        v = torch.cuda.nccl.version()
    except Exception as e:  # a CPU build
        return f"none ({type(e).__name__})"
    return ".".join(map(str, v)) if isinstance(v, tuple) else str(v)


def probe_nccl() -> int:
    info = hpc.init_torch(seed=0)
    dev = hpc.device()
    x = torch.arange(1.0, 5.0, device=dev) * (info.rank + 1)
    dist.all_reduce(x)
    y = torch.full((1 << 20,), 2.0, device=dev)
    dist.all_reduce(y, async_op=True).wait()
    z = torch.tensor([7], device=dev)
    dist.broadcast(z, 0)
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 2)).to(dev)
    before = [t.detach().clone() for t in model.state_dict().values()]
    hpc.sync_model(model, reduce_parameters=True, reduce_buffers=True)
    unchanged = all(torch.equal(a, b) for a, b in zip(before, model.state_dict().values()))
    model(torch.randn(4, 8, device=dev)).sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    hpc.sync_gradients(model)
    cuda = torch.cuda.is_available()  # False only when smoke-testing this script on CPU
    if cuda:
        torch.cuda.synchronize()
    row = {
        "backend": str(dist.get_backend()), "device": str(dev),
        "current_device": torch.cuda.current_device() if cuda else None,
        "device_count": torch.cuda.device_count(),
        "name": torch.cuda.get_device_name() if cuda else None,
        "world_size": info.world_size,
        "allreduce": x.tolist(), "tensor_device": str(x.device),
        "async_allreduce_ok": bool((y == 2.0 * info.world_size).all()),
        "broadcast": z.item(),
        "weights_unchanged": unchanged,
        "grads_unchanged": all(torch.equal(g, p.grad) for g, p in
                               zip(grads, model.parameters())),
        "param_device": str(next(model.parameters()).device),
        "nccl_version": _nccl_version(),
    }
    print("PROBE " + json.dumps(row), flush=True)
    return 0


def probe_shared() -> int:
    info = hpc.init_torch()
    print(f"UNREACHABLE rank={info.rank} backend={dist.get_backend()} device={hpc.device()}",
          flush=True)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=("nccl", "shared"), required=True)
    args = ap.parse_args()
    return probe_nccl() if args.mode == "nccl" else probe_shared()


if __name__ == "__main__":
    sys.exit(main())
