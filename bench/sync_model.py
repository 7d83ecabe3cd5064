"""Benchmark: ``hpc.sync_model`` bandwidth vs one flat broadcast and per-tensor broadcasts.

Two parameter sets: ResNet-50's (25.6M parameters in 161 tensors plus 159 BatchNorm
buffers, 320 tensors) and a 1M-parameter model of 100 tensors (50 Linear layers). For
each, round-robin in one run, median over ``--repeats``:

* ``flat``       one ``broadcast`` of a preallocated tensor holding the same bytes (the
  transport limit: no packing, one collective);
* ``per-tensor`` one ``broadcast`` per parameter/buffer, in place;
* ``sync_model`` ``hpc.sync_model(model)`` (check, bucket, pack on the master, copy out);
* ``sync_model(no check)`` the same with ``check=False``: the share of the agreement
  check (one ``all_reduce`` round trip), which dominates for small models;
* ``sync_model(reduce)`` ``reduce_parameters=True, reduce_buffers=True`` (all_reduce;
  compare with ``flat allreduce``);
* ``link send`` (with ``--link``, ranks on several nodes): rank 0 sends the same bytes
  to the first rank of another node, nobody else moves anything: what one node's link
  carries (the bound of a broadcast across nodes; the ``vs link`` column).

Run (one table per model on rank 0)::

    flock /tmp/hpc-heavy.lock hpc run --nproc 2 -- python bench/sync_model.py
    flock /tmp/hpc-heavy.lock hpc run --nproc 4 -- python bench/sync_model.py
    flock /tmp/hpc-heavy.lock bench/cluster_sync.sh 1gbit 2 model   # across nodes

Every mode runs on each group of ``--groups`` (interleaved, one table each): ``hpc``,
the world group of ``hpc.init_torch`` (under ``hpc run`` gloo gets two loopback
connections, ``GLOO_SOCKET_IFNAME=lo,lo``), and ``plain``, one connection, as a script
calling ``init_process_group`` itself gets here (``GLOO_SOCKET_IFNAME=lo``). With
``--init plain`` (under ``torchrun``) the script is such a script: no
``hpc.init_torch``, its own ``init_process_group``, timed on that world group::

    flock /tmp/hpc-heavy.lock torchrun --nproc-per-node 2 bench/sync_model.py --init plain
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch import nn

import hpc
from hpc.bootstrap.threads import rank_share

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _groups import describe_group, make_groups


def resnet50_like() -> nn.Module:
    """A module with exactly ResNet-50's parameter and buffer shapes (no forward)."""
    layers: list[nn.Module] = [nn.Conv2d(3, 64, 7, bias=False), nn.BatchNorm2d(64)]
    cin = 64
    for width, blocks in ((64, 3), (128, 4), (256, 6), (512, 3)):
        for b in range(blocks):
            out = width * 4
            layers += [nn.Conv2d(cin, width, 1, bias=False), nn.BatchNorm2d(width),
                       nn.Conv2d(width, width, 3, bias=False), nn.BatchNorm2d(width),
                       nn.Conv2d(width, out, 1, bias=False), nn.BatchNorm2d(out)]
            if b == 0:
                layers += [nn.Conv2d(cin, out, 1, bias=False), nn.BatchNorm2d(out)]
            cin = out
    layers.append(nn.Linear(2048, 1000))
    return nn.Sequential(*layers)


def small_1m() -> nn.Module:
    """~1.0M parameters in 100 tensors (50 Linear 141x141 layers, no buffers)."""
    return nn.Sequential(*[nn.Linear(141, 141) for _ in range(50)])


def timeit(fn: Callable[[], None], group: object) -> float:
    dist.barrier(group=group)
    t0 = time.perf_counter()
    fn()
    dist.barrier(group=group)
    return time.perf_counter() - t0


