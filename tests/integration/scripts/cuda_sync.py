"""sync_gradients on CUDA tensors under gloo (all ranks may share a GPU).

``sync_model`` on CUDA tensors is checked by ``sync_model_check.py --device cuda:0``.

``hpc.init_torch(backend="gloo")`` binds no GPU (``hpc.device()`` is the CPU), so the
models live on ``--device`` (default ``cuda:0``); the checks gather through the CPU.

* ``sync_gradients`` and ``GradSync.backward``: same weights, per-rank data and a
  per-rank branch (one branch shared, one used by nobody); after each step every grad
  must equal the mean of the ranks' local grads recomputed on the CPU (zeros for ranks
  that did not use it), ``None`` where nobody used it, on the device, equal on all ranks.

Prints one ``RESULT ok ...`` or ``RESULT FAIL ...`` line per rank.

Usage: cuda_sync.py [--device cuda:0]   (``--device cpu`` smoke-tests it without a GPU)
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

import hpc


def gather_cpu(t: Optional[torch.Tensor], shape: torch.Size, dtype: torch.dtype,
               ws: int) -> list[Optional[torch.Tensor]]:
    """Every rank's copy of ``t`` on the CPU (``None`` stays ``None``), via gloo on CPU."""
    wire_dtype = torch.uint8 if dtype == torch.bool else dtype
    has = torch.tensor([0 if t is None else 1], dtype=torch.uint8)
    mine = torch.zeros(shape, dtype=wire_dtype) if t is None else t.detach().cpu().to(wire_dtype)
    flags = [torch.empty_like(has) for _ in range(ws)]
    outs = [torch.empty_like(mine) for _ in range(ws)]
    dist.all_gather(flags, has)
    dist.all_gather(outs, mine.contiguous())
    return [o.to(dtype) if f.item() else None for f, o in zip(flags, outs)]


class Branchy(nn.Module):
    """stem -> own branch (per rank) + shared branch -> head; ``orphan`` is never used."""

    def __init__(self, ws: int) -> None:
        super().__init__()
        self.stem = nn.Linear(10, 16)
        self.own = nn.ModuleList(nn.Linear(16, 16) for _ in range(ws))
        self.shared = nn.Linear(16, 16)
        self.orphan = nn.Linear(16, 16)
        self.head = nn.Linear(16, 5)

    def forward(self, x: torch.Tensor, rank: int) -> torch.Tensor:
        x = torch.relu(self.stem(x))
        return self.head(x + self.own[rank](x) + self.shared(x))


def check_grads(rank: int, ws: int, dev: torch.device, api: str) -> tuple[str, int]:
    torch.manual_seed(0)
    net = Branchy(ws).to(dev)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    gs = hpc.GradSync(net, overlap_bucket_bytes=2048)
    names = [n for n, _ in net.named_parameters()]
    checks = 0
    for step in range(3):
        gen = torch.Generator().manual_seed(1000 * step + rank)
        x = torch.randn(8, 10, generator=gen).to(dev)
        y = torch.randint(0, 5, (8,), generator=gen).to(dev)
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(net(x, rank), y)
        if api == "backward":
            # the local grads are needed first: run backward on a copy of the graph
            loss.backward(retain_graph=True)
            local = {n: gather_cpu(p.grad, p.shape, p.dtype, ws)
                     for n, p in net.named_parameters()}
            opt.zero_grad(set_to_none=True)
            gs.backward(loss)
        else:
            loss.backward()
            local = {n: gather_cpu(p.grad, p.shape, p.dtype, ws)
                     for n, p in net.named_parameters()}
            hpc.sync_gradients(net)
        for n, p in zip(names, net.parameters()):
            used = [g for g in local[n] if g is not None]
            where = f"api={api} step {step} {n}"
            if not used:
                if p.grad is not None:
                    return f"{where}: nobody used it but it has a grad", checks
                continue
            if p.grad is None:
                return f"{where}: grad is None after the sync", checks
            if p.grad.device != p.device:
                return f"{where}: grad on {p.grad.device}, parameter on {p.device}", checks
            want = sum((g * (1.0 / ws) for g in used), torch.zeros_like(used[0]))
            now = gather_cpu(p.grad, p.shape, p.dtype, ws)
            if not all(torch.equal(g, now[0]) for g in now):  # type: ignore[arg-type]
                return f"{where}: grads differ across ranks", checks
            got = now[rank]
            assert got is not None
            if not torch.allclose(got, want, rtol=1e-6, atol=1e-7):
                return (f"{where}: grad is not the mean of the ranks' grads (max abs diff "
                        f"{float((got - want).abs().max()):.3g})"), checks
            checks += 1
        opt.step()
    gs.close()
    return "", checks


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda:0")
    args = ap.parse_args()
    torch.set_num_threads(1)
    info = hpc.init_torch(backend="gloo")
    dev = torch.device(args.device)
    ws, rank = info.world_size, info.rank
    err, n_grads = "", 0
    for api in ("sync_gradients", "backward"):
        if not err:
            err, n = check_grads(rank, ws, dev, api)
            n_grads += n
    if err:
        print(f"RESULT FAIL rank={rank} device={dev}: {err}", flush=True)
        return 1
    print(f"RESULT ok rank={rank} ws={ws} device={dev} backend={dist.get_backend()} "
          f"grad_checks={n_grads}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
