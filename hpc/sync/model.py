"""``sync_model``: make every rank's parameters and buffers equal, in buckets.

With both flags off every rank receives the master's (rank 0) tensors; with
``reduce_parameters`` / ``reduce_buffers`` that group is averaged across ranks instead.

How (see ``docs/sync.md``):

* a contiguous tensor of at least ``direct_bytes`` (1 MiB) is sent alone, in place:
  no packing and no copy-out (ResNet-50: 29 tensors hold 93% of the bytes);
* the other tensors are grouped by (device, wire dtype, operation) and packed into flat
  buckets of about ``bucket_bytes`` (4 MiB), or into at least two smaller ones when
  there is no large tensor to overlap with; one collective per bucket;
* for a broadcast only the master packs; other ranks receive into a small pool of
  reusable buffers and copy out; up to ``max_in_flight`` buckets are in flight
  (``async_op=True``) so packing, the transfer and unpacking overlap;
* integer tensors (BatchNorm's ``num_batches_tracked``) are averaged with floor division
  of the int64 sum (``sum // world_size``); bool tensors are always broadcast from the
  master (there is no mean of booleans); float16/bfloat16 are averaged in float32;
* CPU tensors under nccl are staged through the current CUDA device;
* the CPU copies run on at most this rank's share of the host's cores
  (:mod:`hpc.sync._threads`: a rank with a thread per core, in a script started without
  ``OMP_NUM_THREADS``, spun on the cores its peers needed);
* across hosts with the same number of ranks (2+) on each, CPU buckets go node by node
  (:mod:`hpc.sync._nodes`): a broadcast crosses to each other node once, then spreads
  inside it; a mean is summed inside each node, across nodes by slices, and shared;
* before anything moves, one ``all_reduce`` of a hash checks that every rank holds the
  same tensor list; a mismatch raises :class:`~hpc.errors.ModelMismatchError` on every
  rank naming the first differing tensor, never a hang;
* nothing happens when torch.distributed is not initialised or has one rank.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import torch
import torch.distributed as dist

from hpc.sync._collective import (
    MODEL_BUCKET_BYTES,
    BucketKind,
    active_world,
    comm_device,
    finish_check,
    start_bucket,
    start_check,
)
from hpc.sync._nodes import NodeBroadcast, NodeReduce, node_collectives, ranks_on_node
from hpc.sync._threads import share_of_host

__all__ = ["sync_model"]

logger = logging.getLogger(__name__)

#: Packed buckets in flight at once (memory held: this many buckets).
DEFAULT_IN_FLIGHT = 6

#: Tensors this large skip the bucket: one in-place collective each, no copies.
DEFAULT_DIRECT_BYTES = 1024 * 1024

#: Without large tensors, cut the packed bytes into at least this many buckets. The
#: 1M-parameter benchmark model, ws 2, gloo on two loopback lanes, four runs of 31
#: (ratio to a flat broadcast): 1 bucket 0.36-0.45, 2: 0.46-0.56, 4: 0.42-0.53,
#: 8: 0.27-0.34 (per-collective latency wins).
_MIN_PIPELINE = 2
#: ...but no bucket smaller than this (per-collective latency dominates below).
_MIN_BUCKET_BYTES = 256 * 1024

_LOW_PRECISION = (torch.float16, torch.bfloat16)


@dataclass
class _Bucket:
    kind: BucketKind             # "broadcast" (from ``src``) or "mean"
    device: torch.device         # where the flat buffer lives
    wire: torch.dtype            # dtype of the flat buffer
    tensors: list[torch.Tensor] = field(default_factory=list)
    numel: int = 0
    direct: bool = False         # one large tensor sent in place: no pack, no copy-out


def _wire(t: torch.Tensor, kind: BucketKind) -> tuple[BucketKind, torch.dtype]:
    """(kind, dtype on the wire) for tensor ``t`` under the requested ``kind``."""
    if t.dtype == torch.bool:
        return "broadcast", torch.uint8
    if kind == "mean":
        if not t.is_floating_point() and not t.is_complex():
            return "mean", torch.int64
        if t.dtype in _LOW_PRECISION:
            return "mean", torch.float32
    return kind, t.dtype


def _buckets(tensors: Sequence[tuple[torch.Tensor, BucketKind]], group: Optional[Any],
             bucket_bytes: int, direct_bytes: int) -> list[_Bucket]:
    """Large contiguous tensors alone (in place), the rest packed by (device, dtype, kind).

    With no large tensor to keep the link busy, the packed bytes are cut into at least
    ``_MIN_PIPELINE`` buckets (not below ``_MIN_BUCKET_BYTES``) so packing,
    the transfer and copying out overlap.
    """
    done: list[_Bucket] = []
    small: list[tuple[torch.Tensor, BucketKind, torch.device, torch.dtype, int]] = []
    devices: dict[torch.device, torch.device] = {}
    for t, requested in tensors:
        if t.is_sparse or t.numel() == 0:
            continue
        kind, wire = _wire(t, requested)
        dev = devices.get(t.device)
        if dev is None:
            dev = devices[t.device] = comm_device(group, t.device)
        nbytes = t.numel() * wire.itemsize
        if (nbytes >= direct_bytes and wire == t.dtype and dev == t.device
                and t.is_contiguous()):
            done.append(_Bucket(kind, dev, wire, [t], t.numel(), direct=True))
        else:
            small.append((t, kind, dev, wire, nbytes))
    if not done:
        total = sum(s[-1] for s in small)
        bucket_bytes = min(bucket_bytes, max(_MIN_BUCKET_BYTES, total // _MIN_PIPELINE))
    open_: dict[tuple[Any, ...], _Bucket] = {}
    for t, kind, dev, wire, nbytes in small:
        key = (kind, dev, wire)
        b = open_.get(key)
        if b is not None and b.numel * wire.itemsize + nbytes > bucket_bytes:
            done.append(b)
            b = None
        if b is None:
            b = open_[key] = _Bucket(kind, dev, wire)
        b.tensors.append(t)
        b.numel += t.numel()
    done.extend(open_.values())
    return done


class _Pool:
    """Reusable flat buffers, one free list per (device, dtype)."""

    def __init__(self) -> None:
        self.free: dict[tuple[Any, ...], list[torch.Tensor]] = {}

    def take(self, device: torch.device, dtype: torch.dtype, numel: int) -> torch.Tensor:
        bufs = self.free.setdefault((device, dtype), [])
        for i, buf in enumerate(bufs):
            if buf.numel() >= numel:
                return bufs.pop(i)[:numel]
        return torch.empty(numel, dtype=dtype, device=device)

    def give(self, buf: torch.Tensor) -> None:
        base = buf if buf._base is None else buf._base
        self.free.setdefault((buf.device, buf.dtype), []).append(base)


def _copy_all(dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor]) -> None:
    """``d.copy_(s)`` for each pair, in one C++ call where torch has ``_foreach_copy_``
    (2.1+; it falls back to per-tensor copies across devices or dtypes by itself)."""
    foreach = getattr(torch, "_foreach_copy_", None)
    if foreach is not None:
        foreach(list(dst), list(src))
        return
    for d, s in zip(dst, src):
        d.copy_(s)


def _pack(b: _Bucket, flat: torch.Tensor) -> None:
    # Two C++ calls instead of a Python loop over the tensors (ResNet-50's 291 small
    # tensors: ~4 ms of per-tensor slicing and copy_ calls on a 2-core host).
    _copy_all(torch._C._nn.unflatten_dense_tensors(flat, b.tensors), b.tensors)


def _unpack(b: _Bucket, flat: torch.Tensor) -> None:
    _copy_all(b.tensors, torch._C._nn.unflatten_dense_tensors(flat, b.tensors))


def _finish(b: _Bucket, flat: torch.Tensor, rank: int, src: int, ws: int) -> None:
    if b.kind == "mean":
        if b.wire.is_floating_point or b.wire.is_complex:
            flat.div_(ws)
        else:
            flat.div_(ws, rounding_mode="floor")
        if not b.direct:
            _unpack(b, flat)
    elif rank != src and not b.direct:
        _unpack(b, flat)


@torch.no_grad()
def sync_model(module: torch.nn.Module, reduce_parameters: bool = False,
               reduce_buffers: bool = False, *, src: int = 0,
               bucket_bytes: int = MODEL_BUCKET_BYTES,
               max_in_flight: int = DEFAULT_IN_FLIGHT,
               direct_bytes: int = DEFAULT_DIRECT_BYTES, group: Optional[Any] = None,
               check: bool = True) -> None:
    """Make ``module``'s parameters and buffers equal on every rank, in place.

    Collective: every rank must call it with the same flags.

    Args:
        module: The model; its ``named_parameters()`` and ``named_buffers()`` are synced.
        reduce_parameters: Average parameters across ranks instead of taking the
            master's.
        reduce_buffers: Average buffers across ranks (BatchNorm running stats) instead of
            taking the master's. Integer buffers get the floor of the mean, bool
            buffers always come from the master.
        src: Rank whose tensors are broadcast (default 0, the master).
        bucket_bytes: Target size of one flat bucket of small tensors (default 4 MiB).
        max_in_flight: Packed buckets in flight at once.
        direct_bytes: Contiguous tensors at least this large are sent in place, without
            packing or copying out.
        group: Process group (default: the world).
        check: Verify first that every rank holds the same tensor list.

    Raises:
        ModelMismatchError: Ranks hold different parameter/buffer lists (names,
            shapes or dtypes); raised on every rank, naming the first difference.
    """
    ws = active_world(group)
    if not ws:
        return
    params = list(module.named_parameters())
    buffers = list(module.named_buffers())
    pending_check = start_check(params + buffers, group) if check else None
    # While the check travels: what to send, and how.
    work = _requests(params, buffers, reduce_parameters, reduce_buffers)
    plan = _buckets(work, group, bucket_bytes, direct_bytes)
    finish_check(pending_check, "sync_model", group)
    _run(plan, group, src, ws, max_in_flight)


def _requests(params: Sequence[tuple[str, torch.Tensor]],
              buffers: Sequence[tuple[str, torch.Tensor]], reduce_parameters: bool,
              reduce_buffers: bool) -> list[tuple[torch.Tensor, BucketKind]]:
    """Every tensor to sync, with the kind its flag asks for (``_wire`` may overrule)."""
    param_kind: BucketKind = "mean" if reduce_parameters else "broadcast"
    buffer_kind: BucketKind = "mean" if reduce_buffers else "broadcast"
    work = [(p.data, param_kind) for _, p in params]
    work += [(b, buffer_kind) for _, b in buffers]
    return work


_InFlight = tuple[_Bucket, torch.Tensor, Any]  # bucket, its flat buffer, the Work


def _run(plan: Sequence[_Bucket], group: Optional[Any], src: int, ws: int,
         max_in_flight: int) -> None:
    """Issue every bucket's collective, keeping at most ``max_in_flight`` packed ones
    in flight (direct buckets hold no buffer and do not count), and finish them all."""
    rank = dist.get_rank(group)
    global_src = dist.get_global_rank(group, src) if group is not None else src
    staged: dict[str, Any] = {}
    local_ranks = 1  # CUDA copies do not use the CPU threads
    if any(b.device.type == "cpu" for b in plan):  # across nodes: node by node
        staged = dict(zip(("broadcast", "mean"), node_collectives(group, src)))
        local_ranks = ranks_on_node(group)
    pool = _Pool()
    pending: deque[_InFlight] = deque()
    direct: list[_InFlight] = []
    with share_of_host(local_ranks):
        for seq, b in enumerate(plan):
            started = _start(b, pool, rank == src, global_src, group, seq,
                             _nodes(b, staged))
            if b.direct:  # no buffer held: no need to wait before issuing more
                direct.append(started)
                continue
            pending.append(started)
            while len(pending) >= max(1, max_in_flight):
                _land(pending.popleft(), pool, rank, src, ws, staged)
        for started in [*pending, *direct]:
            _land(started, pool, rank, src, ws, staged)


def _nodes(b: _Bucket, staged: dict[str, Any]
           ) -> Optional[Union[NodeBroadcast, NodeReduce]]:
    """The node-by-node way of ``b``'s collective, if the group spans nodes so."""
    return staged.get(b.kind) if b.device.type == "cpu" else None


def _start(b: _Bucket, pool: _Pool, is_src: bool, global_src: int,
           group: Optional[Any], seq: int,
           nodes: Optional[Union[NodeBroadcast, NodeReduce]]) -> _InFlight:
    """Pack ``b`` where this rank contributes, then issue its collective (``nodes``:
    its first stage, when it goes node by node)."""
    if b.direct:
        flat = b.tensors[0]
    else:
        flat = pool.take(b.device, b.wire, b.numel)
        if b.kind == "mean" or is_src:
            _pack(b, flat)
    if nodes is not None:
        return b, flat, nodes.start(flat)
    return b, flat, start_bucket(b.kind, flat, global_src, group, seq)


def _land(started: _InFlight, pool: _Pool, rank: int, src: int, ws: int,
          staged: dict[str, Any]) -> None:
    """Wait for one collective (its later stages, node by node), finish its bucket,
    give its buffer back to the pool."""
    b, flat, work = started
    nodes = _nodes(b, staged)
    if nodes is not None:
        nodes.finish(flat, work)
    else:
        work.wait()
    _finish(b, flat, rank, src, ws)
    if not b.direct:
        pool.give(flat)
