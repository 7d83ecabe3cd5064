"""MPI launchers: Open MPI ``mpirun``, MPICH/Intel MPI ``mpiexec`` (hydra), MVAPICH2.

MPI ranks carry no master address. :func:`hpc.init_torch` resolves it (see
:func:`hpc.bootstrap.master.resolve_master`): ``MASTER_ADDR``/``MASTER_PORT`` if set,
else :meth:`~hpc.environments.mpi.MPIEnvironment.master`: rank 0's address and a free
port broadcast through mpi4py, else ``127.0.0.1`` when all ranks share one node, else
the first host of the Slurm allocation, else the first host of ``PBS_NODEFILE`` (PBS
or Torque with hydra's ``mpiexec``). mpi4py is imported only there, at init:
importing it initialises MPI.

Under ``mpirun``/``mpiexec`` inside a Slurm allocation the ranks also inherit
``SLURM_PROCID``/``SLURM_LOCALID`` of the launcher's own step; the MPI variables win.
Ranks direct-launched by ``srun --mpi=pmix`` (only ``PMIX_RANK``) or ``--mpi=pmi2``
(``PMI_RANK``/``PMI_SIZE`` without ``MPI_LOCALRANKID``) are read by the Slurm
environment instead, which has the full layout.

===============================  ============================================
Open MPI                         ``OMPI_COMM_WORLD_RANK``, ``_SIZE``,
                                 ``_LOCAL_RANK``, ``_LOCAL_SIZE``;
                                 ``OMPI_MCA_orte_num_nodes`` (node count);
                                 ``OMPI_MCA_ess_base_jobid`` (job id)
MPICH / Intel MPI (hydra)        ``PMI_RANK``, ``PMI_SIZE``, ``MPI_LOCALRANKID``,
                                 ``MPI_LOCALNRANKS``
MVAPICH2                         ``MV2_COMM_WORLD_RANK``, ``_SIZE``,
                                 ``_LOCAL_RANK``, ``_LOCAL_SIZE``
all                              ``MASTER_ADDR``, ``MASTER_PORT`` (optional);
                                 ``PBS_NODEFILE``, ``PBS_JOBID`` (PBS master)
===============================  ============================================
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Mapping
from typing import Any, ClassVar, Optional

from hpc.environments.base import (
    DistInfo,
    TableEnvironment,
    free_port,
    node_local_master,
)
from hpc.environments.pals import pbs_master
from hpc.environments.slurm import allocation_master

__all__ = ["MPIEnvironment", "OpenMPIEnvironment", "HydraEnvironment", "MVAPICH2Environment",
           "broadcast_master", "mpi4py_world"]

logger = logging.getLogger(__name__)

#: MPI launcher -> ABI family of the libmpi its ranks must load.
_ABI = {"openmpi": "openmpi", "mpich": "mpich", "mvapich2": "mpich"}
#: How to point mpi4py at the launcher's library, shown whenever it would load another.
ABI_HINT = ("HINT: for MPICH make a link <dir>/libmpi.so.12 -> libmpich.so.12 and export "
             "MPI4PY_LIBMPI=<dir>/libmpi.so.12 LD_LIBRARY_PATH=<dir>")


class MPIEnvironment(TableEnvironment):
    """An MPI process manager: a variable table, and a master found at init time."""

    @classmethod
    def master(cls, info: DistInfo, environ: Mapping[str, str]) -> Optional[DistInfo]:
        """mpi4py broadcast of rank 0's host and a free port, else every rank on this
        node (:func:`~hpc.environments.base.node_local_master`), else the first host of
        the Slurm allocation (:func:`~hpc.environments.slurm.allocation_master`), else
        the first host of a PBS/Torque job's ``PBS_NODEFILE``
        (:func:`~hpc.environments.pals.pbs_master`)."""
        return (broadcast_master(info) or node_local_master(info)
                or allocation_master(info, environ) or pbs_master(info, environ))


class OpenMPIEnvironment(MPIEnvironment):
    """Open MPI's ``mpirun``/``mpiexec`` (ORTE or PRRTE)."""

    name = "openmpi"
    patterns = ("OMPI_*",)
    fields: ClassVar[Mapping[str, str]] = {
        "world_size": "OMPI_COMM_WORLD_SIZE",
        "rank": "OMPI_COMM_WORLD_RANK",
        "local_rank": "OMPI_COMM_WORLD_LOCAL_RANK",
        "local_world_size": "OMPI_COMM_WORLD_LOCAL_SIZE",
        "num_nodes": "OMPI_MCA_orte_num_nodes",
        "job_id": "OMPI_MCA_ess_base_jobid",
    }


