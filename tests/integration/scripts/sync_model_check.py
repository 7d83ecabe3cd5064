"""sync_model on every rank-different model: broadcast and the reduce flags.

Each rank seeds differently, so parameters and buffers (BatchNorm running stats and its
int64 ``num_batches_tracked``, a float64 and a bool buffer, a float16 layer) differ.
For every flag combination and four layouts (one bucket beside the in-place large
layer; all packed, which cuts them into at least two buckets; many tiny buckets with
several in flight; most tensors sent alone in place) the originals are all_gathered first and the result is checked:
broadcast -> rank 0's tensors exactly; reduce -> the mean of the originals (floor mean
for integers, rank 0's value for bools); every rank bitwise equal; and every tensor still
on its device. Prints ``RESULT``.

``--src N`` broadcasts from rank N instead of 0. ``--iface eth0`` (across the test
cluster's nodes) then also syncs an 8 MB model once by broadcast and once averaged and
prints, from rank 0, the bytes each node sent through its ``eth0`` meanwhile (``RESULT
bytes``, ``RESULT reduce_bytes``): across nodes a broadcast should leave the source's
node once per other node, not once per rank, and a mean cost each node about what an
all-reduce between the nodes must send.

Usage: sync_model_check.py [--device cuda:0] [--src N] [--iface eth0]
       (default cpu; gloo moves CUDA tensors too)
"""

from __future__ import annotations

import argparse
import os
import sys

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
        self.register_buffer("scale64", torch.randn(5, dtype=torch.float64))
        self.register_buffer("flags", torch.rand(6) > 0.5)


#: (bucket_bytes, direct_bytes): one bucket beside the in-place large layer; all packed
#: (cut into at least two buckets); many tiny buckets; most tensors alone in place.
LAYOUTS = ((25 << 20, 1 << 20), (25 << 20, 1 << 30), (96, 1 << 30), (96, 64))


def build(rank: int, dev: torch.device) -> Net:
    torch.manual_seed(100 + rank)
    net = Net()
    with torch.no_grad():
        net.bn.num_batches_tracked.fill_(3 + 5 * rank)  # floor mean is not trivial
    net.bn(net.conv(torch.randn(4, 3, 6, 6)))  # running stats differ per rank
    return net.to(dev)


def gather(t: torch.Tensor, ws: int) -> list[torch.Tensor]:
    """Every rank's copy of ``t``, on the CPU."""
    src = t.detach().cpu()
    wire = src.to(torch.uint8) if src.dtype == torch.bool else src
    out = [torch.empty_like(wire) for _ in range(ws)]
    dist.all_gather(out, wire.contiguous())
    return [o.to(torch.bool) if src.dtype == torch.bool else o for o in out]


def expected(origs: list[torch.Tensor], mean: bool, src: int) -> torch.Tensor:
    if not mean or origs[0].dtype == torch.bool:
        return origs[src]  # bools come from the source even when averaging
    if origs[0].is_floating_point():
        acc = torch.stack([o.double() for o in origs]).mean(0)
        return acc.to(origs[0].dtype)
    return torch.div(torch.stack(origs).sum(0), len(origs), rounding_mode="floor")


def check(rank: int, ws: int, dev: torch.device, reduce_p: bool, reduce_b: bool,
          bucket: int, direct: int, src: int = 0) -> tuple[str, int]:
    """An error text ('' when fine) and the number of tensors checked."""
    net = build(rank, dev)
    named = [(n, t, reduce_p) for n, t in net.named_parameters()]
    named += [(n, t, reduce_b) for n, t in net.named_buffers()]
    origs = {n: gather(t, ws) for n, t, _ in named}
    if torch.equal(origs["fc.weight"][0], origs["fc.weight"][1]):
        return "setup: ranks started equal, the test would prove nothing", 0
    hpc.sync_model(net, reduce_parameters=reduce_p, reduce_buffers=reduce_b,
                   bucket_bytes=bucket, direct_bytes=direct, src=src)
    checked = 0
    for n, t, mean in named:
        if t.device != dev:
            return f"{n} moved to {t.device}", checked
        now = gather(t, ws)
        if not all(torch.equal(x, now[0]) for x in now):
            return f"{n} differs across ranks", checked
        want = expected(origs[n], mean, src)
        got = now[rank]
        if got.is_floating_point() and mean:
            tol = 1e-3 if got.dtype == torch.float16 else 1e-6
            ok = torch.allclose(got.double(), want.double(), rtol=tol, atol=tol)
        else:
            ok = torch.equal(got, want)
        if not ok:
            return (f"{n} ({got.dtype}) is not the expected "
                    f"{'mean' if mean else 'copy'}"), checked
        checked += 1
    return "", checked


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--src", type=int, default=0)
    ap.add_argument("--iface", default="")
    args = ap.parse_args()
    dev = torch.device(args.device)
    info = hpc.init_torch(backend="gloo")
    checks = 0
    for reduce_p in (False, True):
        for reduce_b in (False, True):
            for bucket, direct in LAYOUTS:
                err, n = check(info.rank, info.world_size, dev, reduce_p, reduce_b,
                               bucket, direct, args.src)
                checks += n
                if err:
                    print(f"RESULT FAIL reduce_parameters={reduce_p} "
                          f"reduce_buffers={reduce_b} bucket_bytes={bucket} "
                          f"direct_bytes={direct}: {err}",
                          flush=True)
                    return 1
    print(f"RESULT ok rank={info.rank} ws={info.world_size} device={dev} checks={checks}",
          flush=True)
    if args.iface:
        node_bytes(info, args.src, args.iface)
    return 0


def tx_bytes(iface: str) -> int:
    """Bytes ``iface`` of this process's network namespace has sent."""
    with open("/proc/self/net/dev") as f:
        for line in f:
            name, _, counters = line.partition(":")
            if name.strip() == iface:
                return int(counters.split()[8])
    raise SystemExit(f"no interface {iface}")


def node_bytes(info: hpc.DistInfo, src: int, iface: str) -> None:
    """One broadcast of an 8 MB model from ``src``; rank 0 prints each node's bytes."""
    torch.manual_seed(info.rank)
    net = nn.Sequential(nn.Linear(1024, 1024), nn.Linear(1024, 1024))
    payload = sum(p.numel() * p.element_size() for p in net.parameters())
    hpc.sync_model(net, src=src)  # the first call gathers the topology
    for what, reduce in (("bytes", False), ("reduce_bytes", True)):
        before = tx_bytes(iface)  # before the barrier: no rank sends before all read
        dist.barrier()
        hpc.sync_model(net, reduce, src=src, check=False)
        dist.barrier()
        sent = tx_bytes(iface) - before
        every: list = [None] * info.world_size
        dist.all_gather_object(every, (os.uname().nodename, info.local_rank, sent))
        if info.rank == 0:
            nodes = {name: b for name, local, b in every if local == 0}
            print(f"RESULT {what} payload={payload} " + " ".join(
                f"{name}={b}" for name, b in sorted(nodes.items())), flush=True)


if __name__ == "__main__":
    sys.exit(main())
