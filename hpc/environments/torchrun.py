"""torchrun / torch.distributed.launch / ``hpc run``.

Variables read:

=======================  ==========================================================
``RANK``                 global rank (required)
``WORLD_SIZE``           number of processes (required)
``LOCAL_RANK``           rank on this node (required; the legacy launch utility may
                         pass ``--local_rank`` instead, see :func:`parse_local_rank`)
``LOCAL_WORLD_SIZE``     processes on this node (torchrun); else ``WORLD_SIZE / NNODES``
``GROUP_RANK``           node index (torchrun); ``NODE_RANK`` is accepted too
``NNODES``               number of nodes (``hpc run`` and some wrappers)
``GROUP_WORLD_SIZE``     agents (nodes) in this world (torchrun); under an srun step with
                         more tasks the step would run several worlds, refused
``MASTER_ADDR``          rendezvous host (required)
``MASTER_PORT``          rendezvous port (required)
``TORCHELASTIC_RUN_ID``  present under torchrun: marks the variables as torchrun's own
``HPC_RUN_ID``           present under ``hpc run``: the launcher is reported as ``hpc-run``
=======================  ==========================================================
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from hpc.environments.base import (
    DistInfo,
    Environment,
    env_int,
    master_port,
    node_local_master,
)
from hpc.environments.slurm import allocation_master
from hpc.errors import LaunchEnvironmentError

__all__ = ["TorchrunEnvironment", "parse_local_rank"]


class TorchrunEnvironment(Environment):
    """torchrun (elastic), the legacy ``torch.distributed.launch`` and ``hpc run``."""

    name = "torchrun"
    rank_var = "RANK"
    variables = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                 "NODE_RANK", "NNODES", "MASTER_ADDR", "MASTER_PORT", "HPC_RUN_ID")
    patterns = ("TORCHELASTIC_*",)

    @staticmethod
    def detect(environ: Mapping[str, str]) -> bool:
        return "RANK" in environ and "WORLD_SIZE" in environ

    @staticmethod
    def read(environ: Mapping[str, str]) -> DistInfo:
        src = "torchrun"
        world = env_int(environ, "WORLD_SIZE", source=src)
        rank = env_int(environ, "RANK", source=src)
        local_rank = env_int(environ, "LOCAL_RANK", default=-1, source=src)
        if local_rank < 0:
            local_rank = rank if world == 1 else env_int(environ, "LOCAL_RANK", source=src)
        nnodes_hint = env_int(environ, "NNODES", default=0, source=src)
        lws = env_int(environ, "LOCAL_WORLD_SIZE", default=0, source=src)
        if lws == 0:
            lws = world // nnodes_hint if nnodes_hint else world
        node_rank = env_int(environ, "GROUP_RANK", default=-1, source=src)
        if node_rank < 0:
            node_rank = env_int(environ, "NODE_RANK", default=-1, source=src)
        if node_rank < 0:
            node_rank = rank // lws
        num_nodes = nnodes_hint or max(1, world // lws)
        launcher = "hpc-run" if "HPC_RUN_ID" in environ else "torchrun"
        return DistInfo(
            launcher=launcher,
            rank=rank,
            local_rank=local_rank,
            world_size=world,
            local_world_size=lws,
            node_rank=node_rank,
            num_nodes=num_nodes,
            master_addr=environ.get("MASTER_ADDR") or None,
            master_port=master_port(environ, src),
            job_id=environ.get("TORCHELASTIC_RUN_ID") or environ.get("HPC_RUN_ID"),
        )

    @classmethod
    def master(cls, info: DistInfo, environ: Mapping[str, str]) -> DistInfo | None:
        # torchrun and `hpc run` export both; RANK/WORLD_SIZE set by hand may lack them.
        return node_local_master(info) or allocation_master(info, environ)


def parse_local_rank(argv: Sequence[str]) -> tuple[int | None, list[str]]:
    """Strip the legacy ``--local_rank``/``--local-rank`` argument from ``argv``.

    ``python -m torch.distributed.launch`` (without ``--use-env``) appends
    ``--local_rank=N`` or ``--local-rank=N`` to the script's arguments. Call this before
    your own argument parser::

        local_rank, argv = parse_local_rank(sys.argv[1:])

    Returns:
        ``(local_rank or None, remaining arguments)``.
    """
    rest: list[str] = []
    found: int | None = None
    args = list(argv)
    i = 0
    while i < len(args):
        arg = args[i]
        for flag in ("--local_rank", "--local-rank"):
            if arg == flag and i + 1 < len(args):
                found = _local_rank_value(args[i + 1])
                i += 2
                break
            if arg.startswith(flag + "="):
                found = _local_rank_value(arg.split("=", 1)[1])
                i += 1
                break
        else:
            rest.append(arg)
            i += 1
    return found, rest


def _local_rank_value(raw: str) -> int:
    try:
        return int(raw)
    except ValueError as e:
        raise LaunchEnvironmentError(
            f"--local_rank={raw!r} is not an integer.\n"
            "HINT: the legacy launch utility passes --local_rank=N; do not pass it by hand."
        ) from e
