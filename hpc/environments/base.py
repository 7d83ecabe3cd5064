"""The :class:`DistInfo` record, the :class:`Environment` interface and its
:class:`TableEnvironment` base for launchers described by a variable table.

An environment is a pure translation of one launcher's variables into a
:class:`DistInfo`. ``detect(environ)`` says whether the launcher is present and
``read(environ)`` does the translation; neither touches ``os.environ``, the network or
mpi4py, so both are tested with plain dicts. Only the optional ``master(info, environ)``
hook, called at init time by :func:`hpc.bootstrap.master.resolve_master`, may look
further (sockets, ``/proc``, mpi4py) to find a master address the launcher does not
export; :func:`node_local_master` and :func:`free_port` are its helpers.
"""

from __future__ import annotations

import dataclasses
import os
import socket
from collections.abc import Mapping
from typing import ClassVar, Optional

from hpc.errors import LaunchEnvironmentError

__all__ = ["DistInfo", "Environment", "TableEnvironment", "env_int", "master_port",
           "derive_port", "free_port", "launcher_pid", "node_local_master", "read_hostfile",
           "PORT_BASE", "PORT_SPAN"]

#: Derived master ports live in [PORT_BASE, PORT_BASE + PORT_SPAN): below Linux's
#: ephemeral range (32768-60999) so a derived port is never taken by an outgoing socket.
PORT_BASE = 15000
PORT_SPAN = 17000
#: Process names of MPI process managers, searched by :func:`launcher_pid`.
_PROCESS_MANAGERS = ("hydra_pmi_proxy", "orted", "prted", "mpirun", "mpiexec", "prterun")


@dataclasses.dataclass(frozen=True)
class DistInfo:
    """Where this process sits in a distributed launch.

    Attributes:
        launcher: Name of the environment that produced this record: the ``name`` of
            the environment in :data:`hpc.environments.ORDER` that matched (or that
            ``HPC_LAUNCHER`` chose), ``hpc-run`` for torchrun's reader under ``hpc run``,
            or ``mpi4py``.
        rank: Global rank, ``0 <= rank < world_size``.
        local_rank: Rank among the processes of this node.
        world_size: Number of processes in the job.
        local_world_size: Number of processes on this node.
        node_rank: Index of this node, ``0 <= node_rank < num_nodes``.
        num_nodes: Number of nodes.
        master_addr: Host of rank 0's rendezvous store, ``None`` when the launcher
            does not say (MPI); :func:`hpc.init_torch` resolves it then.
        master_port: TCP port of that store, ``None`` when unknown.
        job_id: The scheduler's job id (``"slurm:1234.0"`` style), informational.
        warnings: Things the reader noticed that are not fatal (shown by ``init``).
    """

    launcher: str
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    node_rank: int = 0
    num_nodes: int = 1
    master_addr: Optional[str] = None
    master_port: Optional[int] = None
    job_id: Optional[str] = None
    warnings: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        checks = [
            ("world_size", self.world_size >= 1),
            ("rank", 0 <= self.rank < self.world_size),
            ("local_world_size", 1 <= self.local_world_size <= self.world_size),
            ("local_rank", 0 <= self.local_rank < self.local_world_size),
            ("num_nodes", 1 <= self.num_nodes <= self.world_size),
            ("node_rank", 0 <= self.node_rank < self.num_nodes),
        ]
        bad = [name for name, ok in checks if not ok]
        if bad:
            raise LaunchEnvironmentError(
                f"{self.launcher}: inconsistent layout ({', '.join(bad)} out of range): "
                f"rank={self.rank} world_size={self.world_size} local_rank={self.local_rank} "
                f"local_world_size={self.local_world_size} node_rank={self.node_rank} "
                f"num_nodes={self.num_nodes}.\n"
                "The launcher's variables contradict each other, usually because some were "
                "exported by hand or inherited from an outer launch.\n"
                "HINT: unset hand-set RANK/WORLD_SIZE/LOCAL_RANK variables, or force the "
                "launcher with HPC_LAUNCHER=<name>."
            )
        if self.master_port is not None and not 0 < self.master_port < 65536:
            raise LaunchEnvironmentError(
                f"{self.launcher}: master port {self.master_port} is not a TCP port.\n"
                "HINT: set MASTER_PORT to a free port in 1024-65535."
            )

    @property
    def is_master(self) -> bool:
        """True on global rank 0."""
        return self.rank == 0

    @property
    def is_local_master(self) -> bool:
        """True on local rank 0 of each node."""
        return self.local_rank == 0

    def replace(self, **changes: object) -> "DistInfo":
        """Return a copy with ``changes`` applied (validated again)."""
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]

    def describe(self) -> str:
        """One line for logs: ``slurm rank 3/8 local 1/4 node 1/2 master node1:15042``."""
        master = f"{self.master_addr}:{self.master_port}" if self.master_addr else "unresolved"
        return (
            f"{self.launcher} rank {self.rank}/{self.world_size} "
            f"local {self.local_rank}/{self.local_world_size} "
            f"node {self.node_rank}/{self.num_nodes} master {master}"
        )


