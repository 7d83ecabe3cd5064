"""The master address: where rank 0's store listens, when the launcher does not say.

:func:`resolve_master` keeps what is known and otherwise asks the launcher's own
environment (its ``master(info, environ)`` hook, e.g.
:meth:`hpc.environments.mpi.MPIEnvironment.master`); :func:`from_mpi4py` reads the whole
layout from mpi4py (``HPC_LAUNCHER=mpi4py``). mpi4py is imported only on demand:
importing it initialises MPI.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Optional

from hpc.environments import DistInfo, Environment, by_name
from hpc.environments.mpi import ABI_HINT, MPIEnvironment, mpi4py_world
from hpc.errors import LaunchEnvironmentError, MasterAddressError

__all__ = ["from_mpi4py", "resolve_master", "ephemeral_port_warning", "ephemeral_range"]

logger = logging.getLogger(__name__)

#: Where Linux keeps the ports it hands to outgoing sockets.
EPHEMERAL_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"


def ephemeral_range(path: str = EPHEMERAL_RANGE_FILE) -> Optional[tuple[int, int]]:
    """This host's ephemeral port range ``(low, high)``, None when unknown (not Linux)."""
    try:
        with open(path, encoding="utf-8") as fh:
            low, high = (int(v) for v in fh.read().split()[:2])
    except (OSError, ValueError):
        return None
    return low, high


def ephemeral_port_warning(info: DistInfo, environ: Mapping[str, str],
                           port_range: Optional[tuple[int, int]]) -> Optional[str]:
    """A warning when an inherited ``MASTER_PORT`` lies in the ephemeral range (pure).

    Any outgoing connection on the master's host may be given that port first, and
    rank 0 then fails to listen now and then (EADDRINUSE; NVIDIA/enroot#243). Ports
    chosen by a torchrun agent or ``hpc run`` (already bound by them) are not warned.
    """
    raw = environ.get("MASTER_PORT", "").strip()
    if not raw.isdigit() or port_range is None or info.world_size == 1:
        return None
    if "TORCHELASTIC_RUN_ID" in environ or "HPC_RUN_ID" in environ:
        return None
    low, high = port_range
    if not low <= int(raw) <= high:
        return None
    return (
        f"MASTER_PORT={raw} lies in this host's ephemeral port range {low}-{high} "
        "(/proc/sys/net/ipv4/ip_local_port_range): the kernel may give it to any "
        "outgoing connection first, and rank 0 then fails now and then to listen on it "
        "(EADDRINUSE).\n"
        "HINT: unset MASTER_PORT to use the derived port (below the range), or export a "
        f"port below {low}, e.g. MASTER_PORT=29500."
    )


def _launched(environ: Mapping[str, str]) -> Optional[DistInfo]:
    """The layout the launcher's own variables give, ``HPC_LAUNCHER`` aside (None: none
    or unreadable)."""
    from hpc.environments import OVERRIDE_VARIABLE, detect

    try:
        info = detect({k: v for k, v in environ.items() if k != OVERRIDE_VARIABLE})
    except LaunchEnvironmentError:
        return None
    return info if info.launcher != "local" else None


def from_mpi4py(environ: Optional[Mapping[str, str]] = None) -> DistInfo:
    """Read the layout from ``mpi4py.MPI.COMM_WORLD`` (``HPC_LAUNCHER=mpi4py``).

    Raises:
        MasterAddressError: mpi4py cannot be used, or it sees another world size than
            the launcher's own variables say (it would load another MPI library than
            the launcher's: every process would run alone as rank 0).
    """
    import os

    launched = _launched(os.environ if environ is None else environ)
    comm = mpi4py_world(launched.launcher if launched is not None else "")
    if comm is None:
        raise MasterAddressError(
            "HPC_LAUNCHER=mpi4py but mpi4py cannot be imported"
            + (f" or would load another MPI library than {launched.launcher}'s"
               if launched is not None else "") + ".\n"
            "HINT: pip install 'torch-hpc[mpi]' (for MPICH also export MPI4PY_LIBMPI)."
        )
    if launched is not None and comm.Get_size() != launched.world_size:
        raise MasterAddressError(
            f"HPC_LAUNCHER=mpi4py: mpi4py sees {comm.Get_size()} rank(s) but "
            f"{launched.launcher} started {launched.world_size}.\nmpi4py is linked to "
            "another MPI library than the launcher's, so every process would run alone "
            "as rank 0.\n" + ABI_HINT + ", or unset HPC_LAUNCHER.")
    from mpi4py import MPI  # loaded already by mpi4py_world

    local = comm.Split_type(MPI.COMM_TYPE_SHARED)
    nodes = comm.allgather(local.Get_rank() == 0)
    node_rank = sum(nodes[: comm.Get_rank() + 1]) - 1
    return DistInfo(
        launcher="mpi4py", rank=comm.Get_rank(), world_size=comm.Get_size(),
        local_rank=local.Get_rank(), local_world_size=local.Get_size(),
        node_rank=node_rank, num_nodes=sum(nodes),
    )


def resolve_master(info: DistInfo, environ: Mapping[str, str]) -> DistInfo:
    """Fill in ``master_addr``/``master_port`` where the launcher gave none (MPI).

    Order: values already known (``MASTER_ADDR``/``MASTER_PORT``) > ``127.0.0.1`` for a
    single process > the ``master`` hook of the environment that produced ``info`` >
    :class:`MasterAddressError`.
    """
    warning = ephemeral_port_warning(info, environ, ephemeral_range())
    if warning:
        info = info.replace(warnings=(*info.warnings, warning))
    if info.master_addr and info.master_port:
        return info
    if info.world_size == 1:
        return info.replace(master_addr=info.master_addr or "127.0.0.1")
    resolved = _environment(info.launcher).master(info, environ)
    if resolved is not None:
        return resolved
    raise MasterAddressError(
        f"{info.launcher}: {info.world_size} ranks on {info.num_nodes} nodes but no master "
        "address: MPI does not export one, mpi4py is not importable and this is not a "
        "Slurm allocation.\n"
        "HINT: pip install 'torch-hpc[mpi]' (mpi4py), or pass the master explicitly, e.g. "
        "mpirun -x MASTER_ADDR=$(hostname) -x MASTER_PORT=29500 ... "
        "(MPICH: mpiexec -genv MASTER_ADDR $(hostname) -genv MASTER_PORT 29500 ...)."
    )


def _environment(launcher: str) -> type[Environment]:
    """The environment whose ``master`` hook applies to ``launcher``.

    ``mpi4py`` layouts (:func:`from_mpi4py`) are MPI's; a name no environment has (a
    hand-made :class:`DistInfo`) gets the base class, which has no fallback.
    """
    if launcher == "mpi4py":
        return MPIEnvironment
    try:
        return by_name(launcher)
    except LaunchEnvironmentError:
        return Environment
