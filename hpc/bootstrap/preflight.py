"""Master resolution and the fast pre-flight that runs before torch.distributed init.

The pre-flight turns the two classic silent hangs into errors within seconds:

* an unreachable master (wrong ``MASTER_ADDR``, rank 0 never started, a firewall):
  every other rank probes ``host:port`` with plain sockets and fails at the deadline
  naming both, instead of waiting out the 30-minute default timeout;
* a missing rank (``--ntasks`` vs ``--ntasks-per-node``, a dead process): rank 0 waits
  for every rank's key in its store and reports exactly which ranks never came.

It also stops nccl ranks that would share one GPU (see :mod:`hpc.bootstrap.gpubind`) before NCCL
fails on them with "Duplicate GPU detected" or stalls.

Non-master ranks only open the torch store once rank 0's port accepts connections, so
no client falls into the store's reconnect back-off.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from collections.abc import Mapping
from datetime import timedelta
from typing import Any, Optional

from hpc.bootstrap import gpubind
from hpc.environments import DistInfo
from hpc.environments.base import derive_port
from hpc.errors import LaunchEnvironmentError, MasterAddressError, RendezvousError

__all__ = ["resolve_master", "confirm_init", "from_mpi4py", "free_port", "preflight", "launcher_pid"]

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


def _probe(addr: str, port: int, rank: int, deadline: float) -> None:
    """Wait until ``addr:port`` accepts TCP connections, or fail at ``deadline``."""
    last: Exception | None = None
    try:
        infos = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise RendezvousError(
            f"rank {rank}: cannot resolve master address {addr!r} ({e}).\n"
            "MASTER_ADDR (or the first host of the nodelist) is not a known host name "
            "on this node.\n"
            "HINT: export MASTER_ADDR=<an address of rank 0's node that every node can "
            "reach>, e.g. $(scontrol show hostnames $SLURM_JOB_NODELIST | head -n1)."
        ) from e
    while True:
        for family, stype, proto, _, sockaddr in infos:
            try:
                with socket.socket(family, stype, proto) as s:
                    s.settimeout(max(0.05, min(1.0, deadline - time.monotonic())))
                    s.connect(sockaddr)
                    return
            except OSError as e:
                last = e
        if time.monotonic() >= deadline:
            raise RendezvousError(
                f"rank {rank}: master {addr}:{port} is unreachable ({last}) after "
                f"waiting {_since(deadline)}.\n"
                "Rank 0 never opened its store there: it did not start, crashed before "
                "init, runs on another host than MASTER_ADDR names, or a firewall blocks "
                "the port.\n"
                "HINT: check rank 0's log first; make sure MASTER_ADDR/MASTER_PORT are the "
                "same on every rank and reachable (HPC_CONNECT_TIMEOUT sets this wait)."
            ) from last
        time.sleep(0.02)


_START: dict[str, float] = {}


def _since(deadline: float) -> str:
    return f"{deadline - _START.get('t', deadline):.1f}s"


def preflight(info: DistInfo, connect_timeout: float, pg_timeout: timedelta,
              environ: Optional[Mapping[str, str]] = None,
              gpu: Optional[gpubind.GpuClaim] = None) -> Any:
    """Bring every rank together on rank 0's TCPStore and return the store.

    ``gpu`` is the GPU this rank bound for nccl; rank 0 refuses a GPU claimed twice.

    Under torchrun (``TORCHELASTIC_USE_AGENT_STORE=True``) the agent already serves the
    store at ``MASTER_PORT``; every rank, rank 0 included, joins it as a client, and keys
    are scoped by ``TORCHELASTIC_RESTART_COUNT`` so a restarted attempt starts clean.

    Raises:
        RendezvousError: the master is unreachable, its port is taken, a rank is
            missing at the deadline, or two processes claim the same rank.
        LaunchEnvironmentError: two ranks would share one GPU under nccl (every rank).
    """
    import torch.distributed as dist

    addr, port = info.master_addr, info.master_port
    assert addr and port, "resolve_master() runs first"
    start = time.monotonic()
    _START["t"] = start
    deadline = start + connect_timeout
    env = os.environ if environ is None else environ
    agent_store = env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    if agent_store:
        _probe(addr, port, info.rank, deadline)
        store = dist.TCPStore(addr, port, None, False, timeout=pg_timeout)
        store = dist.PrefixStore(f"attempt{env.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
    elif info.rank == 0:
        try:
            store = dist.TCPStore(addr, port, None, True, timeout=pg_timeout,
                                  wait_for_workers=False)
        except Exception as e:  # DistNetworkError: bind failed
            raise RendezvousError(
                f"rank 0: cannot listen on {addr}:{port}: {e}.\n"
                "Another job or step on this node already uses the port.\n"
                "HINT: export MASTER_PORT=<a free port> (the derived port is documented "
                "under 'Master port' in the launching guide)."
            ) from e
    else:
        _probe(addr, port, info.rank, deadline)
        store = dist.TCPStore(addr, port, None, False,
                              timeout=timedelta(seconds=max(1.0, deadline - time.monotonic())))
    me = {"host": socket.gethostname(), "pid": os.getpid(), "local_rank": info.local_rank,
          "world_size": info.world_size}
    if store.add(f"hpc/pf/claim/{info.rank}", 1) != 1:
        raise RendezvousError(
            f"rank {info.rank}: another process already joined {addr}:{port} as rank "
            f"{info.rank}.\nTwo launches share the master port, or RANK was exported by "
            "hand so several processes carry the same rank.\n"
            "HINT: unset RANK/LOCAL_RANK in the job script; give concurrent jobs distinct "
            "MASTER_PORTs."
        )
    if gpu is not None:
        gpubind.publish(store, gpu)  # before joining: rank 0 then sees every claim
    store.set(f"hpc/pf/{info.rank}", json.dumps(me))
    if info.rank == 0:
        _master_wait(store, info, addr, port, deadline, start)
    else:
        _worker_wait(store, info, addr, port, deadline + 10.0)
    logger.debug("pre-flight done in %.3fs", time.monotonic() - start)
    return store


def _master_wait(store: Any, info: DistInfo, addr: str, port: int,
                 deadline: float, start: float) -> None:
    keys = [f"hpc/pf/{r}" for r in range(info.world_size)]
    try:
        store.wait(keys, timedelta(seconds=max(0.01, deadline - time.monotonic())))
    except Exception as e:
        missing = [r for r in range(info.world_size) if not store.check([keys[r]])]
        shown = ", ".join(map(str, missing[:16])) + (" ..." if len(missing) > 16 else "")
        msg = (
            f"rank 0: {len(missing)} of {info.world_size} ranks did not join "
            f"{addr}:{port} within {time.monotonic() - start:.1f}s: missing rank(s) {shown}.\n"
            "They were never started, crashed before init, or run with another world "
            "size or master (e.g. --ntasks=N with --ntasks-per-node, or different "
            "MASTER_PORT per node).\n"
            "HINT: check the missing ranks' logs; under Slurm compare SLURM_NTASKS with "
            "what srun started (`hpc env` on each node shows the detected layout)."
        )
        _abort(store, "abort:" + msg, info.world_size - 1 - len(missing))
        raise RendezvousError(msg) from e
    shared = gpubind.find_shared(store)
    if shared is not None:
        _abort(store, "abort-launch:" + str(shared), info.world_size - 1)
        raise shared
    store.set("hpc/pf/go", "ok")


def _abort(store: Any, verdict: str, readers: int, linger: float = 3.0) -> None:
    """Publish an abort verdict; wait (briefly) until ``readers`` ranks have read it.

    Rank 0 serves the store: exiting at once could close it before the other ranks
    fetched the reason, and they would report a vanished master instead.
    """
    store.set("hpc/pf/go", verdict)
    end = time.monotonic() + linger
    while readers > 0 and time.monotonic() < end:
        if store.add("hpc/pf/verdict-read", 0) >= readers:
            return
        time.sleep(0.01)


def _worker_wait(store: Any, info: DistInfo, addr: str, port: int, deadline: float) -> None:
    try:
        store.wait(["hpc/pf/go"], timedelta(seconds=max(0.01, deadline - time.monotonic())))
        verdict = store.get("hpc/pf/go").decode()
        if verdict != "ok":
            store.add("hpc/pf/verdict-read", 1)  # rank 0 may leave now
    except Exception as e:
        raise RendezvousError(
            f"rank {info.rank}: connected to {addr}:{port} but rank 0 never confirmed "
            "that all ranks joined.\nRank 0 died or stalled during start-up.\n"
            "HINT: check rank 0's log."
        ) from e
    if verdict.startswith("abort"):
        kind, reason = verdict.split(":", 1)
        error = LaunchEnvironmentError if kind == "abort-launch" else RendezvousError
        raise error(f"rank {info.rank}: rank 0 aborted start-up: {reason}")


def confirm_init(store: Any, info: DistInfo, timeout: float) -> None:
    """Return only once every rank has finished ``init_process_group``.

    Without it a rank that returns from init and fails at once (a bad argument, a
    missing file) closes its sockets while peers are still connecting their gloo mesh,
    and they die with "Connection closed by peer", hiding the real cause. One counter
    in the store; the last rank to arrive releases the others.
    """
    if store.add("hpc/pf/initialised", 1) == info.world_size:
        store.set("hpc/pf/all-initialised", "1")
    try:
        store.wait(["hpc/pf/all-initialised"], timedelta(seconds=max(1.0, timeout)))
    except Exception as e:
        raise RendezvousError(
            f"rank {info.rank}: initialised, but not every rank of {info.world_size} "
            f"finished init_process_group within {timeout:.0f}s.\n"
            "A rank crashed or stalled while connecting to its peers.\n"
            "HINT: check the other ranks' logs for the first error."
        ) from e
