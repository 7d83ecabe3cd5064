"""Same-host gradient exchange through shared memory (internal): :class:`ShmLane`.

When every rank of a group runs on one host and the gradients live on the CPU (``hpc
run --nproc N``, a single-node CPU job), gloo still moves every byte through loopback
TCP: a copy into the kernel, a copy out, a worker thread per collective. Here each rank
instead packs its buckets into its own file in ``/dev/shm``, which every rank has
mapped; one barrier (a gloo collective, so a full memory barrier on every rank) says
that all ranks have packed, and each rank then reads the others' buckets directly:
a broadcast bucket is one copy from its owner's region, a mean is the sum of every
rank's region, in rank order (so every rank computes the same bits). From
:data:`SCATTER_FROM` ranks on, a mean is reduce-scattered instead: each rank sums one
slice of it over every region (in rank order: the same bits) and publishes that sum in
its own region, and after a second barrier each copies the others' slices, so that a
rank reads about twice a mean's bytes, not world size times.

Each region holds two halves, used in alternate steps: a rank writes step k+2 into the
half of step k only after the (first) barrier of step k+1, which no rank passes before
it has finished reading step k. The results are copied into the rank's private buffers, so the
gradients never alias shared memory (clipping them in place, or ``zero_grad(
set_to_none=False)``, cannot reach another rank's read).

This module holds what runs every step: the slot layout (:func:`half_bytes`,
:meth:`ShmLane.place`), the combining and the :func:`barrier`. The regions themselves
(their names, creation, mapping, the collective opening that builds a lane, and the
sweep of those a dead rank left) are in :mod:`hpc.sync._shm_region`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

import torch

from hpc.sync._collective import start_max

__all__ = ["ShmLane", "half_bytes", "barrier", "ALIGN", "SCATTER_FROM"]

#: Alignment of every bucket's slot (and the size of the stamp header).
ALIGN = 64
#: From this world size on a mean is reduce-scattered (:meth:`ShmLane.exchange`): a
#: rank reads ~2x a mean's bytes instead of ws x, for a second barrier per step.
#: Measured in docs/sync.md.
SCATTER_FROM = 4


def _ceil(n: int, d: int) -> int:
    return -(-n // d)


def _aligned(n: int) -> int:
    return _ceil(n, ALIGN) * ALIGN


def half_bytes(numels: Sequence[int], itemsizes: Sequence[int]) -> int:
    """Bytes one step's half must hold for these parameters: every one on the wire, each
    in its own aligned slot at worst (a parameter is in one bucket at most), rounded up
    to :data:`ALIGN` so that the second half starts aligned as well (mixed itemsizes
    sum to any byte count: fp32 with an odd-sized bf16 head)."""
    return _aligned(sum(n * size for n, size in zip(numels, itemsizes))
                    + ALIGN * len(numels))


class ShmLane:
    """Every rank's mapped region; one rank's view of the shared exchange.

    Args:
        regions: One uint8 tensor per group rank, each mapping that rank's file.
        rank: This rank in the group.
        half: Bytes of one half (a step's slots), a multiple of :data:`ALIGN`.
        scatter: Reduce-scatter the means (:meth:`exchange`); None: from
            :data:`SCATTER_FROM` ranks on.
    """

    def __init__(self, regions: Sequence[torch.Tensor], rank: int, half: int,
                 scatter: Optional[bool] = None) -> None:
        if half % ALIGN:
            # Every slot offset is aligned within a half; the halves must be too, or a
            # slot of the second half cannot be viewed as a wider dtype.
            raise ValueError(f"ShmLane: half={half} is not a multiple of {ALIGN} "
                             "(size it with half_bytes())")
        self.regions = list(regions)
        self.rank = rank
        self.half = half
        #: Reduce-scatter the means (see :meth:`exchange`); by world size by default.
        self.scatter = len(self.regions) >= SCATTER_FROM if scatter is None else scatter
        self._step = 0

    @property
    def local_ranks(self) -> int:
        """Ranks on this host that share the lane."""
        return len(self.regions)

    #: Reading a broadcast out (:meth:`combine`) turns ``-0.0`` into ``+0.0``, as DDP's
    #: sum with the other ranks' zeros does: its owner packs it without that pass.
    signs_zeros = True

    def begin_step(self) -> None:
        """Switch to the other half (call once per step, on every rank)."""
        self._step += 1

    def slot(self, rank: int, offset: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """``rank``'s slot at byte ``offset`` of this step's half, as ``numel`` of ``dtype``."""
        start = ALIGN + (self._step % 2) * self.half + offset
        return self.regions[rank][start:start + numel * dtype.itemsize].view(dtype)

    @staticmethod
    def offsets(sizes: Sequence[int]) -> list[int]:
        """Byte offsets of consecutive slots of ``sizes`` bytes, each aligned."""
        out, at = [], 0
        for n in sizes:
            out.append(at)
            at += _aligned(n)
        return out

    def place(self, plan: Sequence[Any]) -> None:
        """Start a step: give every bucket its slot; ``flat`` = this rank's slot where
        it packs (its own broadcasts, every mean), else None."""
        self.begin_step()
        sizes = [b.numel * b.key[1].itemsize for b in plan]
        for b, off in zip(plan, self.offsets(sizes)):
            b.slot = off
            mine = b.kind == "mean" or b.owner == self.rank
            b.flat = self.slot(self.rank, off, b.numel, b.key[1]) if mine else None

    def exchange(self, plan: Sequence[Any], arena: Any, group: Optional[Any]) -> None:
        """After packing: a barrier, then every bucket's result into a private buffer
        from ``arena`` (``flat`` then points at it).

        Below :data:`SCATTER_FROM` ranks each rank sums every rank's whole slot of a
        mean (:meth:`combine`). From it on a mean is reduce-scattered: each rank sums
        its own slice of the mean over every rank into its buffer and publishes it in
        its own slot (:meth:`reduce_slice`), a second barrier, and each copies the
        others' sums of their slices (:meth:`gather_slices`). Per rank that reads about
        twice a mean's bytes instead of ``world size`` times; every element is summed in
        the same rank order either way, so the bits are the same.
        """
        barrier(group)
        outs = [arena.take(torch.device("cpu"), b.key[1], b.numel, b.numel) for b in plan]
        if not self.scatter:
            for b, out in zip(plan, outs):
                self.combine(b.kind, b.owner, b.slot, out)
        else:
            for b, out in zip(plan, outs):
                if b.kind == "broadcast":
                    self.combine(b.kind, b.owner, b.slot, out)
                else:
                    self.reduce_slice(b.slot, out)
            if any(b.kind == "mean" for b in plan):
                barrier(group)  # every rank has published its slices
                for b, out in zip(plan, outs):
                    if b.kind == "mean":
                        self.gather_slices(b.slot, out)
        for b, out in zip(plan, outs):
            b.flat = out

    def barriers(self, plan: Sequence[Any]) -> int:
        """Collectives (barriers) :meth:`exchange` runs for ``plan``."""
        return 2 if self.scatter and any(b.kind == "mean" for b in plan) else 1

    def combine(self, kind: str, owner: int, offset: int, out: torch.Tensor) -> None:
        """Write the bucket's result into ``out`` (after the step's barrier); a
        broadcast's ``-0.0`` becomes ``+0.0`` on the way (:attr:`signs_zeros`), in the
        pass that copies it (``x + 0.0``: the same bits as DDP's sum with zeros)."""
        numel, dtype = out.numel(), out.dtype
        if kind == "broadcast":
            torch.add(self.slot(owner, offset, numel, dtype), 0.0, out=out)
            return
        slots = [self.slot(r, offset, numel, dtype) for r in range(len(self.regions))]
        torch.add(slots[0], slots[1], out=out)
        for extra in slots[2:]:
            out.add_(extra)

    def slices(self, numel: int, itemsize: int) -> list[tuple[int, int]]:
        """Each rank's ``[start, end)`` of a mean of ``numel`` elements: equal parts,
        rounded up to whole :data:`ALIGN` blocks (no two ranks write one cache line)."""
        block = max(1, ALIGN // itemsize)
        ws = len(self.regions)
        per = _ceil(_ceil(numel, ws), block) * block
        return [(min(numel, r * per), min(numel, (r + 1) * per)) for r in range(ws)]

    def part(self, rank: int, offset: int, lo: int, hi: int,
              dtype: torch.dtype) -> torch.Tensor:
        return self.slot(rank, offset + lo * dtype.itemsize, hi - lo, dtype)

    def reduce_slice(self, offset: int, out: torch.Tensor) -> None:
        """This rank's slice of a mean: the sum over every rank's slot, in rank order,
        into ``out``'s slice and, for the others, over this rank's own slot's slice (no
        other rank reads that part of it before the next barrier)."""
        lo, hi = self.slices(out.numel(), out.itemsize)[self.rank]
        if lo == hi:
            return
        mine = out[lo:hi]
        self.sum_part(offset, lo, hi, mine)
        self.part(self.rank, offset, lo, hi, out.dtype).copy_(mine)

    def sum_part(self, offset: int, lo: int, hi: int, out: torch.Tensor) -> None:
        """Elements ``[lo, hi)`` of the slot at ``offset`` summed over every rank's
        region, in rank order, into ``out`` (``hi - lo`` elements)."""
        parts = [self.part(r, offset, lo, hi, out.dtype) for r in range(len(self.regions))]
        if len(parts) == 1:
            out.copy_(parts[0])
            return
        torch.add(parts[0], parts[1], out=out)
        for extra in parts[2:]:
            out.add_(extra)

    def gather_slices(self, offset: int, out: torch.Tensor) -> None:
        """The other ranks' slices of a mean, as they published them (after the second
        barrier)."""
        for r, (lo, hi) in enumerate(self.slices(out.numel(), out.itemsize)):
            if r != self.rank and lo < hi:
                out[lo:hi].copy_(self.part(r, offset, lo, hi, out.dtype))


def barrier(group: Optional[Any]) -> None:
    """Every rank of ``group`` got here (a gloo collective: also a full memory barrier)."""
    start_max(torch.zeros(1, dtype=torch.int64), group, "barrier").wait()
