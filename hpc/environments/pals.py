"""HPE Cray PALS: PBS Pro's ``mpiexec`` on HPE Cray EX systems (Polaris, Aurora, ...).

PALS cannot run here; ``tests/fixtures/env/pals_mpiexec_env.txt`` is built from HPE's
PALS documentation (the fixture README cites it).

=========================  =======================================================
``PALS_RANKID``            global rank; marks a PALS launch (required)
``PALS_LOCAL_RANKID``      rank on this node
``PALS_NODEID``            node index
``PALS_LOCAL_SIZE``        processes on this node
``PMI_SIZE``               number of processes (PALS has no ``PALS_*`` world size)
``PBS_JOBID``              the PBS job id (informational, and the master port)
``PBS_NODEFILE``           the job's hosts, one line per slot: the master is its first
                           host (read at init, only when ``MASTER_ADDR`` is unset)
``MASTER_ADDR``            override the master address
``MASTER_PORT``            override the derived master port
=========================  =======================================================

PALS also sets ``PMI_RANK``, ``PMI_LOCAL_RANK`` and ``PMI_LOCAL_SIZE`` (equal to the
``PALS_*`` values). The derived master port is
``15000 + (job_number * 64 + "pbs") % 17000``, from the leading digits of ``PBS_JOBID``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar, Optional

from hpc.environments.base import (
    DistInfo,
    TableEnvironment,
    derive_port,
    node_local_master,
    read_hostfile,
)

__all__ = ["PALSEnvironment", "pbs_master"]


def pbs_master(info: DistInfo, environ: Mapping[str, str]) -> Optional[DistInfo]:
    """Inside a PBS job (``PBS_NODEFILE`` set): its first host and a port derived from
    ``PBS_JOBID``, else None. Known values are kept. Also the fallback of hydra's
    ``mpiexec`` under PBS/Torque without mpi4py."""
    path = environ.get("PBS_NODEFILE")
    if not path:
        return None
    job = environ.get("PBS_JOBID", "0")
    number = job.split(".", 1)[0]
    host = info.master_addr or read_hostfile(path, "PBS_NODEFILE")[0]
    return info.replace(master_addr=host,
                        master_port=info.master_port or derive_port(number, "pbs"))


class PALSEnvironment(TableEnvironment):
    """Ranks started by Cray PALS ``mpiexec`` (PBS Pro on HPE Cray)."""

    name = "pals"
    patterns = ("PALS_*", "PBS_*")
    fields: ClassVar[Mapping[str, str]] = {
        "world_size": "PMI_SIZE",
        "rank": "PALS_RANKID",
        "local_rank": "PALS_LOCAL_RANKID",
        "local_world_size": "PALS_LOCAL_SIZE",
        "node_rank": "PALS_NODEID",
        "job_id": "PBS_JOBID",
    }

    @staticmethod
    def detect(environ: Mapping[str, str]) -> bool:
        return "PALS_RANKID" in environ

    @classmethod
    def master(cls, info: DistInfo, environ: Mapping[str, str]) -> Optional[DistInfo]:
        """First host of ``PBS_NODEFILE``, else every rank on this node."""
        return pbs_master(info, environ) or node_local_master(info)
