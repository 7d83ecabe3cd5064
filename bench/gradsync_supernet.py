"""Benchmark: gradient sync of a weight-sharing supernet, ``sync_gradients`` vs DDP.

A ~10M-parameter supernet (8 searchable blocks of 4 candidate ops, stem, head); every
rank draws a different random path every step (a pure function of rank and step), so
the set of parameters with gradients differs between ranks. Modes, each with its own
copy of the model and SGD, interleaved round-robin so that the ratios come from one run
under the same machine load:

* ``nosync``    no communication at all: the compute ceiling;
* ``barrier``   no data moved, but ranks wait for each other every step: the ceiling
  of any synchronous method (the ranks' paths differ in cost, so the slower one sets
  the pace);
* ``ddp``       ``DistributedDataParallel(find_unused_parameters=True)``;
* ``ddp-bf16``  the same with DDP's ``bf16_compress_hook`` (its body: DDP refuses the
  original on gloo);
* ``pertensor`` one ``all_reduce`` per parameter (zeros where unused), the naive fix;
* ``gradsync``  ``hpc.GradSync.sync()`` after ``loss.backward()``;
* ``users``     ``GradSync.sync(users=...)``: every rank computes every rank's path, so
  the agreement round is skipped;
* ``overlap``   ``GradSync.backward(loss, users=...)``: overlapped with backward;
* ``bf16``      ``GradSync(comm_dtype=torch.bfloat16).sync(users=...)`` (not bitwise);
* ``<mode>-tcp`` (``gradsync-tcp``, ``users-tcp``, ...) the same with ``shm=False``:
  through the process group even where all ranks share this host (the GradSync modes
  above use the shared-memory exchange there, the default);
* ``<mode>-direct``, ``<mode>-scatter`` (``users-direct``, ...) the shared-memory
  exchange with its means summed whole by every rank, or reduce-scattered, whatever the
  world size would choose (``hpc.sync._shm.SCATTER_FROM``).

Every mode runs on each process group of ``--groups``, also interleaved: ``hpc``, the
world group ``hpc.init_torch`` created (under ``hpc run``: two gloo connections,
``GLOO_SOCKET_IFNAME=lo,lo``), and ``plain``, a group built the way a plain
``init_process_group`` builds it here (``GLOO_SOCKET_IFNAME=lo``: one connection).

Run (2 ranks, gloo, one table per batch size and group on rank 0)::

    flock /tmp/hpc-heavy.lock hpc run --nproc 2 -- python bench/gradsync_supernet.py

Across nodes (``bench/cluster_sync.sh``: the test cluster's nodes, each link shaped by
``tc``), ``--iface eth0`` also prints the bytes each node sent per step (its interface's
``tx_bytes``, median over the windows, the busiest node), and for the GradSync modes the
minimum of what the mode moves: ``(N-1)/N x (2 x mean bytes + broadcast bytes)`` per node
and step on N nodes, averaged over the nodes (an all-reduce's and a broadcast's lower
bounds; for DDP every gradient is a mean)::

    srun -p four -N2 --ntasks-per-node=2 python bench/gradsync_supernet.py --groups hpc \
        --iface eth0 --modes nosync,ddp,users-tcp,users,overlap,bf16

Options: ``--batches 256,64`` (compute- and communication-bound), ``--steps 20`` timed
steps per window, ``--repeats 5`` windows per mode (median), ``--dim 448``,
``--blocks 8``, ``--profile`` (where one ``sync`` step's time goes, per phase),
``--combine auto,direct,scatter`` (with ``--profile``: profile each way of combining
means through shared memory).
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import nn

import hpc
from hpc.bootstrap.threads import rank_share

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _groups import bf16_hook, describe_group, make_groups


class Supernet(nn.Module):
    """Stem, ``blocks`` searchable blocks of 4 candidate ops, head (~52 dim^2 params)."""

    def __init__(self, dim: int, blocks: int = 8, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Linear(dim, dim)

        def ops() -> nn.ModuleList:
            return nn.ModuleList([
                nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, dim), nn.GELU()),
                nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, 2 * dim), nn.GELU(),
                              nn.Linear(2 * dim, dim)),
                nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, dim // 4), nn.GELU(),
                              nn.Linear(dim // 4, dim)),
                nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, dim // 2), nn.ReLU(),
                              nn.Linear(dim // 2, dim)),
            ])

        self.blocks = nn.ModuleList(ops() for _ in range(blocks))
        self.head = nn.Linear(dim, classes)

    def forward(self, x: torch.Tensor, path: Sequence[int]) -> torch.Tensor:
        x = self.stem(x)
        for block, choice in zip(self.blocks, path):
            x = x + block[choice](x)
        return self.head(x)

    def used(self, path: Sequence[int]) -> list[nn.Parameter]:
        """The parameters ``forward(x, path)`` uses."""
        out = [*self.stem.parameters(), *self.head.parameters()]
        for block, choice in zip(self.blocks, path):
            out += block[choice].parameters()
        return out


def path_of(rank: int, step: int, blocks: int) -> list[int]:
    """Rank ``rank``'s path at ``step``: a pure function, so any rank can compute it."""
    gen = torch.Generator().manual_seed(1_000_003 * step + rank)
    return [int(c) for c in torch.randint(0, 4, (blocks,), generator=gen)]


