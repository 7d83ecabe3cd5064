"""Same-host gradient exchange through shared memory (internal): :class:`ShmLane`.

When every rank of a group runs on one host and the gradients live on the CPU (``hpc
run --nproc N``, a single-node CPU job), gloo still moves every byte through loopback
TCP: a copy into the kernel, a copy out, a worker thread per collective. Here each rank
instead packs its buckets into its own file in ``/dev/shm``, which every rank has
mapped; one barrier (a gloo collective, so a full memory barrier on every rank) says
that all ranks have packed, and each rank then reads the others' buckets directly:
a broadcast bucket is one copy from its owner's region, a mean is the sum of every
rank's region, in rank order (so every rank computes the same bits).

Each region holds two halves, used in alternate steps: a rank writes step k+2 into the
half of step k only after the barrier of step k+1, which no rank passes before it has
finished reading step k. The results are copied into the rank's private buffers, so the
gradients never alias shared memory (clipping them in place, or ``zero_grad(
set_to_none=False)``, cannot reach another rank's read).

Opening is collective and decided on every rank alike: one MAX over the ranks agrees whether
every rank wants it (and carries rank 0's random token, which names the files), one says
whether every rank could create its file (``posix_fallocate`` reserves the memory, so a
full ``/dev/shm`` is refused now instead of a SIGBUS later), one whether every rank
mapped every other rank's file and read back its stamp (ranks on other hosts, or in
containers with their own ``/dev/shm``, do not see the file: the group keeps gloo).
Each file is unlinked as soon as all ranks mapped it, so nothing is left behind even if
the job is killed later.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any, Optional

import torch
import torch.distributed as dist

from hpc.errors import HPCError
from hpc.sync._collective import comm_device, start_max
from hpc.sync.agree import all_true, max_ints

__all__ = ["ShmLane", "open_lane", "lane_wanted", "half_bytes", "SHM_DIR", "ENV"]

logger = logging.getLogger(__name__)

#: Where the regions live: tmpfs on Linux, node-local by construction.
SHM_DIR = "/dev/shm"
#: Alignment of every bucket's slot (and the size of the stamp header).
ALIGN = 64
#: ``HPC_SYNC_SHM=0`` turns the lane off where it would be used by default.
ENV = "HPC_SYNC_SHM"


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


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
    """

    def __init__(self, regions: Sequence[torch.Tensor], rank: int, half: int) -> None:
        if half % ALIGN:
            # Every slot offset is aligned within a half; the halves must be too, or a
            # slot of the second half cannot be viewed as a wider dtype.
            raise ValueError(f"ShmLane: half={half} is not a multiple of {ALIGN} "
                             "(size it with half_bytes())")
        self.regions = list(regions)
        self.rank = rank
        self.half = half
        self._step = 0

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
        """After packing: one barrier, then every bucket's result into a private buffer
        from ``arena`` (``flat`` then points at it)."""
        start_max(torch.zeros(1, dtype=torch.int64), group, "barrier").wait()
        for b in plan:
            out = arena.take(torch.device("cpu"), b.key[1], b.numel, b.numel)
            self.combine(b.kind, b.owner, b.slot, out)
            b.flat = out

    def combine(self, kind: str, owner: int, offset: int, out: torch.Tensor) -> None:
        """Write the bucket's result into ``out`` (after the step's barrier)."""
        numel, dtype = out.numel(), out.dtype
        if kind == "broadcast":
            out.copy_(self.slot(owner, offset, numel, dtype))
            return
        slots = [self.slot(r, offset, numel, dtype) for r in range(len(self.regions))]
        torch.add(slots[0], slots[1], out=out)
        for extra in slots[2:]:
            out.add_(extra)


def _stamp(token: int, rank: int) -> torch.Tensor:
    return torch.tensor([token, rank, 0x48504353484D], dtype=torch.int64)


def _agree(want: bool, group: Optional[Any]) -> tuple[bool, int]:
    """(every rank wants the lane, rank 0's token): one MAX over the ranks."""
    token = int.from_bytes(os.urandom(7), "little") if dist.get_rank(group) == 0 else 0
    refused, token = max_ints([0 if want else 1, token], group)
    return refused == 0, token


