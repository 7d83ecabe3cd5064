"""GPU check: the pretrain loop's overhead on one CUDA device (target <= 3%).

Compares, on one GPU, in one process, interleaved ``--repeats`` times:

* ``plain``: the supernet loop with no torch-hpc (``bench/plain_loop.py``): data on the
  GPU, one random architecture per step, SGD, cosine schedule, ``loss.item()``;
* ``hpc``: :func:`hpc.pretrain.pretrain` on the NCCL path: ``hpc.init_torch`` picks
  nccl and binds the GPU, the model is broadcast, and every step runs
  ``hpc.sync_gradients`` and the loop's fused all_reduce (both no-ops at world size 1,
  which is exactly the overhead a single-GPU user pays), with no run directory.

Both report training samples/s (time inside training steps). The overhead is
``1 - median(hpc) / median(plain)``; exit 0 when it is <= ``--target`` (3%), 1 when not,
and 77 (skipped, the automake convention) when no CUDA device is visible. Takes about a
minute::

    srun --gpus=1 --time=5 python bench/gpu_check.py        # or: python bench/gpu_check.py

For NCCL between ranks run the CPU benchmark's launcher on a GPU node instead:
``hpc run --nproc 2 -- python bench/pretrain_throughput.py --worker``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))

EXIT_SKIPPED = 77


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--epochs", type=int, default=4, help="epochs per measurement")
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--target", type=float, default=0.03, help="max overhead (0.03 = 3%%)")
    args = ap.parse_args(argv)

    import torch

    if not torch.cuda.is_available():
        print("gpu_check: SKIPPED: no CUDA device visible (torch.cuda.is_available() is "
              f"False; torch {torch.__version__}, CUDA build {torch.version.cuda}).\n"
              "This check measures the NCCL path on one GPU and cannot run on CPU.\n"
              "HINT: run it on a GPU node, e.g. `srun --gpus=1 python bench/gpu_check.py`.",
              file=sys.stderr)
        return EXIT_SKIPPED

    import hpc
    from hpc.pretrain import PretrainConfig, pretrain
    from plain_loop import plain_loop

    info = hpc.init_torch(seed=0)
    if info.world_size != 1:
        print(f"gpu_check: run it as one process (world size is {info.world_size}).",
              file=sys.stderr)
        return 2
    import torch.distributed as dist

    cfg = PretrainConfig(epochs=args.epochs, batch_size=args.batch_size, width=args.width,
                         out=None, progress=False, val_every=0, val_archs=1,
                         recal_samples=0, setup_logging=False)
    steps = args.epochs * (1437 // args.batch_size)
    dev = str(hpc.device())
    plain_loop(max(5, steps // 4), args.batch_size, args.width, device=dev)  # warm-up
    pretrain(cfg)
    rates: dict[str, list[float]] = {"plain": [], "hpc": []}
    for _ in range(args.repeats):
        rates["plain"].append(plain_loop(steps, args.batch_size, args.width, device=dev))
        rates["hpc"].append(pretrain(cfg).samples_per_s)
    plain, ours = (statistics.median(rates[k]) for k in ("plain", "hpc"))
    overhead = 1.0 - ours / plain
    print(f"device {torch.cuda.get_device_name()} backend {dist.get_backend()}; "
          f"{steps} steps x batch {args.batch_size}, width {args.width}, median of "
          f"{args.repeats}")
    print("| loop | samples/s (median) | runs |")
    print("|---|---:|---|")
    for k, v in rates.items():
        print(f"| {k} | {statistics.median(v):.0f} | {', '.join(f'{x:.0f}' for x in v)} |")
    verdict = "PASS" if overhead <= args.target else "FAIL"
    print(f"overhead {overhead * 100:+.2f}% (target <= {args.target * 100:.0f}%): {verdict}")
    print("GPU_CHECK " + json.dumps({"plain": rates["plain"], "hpc": rates["hpc"],
                                     "overhead": overhead, "verdict": verdict}))
    return 0 if verdict == "PASS" else 1


if __name__ == "__main__":
    sys.exit(main())
