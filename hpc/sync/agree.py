"""The small collectives by which ranks agree: all true, any true, a maximum, one object.

Every room needs a few of them (the agreed stop, the checkpoint the master chose, the
requeue outcome, "did every rank load it", the shared-memory lane's opening); they live
here once, public, instead of a private copy per room. Each is collective (call it on
every rank of ``group`` in the same order) and is the identity without a process group
or at world size 1, so the same code runs in a plain ``python train.py``.

The integer reductions go through the sync's own element-wise MAX (two-rank groups on
gloo swap their values with ``isend``/``irecv``, which skips gloo's worker hand-off; the
watchdog counts it as one collective) on :func:`~hpc.sync._collective.comm_device`: the CPU where the backend
moves CPU tensors, else the current CUDA device.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

import torch
import torch.distributed as dist

from hpc.sync._collective import comm_device, same_on_all_ranks, start_max

__all__ = ["all_true", "any_true", "broadcast_object", "comm_device", "gather_objects",
           "gather_ints", "gather_rows", "max_ints", "same_on_all_ranks", "world"]


def world(group: Optional[Any] = None) -> tuple[int, int]:
    """``(rank, world size)`` in ``group``; ``(0, 1)`` without a process group."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(group), dist.get_world_size(group)
    return 0, 1


def max_ints(values: Sequence[int], group: Optional[Any] = None) -> list[int]:
    """The element-wise maximum of every rank's ``values`` (same length on all ranks).

    Also a barrier: it returns on a rank only once every rank has contributed.
    """
    if world(group)[1] == 1:
        return [int(v) for v in values]
    t = torch.tensor(list(values), dtype=torch.int64, device=comm_device(group))
    return [int(v) for v in start_max(t, group).wait().tolist()]


def gather_rows(row: Sequence[float], group: Optional[Any] = None) -> list[list[float]]:
    """Every rank's ``row`` of floats (same length on all ranks), in rank order, on every
    rank: one ``all_gather`` of float64."""
    return [[float(v) for v in r] for r in _gather(list(row), torch.float64, group)]


def gather_ints(values: Sequence[int], group: Optional[Any] = None) -> list[list[int]]:
    """Every rank's ``values`` (int64, same length on all ranks), in rank order."""
    return [[int(v) for v in r] for r in _gather(list(values), torch.int64, group)]


def _gather(values: list[Any], dtype: torch.dtype, group: Optional[Any]) -> list[list[Any]]:
    _, size = world(group)
    if size == 1:
        return [values]
    dev = comm_device(group)
    mine = torch.tensor(values, dtype=dtype, device=dev)
    out = torch.empty(size * len(values), dtype=dtype, device=dev)
    # looked up per call, so the watchdog's tracker (installed later) sees it
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, mine, group=group)
    return out.view(size, len(values)).tolist()


def all_true(ok: bool, group: Optional[Any] = None) -> bool:
    """True on every rank when ``ok`` is true on every rank."""
    return max_ints([0 if ok else 1], group)[0] == 0


def any_true(flag: bool, group: Optional[Any] = None) -> bool:
    """True on every rank when ``flag`` is true on at least one rank."""
    return max_ints([1 if flag else 0], group)[0] == 1


def broadcast_object(obj: Any, src: int = 0, group: Optional[Any] = None) -> Any:
    """``obj`` of global rank ``src`` on every rank (pickled; small objects only)."""
    if world(group)[1] == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def gather_objects(obj: Any, group: Optional[Any] = None) -> list[Any]:
    """Every rank's ``obj``, in rank order, on every rank (pickled; small objects only)."""
    _, size = world(group)
    if size == 1:
        return [obj]
    out: list[Any] = [None] * size
    dist.all_gather_object(out, obj, group=group)
    return out