def _base(mode: str) -> str:
    """``users-tcp`` -> ``users``: the GradSync mode without its transport suffix."""
    for suffix in ("-tcp", "-direct", "-scatter"):
        mode = mode.removesuffix(suffix)
    return mode


def per_tensor(model: nn.Module, group: Any) -> None:
    """The naive fix: one all_reduce per parameter, zeros where unused."""
    ws = dist.get_world_size(group)
    for p in model.parameters():
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        dist.all_reduce(p.grad, group=group)
        p.grad.div_(ws)


class Runner:
    """One mode on one group: its own model copy, optimizer and step function."""

    def __init__(self, mode: str, base: Supernet, group: Any) -> None:
        self.mode, self.group = mode, group
        self.model = copy.deepcopy(base)
        self.net: nn.Module = self.model
        self.opt = torch.optim.SGD(self.model.parameters(), lr=1e-3)
        self.ws = dist.get_world_size(group)
        self.sync: Optional[Callable[[int], None]] = None
        self.scatter: Optional[bool] = None  # force the shm lane's way of combining
        self.backward: Callable[[torch.Tensor, int], None] = lambda loss, k: loss.backward()
        self.wire: list[float] = []  # per window: what an all-reduce/broadcast must move
        self.grad_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        if mode.startswith("ddp"):
            self.net = nn.parallel.DistributedDataParallel(
                self.model, find_unused_parameters=True, process_group=group)
            if mode == "ddp-bf16":
                self.net.register_comm_hook(group, bf16_hook)
        elif _base(mode) in ("gradsync", "users", "overlap", "bf16"):
            shm = False if mode.endswith("-tcp") else None
            if mode.endswith(("-direct", "-scatter")):
                self.scatter = mode.endswith("-scatter")
            mode = _base(mode)
            dtype = torch.bfloat16 if mode == "bf16" else None
            gs = self.gs = hpc.GradSync(self.model, group=group, comm_dtype=dtype, shm=shm)
            if mode == "gradsync":
                self.sync = lambda k: gs.sync()
            elif mode == "overlap":
                self.backward = lambda loss, k: gs.backward(loss, users=self.users(k))
            else:
                self.sync = lambda k: gs.sync(users=self.users(k))
        elif mode == "barrier":
            self.sync = lambda k: dist.barrier(group=group)
        elif mode == "pertensor":
            self.sync = lambda k: per_tensor(self.model, group)

    def users(self, k: int) -> list[list[nn.Parameter]]:
        blocks = len(self.model.blocks)
        return [self.model.used(path_of(r, k, blocks)) for r in range(self.ws)]

    def run(self, batches: list[tuple[torch.Tensor, torch.Tensor]], rank: int,
            start: int, steps: int, iface: str = "") -> tuple[float, int]:
        """Time ``steps`` training steps: (seconds, all ranks done; bytes ``iface``
        sent meanwhile, 0 without ``iface``)."""
        gs = getattr(self, "gs", None)
        lane = getattr(gs, "_lane", None)  # opened by a first sync
        if lane is not None and self.scatter is not None:
            lane.scatter = self.scatter
        tx0 = tx_bytes(iface)  # before the barrier: no rank sends before all read
        dist.barrier(group=self.group)
        t0 = time.perf_counter()
        wire = 0
        for k in range(start, start + steps):
            x, y = batches[k % len(batches)]
            self.opt.zero_grad(set_to_none=True)
            path = path_of(rank, k, len(self.model.blocks))
            self.backward(nn.functional.cross_entropy(self.net(x, path), y), k)
            if self.sync is not None:
                self.sync(k)
            if gs is not None:
                wire += 2 * gs.stats["mean_bytes"] + gs.stats["broadcast_bytes"]
            elif self.mode.startswith("ddp"):  # an all-reduce of every gradient
                wire += 2 * self.grad_bytes // (2 if self.mode == "ddp-bf16" else 1)
            self.opt.step()
        dist.barrier(group=self.group)
        elapsed = time.perf_counter() - t0
        self.wire.append(wire / steps)
        return elapsed, tx_bytes(iface) - tx0


def tx_bytes(iface: str) -> int:
    """Bytes this node's ``iface`` has sent (0 without one). From ``/proc/self/net/dev``,
    which shows this process's network namespace (``/sys/class/net`` shows the one
    sysfs was mounted in: the host's, inside the test cluster's nodes)."""
    if not iface:
        return 0
    with open("/proc/self/net/dev") as f:
        for line in f:
            name, _, counters = line.partition(":")
            if name.strip() == iface:
                return int(counters.split()[8])  # receive has 8 columns, then transmit
    raise SystemExit(f"--iface {iface}: no such interface in /proc/self/net/dev")


