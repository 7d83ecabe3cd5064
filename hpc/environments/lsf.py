"""IBM Spectrum LSF with ``jsrun`` (CSM clusters such as Summit and Lassen).

``jsrun`` cannot run here; ``tests/fixtures/env/lsf_jsrun_env.txt`` is built from IBM's
jsrun/LSF documentation (the fixture README cites it).

==============================  ========================================================
``JSM_NAMESPACE_SIZE``          number of processes; marks a jsrun launch (required)
``JSM_NAMESPACE_RANK``          global rank
``JSM_NAMESPACE_LOCAL_RANK``    rank on this node
``JSM_NAMESPACE_LOCAL_SIZE``    processes on this node
``LSB_JOBID``                   the LSF job id (informational, and the master port)
``LSB_DJOB_HOSTFILE``           the job's hosts, one line per slot; its first host is the
                                launch (batch) node, which runs no ranks
``LSB_MCPU_HOSTS``              the same as ``host slots host slots ...`` (used when the
                                host file is unreadable)
``MASTER_ADDR``                 override the master address
``MASTER_PORT``                 override the derived master port
==============================  ========================================================

The master is the first *compute* host: the first host of ``LSB_DJOB_HOSTFILE`` (else
``LSB_MCPU_HOSTS``) after the launch node, read at init only when ``MASTER_ADDR`` is
unset; the port is ``15000 + (LSB_JOBID * 64 + "lsf") % 17000``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar, Optional

from hpc.environments.base import DistInfo, TableEnvironment, derive_port, read_hostfile
from hpc.errors import MasterAddressError

__all__ = ["LSFEnvironment", "compute_hosts"]


def compute_hosts(hosts: list[str]) -> list[str]:
    """Distinct hosts in order, without the launch node (the first one) when there are
    others: LSF lists the batch node first, with one slot, and jsrun starts no rank there."""
    distinct = list(dict.fromkeys(hosts))
    return distinct[1:] if len(distinct) > 1 else distinct


def _lsf_hosts(environ: Mapping[str, str]) -> list[str]:
    path = environ.get("LSB_DJOB_HOSTFILE")
    if path:
        try:
            return read_hostfile(path, "LSB_DJOB_HOSTFILE")
        except MasterAddressError:
            if not environ.get("LSB_MCPU_HOSTS"):
                raise
    return environ.get("LSB_MCPU_HOSTS", "").split()[::2]


class LSFEnvironment(TableEnvironment):
    """Ranks started by ``jsrun`` inside an LSF job."""

    name = "lsf"
    patterns = ("JSM_*", "LSB_*")
    fields: ClassVar[Mapping[str, str]] = {
        "world_size": "JSM_NAMESPACE_SIZE",
        "rank": "JSM_NAMESPACE_RANK",
        "local_rank": "JSM_NAMESPACE_LOCAL_RANK",
        "local_world_size": "JSM_NAMESPACE_LOCAL_SIZE",
        "job_id": "LSB_JOBID",
    }

    @classmethod
    def master(cls, info: DistInfo, environ: Mapping[str, str]) -> Optional[DistInfo]:
        """The first compute host of the job and a port derived from ``LSB_JOBID``."""
        hosts = compute_hosts(_lsf_hosts(environ))
        if not hosts:
            raise MasterAddressError(
                f"lsf: {info.world_size} ranks but no master address: neither "
                "LSB_DJOB_HOSTFILE nor LSB_MCPU_HOSTS names a host.\n"
                "jsrun ranks find rank 0's host in the LSF job's host list.\n"
                "HINT: run jsrun inside an LSF job (bsub), or export MASTER_ADDR and "
                "MASTER_PORT."
            )
        port = info.master_port or derive_port(environ.get("LSB_JOBID", "0"), "lsf")
        return info.replace(master_addr=info.master_addr or hosts[0], master_port=port)
