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

Opening is collective and decided on every rank alike: one MAX over the ranks agrees
whether every rank wants it (and carries rank 0's random token); each rank then reserves
its region as a file without a name (``O_TMPFILE``; ``posix_fallocate`` reserves the
memory, so a full ``/dev/shm`` is refused now instead of a SIGBUS later), locks it
(``flock``), maps and stamps it, and only then names it
``hpc-grads-<job>-<token>-<rank>-<pid>`` (:func:`region_name`); one MAX says whether
every rank could, one whether every rank mapped every other rank's region and read back
its stamp (ranks on other hosts, or in containers with their own ``/dev/shm``, do not
see the file: the group keeps gloo). A region that cannot be mapped is an answer in that
MAX, never an exception that would leave the peers waiting. Each rank unlinks its name
as soon as all ranks mapped it, or as soon as the opening fails or raises, so nothing
is left behind once the lane is open, even if the job is killed later.

A rank killed between naming and unlinking (or stopped by its launcher while it waits
for such a peer) does leave its file, but not its lock: every opening first removes the
``hpc-grads-*`` files nobody holds (:func:`sweep`), as does a rank whose opening
collective raised; a scheduler's epilog can remove a job's with ``rm -f
/dev/shm/hpc-grads-$SLURM_JOB_ID-*``.
"""

from __future__ import annotations

import fcntl
import logging
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any, Optional

import torch
import torch.distributed as dist

from hpc import envvars
from hpc.errors import HPCError
from hpc.sync._collective import comm_device, start_max
from hpc.sync.agree import all_true, max_ints

__all__ = ["ShmLane", "open_lane", "lane_wanted", "half_bytes", "sweep", "job_label",
           "region_name", "SHM_DIR", "ENV", "PREFIX"]

logger = logging.getLogger(__name__)

#: Where the regions live: tmpfs on Linux, node-local by construction.
SHM_DIR = "/dev/shm"
#: Alignment of every bucket's slot (and the size of the stamp header).
ALIGN = 64
#: ``HPC_SYNC_SHM=0`` turns the lane off where it would be used by default.
ENV = "HPC_SYNC_SHM"
#: From this world size on a mean is reduce-scattered (:meth:`ShmLane.exchange`): a
#: rank reads ~2x a mean's bytes instead of ws x, for a second barrier per step.
#: Measured in docs/sync.md.
SCATTER_FROM = 4
#: Every region's name starts so (:func:`region_name`).
PREFIX = "hpc-grads-"
_NAME = re.compile(r"^hpc-grads-(?P<job>[A-Za-z0-9._]+)-(?P<token>[0-9a-f]{14})"
                   r"-(?P<rank>\d+)-(?P<pid>\d+)$")
#: Where :func:`job_label` looks, in order: schedulers first (an epilog knows their id).
_JOB_VARIABLES = ("SLURM_JOB_ID", "SLURM_JOBID", "PBS_JOBID", "LSB_JOBID", "FLUX_JOB_ID",
                  "HPC_RUN_ID", "TORCHELASTIC_RUN_ID")
#: Bytes of the stamp at the start of a region (inside its first ALIGN bytes).
STAMP_BYTES = 24


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


def _stamp(token: int, rank: int) -> torch.Tensor:
    """The header a region starts with (:data:`STAMP_BYTES`): the peers check it."""
    return torch.tensor([token, rank, 0x48504353484D], dtype=torch.int64)


def _agree(want: bool, group: Optional[Any]) -> tuple[bool, int]:
    """(every rank wants the lane, rank 0's token): one MAX over the ranks."""
    token = int.from_bytes(os.urandom(7), "little") if dist.get_rank(group) == 0 else 0
    refused, token = max_ints([0 if want else 1, token], group)
    return refused == 0, token


def job_label(environ: Mapping[str, str]) -> str:
    """The job a region belongs to, for its name: the scheduler's job id (so that an
    epilog can remove what a killed job left: ``rm -f /dev/shm/hpc-grads-$SLURM_JOB_ID-*``),
    else the launcher's run id, else ``0``; reduced to letters, digits, dots and ``_``."""
    for var in _JOB_VARIABLES:
        value = environ.get(var)
        if value:
            return re.sub(r"[^A-Za-z0-9.]", "_", value)[:64]
    return "0"


def region_name(job: str, token: int, rank: int, pid: int) -> str:
    """``hpc-grads-<job>-<token>-<rank>-<pid>``: whose region this is, for the peers that
    map it (by token and rank), an epilog (by job) and whoever finds it (by pid)."""
    return f"{PREFIX}{job}-{token:014x}-{rank}-{pid}"


def sweep(directory: str = SHM_DIR) -> list[str]:
    """Remove the regions in ``directory`` whose owner is gone; returns their names.

    An owner holds an exclusive ``flock`` on its region from before the region has a
    name until it unlinks it, and the kernel drops the lock when the owner dies, however
    it dies: a region nobody holds was left by a dead process. (Its pid would not tell:
    pids are reused, and ranks in containers that share ``/dev/shm`` but not a pid
    namespace, ``docker --ipc=host``, see other pids.) Regions of other users cannot be
    opened or unlinked here and are skipped.
    """
    removed = []
    try:
        entries = os.listdir(directory)
    except OSError:
        return removed
    for entry in entries:
        if not _NAME.match(entry):
            continue
        path = os.path.join(directory, entry)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            continue  # unlinked meanwhile, or not ours
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue  # its owner lives
        else:
            try:
                os.unlink(path)
                removed.append(entry)
            except OSError:
                pass  # another sweep was first, or not ours to remove
        finally:
            os.close(fd)
    return removed


def _create(path: str, size: int, stamp: torch.Tensor
            ) -> tuple[Optional[int], Optional[torch.Tensor], Optional[str]]:
    """Reserve, lock, map and stamp this rank's region, then give it the name ``path``.

    Returns (the fd that holds the lock, the mapped region, None) or (None, None, why
    not). Up to the last step the file has no name (``O_TMPFILE``): a death here, in
    the ``posix_fallocate`` that may itself draw the OOM killer, leaves nothing behind.
    """
    directory, name = os.path.split(path)
    try:
        fd = os.open(directory, os.O_TMPFILE | os.O_RDWR, 0o600)
    except OSError as e:
        return None, None, f"cannot create a file in {directory}: {e.strerror}"
    doing = "lock"
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # held until unlinked: see sweep()
        doing = f"reserve {size} bytes in {directory}"
        os.posix_fallocate(fd, 0, size)
        doing = f"map {path}"
        region = _map_fd(fd, size)
        region[:STAMP_BYTES].view(torch.int64).copy_(stamp)
        doing = f"name {path}"
        dirfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
        try:  # given a directory fd, os.link is linkat(AT_SYMLINK_FOLLOW)
            os.link(f"/proc/self/fd/{fd}", name, dst_dir_fd=dirfd, follow_symlinks=True)
        finally:
            os.close(dirfd)
    except (OSError, RuntimeError) as e:
        os.close(fd)
        return None, None, f"cannot {doing}: {getattr(e, 'strerror', None) or e}"
    return fd, region, None


def _map_fd(fd: int, size: int) -> torch.Tensor:
    # from_file(shared=True) creates a missing path: map the open file, never a name.
    return torch.from_file(f"/proc/self/fd/{fd}", shared=True, size=size,
                           dtype=torch.uint8)


def _map_all(directory: str, token: int, rank: int, ws: int, mine: torch.Tensor
             ) -> tuple[list[torch.Tensor], Optional[str]]:
    """Every rank's region, in rank order (this rank's is ``mine``), each checked by its
    size and stamp: (regions, None), or ([], why not). A region that cannot be mapped
    is an answer, not an exception: the peers wait in the next collective for it."""
    size = mine.numel()
    try:
        names = {}
        for entry in os.listdir(directory):
            m = _NAME.match(entry)
            if m and int(m["token"], 16) == token:
                names[int(m["rank"])] = entry
    except OSError as e:
        return [], f"cannot list {directory}: {e.strerror}"
    regions = []
    for r in range(ws):
        if r == rank:
            regions.append(mine)
            continue
        pattern = os.path.join(directory, f"{PREFIX}*-{token:014x}-{r}-*")
        if r not in names:
            return [], f"rank {r}'s {pattern} is not visible here"
        path = os.path.join(directory, names[r])
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        except OSError as e:
            return [], f"rank {r}'s {path} cannot be opened here ({e.strerror})"
        try:
            found = os.fstat(fd).st_size
            if found != size:
                return [], f"rank {r}'s {path} has {found} bytes, not {size}"
            region = _map_fd(fd, size)
        except (OSError, RuntimeError) as e:
            return [], f"cannot map rank {r}'s {path}: {e}"
        finally:
            os.close(fd)
        if not torch.equal(region[:STAMP_BYTES].view(torch.int64), _stamp(token, r)):
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
    return bool(envvars.value(ENV))


def open_lane(half: int, group: Optional[Any], want: Optional[bool],
              required: bool = False) -> Optional[ShmLane]:
    """Collectively open a lane whose halves hold ``half`` bytes, or None (the same on
    every rank). ``want`` from :func:`lane_wanted` (None: decided without asking,
    nothing is sent). ``required``: raise :class:`HPCError` instead of returning None."""
    if want is None:
        lane, why = None, ("it applies to CPU parameters on a backend that moves CPU "
                           "tensors, without match_ddp at world size 3 or more")
    else:
        lane, why = try_open(half, group, want)
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


def try_open(half: int, group: Optional[Any], want: bool) -> tuple[Optional[ShmLane], str]:
    everyone, token = _agree(want, group)
    if not everyone:
        return None, "not requested on every rank"
    rank, ws = dist.get_rank(group), dist.get_world_size(group)
    _report_swept(sweep())
    path = os.path.join(SHM_DIR, region_name(job_label(os.environ), token, rank,
                                             os.getpid()))
    fd, mine, why = _create(path, ALIGN + 2 * half, _stamp(token, rank))
    try:
        created = all_true(mine is not None, group)
        if mine is None or not created:
            return None, why or "another rank could not create its region"
        regions, why = _map_all(SHM_DIR, token, rank, ws, mine)
        if not all_true(why is None, group):  # every rank has mapped (or failed) by now
            return None, why or "another rank cannot see every region (other hosts?)"
        return ShmLane(regions, rank, half), ""
    except BaseException:  # a peer died, and the collective raised: it left its region
        _report_swept(sweep())
        raise
    finally:
        # However the opening ends, this rank's name goes now; the mappings keep the
        # memory for as long as they live.
        if fd is not None:
            try:
                os.unlink(path)
            except OSError:
                pass
            os.close(fd)


def _report_swept(names: Sequence[str]) -> None:
    if names:
        logger.info("sync_gradients: removed %d shared-memory region(s) whose process "
                    "died while opening its lane: %s", len(names), ", ".join(names))
