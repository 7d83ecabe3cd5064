"""A user's own script: ``init_process_group`` itself (no ``hpc.init_torch``), started
with a torch thread per CPU of the host on every rank. ``sync_model`` and
``sync_gradients`` (through shared memory) must give the right values, run their copies
on this rank's share of the host, and leave the script's thread count as it was.

Prints ``RESULT ok <threads before> <threads after>`` per rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

import hpc


def main() -> None:
    dist.init_process_group("gloo")
    rank, ws = dist.get_rank(), dist.get_world_size()
    before = torch.get_num_threads()
    seen = []
    real = torch.set_num_threads

    def counted(n: int) -> None:  # the counts the sync sets, in order
        seen.append(n)
        real(n)

    torch.set_num_threads = counted
    torch.manual_seed(rank)
    # 1 MiB and more goes alone in place; the 600x300 weights are packed (copies).
    model = nn.Sequential(nn.Linear(300, 600), nn.Linear(600, 300), nn.Linear(300, 1000))
    hpc.sync_model(model)
    got = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    every = [torch.empty_like(got) for _ in range(ws)]
    dist.all_gather(every, got)
    assert all(torch.equal(every[0], t) for t in every), "sync_model: ranks differ"
    model(torch.randn(8, 300)).sum().backward()
    hpc.sync_gradients(model)  # cached GradSync: through shared memory on this host
    grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    dist.all_gather(every, grads)
    assert all(torch.equal(every[0], t) for t in every), "sync_gradients: ranks differ"
    after = torch.get_num_threads()
    assert after == before, (before, after)
    assert seen and all(n < before for n in seen[::2]), seen  # capped, then restored
    assert all(n == before for n in seen[1::2]), seen
    print(f"RESULT ok {before} {after} {seen[:2]}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
