"""sync_gradients vs DDP(find_unused_parameters=True) on a small supernet, same seeds.

Every rank takes a different random path each step (so each rank leaves different
parameters unused) and one module is never used by anyone. Two copies of the model
train side by side: one with ``hpc.sync_gradients``, one wrapped in DDP. After every
step the gradients are compared (values and ``None``-ness), at the end the weights, and
across ranks everything must be bitwise equal. Prints one ``RESULT`` line per rank.

``--users`` passes every rank's used parameters (each rank replays the others' seeded
draws), skipping the agreement round; ``--comm-dtype bfloat16`` sends in bf16 and is
compared with DDP's ``bf16_compress_hook`` (close, not bitwise).

Usage: sync_grads_vs_ddp.py [--match-ddp] [--expect bitwise|close] [--steps N]
                            [--api sync_gradients|backward] [--users]
                            [--comm-dtype bfloat16] [--dtype bfloat16|float16]
"""

from __future__ import annotations

import argparse
import copy
import sys

import torch
import torch.distributed as dist
from torch import nn

import hpc


class Gate(nn.Module):
    """relu(x) * table: an elementwise parameter gradient, full of -0.0 (no reduction)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(16, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x) * self.table


class Supernet(nn.Module):
    """Stem, 4 searchable blocks of 4 candidate ops, head, and one never-used module."""

    def __init__(self, dim: int = 24) -> None:
        super().__init__()
        self.stem = nn.Linear(10, dim)
        self.blocks = nn.ModuleList(
            nn.ModuleList([
                nn.Sequential(nn.Linear(dim, dim), nn.ReLU()),
                nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim)),
                nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, dim, bias=False), nn.Tanh()),
                Gate(dim),
            ]) for _ in range(4))
        self.orphan = nn.Linear(dim, dim)  # used by no rank: grad must stay None
        self.head = nn.Linear(dim, 5)

    def forward(self, x: torch.Tensor, path: list[int]) -> torch.Tensor:
        x = self.stem(x)
        for block, choice in zip(self.blocks, path):
            x = x + block[choice](x)
        return self.head(x)

    def used(self, path: list[int]) -> list[nn.Parameter]:
        """The parameters ``forward(x, path)`` uses."""
        out = [*self.stem.parameters(), *self.head.parameters()]
        for block, choice in zip(self.blocks, path):
            out += block[choice].parameters()
        return out


def bf16_hook(group, bucket):  # type: ignore[no-untyped-def]  # DDP checks annotations
    """DDP's ``bf16_compress_hook``, verbatim in effect (DDP refuses the original on gloo,
    checking for CUDA+NCCL): cast to bf16, divide by the world size, all_reduce, copy back.
    """
    buffer = bucket.buffer()
    compressed = buffer.to(torch.bfloat16).div_(dist.get_world_size())
    fut = dist.all_reduce(compressed, async_op=True).get_future()
    return fut.then(lambda f: buffer.copy_(f.value()[0]))


def draw(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Rank ``rank``'s batch and path at ``step``: any rank can replay any rank's."""
    gen = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(16, 10, generator=gen)
    y = torch.randint(0, 5, (16,), generator=gen)
    # each rank draws its own path: ops used by 0, 1, 2 or 3 ranks all occur
    path = [int(torch.randint(0, 4, (1,), generator=gen)) for _ in range(4)]
    return x, y, path


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality: unlike torch.equal, -0.0 and +0.0 differ."""
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(
        a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--match-ddp", action="store_true")
    ap.add_argument("--expect", choices=("bitwise", "close"), default="bitwise")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--api", choices=("sync_gradients", "backward"), default="sync_gradients",
                    help="backward: GradSync.backward(loss), overlapped with backward")
    ap.add_argument("--users", action="store_true",
                    help="pass every rank's used parameters (no agreement round)")
    ap.add_argument("--comm-dtype", choices=("bfloat16",), default=None)
    ap.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                    default="float32", help="the model's parameters (and inputs)")
    ap.add_argument("--shm", choices=("auto", "on", "off"), default="auto",
                    help="GradSync(shm=None/True/False): the same-host shared-memory lane")
    args = ap.parse_args()
    shm = {"auto": None, "on": True, "off": False}[args.shm]
    comm_dtype = getattr(torch, args.comm_dtype) if args.comm_dtype else None
    torch.set_num_threads(1)
    info = hpc.init_torch(backend="gloo", seed=0)
    ws, rank = info.world_size, info.rank
    dtype = getattr(torch, args.dtype)
    ours = Supernet().to(dtype)
    theirs = copy.deepcopy(ours)
    ddp = nn.parallel.DistributedDataParallel(theirs, find_unused_parameters=True)
    if comm_dtype is not None:
        ddp.register_comm_hook(None, bf16_hook)
    opt_a = torch.optim.SGD(ours.parameters(), lr=0.1, momentum=0.9)
    opt_b = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    names = [n for n, _ in ours.named_parameters()]
    gs = hpc.GradSync(ours, match_ddp=args.match_ddp, overlap_bucket_bytes=2048,
                      comm_dtype=comm_dtype, shm=shm)
    worst = 0.0
    differing = 0
    for step in range(args.steps):
        x, y, path = draw(step, rank)
        x = x.to(dtype)
        users = [ours.used(draw(step, r)[2]) for r in range(ws)] if args.users else None
        for opt in (opt_a, opt_b):
            opt.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(ours(x, path), y)
        if args.api == "backward":
            gs.backward(loss, users=users)
        elif comm_dtype is not None or args.users:
            loss.backward()
            gs.sync(users)
        else:
            loss.backward()
            hpc.sync_gradients(ours, match_ddp=args.match_ddp, shm=shm)
            gs.stats = hpc.sync.grads._CACHE[ours][1].stats
        nn.functional.cross_entropy(ddp(x, path), y).backward()
        for name, a, b in zip(names, ours.parameters(), theirs.parameters()):
            if (a.grad is None) != (b.grad is None):
                print(f"RESULT FAIL step {step} {name}: grad None-ness differs "
                      f"(ours {a.grad is None}, ddp {b.grad is None})", flush=True)
                return 1
            if a.grad is None:
                continue
            if not same_bits(a.grad, b.grad):
                differing += int((a.grad != b.grad).sum())
                worst = max(worst, float((a.grad - b.grad).abs().max()))
                rtol, atol = (2e-2, 1e-3) if comm_dtype is not None else (1e-5, 1e-7)
                if args.expect == "bitwise" or not torch.allclose(a.grad, b.grad,
                                                                  rtol=rtol, atol=atol):
                    print(f"RESULT FAIL step {step} {name}: grads differ, max abs "
                          f"{worst:.3g}", flush=True)
                    return 1
        opt_a.step()
        opt_b.step()
    if ours.orphan.weight.grad is not None:
        print("RESULT FAIL orphan has a gradient", flush=True)
        return 1
    flat = torch.cat([p.detach().reshape(-1) for p in ours.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(ws)]
    dist.all_gather(gathered, flat)
    if not all(same_bits(g, gathered[0]) for g in gathered):
        print("RESULT FAIL weights differ across ranks", flush=True)
        return 1
    same = all(same_bits(a.detach(), b.detach())
               for a, b in zip(ours.parameters(), theirs.parameters()))
    if args.expect == "bitwise" and not same:
        print("RESULT FAIL final weights differ from DDP", flush=True)
        return 1
    sent = sum(p.numel() for p in ours.parameters() if p.grad is not None)
    wire = (gs.stats["broadcast_bytes"] + gs.stats["mean_bytes"]) / sent
    print(f"RESULT ok rank={rank} ws={ws} steps={args.steps} bitwise_vs_ddp={same} "
          f"differing_grad_elements={differing} max_abs={worst:.3g} "
          f"wire_bytes_per_element={wire:.1f} shared_memory={gs.stats['shared_memory']} "
          f"across_nodes={gs.stats['across_nodes']}",
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
