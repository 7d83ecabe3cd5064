"""sync_model and sync_gradients on CUDA tensors under gloo (all ranks may share a GPU).

``hpc.init_torch(backend="gloo")`` binds no GPU (``hpc.device()`` is the CPU), so the
models live on ``--device`` (default ``cuda:0``); the checks gather through the CPU.

* ``sync_model``: every rank seeds differently (conv, BatchNorm with its int64
  ``num_batches_tracked``, float16 layer, a bool buffer, a 1.2 MB layer that goes the
  in-place path); for each flag combination and three bucket layouts the result must be
  rank 0's tensors (broadcast) or the mean of the originals (floor mean for integers,
  rank 0's value for bools), bitwise equal on every rank, still on the device.
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


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)
        self.bn = nn.BatchNorm2d(8)
        self.fc = nn.Linear(8, 4)
        self.half = nn.Linear(4, 4).half()
        self.big = nn.Linear(600, 512)  # 1.2 MB of float32: sent alone, in place
        self.register_buffer("flags", torch.rand(6) > 0.5)


def build(rank: int, dev: torch.device) -> Net:
    torch.manual_seed(100 + rank)
    net = Net()
    with torch.no_grad():
        net.bn.num_batches_tracked.fill_(3 + 5 * rank)
    net.bn(net.conv(torch.randn(4, 3, 6, 6)))  # running stats differ per rank
    return net.to(dev)


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


def expected_sync(origs: list[torch.Tensor], mean: bool) -> torch.Tensor:
    if not mean or origs[0].dtype == torch.bool:
        return origs[0]
    if origs[0].is_floating_point():
        return torch.stack([o.double() for o in origs]).mean(0).to(origs[0].dtype)
    return torch.div(torch.stack(origs).sum(0), len(origs), rounding_mode="floor")


def check_sync_model(rank: int, ws: int, dev: torch.device) -> tuple[str, int]:
    checks = 0
    for reduce_p in (False, True):
        for reduce_b in (False, True):
            for bucket, direct in ((4 << 20, 1 << 20), (96, 1 << 30), (96, 64)):
                net = build(rank, dev)
                named = [(n, t, reduce_p) for n, t in net.named_parameters()]
                named += [(n, t, reduce_b) for n, t in net.named_buffers()]
                origs = {n: gather_cpu(t, t.shape, t.dtype, ws) for n, t, _ in named}
                hpc.sync_model(net, reduce_parameters=reduce_p, reduce_buffers=reduce_b,
                               bucket_bytes=bucket, direct_bytes=direct)
                where = (f"reduce_parameters={reduce_p} reduce_buffers={reduce_b} "
                         f"bucket_bytes={bucket} direct_bytes={direct}")
                for n, t, mean in named:
                    if t.device != dev:
                        return f"{where}: {n} moved to {t.device}", checks
                    now = gather_cpu(t, t.shape, t.dtype, ws)
                    if not all(torch.equal(x, now[0]) for x in now):
                        return f"{where}: {n} differs across ranks", checks
                    want, got = expected_sync(origs[n], mean), now[rank]
                    assert got is not None and want is not None
                    if got.is_floating_point() and mean:
                        tol = 1e-3 if got.dtype == torch.float16 else 1e-6
                        ok = torch.allclose(got.double(), want.double(), rtol=tol, atol=tol)
                    else:
                        ok = torch.equal(got, want)
                    if not ok:
                        return (f"{where}: {n} ({got.dtype}) is not the expected "
                                f"{'mean' if mean else 'copy'}"), checks
                    checks += 1
    return "", checks


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
    err, n_model = check_sync_model(rank, ws, dev)
    n_grads = 0
    for api in ("sync_gradients", "backward"):
        if not err:
            err, n = check_grads(rank, ws, dev, api)
            n_grads += n
    if err:
        print(f"RESULT FAIL rank={rank} device={dev}: {err}", flush=True)
        return 1
    print(f"RESULT ok rank={rank} ws={ws} device={dev} backend={dist.get_backend()} "
          f"sync_model_checks={n_model} grad_checks={n_grads}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
