"""Does DDP's gradient sum depend on its bucket layout? (issue #27 item 5b)

DDP (torch 2.x, ``find_unused_parameters=False``) reduces the first iteration's
gradients in one bucket of every parameter in ``model.parameters()`` order, then
rebuilds its buckets in the order the gradients became ready. A run resumed from a
checkpoint starts again with the first layout at step k+1, where the uninterrupted run
uses the rebuilt one. This script gives DDP the same local gradients twice, once in each
layout, and counts the elements of the averaged gradient that differ::

    hpc run --nproc 4 -- python bench/ddp_bucket_order.py
    hpc run --nproc 2 -- python bench/ddp_bucket_order.py

``--find-unused``: ``DDP(find_unused_parameters=True)``, which never rebuilds: both
iterations reduce in the same layout (docs/preemptible.md's advice). ``--pin``: call the
private ``reducer._push_all_rebuilt_params()`` before the first forward: the rebuild
happens at once, in parameter order, also one layout throughout, but its first bucket
holds the first layer, whose gradient is ready last, so no bucket is reduced before the
backward ends (no overlap); hpc does not do this for you. ``--time N``: then the median
of N timed steps.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import hpc


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--pin", action="store_true")
    parser.add_argument("--find-unused", action="store_true")
    parser.add_argument("--time", type=int, default=0, metavar="N")
    args = parser.parse_args()
    info = hpc.init_torch(seed=0)
    model = nn.Sequential(nn.Conv2d(3, 16, 3), nn.BatchNorm2d(16), nn.ReLU(),
                          nn.Conv2d(16, 16, 3), nn.ReLU(), nn.Flatten(),
                          nn.Linear(16 * 12 * 12, 64), nn.ReLU(), nn.Linear(64, 10))
    net = DDP(model, find_unused_parameters=args.find_unused, broadcast_buffers=False)
    if args.pin:
        net.reducer._push_all_rebuilt_params()
    x = torch.randn(8, 3, 16, 16, generator=torch.Generator().manual_seed(info.rank))
    grads, layouts = [], []
    for _ in range(2):  # same weights, same data: same local gradients
        net.zero_grad(set_to_none=True)
        net(x).square().mean().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        data = net._get_ddp_logging_data()
        layouts.append((data.get("bucket_sizes"), data.get("rebuilt_bucket_sizes"),
                        data.get("rebuilt_per_bucket_param_indices")))
    differ = sum(int((a != b).sum()) for a, b in zip(*grads))
    total = sum(g.numel() for g in grads[0])
    worst = max(float((a - b).abs().max()) for a, b in zip(*grads))
    if info.rank == 0:
        print(f"world {info.world_size} pin={args.pin} find_unused={args.find_unused}: "
              f"layouts {layouts[0]} -> {layouts[1]}")
        print(f"world {info.world_size}: {differ} of {total} averaged gradient elements "
              f"differ between iteration 1 and 2 (max |diff| {worst:.3g})", flush=True)
    times = []
    for _ in range(args.time):
        start = time.perf_counter()
        net.zero_grad(set_to_none=True)
        net(x).square().mean().backward()
        times.append(time.perf_counter() - start)
    if times and info.rank == 0:
        print(f"world {info.world_size}: step {statistics.median(times) * 1e3:.2f} ms "
              f"(median of {len(times)})", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
