"""MPI launchers: Open MPI ``mpirun``, MPICH/Intel MPI ``mpiexec`` (hydra), MVAPICH2.

MPI ranks carry no master address. :func:`hpc.init_torch` resolves it (see
:func:`hpc.bootstrap.preflight.resolve_master`): ``MASTER_ADDR``/``MASTER_PORT`` if set, else
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

from hpc.environments.base import DistInfo, Environment, env_int, master_port

__all__ = ["OpenMPIEnvironment", "HydraEnvironment", "MVAPICH2Environment"]


class _MPIEnvironment(Environment):
    """An MPI process manager: :attr:`variables` names the variable behind each field
    (submitit's ``_env`` table) and one reader does the rest."""

    #: DistInfo field -> variable. ``world_size``, ``rank``, ``local_rank`` and
    #: ``local_world_size`` are required; ``num_nodes`` and ``job_id`` are optional.
    variables: ClassVar[Mapping[str, str]] = {}

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        cls.rank_var = cls.variables["rank"]  # named in cross-launcher rank errors

    @classmethod
    def detect(cls, environ: Mapping[str, str]) -> bool:
        return cls.variables["world_size"] in environ

    @classmethod
    def read(cls, environ: Mapping[str, str]) -> DistInfo:
        var, src = cls.variables, cls.name
        world = env_int(environ, var["world_size"], source=src)
        rank = env_int(environ, var["rank"], source=src)
        local_rank = env_int(environ, var["local_rank"], source=src)
        lws = env_int(environ, var["local_world_size"], source=src)
        # MPI does not export the node index; with the usual block mapping (equal ranks
        # per node, filled in order) it is rank // local size. A ragged layout still gets
        # correct ranks; only node_rank is approximate there.
        num_nodes = 0
        if "num_nodes" in var:
            num_nodes = env_int(environ, var["num_nodes"], default=0, source=src)
        if num_nodes <= 0:
            num_nodes = max(1, -(-world // lws))
        return DistInfo(
            launcher=src,
            rank=rank,
            local_rank=local_rank,
            world_size=world,
            local_world_size=lws,
            node_rank=min(rank // lws, num_nodes - 1),
            num_nodes=num_nodes,
            master_addr=environ.get("MASTER_ADDR") or None,
            master_port=master_port(environ, src),
            job_id=environ.get(var["job_id"]) if "job_id" in var else None,
        )


class OpenMPIEnvironment(_MPIEnvironment):
    """Open MPI's ``mpirun``/``mpiexec`` (ORTE or PRRTE)."""

    name = "openmpi"
    variables = {
        "world_size": "OMPI_COMM_WORLD_SIZE",
        "rank": "OMPI_COMM_WORLD_RANK",
        "local_rank": "OMPI_COMM_WORLD_LOCAL_RANK",
        "local_world_size": "OMPI_COMM_WORLD_LOCAL_SIZE",
        "num_nodes": "OMPI_MCA_orte_num_nodes",
        "job_id": "OMPI_MCA_ess_base_jobid",
    }


class MVAPICH2Environment(_MPIEnvironment):
    """MVAPICH2's ``mpirun_rsh``/``mpiexec``."""

    name = "mvapich2"
    variables = {
        "world_size": "MV2_COMM_WORLD_SIZE",
        "rank": "MV2_COMM_WORLD_RANK",
        "local_rank": "MV2_COMM_WORLD_LOCAL_RANK",
        "local_world_size": "MV2_COMM_WORLD_LOCAL_SIZE",
    }


class HydraEnvironment(_MPIEnvironment):
    """MPICH and Intel MPI ``mpiexec`` (the hydra process manager)."""

    name = "mpich"
    variables = {
        "world_size": "PMI_SIZE",
        "rank": "PMI_RANK",
        "local_rank": "MPI_LOCALRANKID",
        "local_world_size": "MPI_LOCALNRANKS",
    }

    @staticmethod
    def detect(environ: Mapping[str, str]) -> bool:
        # PMI_RANK and PMI_SIZE without MPI_LOCALRANKID: srun --mpi=pmi2, read by Slurm.
        return "PMI_RANK" in environ and "PMI_SIZE" in environ and "MPI_LOCALRANKID" in environ