def _modes(model: nn.Module, group: object, peer: Optional[int]
           ) -> dict[str, Callable[[], None]]:
    """The timed operations on ``group`` (``peer``: the ``link send`` target, if any)."""
    tensors = [p.data for p in model.parameters()] + list(model.buffers())
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    flat = torch.empty(nbytes // 4 + 1, dtype=torch.float32)

    def per_tensor() -> None:
        for t in tensors:
            dist.broadcast(t, 0, group=group)

    def link() -> None:
        rank = dist.get_rank()
        if rank == 0:
            dist.send(flat, peer, group=group)
        elif rank == peer:
            dist.recv(flat, 0, group=group)

    extra = {"link send": link} if peer is not None else {}
    return {**extra,
        "flat broadcast": lambda: dist.broadcast(flat, 0, group=group),
        "per-tensor broadcast": per_tensor,
        "sync_model": lambda: hpc.sync_model(model, group=group),
        "sync_model(no check)": lambda: hpc.sync_model(model, check=False, group=group),
        "flat allreduce": lambda: dist.all_reduce(flat, group=group),
        "sync_model(reduce)": lambda: hpc.sync_model(model, reduce_parameters=True,
                                                     reduce_buffers=True, group=group),
    }


def other_node() -> Optional[int]:
    """The first rank on another host than rank 0's (None: all on one)."""
    hosts: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(hosts, os.uname().nodename)
    return next((r for r, h in enumerate(hosts) if h != hosts[0]), None)


def bench(name: str, model: nn.Module, repeats: int, rank: int, ws: int,
          groups: dict[str, object], peer: Optional[int] = None) -> None:
    tensors = [p.data for p in model.parameters()] + list(model.buffers())
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    modes = {(g, m): fn for g, group in groups.items()
             for m, fn in _modes(model, group, peer).items()}
    for (g, _), fn in modes.items():  # warm up: connections, allocator
        timeit(fn, groups[g])
    times: dict[tuple[str, str], list[float]] = {k: [] for k in modes}
    for _ in range(repeats):
        for (g, m), fn in modes.items():
            times[g, m].append(timeit(fn, groups[g]))
    if rank != 0:
        return
    nparams = sum(p.numel() for p in model.parameters())
    for g, group in groups.items():
        print(f"\n{name}: {nparams / 1e6:.1f}M params, {len(tensors)} tensors, "
              f"{nbytes / 2**20:.1f} MiB, world size {ws}, median of {repeats}, "
              f"group {g!r} ({describe_group(group)})")
        link = statistics.median(times[g, "link send"]) if peer is not None else None
        print(f"{'mode':<22} {'ms':>8} {'GB/s':>6} {'vs flat':>8}"
              + (f" {'vs link':>8}" if link else ""))
        for (gg, mode), ts in times.items():
            if gg != g:
                continue
            t = statistics.median(ts)
            base = statistics.median(times[g, "flat allreduce" if "reduce" in mode
                                           else "flat broadcast"])
            print(f"{mode:<22} {t * 1e3:8.2f} {nbytes / t / 1e9:6.2f} {base / t:8.2f}"
                  + (f" {link / t:8.2f}" if link else ""))
    sys.stdout.flush()


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--models", default="resnet50,small")
    ap.add_argument("--groups", default="hpc,plain")
    ap.add_argument("--link", action="store_true",
                    help="also time one send from rank 0 to another node (the link)")
    ap.add_argument("--init", choices=("hpc", "plain"), default="hpc",
                    help="plain: no hpc.init_torch, the script's own "
                         "init_process_group('gloo') from torchrun's variables, timed on "
                         "that world group (--groups is ignored)")
    args = ap.parse_args(argv)
    if args.init == "plain":  # what a user's own script does (run it under torchrun)
        dist.init_process_group("gloo")
        rank, ws = dist.get_rank(), dist.get_world_size()
        groups = {"plain world": dist.group.WORLD}
    else:
        info = hpc.init_torch(backend="gloo")
        torch.set_num_threads(rank_share(info.local_world_size))
        rank, ws = info.rank, info.world_size
        groups = make_groups(args.groups.split(","))
    torch.manual_seed(rank)  # different weights per rank, as before a real sync
    builders = {"resnet50": ("ResNet-50-like", resnet50_like), "small": ("1M/100", small_1m)}
    peer = other_node() if args.link else None
    for key in args.models.split(","):
        name, build = builders[key]
        bench(name, build(), args.repeats, rank, ws, groups, peer)
    return 0


if __name__ == "__main__":
    sys.exit(main())