class Environment:
    """One launcher. Subclasses set :attr:`name` and implement ``detect`` and ``read``."""

    name: ClassVar[str] = ""
    #: The variable holding the global rank, named in inconsistency errors.
    rank_var: ClassVar[str] = ""
    #: The variables ``detect``/``read`` look at, beyond those of ``patterns``.
    variables: ClassVar[tuple[str, ...]] = ()
    #: Shell-style patterns (``SLURM_*``) of this launcher's own variables: every
    #: variable they match belongs to it, so tests clear them all.
    patterns: ClassVar[tuple[str, ...]] = ()

    @staticmethod
    def detect(environ: Mapping[str, str]) -> bool:  # pragma: no cover - interface
        """Return True when this launcher started the current process."""
        raise NotImplementedError

    @staticmethod
    def read(environ: Mapping[str, str]) -> DistInfo:  # pragma: no cover - interface
        """Translate ``environ`` into a :class:`DistInfo`."""
        raise NotImplementedError

    @classmethod
    def master(cls, info: DistInfo, environ: Mapping[str, str]) -> Optional[DistInfo]:
        """This launcher's own fallback for a master address it did not export.

        Called at init time by :func:`hpc.bootstrap.master.resolve_master`, never by
        ``detect``/``read``, and only for more than one rank with ``master_addr`` or
        ``master_port`` unknown. It may import mpi4py (lazily, inside) or read ``/proc``.

        Returns:
            ``info`` with both filled in, or None: no fallback of this launcher (the
            caller then raises :class:`~hpc.errors.MasterAddressError`).
        """
        return None


