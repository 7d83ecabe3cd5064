"""MPI launchers: Open MPI ``mpirun``, MPICH/Intel MPI ``mpiexec`` (hydra), MVAPICH2.

MPI ranks carry no master address. :func:`hpc.init_torch` resolves it (see
:func:`hpc.bootstrap.master.resolve_master`): ``MASTER_ADDR``/``MASTER_PORT`` if set, else
rank 0's address and a free port broadcast through mpi4py, else ``127.0.0.1`` when all
ranks share one node, else the first host of the Slurm allocation.

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
all                              ``MASTER_ADDR``, ``MASTER_PORT`` (optional)
===============================  ============================================
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

from hpc.environments.base import TableEnvironment

__all__ = ["OpenMPIEnvironment", "HydraEnvironment", "MVAPICH2Environment"]


class OpenMPIEnvironment(TableEnvironment):
    """Open MPI's ``mpirun``/``mpiexec`` (ORTE or PRRTE)."""

    name = "openmpi"
    fields: ClassVar[Mapping[str, str]] = {
        "world_size": "OMPI_COMM_WORLD_SIZE",
        "rank": "OMPI_COMM_WORLD_RANK",
        "local_rank": "OMPI_COMM_WORLD_LOCAL_RANK",
        "local_world_size": "OMPI_COMM_WORLD_LOCAL_SIZE",
        "num_nodes": "OMPI_MCA_orte_num_nodes",
        "job_id": "OMPI_MCA_ess_base_jobid",
    }


class MVAPICH2Environment(TableEnvironment):
    """MVAPICH2's ``mpirun_rsh``/``mpiexec``."""

    name = "mvapich2"
    fields: ClassVar[Mapping[str, str]] = {
        "world_size": "MV2_COMM_WORLD_SIZE",
        "rank": "MV2_COMM_WORLD_RANK",
        "local_rank": "MV2_COMM_WORLD_LOCAL_RANK",
        "local_world_size": "MV2_COMM_WORLD_LOCAL_SIZE",
    }


class HydraEnvironment(TableEnvironment):
    """MPICH and Intel MPI ``mpiexec`` (the hydra process manager)."""

    name = "mpich"
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
