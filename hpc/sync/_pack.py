"""Where each gradient sits in a flat bucket, and the arithmetic of packing it (internal).

:class:`Layout` holds, per parameter of a :class:`hpc.sync.GradSync`, what its slot in a
flat buffer looks like (element count, strides, dtype on the wire) and does the
per-gradient work of a step: packing a gradient into its slot (DDP's ``mul`` by
``1/world_size``), reading a result back as a view shaped like the parameter, and
widening a ``comm_dtype`` result. :func:`hpc.sync.grads` keeps the step's control flow.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from hpc.sync._collective import BUCKET_KINDS
from hpc.sync._plan import Arena, Bucket, dense_layout

__all__ = ["Layout", "bucket_key"]

#: 16-bit floats: packed one tensor at a time (:meth:`Layout.fusable`).
_HALF = (torch.bfloat16, torch.float16)
#: Gradients of this many elements or more are packed one at a time
#: (:meth:`Layout.fusable`): one ``mul`` pass over their bytes costs more than the
#: dispatch that fusing saves (the fused packing passes over them twice).
FUSE_BELOW = 16384


def bucket_key(p: torch.Tensor, comm_dtype: torch.dtype | None) -> tuple[Any, ...]:
    """Bucket key of ``p``: (device, dtype on the wire[, its own dtype when it differs]).

    ``comm_dtype`` applies to float32 parameters only; the third entry keeps them out
    of the buckets of parameters that are natively of ``comm_dtype``.
    """
    if comm_dtype is not None and p.dtype == torch.float32:
        return (p.device, comm_dtype, p.dtype)
    return (p.device, p.dtype)


class Layout:
    """Per-parameter slot layout of one parameter list (device-agnostic).

    Args:
        params: The synced parameters, in order.
        comm_dtype: Wire dtype for float32 parameters, or None.
    """

    def __init__(self, params: Sequence[torch.Tensor],
                 comm_dtype: torch.dtype | None) -> None:
        self.params = list(params)
        self.numels = [p.numel() for p in self.params]
        #: (device, dtype on the wire) per parameter: its bucket key.
        self.keys = [bucket_key(p, comm_dtype) for p in self.params]
        self.itemsizes = [k[1].itemsize for k in self.keys]
        #: Strides of a dense non-contiguous parameter (channels_last), else None: its
        #: synced gradient keeps that layout, as DDP's bucket views do.
        self.strides = [None if p.is_contiguous() or not dense_layout(p) else p.stride()
                        for p in self.params]

    def stats(self, plan: Sequence[Bucket], sent: int,
              barriers: int | None) -> dict[str, int]:
        """:attr:`hpc.GradSync.stats` of a step: parameters synced and skipped, bytes
        per bucket kind, collectives (through shared memory: its ``barriers``; None:
        not through shared memory)."""
        shm = barriers is not None
        out = {"params_synced": sent, "params_skipped": len(self.params) - sent,
               "collectives": barriers if barriers is not None else len(plan),
               "shared_memory": int(shm)}
        for k in BUCKET_KINDS:  # "broadcast_bytes", "mean_bytes"
            out[f"{k}_bytes"] = sum(b.numel * self.itemsizes[b.idx[0]]
                                    for b in plan if b.kind == k)
        return out

    def view(self, flat: torch.Tensor, off: int, i: int) -> torch.Tensor:
        """Parameter ``i``'s slot in ``flat``, shaped (and strided) like the parameter."""
        strides = self.strides[i]
        if strides is None:
            return flat[off:off + self.numels[i]].view(self.params[i].shape)
        return flat.as_strided(self.params[i].shape, strides, flat.storage_offset() + off)

    def pack(self, b: Bucket, off: int, i: int, scale: float,
             signed_zeros: bool = True) -> None:
        """Write parameter ``i``'s scaled gradient (zeros when it has none) into ``b``.

        ``signed_zeros``: turn a broadcast's ``-0.0`` into ``+0.0`` here, as DDP's sum
        with the other ranks' zeros does; False where every reader of the bucket does it
        while copying it out (:attr:`hpc.sync._shm.ShmLane.signs_zeros`), which saves a
        pass over the owner's bytes."""
        dst = self.view(b.flat, off, i)  # type: ignore[arg-type]  # set by the plan
        g = self.params[i].grad
        if g is None:  # reachable, yet autograd produced nothing: contributes zero
            dst.zero_()
        elif g.device != dst.device:  # a CPU parameter under plain nccl: stage it
            dst.copy_(g)
            dst.mul_(scale)  # the same product as mul_out below, on the comm device
        else:
            torch.mul(g, scale, out=dst)  # DDP's reducer: mul_out(1/ws)
        if g is not None and b.kind == "broadcast" and signed_zeros:
            dst.add_(0.0)  # -0.0 -> +0.0, as the zeros DDP adds to it (cache-hot)

    def fusable(self, b: Bucket, i: int) -> bool:
        """True when :meth:`pack_fused` may pack parameter ``i`` into ``b``: a small
        gradient (below :data:`FUSE_BELOW` elements: the fused copy-then-scale passes
        over its bytes twice, :meth:`pack` once), not into a 16-bit float bucket, where
        ``_foreach_mul_`` rounds the scale itself to 16 bits (1/3 in bf16 is 0.33398:
        +0.2 % on every gradient) while ``torch.mul``, as DDP's reducer, multiplies by
        it in float32 and rounds the product."""
        g, flat = self.params[i].grad, b.flat
        return g is not None and b.kind == "mean" and flat is not None \
            and g.numel() < FUSE_BELOW and g.device == flat.device \
            and flat.dtype not in _HALF

    def pack_fused(self, items: Sequence[tuple[Bucket, int, int]], scale: float) -> None:
        """:meth:`pack` of ``(bucket, offset, i)`` items that are :meth:`fusable`: one
        ``_foreach_copy_`` and one ``_foreach_mul_`` per bucket instead of a kernel per
        gradient (the same products)."""
        fused: dict[int, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        for b, off, i in items:
            dsts, srcs = fused.setdefault(id(b), ([], []))
            dsts.append(self.view(b.flat, off, i))  # type: ignore[arg-type]
            srcs.append(self.params[i].grad)  # type: ignore[arg-type]  # fusable
        for dsts, srcs in fused.values():
            torch._foreach_copy_(dsts, srcs)
            torch._foreach_mul_(dsts, scale)

    def widen(self, arena: Arena, b: Bucket) -> torch.Tensor:
        """``b``'s result in its parameters' dtype (one conversion under comm_dtype)."""
        flat: torch.Tensor = b.flat  # type: ignore[assignment]  # set by the plan
        dtype = self.params[b.idx[0]].dtype
        if flat.dtype == dtype:
            return flat
        out = arena.take(flat.device, dtype, b.numel, b.numel)
        out.copy_(flat)
        return out

    def ddp_buckets(self, bucket_bytes: int) -> list[list[int]]:
        """DDP's bucket assignment for these parameters (find_unused_parameters=True)."""
        limits = [dist._DEFAULT_FIRST_BUCKET_BYTES, bucket_bytes]
        indices, _ = dist._compute_bucket_assignment_by_size(
            self.params, limits, [False] * len(self.params))
        return [list(b) for b in reversed(indices)]
