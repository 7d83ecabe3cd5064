"""Flux: tasks started by ``flux run`` / ``flux submit`` (LLNL's resource manager).

Flux cannot run here; ``tests/fixtures/env/flux_run_env.txt`` is built from the Flux
documentation (the fixture README cites it).

=======================  =========================================================
``FLUX_TASK_RANK``       global rank; marks a Flux task (required)
``FLUX_TASK_LOCAL_ID``   rank on this node
``FLUX_JOB_SIZE``        number of tasks
``FLUX_JOB_NNODES``      number of nodes
``FLUX_JOB_ID``          the job id (informational)
``MASTER_ADDR``          override the master address
``MASTER_PORT``          override the master port
=======================  =========================================================

Flux exports no per-node task count: with the default block layout it is
``FLUX_JOB_SIZE / FLUX_JOB_NNODES``; an uneven layout gets a warning. Flux also exports
``PMI_RANK``/``PMI_SIZE``/``PMI_FD`` (its PMI server) and no host list, so the master is
rank 0's host sent through mpi4py (over Flux's PMI), ``127.0.0.1`` on one node, or a
clear error.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar, Optional

from hpc.environments.base import DistInfo, TableEnvironment, env_int, node_local_master
from hpc.errors import MasterAddressError

__all__ = ["FluxEnvironment"]


class FluxEnvironment(TableEnvironment):
    """Tasks of a Flux job."""

    name = "flux"
    patterns = ("FLUX_*",)
    fields: ClassVar[Mapping[str, str]] = {
        "world_size": "FLUX_JOB_SIZE",
        "rank": "FLUX_TASK_RANK",
        "local_rank": "FLUX_TASK_LOCAL_ID",
        "local_world_size": "FLUX_JOB_SIZE",  # replaced in read(): Flux has no local size
        "num_nodes": "FLUX_JOB_NNODES",
        "job_id": "FLUX_JOB_ID",
    }

    @staticmethod
    def detect(environ: Mapping[str, str]) -> bool:
        return "FLUX_TASK_RANK" in environ

    @classmethod
    def read(cls, environ: Mapping[str, str]) -> DistInfo:
        world = env_int(environ, "FLUX_JOB_SIZE", source="flux")
        nodes = max(1, min(world, env_int(environ, "FLUX_JOB_NNODES", default=1,
                                          source="flux")))
        per_node = -(-world // nodes)  # block layout: the first nodes hold the extra task
        warnings: tuple[str, ...] = ()
        if world % nodes:
            warnings = (
                f"flux: FLUX_JOB_SIZE={world} tasks on FLUX_JOB_NNODES={nodes} nodes is "
                f"uneven; assuming {per_node} tasks per node in rank order (Flux exports "
                "no per-node count), so local_world_size/node_rank may be off.\n"
                "HINT: use a task count that is a multiple of the node count "
                "(flux run -N2 --tasks-per-node=4 ...).",
            )
        info = super().read(environ)
        return info.replace(local_world_size=per_node, num_nodes=nodes, warnings=warnings,
                            node_rank=min(info.rank // per_node, nodes - 1))

    @classmethod
    def master(cls, info: DistInfo, environ: Mapping[str, str]) -> Optional[DistInfo]:
        """mpi4py broadcast of rank 0's host, else every rank on this node, else an error
        (Flux exports no host list)."""
        from hpc.environments.mpi import broadcast_master

        found = broadcast_master(info) or node_local_master(info)
        if found is not None:
            return found
        raise MasterAddressError(
            f"flux: {info.world_size} tasks on {info.num_nodes} nodes but no master "
            "address: Flux exports no host list and mpi4py cannot be used.\n"
            "Rank 0's host is sent to the other tasks through mpi4py over Flux's PMI.\n"
            "HINT: pip install 'torch-hpc[mpi]' (mpi4py built for the MPI Flux runs), or "
            "pass the master: flux run --env=MASTER_ADDR=<first host of the job> "
            "--env=MASTER_PORT=29500 ..."
        )
