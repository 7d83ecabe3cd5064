"""The shared-memory lane's regions (internal): from naming to sweeping.

Each rank of a :class:`~hpc.sync._shm.ShmLane` exchanges through its own file in
``/dev/shm``; here those files are named (:func:`region_name`, :func:`job_label`),
created and mapped, checked by their stamp, agreed on collectively (:func:`lane_wanted`,
:func:`open_lane`, which builds the lane) and, where a dead rank left one, removed
(:func:`sweep`).

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
from hpc.sync._collective import comm_device
from hpc.sync._shm import ALIGN, ShmLane
from hpc.sync.agree import all_true, max_ints

__all__ = ["open_lane", "try_open", "lane_wanted", "sweep", "job_label", "region_name",
           "SHM_DIR", "ENV", "PREFIX"]

logger = logging.getLogger(__name__)

#: Where the regions live: tmpfs on Linux, node-local by construction.
SHM_DIR = "/dev/shm"
#: ``HPC_SYNC_SHM=0`` turns the lane off where it would be used by default.
ENV = "HPC_SYNC_SHM"
#: Every region's name starts so (:func:`region_name`).
PREFIX = "hpc-grads-"
_NAME = re.compile(r"^hpc-grads-(?P<job>[A-Za-z0-9._]+)-(?P<token>[0-9a-f]{14})"
                   r"-(?P<rank>\d+)-(?P<pid>\d+)$")
#: Where :func:`job_label` looks, in order: schedulers first (an epilog knows their id).
_JOB_VARIABLES = ("SLURM_JOB_ID", "SLURM_JOBID", "PBS_JOBID", "LSB_JOBID", "FLUX_JOB_ID",
                  "HPC_RUN_ID", "TORCHELASTIC_RUN_ID")
#: Bytes of the stamp at the start of a region (inside its first ALIGN bytes).
STAMP_BYTES = 24


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
