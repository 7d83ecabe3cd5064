"""What ``hpc check`` times: GEMM, memory copy, GPU visibility, and all_reduce.

Every timing is bounded by a budget in seconds, not a fixed count: one warm-up run, then
as many runs as fit in the budget (at least one). On CUDA the timed region is bracketed
by CUDA events on the current stream and read after ``torch.cuda.synchronize()``, so
asynchronous launches are not mistaken for finished work; on the CPU ``perf_counter``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

__all__ = ["gpu_visibility", "time_all_reduce", "time_copy", "time_gemm", "timed"]

#: The variables that decide which GPUs a process sees (NVIDIA, AMD).
VISIBLE = ("CUDA_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES")


def timed(fn: Callable[[], Any], device: Any, budget: float, max_iters: int = 10000) -> float:
    """Seconds per call of ``fn`` on ``device``: warm up once, then double the count of
    calls until one batch lasts ``budget`` seconds (or ``max_iters`` calls)."""
    import torch

    cuda = getattr(device, "type", str(device)) == "cuda"

    def batch(k: int) -> float:
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize(device)
            start.record()
            for _ in range(k):
                fn()
            end.record()
            torch.cuda.synchronize(device)
            return start.elapsed_time(end) / 1000.0
        t0 = time.perf_counter()
        for _ in range(k):
            fn()
        return time.perf_counter() - t0

    first = batch(1)  # warm-up: allocations, kernel selection, thread pools
    k = max(1, min(max_iters, int(budget / max(first, 1e-9))))
    while True:
        elapsed = batch(k)
        if elapsed >= budget / 2 or k >= max_iters:
            return elapsed / k
        k = min(max_iters, k * 2)


def time_gemm(n: int, dtype: Any, device: Any, budget: float) -> float:
    """GEMM throughput in FLOP/s of ``n x n @ n x n`` (``2 n^3`` FLOP per product)."""
    import torch

    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    out = torch.empty(n, n, device=device, dtype=dtype)
    seconds = timed(lambda: torch.mm(a, b, out=out), device, budget)
    return 2.0 * n ** 3 / seconds


def time_copy(nbytes: int, device: Any, budget: float) -> float:
    """Memory bandwidth in bytes/s of ``dst.copy_(src)``: ``2 x nbytes`` moved per copy
    (read + write, STREAM's "copy" convention)."""
    import torch

    n = max(1, nbytes // 4)
    src = torch.ones(n, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    seconds = timed(lambda: dst.copy_(src), device, budget)
    return 2.0 * n * 4 / seconds


def gpu_visibility(device: Any, environ: dict[str, str] | None = None) -> dict[str, Any]:
    """What this rank sees: the visibility variables set, torch's GPU count, the CUDA
    build, and the name and UUID of the GPU it uses (``None`` on the CPU)."""
    import torch

    env = os.environ if environ is None else environ
    row: dict[str, Any] = {k: env[k] for k in VISIBLE if k in env}
    row["torch_cuda"] = torch.version.cuda or getattr(torch.version, "hip", None)
    try:
        row["gpus"] = torch.cuda.device_count()
    except RuntimeError:  # a broken driver: report zero rather than fail the check
        row["gpus"] = 0
    row["gpu_name"] = row["gpu_uuid"] = None
    if getattr(device, "type", None) == "cuda":
        props = torch.cuda.get_device_properties(device)
        row["gpu_name"] = props.name
        row["gpu_uuid"] = str(getattr(props, "uuid", "")) or None
    return row


def time_all_reduce(nbytes: int, device: Any, budget: float, group: Any = None,
                    max_iters: int = 1000, per_op: bool = False) -> float:
    """Seconds per ``all_reduce`` of ``nbytes`` over ``group``, the same on every member.

    Warm up once (NCCL builds its communicator here), agree on the count of timed runs
    from the slowest member's warm-up (every member must run the same number), time them,
    and return the slowest member's figure: a collective ends when its last rank is done.
    NCCL runs on its own stream, so the timed region is closed by ``synchronize()``.

    Args:
        nbytes: Message size.
        device: Where the tensor lives (CUDA: NCCL, CPU: gloo).
        budget: Seconds the timed runs should take together.
        group: Process group (default: the world).
        max_iters: Upper bound on the timed runs.
        per_op: Time each run and take the median (latency: robust to one scheduling
            hiccup) instead of the mean of one timed batch (bandwidth, as nccl-tests).
    """
    import statistics

    import torch
    import torch.distributed as dist

    data = torch.zeros(max(1, nbytes // 4), dtype=torch.float32, device=device)
    cuda = device.type == "cuda"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    def agree(x: float) -> float:
        t = torch.tensor([x], dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        return float(t.item())

    def run(k: int) -> float:
        sync()
        t0 = time.perf_counter()
        for _ in range(k):
            dist.all_reduce(data, group=group)
        sync()
        return time.perf_counter() - t0

    warm = agree(run(1))
    iters = max(1, min(max_iters, int(budget / max(warm, 1e-9))))
    if per_op:
        return agree(statistics.median(run(1) for _ in range(iters)))
    return agree(run(iters) / iters)
