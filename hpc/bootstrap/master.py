"""The master address: where rank 0's store listens, when the launcher does not say.

:func:`resolve_master` fills in ``master_addr``/``master_port`` for launchers that export
none (MPI); :func:`from_mpi4py` reads the whole layout from mpi4py
(``HPC_LAUNCHER=mpi4py``). mpi4py is imported only here and only on demand: importing it
initialises MPI.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Mapping
from typing import Any, Optional

from hpc.environments import DistInfo
from hpc.environments.base import derive_port
from hpc.errors import MasterAddressError

__all__ = ["free_port", "from_mpi4py", "launcher_pid", "resolve_master"]

logger = logging.getLogger(__name__)

_MPI_LAUNCHERS = ("openmpi", "mpich", "mvapich2", "mpi4py")
_PROCESS_MANAGERS = ("hydra_pmi_proxy", "orted", "prted", "mpirun", "mpiexec", "prterun")


def free_port(host: str = "") -> int:
    """A TCP port that is free on this host right now (bound, then released)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def launcher_pid(pid: Optional[int] = None) -> int:
    """Pid of the nearest MPI process manager above ``pid`` (Linux), else the parent.

    All ranks of one node share it, even when each rank is wrapped in a shell.
    """
    pid = os.getpid() if pid is None else pid
    parent = os.getppid()
    for _ in range(32):
        try:
            with open(f"/proc/{pid}/stat", encoding="utf-8") as fh:
                stat = fh.read()
        except OSError:
            return parent
        comm = stat[stat.index("(") + 1:stat.rindex(")")]
        ppid = int(stat[stat.rindex(")") + 2:].split()[1])
        if pid != os.getpid() and comm.startswith(_PROCESS_MANAGERS):
            return pid
        if ppid <= 1:
            return parent
        pid = ppid
    return parent


def from_mpi4py() -> DistInfo:
    """Read the layout from ``mpi4py.MPI.COMM_WORLD`` (``HPC_LAUNCHER=mpi4py``)."""
    comm = _mpi_comm()
    if comm is None:
        raise MasterAddressError(
            "HPC_LAUNCHER=mpi4py but mpi4py cannot be imported.\n"
            "HINT: pip install 'torch-hpc[mpi]' (for MPICH also export MPI4PY_LIBMPI)."
        )
    local = comm.Split_type(_mpi().COMM_TYPE_SHARED)
    nodes = comm.allgather(local.Get_rank() == 0)
    node_rank = sum(nodes[: comm.Get_rank() + 1]) - 1
    return DistInfo(
        launcher="mpi4py", rank=comm.Get_rank(), world_size=comm.Get_size(),
        local_rank=local.Get_rank(), local_world_size=local.Get_size(),
        node_rank=node_rank, num_nodes=sum(nodes),
    )


def resolve_master(info: DistInfo, environ: Mapping[str, str]) -> DistInfo:
    """Fill in ``master_addr``/``master_port`` where the launcher gave none (MPI).

    Order: values already known (``MASTER_ADDR``/``MASTER_PORT``) > mpi4py broadcast of
    rank 0's host and a port it checked is free > ``127.0.0.1`` when every rank is on
    this node > the first host of the Slurm allocation > :class:`MasterAddressError`.
    """
    if info.master_addr and info.master_port:
        return info
    if info.world_size == 1:
        return info.replace(master_addr=info.master_addr or "127.0.0.1")
    comm = _mpi_comm(info.launcher) if info.launcher in _MPI_LAUNCHERS else None
    if comm is not None and (comm.Get_size(), comm.Get_rank()) != (info.world_size, info.rank):
        logger.warning(
            "mpi4py sees rank %d of %d but %s says rank %d of %d: mpi4py is linked to "
            "another MPI library than the launcher's; not using it.\n"
            "HINT: for MPICH make a link <dir>/libmpi.so.12 -> libmpich.so.12 and export "
            "MPI4PY_LIBMPI=<dir>/libmpi.so.12 LD_LIBRARY_PATH=<dir>, or rebuild mpi4py "
            "against the launcher's MPI.",
            comm.Get_rank(), comm.Get_size(), info.launcher, info.rank, info.world_size)
        comm = None
    if comm is not None:
        single = info.local_world_size == info.world_size
        mine = None
        if info.rank == 0:
            mine = (info.master_addr or ("127.0.0.1" if single else socket.gethostname()),
                    info.master_port or free_port())
        addr, port = comm.bcast(mine, root=0)
        return info.replace(master_addr=addr, master_port=port)
    job = environ.get("SLURM_JOB_ID")
    if info.local_world_size == info.world_size:
        # Open MPI names its job; otherwise the process manager's pid, which all
        # local ranks share and concurrent mpiexec runs in one allocation do not.
        ident = info.job_id or launcher_pid()
        return info.replace(master_addr=info.master_addr or "127.0.0.1",
                            master_port=info.master_port or derive_port("mpi", ident))
    if job and environ.get("SLURM_JOB_NODELIST"):
        from hpc.environments.slurm import expand_hostnames

        host = expand_hostnames(environ["SLURM_JOB_NODELIST"])[0]
        return info.replace(master_addr=info.master_addr or host,
                            master_port=info.master_port or derive_port(job, "mpi"))
    raise MasterAddressError(
        f"{info.launcher}: {info.world_size} ranks on {info.num_nodes} nodes but no master "
        "address: MPI does not export one, mpi4py is not importable and this is not a "
        "Slurm allocation.\n"
        "HINT: pip install 'torch-hpc[mpi]' (mpi4py), or pass the master explicitly, e.g. "
        "mpirun -x MASTER_ADDR=$(hostname) -x MASTER_PORT=29500 ... "
        "(MPICH: mpiexec -genv MASTER_ADDR $(hostname) -genv MASTER_PORT 29500 ...)."
    )


def _mpi() -> Any:
    from mpi4py import MPI  # noqa: PLC0415 - importing initialises MPI: only on demand

    return MPI


#: MPI launcher -> ABI family of the libmpi its ranks must load.
_ABI = {"openmpi": "openmpi", "mpich": "mpich", "mvapich2": "mpich"}


def _mpi4py_abi() -> Optional[str]:
    """ABI the mpi4py wheel would load ("openmpi"/"mpich"); None when not knowable.

    The multi-ABI wheel (mpi4py >= 4) picks its library at import of ``mpi4py.MPI``;
    asking first only dlopens the library and does not initialise MPI. Loading the
    wrong one is not recoverable: Open MPI's MPI_Init aborts a process started by
    MPICH's mpiexec inside an allocation.
    """
    try:
        from mpi4py import _mpiabi  # type: ignore[attr-defined]

        return str(_mpiabi._get_mpiabi())
    except Exception:  # a source build, an old mpi4py, or no libmpi at all
        return None


def _mpi_comm(launcher: str = "") -> Any:
    import importlib.util

    if importlib.util.find_spec("mpi4py") is None:
        return None
    want, have = _ABI.get(launcher), _mpi4py_abi()
    if want and have and want != have:
        logger.warning(
            "mpi4py would load the %s library but %s started this process; not using it "
            "to find the master.\nHINT: for MPICH make a link <dir>/libmpi.so.12 -> "
            "libmpich.so.12 and export MPI4PY_LIBMPI=<dir>/libmpi.so.12 "
            "LD_LIBRARY_PATH=<dir>.", have, launcher)
        return None
    try:
        return _mpi().COMM_WORLD
    except Exception as e:  # ImportError, or RuntimeError when libmpi cannot load
        logger.debug("mpi4py unavailable: %s", e)
        return None