def _create(path: str, size: int) -> Optional[str]:
    """Create and reserve ``path``; None, or why not."""
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    except OSError as e:
        return f"cannot create {path}: {e.strerror}"
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        os.unlink(path)
        return f"cannot reserve {size} bytes in {SHM_DIR}: {e.strerror}"
    finally:
        os.close(fd)
    return None


def _map_all(paths: Sequence[str], size: int, token: int
             ) -> tuple[list[torch.Tensor], Optional[str]]:
    """Map every rank's file and check its stamp; (regions, None) or ([], why not)."""
    regions = []
    for r, path in enumerate(paths):
        # from_file(shared=True) would create a missing file: look first.
        try:
            found = os.stat(path).st_size
        except OSError as e:
            return [], f"rank {r}'s {path} is not visible here ({e.strerror})"
        if found != size:
            return [], f"rank {r}'s {path} has {found} bytes, not {size}"
        region = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
        if not torch.equal(region[:24].view(torch.int64), _stamp(token, r)):
            return [], f"rank {r}'s {path} holds another stamp"
        regions.append(region)
    return regions, None


def lane_wanted(option: Optional[bool], params: Sequence[torch.Tensor], match_ddp: bool,
                group: Optional[Any]) -> Optional[bool]:
    """Whether this rank wants a lane; None when the answer is the same on every rank
    without asking (then :func:`open_lane` sends nothing): the caller's ``shm=False``
    (options are the same on every rank, as the parameter list is), or a lane that cannot
    apply (parameters not all on the CPU, a backend without CPU tensors, ``match_ddp``
    at world size 3+, whose ring order only gloo reproduces). ``HPC_SYNC_SHM=0`` answers
    False, not None: the environment may differ between ranks, so it is agreed on."""
    if option is False:
        return None
    cpu = torch.device("cpu")
    if not params or any(p.device != cpu for p in params):
        return None
    if comm_device(group, cpu) != cpu or (match_ddp and dist.get_world_size(group) > 2):
        return None
    if option is not None:
        return option
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "off", "false", "no")


def open_lane(half: int, group: Optional[Any], want: Optional[bool],
              required: bool = False) -> Optional[ShmLane]:
    """Collectively open a lane whose halves hold ``half`` bytes, or None (the same on
    every rank). ``want`` from :func:`lane_wanted` (None: decided without asking,
    nothing is sent). ``required``: raise :class:`HPCError` instead of returning None."""
    if want is None:
        lane, why = None, ("it applies to CPU parameters on a backend that moves CPU "
                           "tensors, without match_ddp at world size 3 or more")
    else:
        lane, why = _open(half, group, want)
    if lane is None and (want or required):
        if required:
            raise HPCError(
                f"sync_gradients: shm=True, but the shared-memory exchange cannot be "
                f"opened: {why}.\nIt needs every rank of the group on this host, seeing "
                f"the same {SHM_DIR}, with room for two copies of the gradients.\nHINT: "
                "pass shm=None to fall back to the process group's own transport.")
        logger.info("sync_gradients: no shared-memory exchange (%s); using the process "
                    "group's transport", why)
    return lane


def _open(half: int, group: Optional[Any], want: bool) -> tuple[Optional[ShmLane], str]:
    everyone, token = _agree(want, group)
    if not everyone:
        return None, "not requested on every rank"
    rank, ws = dist.get_rank(group), dist.get_world_size(group)
    size = ALIGN + 2 * half
    paths = [os.path.join(SHM_DIR, f"hpc-grads-{token:014x}-{r}") for r in range(ws)]
    why = _create(paths[rank], size)
    if why is None:
        mine = torch.from_file(paths[rank], shared=True, size=size, dtype=torch.uint8)
        mine[:24].view(torch.int64).copy_(_stamp(token, rank))
        del mine
    if not all_true(why is None, group):
        if why is None:
            os.unlink(paths[rank])
        return None, why or "another rank could not create its region"
    regions, why = _map_all(paths, size, token)
    ok = all_true(why is None, group)  # every rank has mapped (or failed) by now
    os.unlink(paths[rank])
    if not ok:
        return None, why or "another rank cannot see every region (other hosts?)"
    return ShmLane(regions, rank, half), ""
