"""MPI launchers: Open MPI ``mpirun``, MPICH/Intel MPI ``mpiexec`` (hydra), MVAPICH2.

MPI ranks carry no master address. :func:`hpc.init_torch` resolves it (see
:func:`hpc.rendezvous.resolve_master`): ``MASTER_ADDR``/``MASTER_PORT`` if set, else
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

from hpc.environments.base import DistInfo, Environment, env_int

__all__ = ["OpenMPIEnvironment", "HydraEnvironment", "MVAPICH2Environment"]


def _read(environ: Mapping[str, str], launcher: str, keys: tuple[str, str, str, str],
          job_key: str = "") -> DistInfo:
    rank_k, size_k, lrank_k, lsize_k = keys
    world = env_int(environ, size_k, source=launcher)
    rank = env_int(environ, rank_k, source=launcher)
    local_rank = env_int(environ, lrank_k, source=launcher)
    lws = env_int(environ, lsize_k, source=launcher)
    # MPI does not export the node index; with the usual block mapping (equal ranks
    # per node, filled in order) it is rank // local size. A ragged layout still gets
    # correct ranks; only node_rank is approximate there.
    num_nodes = env_int(environ, "OMPI_MCA_orte_num_nodes", default=0, source=launcher)
    if num_nodes <= 0:
        num_nodes = max(1, -(-world // lws))
    node_rank = min(rank // lws, num_nodes - 1)
    port = environ.get("MASTER_PORT")
    return DistInfo(
        launcher=launcher,
        rank=rank,
        local_rank=local_rank,
        world_size=world,
        local_world_size=lws,
        node_rank=node_rank,
        num_nodes=num_nodes,
        master_addr=environ.get("MASTER_ADDR") or None,
        master_port=env_int(environ, "MASTER_PORT", source=launcher) if port else None,
        job_id=environ.get(job_key) if job_key else None,
    )


class OpenMPIEnvironment(Environment):
    """Open MPI's ``mpirun``/``mpiexec`` (ORTE or PRRTE)."""

    name = "openmpi"
    rank_var = "OMPI_COMM_WORLD_RANK"

    @staticmethod
    def detect(environ: Mapping[str, str]) -> bool:
        return "OMPI_COMM_WORLD_SIZE" in environ

    @staticmethod
    def read(environ: Mapping[str, str]) -> DistInfo:
        return _read(environ, "openmpi", (
            "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
            "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE",
        ), job_key="OMPI_MCA_ess_base_jobid")


class MVAPICH2Environment(Environment):
    """MVAPICH2's ``mpirun_rsh``/``mpiexec``."""

    name = "mvapich2"
    rank_var = "MV2_COMM_WORLD_RANK"

    @staticmethod
    def detect(environ: Mapping[str, str]) -> bool:
        return "MV2_COMM_WORLD_SIZE" in environ

    @staticmethod
    def read(environ: Mapping[str, str]) -> DistInfo:
        return _read(environ, "mvapich2", (
            "MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE",
            "MV2_COMM_WORLD_LOCAL_RANK", "MV2_COMM_WORLD_LOCAL_SIZE",
        ))


class HydraEnvironment(Environment):
    """MPICH and Intel MPI ``mpiexec`` (the hydra process manager)."""

    name = "mpich"
    rank_var = "PMI_RANK"

    @staticmethod
    def detect(environ: Mapping[str, str]) -> bool:
        return "PMI_RANK" in environ and "PMI_SIZE" in environ and "MPI_LOCALRANKID" in environ

    @staticmethod
    def read(environ: Mapping[str, str]) -> DistInfo:
        return _read(environ, "mpich",
                     ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"))