class TableEnvironment(Environment):
    """A launcher described by a table: :attr:`fields` names the variable behind each
    :class:`DistInfo` field (submitit's ``_env``) and one generic reader does the rest.

    ``detect`` is true when the world-size variable is set. The launcher does not export
    the node index: with the usual block mapping (equal ranks per node, filled in order)
    it is ``rank // local_world_size``, and the node count, when the table has none, is
    ``ceil(world_size / local_world_size)``; a table with ``node_rank`` (PALS) reads it.
    ``MASTER_ADDR``/``MASTER_PORT`` are read when set.
    """

    #: DistInfo field -> variable. ``world_size``, ``rank``, ``local_rank`` and
    #: ``local_world_size`` are required; ``num_nodes``, ``node_rank`` and ``job_id``
    #: are optional.
    fields: ClassVar[Mapping[str, str]] = {}

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        if cls.fields:
            cls.rank_var = cls.fields["rank"]  # named in cross-launcher rank errors
            cls.variables = (*cls.fields.values(), "MASTER_ADDR", "MASTER_PORT")

    @classmethod
    def detect(cls, environ: Mapping[str, str]) -> bool:
        return cls.fields["world_size"] in environ

    @classmethod
    def read(cls, environ: Mapping[str, str]) -> DistInfo:
        var, src = cls.fields, cls.name
        world = env_int(environ, var["world_size"], source=src)
        rank = env_int(environ, var["rank"], source=src)
        local_rank = env_int(environ, var["local_rank"], source=src)
        lws = env_int(environ, var["local_world_size"], source=src)
        # A ragged layout still gets correct ranks; only node_rank is approximate there.
        num_nodes = 0
        if "num_nodes" in var:
            num_nodes = env_int(environ, var["num_nodes"], default=0, source=src)
        if num_nodes <= 0:
            num_nodes = max(1, -(-world // lws))
        node_rank = min(rank // lws, num_nodes - 1)
        if "node_rank" in var:
            node_rank = env_int(environ, var["node_rank"], default=node_rank, source=src)
        return DistInfo(
            launcher=src,
            rank=rank,
            local_rank=local_rank,
            world_size=world,
            local_world_size=lws,
            node_rank=node_rank,
            num_nodes=num_nodes,
            master_addr=environ.get("MASTER_ADDR") or None,
            master_port=master_port(environ, src),
            job_id=environ.get(var["job_id"]) if "job_id" in var else None,
        )


def env_int(environ: Mapping[str, str], key: str, default: Optional[int] = None,
            *, source: str = "") -> int:
    """Read an integer variable, with a clear error when it is missing or malformed."""
    raw = environ.get(key)
    if raw is None or raw.strip() == "":
        if default is not None:
            return default
        raise LaunchEnvironmentError(
            f"{source or 'launch environment'}: {key} is not set.\n"
            f"The launcher was detected from other variables but {key} is missing.\n"
            f"HINT: launch through the launcher itself, or export {key}."
        )
    try:
        return int(raw.strip())
    except ValueError as e:
        raise LaunchEnvironmentError(
            f"{source or 'launch environment'}: {key}={raw!r} is not an integer.\n"
            f"HINT: fix or unset {key}."
        ) from e


def master_port(environ: Mapping[str, str], source: str) -> Optional[int]:
    """``MASTER_PORT`` when set (:class:`DistInfo` checks the range), else None."""
    return env_int(environ, "MASTER_PORT", source=source) if environ.get("MASTER_PORT") else None


def derive_port(*parts: object) -> int:
    """A stable port in ``[PORT_BASE, PORT_BASE + PORT_SPAN)`` from job identifiers.

    Consecutive job ids map to different ports and each step of a job gets its own
    port, so concurrent jobs and steps sharing a node do not collide.
    """
    acc = 0
    for part in parts:
        text = str(part)
        value = int(text) if text.isdigit() else sum(ord(c) * 131 ** i for i, c in enumerate(text))
        acc = acc * 64 + value
    return PORT_BASE + acc % PORT_SPAN


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


def node_local_master(info: DistInfo) -> Optional[DistInfo]:
    """Every rank on this node: ``127.0.0.1`` and a port derived from the job, else None.

    The job id when the launcher names one (Open MPI does), else the process manager's
    pid (:func:`launcher_pid`), which all local ranks share and concurrent ``mpiexec``
    runs in one allocation do not. Known values are kept.
    """
    if info.local_world_size != info.world_size:
        return None
    ident = info.job_id or launcher_pid()
    return info.replace(master_addr=info.master_addr or "127.0.0.1",
                        master_port=info.master_port or derive_port("mpi", ident))


def read_hostfile(path: str, variable: str) -> list[str]:
    """The host names of a scheduler's host file (``PBS_NODEFILE``, ``LSB_DJOB_HOSTFILE``):
    the first word of each non-blank line, in order, one line per slot.

    Raises:
        MasterAddressError: the file named by ``variable`` cannot be read or is empty.
    """
    from hpc.errors import MasterAddressError

    try:
        with open(path, encoding="utf-8") as fh:
            hosts = [line.split()[0] for line in fh if line.strip()]
    except OSError as e:
        raise MasterAddressError(
            f"cannot read the host file {variable}={path}: {e}.\n"
            "The master address is the first host of that file.\n"
            "HINT: run on a node that sees the file, or export MASTER_ADDR and MASTER_PORT."
        ) from e
    if not hosts:
        raise MasterAddressError(
            f"the host file {variable}={path} lists no hosts.\n"
            "The master address is the first host of that file.\n"
            "HINT: export MASTER_ADDR=<rank 0's host> and MASTER_PORT=<a free port>."
        )
    return hosts
