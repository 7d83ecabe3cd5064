"""Helpers of the sync benchmarks: ``hpc run``'s group and a plain one; a bf16 DDP hook.

``hpc run`` exports ``GLOO_SOCKET_IFNAME=lo,lo`` (two gloo connections per pair of
ranks); a script that calls ``init_process_group`` itself on this host gets one (``lo``).
Gloo reads the variable when a group is created, so one run can time both.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

#: ``GLOO_SOCKET_IFNAME`` of the ``plain`` group: what a plain script gets here.
PLAIN_IFNAME = "lo"


def make_groups(names: Sequence[str]) -> dict[str, Any]:
    """``{"hpc": the world group, "plain": a new one-connection group}`` as asked."""
    unknown = sorted(set(names) - {"hpc", "plain"})
    if unknown:
        raise SystemExit(f"unknown group(s) {unknown}; choose from hpc, plain")
    out: dict[str, Any] = {}
    for name in names:
        if name == "hpc":
            out[name] = dist.group.WORLD
            continue
        before = os.environ.get("GLOO_SOCKET_IFNAME")
        os.environ["GLOO_SOCKET_IFNAME"] = PLAIN_IFNAME
        try:
            out[name] = dist.new_group(backend="gloo")
        finally:
            if before is None:
                del os.environ["GLOO_SOCKET_IFNAME"]
            else:
                os.environ["GLOO_SOCKET_IFNAME"] = before
    return out


def describe_group(group: Any) -> str:
    """``gloo, 2 connection(s)``: how many devices gloo made for ``group``."""
    try:
        opts = group._get_backend(torch.device("cpu")).options
        return f"gloo, {len(opts._devices)} connection(s)"
    except (AttributeError, RuntimeError):
        return "gloo"


def bf16_hook(group, bucket):  # type: ignore[no-untyped-def]  # DDP checks annotations
    """DDP's ``bf16_compress_hook`` (cast, divide by the world size, all_reduce, copy
    back); DDP refuses the original unless CUDA and NCCL are there."""
    buffer = bucket.buffer()
    compressed = buffer.to(torch.bfloat16).div_(dist.get_world_size(group))
    fut = dist.all_reduce(compressed, group=group, async_op=True).get_future()
    return fut.then(lambda f: buffer.copy_(f.value()[0]))