class MVAPICH2Environment(MPIEnvironment):
    """MVAPICH2's ``mpirun_rsh``/``mpiexec``."""

    name = "mvapich2"
    patterns = ("MV2_*",)
    fields: ClassVar[Mapping[str, str]] = {
        "world_size": "MV2_COMM_WORLD_SIZE",
        "rank": "MV2_COMM_WORLD_RANK",
        "local_rank": "MV2_COMM_WORLD_LOCAL_RANK",
        "local_world_size": "MV2_COMM_WORLD_LOCAL_SIZE",
    }


class HydraEnvironment(MPIEnvironment):
    """MPICH and Intel MPI ``mpiexec`` (the hydra process manager)."""

    name = "mpich"
    patterns = ("PMI_*", "MPI_LOCAL*", "HYDI_*")  # HYDI_*: hydra's own control variables
    fields: ClassVar[Mapping[str, str]] = {
        "world_size": "PMI_SIZE",
        "rank": "PMI_RANK",
        "local_rank": "MPI_LOCALRANKID",
        "local_world_size": "MPI_LOCALNRANKS",
    }

    @staticmethod
    def detect(environ: Mapping[str, str]) -> bool:
        # PMI_RANK and PMI_SIZE without MPI_LOCALRANKID: srun --mpi=pmi2, read by Slurm.
        return "PMI_RANK" in environ and "PMI_SIZE" in environ and "MPI_LOCALRANKID" in environ


def broadcast_master(info: DistInfo) -> Optional[DistInfo]:
    """Rank 0's host (``127.0.0.1`` on one node) and a port it checked is free, sent to
    every rank through mpi4py; None when mpi4py is unusable for this launch."""
    comm = mpi4py_world(info.launcher)
    if comm is None:
        return None
    if (comm.Get_size(), comm.Get_rank()) != (info.world_size, info.rank):
        logger.warning(
            "mpi4py sees rank %d of %d but %s says rank %d of %d: mpi4py is linked to "
            "another MPI library than the launcher's; not using it.\n%s, or rebuild "
            "mpi4py against the launcher's MPI.",
            comm.Get_rank(), comm.Get_size(), info.launcher, info.rank, info.world_size,
            ABI_HINT)
        return None
    single = info.local_world_size == info.world_size
    mine = None
    if info.rank == 0:
        mine = (info.master_addr or ("127.0.0.1" if single else socket.gethostname()),
                info.master_port or free_port())
    addr, port = comm.bcast(mine, root=0)
    return info.replace(master_addr=addr, master_port=port)


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


def mpi4py_world(launcher: str = "") -> Any:
    """``mpi4py.MPI.COMM_WORLD`` (importing mpi4py initialises MPI), or None.

    None when mpi4py is not installed, cannot load its library, or would load another
    MPI ABI than ``launcher``'s (a warning with the fix is logged then).
    """
    import importlib.util

    if importlib.util.find_spec("mpi4py") is None:
        return None
    want, have = _ABI.get(launcher), _mpi4py_abi()
    if want and have and want != have:
        logger.warning(
            "mpi4py would load the %s library but %s started this process; not using it "
            "to find the master.\n%s.", have, launcher, ABI_HINT)
        return None
    try:
        from mpi4py import MPI  # noqa: PLC0415 - importing initialises MPI: only on demand

        return MPI.COMM_WORLD
    except Exception as e:  # ImportError, or RuntimeError when libmpi cannot load
        logger.debug("mpi4py unavailable: %s", e)
        return None