def per_node_tx(sent: dict[tuple[str, str], list[int]], steps: int, info: hpc.DistInfo
                ) -> Optional[dict[tuple[str, str], list[float]]]:
    """On rank 0: per mode, each node's median bytes sent per step (read by the node's
    local rank 0); None elsewhere."""
    mine = (os.uname().nodename, info.local_rank, sent)
    every: list[Any] = [None] * info.world_size
    dist.all_gather_object(every, mine)
    if info.rank != 0:
        return None
    nodes = [s for _, local, s in every if local == 0]
    return {key: [statistics.median(s[key]) / steps for s in nodes] for key in sent}


def bench(batch: int, args: argparse.Namespace, info: hpc.DistInfo,
          groups: dict[str, Any]) -> None:
    torch.manual_seed(0)
    base = Supernet(args.dim, args.blocks)
    nparams = sum(p.numel() for p in base.parameters())
    gen = torch.Generator().manual_seed(1 + info.rank)
    batches = [(torch.randn(batch, args.dim, generator=gen),
                torch.randint(0, 10, (batch,), generator=gen)) for _ in range(8)]
    runners = {(g, m): Runner(m, base, groups[g]) for g in groups for m in args.modes}
    for r in runners.values():  # warm up (allocations, DDP's first iteration)
        r.run(batches, info.rank, 0, args.warmup)
        r.wire.clear()
    times: dict[tuple[str, str], list[float]] = {k: [] for k in runners}
    sent: dict[tuple[str, str], list[int]] = {k: [] for k in runners}
    for rep in range(args.repeats):
        for key, r in runners.items():
            start = args.warmup + rep * args.steps
            elapsed, tx = r.run(batches, info.rank, start, args.steps, args.iface)
            times[key].append(elapsed)
            sent[key].append(tx)
    tx_per_node = per_node_tx(sent, args.steps, info) if args.iface else None
    if info.rank != 0:
        return
    for g, group in groups.items():
        rates = {m: args.steps / statistics.median(times[g, m]) for m in args.modes}
        print(f"\nbatch {batch}, {nparams / 1e6:.1f}M params, world size "
              f"{info.world_size}, group {g!r} ({describe_group(group)}), "
              f"{torch.get_num_threads()} thread(s)/rank, {args.repeats}x{args.steps} "
              f"steps, median")
        wire = f" {'MB/node/step':>12} {'vs min':>6}" if tx_per_node else ""
        print(f"{'mode':<10} {'steps/s':>8} {'vs ddp':>7} {'vs nosync':>9}{wire}")
        nodes = info.world_size // info.local_world_size
        for mode in args.modes:
            rel = f"{rates[mode] / rates['ddp']:.2f}" if "ddp" in rates else "-"
            ceil = f"{rates[mode] / rates['nosync']:.2f}" if "nosync" in rates else "-"
            if tx_per_node:
                busiest = max(tx_per_node[g, mode])
                r = runners[g, mode]
                least = (nodes - 1) / nodes * statistics.median(r.wire) if r.wire[-1] else 0
                rel_min = f"{busiest / least:.2f}" if least else "-"
                ceil += f" {busiest / 1e6:12.2f} {rel_min:>6}"
            print(f"{mode:<10} {rates[mode]:8.2f} {rel:>7} {ceil:>9}")
    sys.stdout.flush()


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="256,64")
    ap.add_argument("--dim", type=int, default=448)
    ap.add_argument("--blocks", type=int, default=8)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--modes", default="nosync,barrier,ddp,pertensor,gradsync,users,"
                                       "overlap,users-tcp,ddp-bf16,bf16")
    ap.add_argument("--groups", default="hpc,plain")
    ap.add_argument("--threads", type=int, default=0, help="torch threads per rank")
    ap.add_argument("--iface", default="",
                    help="print the bytes each node sent per step through this interface")
    ap.add_argument("--profile", action="store_true",
                    help="print where a GradSync step's time goes instead")
    ap.add_argument("--combine", default="auto",
                    help="with --profile: auto,direct,scatter (the shm lane's means)")
    args = ap.parse_args(argv)
    args.modes = args.modes.split(",")
    info = hpc.init_torch(backend="gloo")
    threads = args.threads or rank_share(info.local_world_size)
    torch.set_num_threads(threads)
    groups = make_groups(args.groups.split(","))
    for batch in (int(b) for b in args.batches.split(",")):
        if args.profile:
            from _profile_sync import profile
            profile(Supernet(args.dim, args.blocks), batch, args, info, groups,
                    path_of)
        else:
            bench(batch, args, info, groups)
    return 0


if __name__ == "__main__":
    sys.exit(main())
