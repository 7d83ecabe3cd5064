"""Launch-environment detection: one ordered list of launchers, one ``detect``.

The first environment in :data:`ORDER` whose ``detect`` is true wins: the innermost
launcher, the one that started this very process.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Optional

from hpc import envvars
from hpc.environments.base import DistInfo, Environment
from hpc.environments.flux import FluxEnvironment
from hpc.environments.local import LocalEnvironment
from hpc.environments.lsf import LSFEnvironment
from hpc.environments.mpi import HydraEnvironment, MVAPICH2Environment, OpenMPIEnvironment
from hpc.environments.pals import PALSEnvironment
from hpc.environments.slurm import (
    SlurmEnvironment,
    expand_hostnames,
    expand_tasks_per_node,
    in_step,
)
from hpc.environments.torchrun import TorchrunEnvironment, parse_local_rank
from hpc.errors import InconsistentEnvironmentError, LaunchEnvironmentError

__all__ = [
    "ORDER", "DistInfo", "Environment", "detect", "by_name", "check_override", "launcher_names",
    "no_launcher_hint", "parse_local_rank", "expand_hostnames", "expand_tasks_per_node",
]

ORDER: tuple[type[Environment], ...] = (
    # torchrun (and `hpc run`) set per-worker variables and are often started *inside*
    # srun or mpirun (one agent per node), so they are the innermost launcher.
    TorchrunEnvironment,
    # mpirun/mpiexec inside a Slurm allocation inherit the launcher step's SLURM_*
    # variables; the MPI world is the real one, so MPI comes before Slurm.
    OpenMPIEnvironment,
    MVAPICH2Environment,
    # Cray PALS, Flux and LSF jsrun also export PMI_RANK/PMI_SIZE (PALS, Flux), so each
    # comes before hydra; started inside a Slurm job they inherit SLURM_* as MPI does.
    PALSEnvironment,
    FluxEnvironment,
    LSFEnvironment,
    HydraEnvironment,
    # srun steps, including srun --mpi=pmix/pmi2 direct launch of MPI programs, and
    # the batch script itself (one process, with a warning).
    SlurmEnvironment,
    # Nothing detected: a single process, unless a rank/size variable says otherwise
    # (see GUARD_VARIABLES).
    LocalEnvironment,
)

#: Rank and size variables of launchers (and of their PMI layers). When no environment
#: matched, any of them saying "one of several processes" (a size > 1 or a rank > 0) is
#: refused instead of starting N unrelated single processes.
GUARD_VARIABLES = (
    "PMI_SIZE", "PMI_RANK", "PMI_LOCAL_SIZE", "PMI_LOCAL_RANK", "PMIX_RANK",
    "MPI_LOCALNRANKS", "MPI_LOCALRANKID", "PALS_RANKID", "PALS_LOCAL_SIZE",
    "PALS_LOCAL_RANKID", "FLUX_JOB_SIZE", "FLUX_TASK_RANK", "JSM_NAMESPACE_SIZE",
    "JSM_NAMESPACE_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK",
    "MV2_COMM_WORLD_SIZE", "MV2_COMM_WORLD_RANK", "WORLD_SIZE", "RANK", "LOCAL_RANK",
)

#: Extra names accepted by ``HPC_LAUNCHER`` that :func:`hpc.init_torch` handles.
RUNTIME_LAUNCHERS = ("mpi4py",)
#: The variable that chooses a launcher by name, overriding detection.
OVERRIDE_VARIABLE = "HPC_LAUNCHER"


def launcher_names() -> tuple[str, ...]:
    """Every name ``HPC_LAUNCHER`` accepts, in detection order, aliases after their
    launcher (``hpc-run``: torchrun; ``hydra``/``intelmpi``: mpich), ``mpi4py`` last: the
    one list the errors and ``docs/troubleshooting.md`` show."""
    names: list[str] = []
    for env in ORDER:
        names += [env.name, *(alias for alias, of in _ALIASES.items() if of is env)]
    return (*names, *RUNTIME_LAUNCHERS)


#: Other names of some launchers.
_ALIASES: dict[str, type[Environment]] = {
    "hpc-run": TorchrunEnvironment, "hydra": HydraEnvironment, "intelmpi": HydraEnvironment}


def by_name(name: str) -> type[Environment]:
    """The environment called ``name`` (``hpc-run`` is an alias of ``torchrun``).

    Raises:
        LaunchEnvironmentError: ``name`` is not one of :func:`launcher_names` (as
            ``HPC_LAUNCHER`` would be).
        KeyError: ``mpi4py``, which has no environment of its own.
    """
    names = {env.name: env for env in ORDER}
    names.update(_ALIASES)
    if name not in names:
        check_override(name)  # an unknown name: HPC_LAUNCHER's refusal
    return names[name]


def check_override(name: str) -> None:
    """Refuse ``name`` as ``HPC_LAUNCHER`` unless it is one of :func:`launcher_names`.

    Raises:
        LaunchEnvironmentError: the value, the names it may take, HINT.
    """
    if name not in launcher_names():
        raise envvars.refusal(OVERRIDE_VARIABLE, name, "is not a known launcher (one of: "
                              f"{', '.join(launcher_names())})")


def detect(environ: Optional[Mapping[str, str]] = None) -> DistInfo:
    """Read the launch environment into a :class:`DistInfo`.

    Args:
        environ: The variables to read; ``os.environ`` when None. With a mapping given,
            nothing else is read: no ``os.environ``, no network, no mpi4py import.

    Raises:
        LaunchEnvironmentError: variables are missing or malformed, or
            ``HPC_LAUNCHER`` names an unknown launcher.
        InconsistentEnvironmentError: two launchers disagree about this process
            (e.g. ``RANK=3`` vs ``SLURM_PROCID=1``), showing both sides.
    """
    env: Mapping[str, str] = os.environ if environ is None else environ
    forced = envvars.value(OVERRIDE_VARIABLE, env) or ""
    if forced:
        check_override(forced)
    if forced and forced not in RUNTIME_LAUNCHERS:
        return by_name(forced).read(env)
    if forced:  # resolved at init time
        return LocalEnvironment.read(env).replace(launcher=forced)
    for candidate in ORDER:
        if candidate.detect(env):
            try:
                info = candidate.read(env)
            except LaunchEnvironmentError as e:
                # Hand-set RANK/WORLD_SIZE without LOCAL_RANK (or out of range): report
                # the conflict with the real launcher, not the missing variable.
                raw = (env.get("RANK", "").strip(), env.get("WORLD_SIZE", "").strip())
                if candidate is TorchrunEnvironment and all(v.isdigit() for v in raw):
                    try:
                        _check_hand_set(int(raw[0]), int(raw[1]), env)
                    except InconsistentEnvironmentError as conflict:
                        raise conflict from e
                    _refuse_hand_set_without_launcher(raw, env, e)
                raise
            _cross_check(candidate, info, env)
            if candidate is TorchrunEnvironment:
                _check_one_world(info, env)
                return _container_hook(info, env) or info
            if candidate is LocalEnvironment:
                _guard_single_process(env)
            return info
    raise AssertionError("LocalEnvironment always detects")  # pragma: no cover


def _container_hook(info: DistInfo, env: Mapping[str, str]) -> Optional[DistInfo]:
    """The Slurm step's layout when torchrun-style variables merely copy it.

    enroot's PyTorch hook (NGC images under pyxis) exports ``RANK``, ``LOCAL_RANK``,
    ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` from the ``SLURM_*`` variables
    into every srun task, but no ``LOCAL_WORLD_SIZE``/``GROUP_RANK``: read as torchrun,
    every rank would be on node 0 of 1. No torchrun agent set them (no
    ``TORCHELASTIC_RUN_ID``/``HPC_RUN_ID``) and they agree with the step: the step
    says how many nodes and tasks per node; the exported master is kept.
    """
    if "TORCHELASTIC_RUN_ID" in env or "HPC_RUN_ID" in env:
        return None
    if not (SlurmEnvironment.detect(env) and in_step(env)):
        return None
    try:
        step = SlurmEnvironment.read(env)
    except LaunchEnvironmentError:
        return None
    mine = (info.rank, info.world_size, info.local_rank)
    if mine != (step.rank, step.world_size, step.local_rank):
        return None
    return step


def no_launcher_hint() -> str:
    """The HINT of every "no launcher started these processes" error: how to start N."""
    return ("HINT: start N ranks with a launcher: hpc run --nproc N train.py (one machine), "
            "torchrun --nproc-per-node N train.py, srun, mpirun/mpiexec, flux run or jsrun; "
            "or set HPC_LAUNCHER to the launcher that started this job (one of: "
            f"{', '.join(launcher_names())}); HPC_LAUNCHER=local runs each process alone "
            "on purpose.")


def _agent_started(env: Mapping[str, str]) -> bool:
    """A torchrun agent (``TORCHELASTIC_RUN_ID``) or ``hpc run`` (``HPC_RUN_ID``) set this
    process's rank variables, rather than a user's export."""
    return "TORCHELASTIC_RUN_ID" in env or "HPC_RUN_ID" in env


def _refuse_hand_set_without_launcher(raw: tuple[str, str], env: Mapping[str, str],
                                      cause: LaunchEnvironmentError) -> None:
    """``RANK``/``WORLD_SIZE`` exported by hand, no torchrun agent, no ``LOCAL_RANK``:
    nothing will start the other ranks, so exporting ``LOCAL_RANK`` would only wait for
    them until the connect timeout."""
    if _agent_started(env) or "LOCAL_RANK" in env or int(raw[1]) <= 1:
        return
    raise LaunchEnvironmentError(
        f"no launcher found: RANK={raw[0]} WORLD_SIZE={raw[1]} are set, but no torchrun "
        "or hpc run started this process (no TORCHELASTIC_RUN_ID, HPC_RUN_ID or "
        "LOCAL_RANK).\n"
        "They were exported by hand; nothing starts the other ranks, so this process "
        "would wait for them until the connect timeout.\n" + no_launcher_hint()
        + " Unset RANK and WORLD_SIZE to run one process.") from cause


def _check_one_world(info: DistInfo, env: Mapping[str, str]) -> None:
    """Refuse a torchrun/``hpc run`` world that holds fewer agents than its srun step.

    ``srun -N2 --ntasks-per-node=1 torchrun --nproc-per-node 2 train.py`` (no
    ``--nnodes``/rendezvous flags) starts one torchrun per srun task, and each forms a
    world of its own node: N trainings with a rank 0 each, writing the same files. The
    agent's variables (``TORCHELASTIC_RUN_ID``/``HPC_RUN_ID``) say how many agents
    joined this world (``GROUP_WORLD_SIZE``, else ``NNODES``/the node count); the step
    says how many it started (``SLURM_STEP_NUM_TASKS``). Fewer in the world than in the
    step means the others are in worlds of their own. ``HPC_LAUNCHER`` skips this.
    """
    if not _agent_started(env):
        return  # RANK/WORLD_SIZE not set by an agent: _check_hand_set compares them
    if not (SlurmEnvironment.detect(env) and in_step(env)):
        return
    tasks = (env.get("SLURM_STEP_NUM_TASKS") or env.get("SLURM_NTASKS") or "").strip()
    nodes = (env.get("SLURM_STEP_NUM_NODES") or env.get("SLURM_NNODES") or "?").strip()
    agents = env.get("GROUP_WORLD_SIZE", "").strip()
    joined = int(agents) if agents.isdigit() else info.num_nodes
    if not tasks.isdigit() or int(tasks) <= joined:
        return
    hpc_run = "HPC_RUN_ID" in env
    name = "hpc run" if hpc_run else "torchrun"
    said = (f"GROUP_WORLD_SIZE={agents}" if agents.isdigit()
            else f"NNODES={env.get('NNODES', joined)}")
    fix = ("`hpc run` is one node only: under srun start the ranks with srun itself "
           "(srun -N$SLURM_NNODES --ntasks-per-node=<ranks per node> python train.py), or "
           "use torchrun with a rendezvous" if hpc_run else
           "give every torchrun the same rendezvous")
    raise InconsistentEnvironmentError(
        f"{name} formed a world of {info.world_size} rank(s) on {joined} node(s) "
        f"(WORLD_SIZE={info.world_size}, {said}) inside a Slurm step of {tasks} tasks on "
        f"{nodes} node(s) (SLURM_STEP_NUM_TASKS={tasks}, SLURM_STEP_NUM_NODES={nodes}).\n"
        f"Every srun task started its own {name} and they share no rendezvous (torchrun "
        "without --nnodes/--rdzv-endpoint), so the step would run independent trainings, "
        "each with its own rank 0 writing the same files.\n"
        f"HINT: {fix}: srun -N$SLURM_NNODES --ntasks-per-node=1 torchrun --nnodes "
        "$SLURM_NNODES --nproc-per-node <ranks per node> --rdzv-backend c10d "
        "--rdzv-endpoint $(hostname):29500 --rdzv-id $SLURM_JOB_ID train.py from the "
        "batch script (slurm/torchrun.sbatch does exactly this); HPC_LAUNCHER=torchrun "
        "accepts separate worlds on purpose."
    )


def _guard_single_process(env: Mapping[str, str]) -> None:
    """Refuse rank/size variables that say "several processes" when nothing matched."""
    said = [f"{k}={env[k].strip()}" for k in GUARD_VARIABLES
            if env.get(k, "").strip().isdigit()
            and int(env[k]) > (1 if k.endswith(("SIZE", "NRANKS")) else 0)]
    if not said:
        return
    raise LaunchEnvironmentError(
        f"no launcher detected, but {' '.join(said)} say this process is one of several.\n"
        "Those variables belong to a launcher whose full set of rank variables is "
        "missing (an unsupported launcher, or a partial hand-made set); starting anyway "
        "would run every process alone as rank 0 of 1, N unrelated trainings.\n"
        + no_launcher_hint()
    )


def _cross_check(winner: type[Environment], info: DistInfo, env: Mapping[str, str]) -> None:
    """Refuse variables of two launchers that disagree about this process."""
    if winner is TorchrunEnvironment:
        _check_hand_set(info.rank, info.world_size, env)
    if winner is SlurmEnvironment:
        for key in ("PMIX_RANK", "PMI_RANK"):
            if key in env and env[key].isdigit() and int(env[key]) != info.rank:
                raise InconsistentEnvironmentError(
                    f"{key}={env[key]} vs SLURM_PROCID={info.rank}.\n"
                    "An MPI process manager and the Slurm step disagree about this rank.\n"
                    "HINT: launch MPI programs either with srun --mpi=pmix/pmi2 or with "
                    "mpirun, not a mix; or set HPC_LAUNCHER explicitly."
                )


def _check_hand_set(rank: int, world: int, env: Mapping[str, str]) -> None:
    """Refuse hand-set torchrun variables that contradict the real launcher.

    Nested launches are expected and not compared: torchrun/``hpc run`` agents inside
    srun or mpirun (they mark their variables with TORCHELASTIC_RUN_ID/HPC_RUN_ID), and
    MPI ranks inside an allocation (the SLURM_* variables belong to mpirun's own step).
    What is left are variables exported by hand, e.g. ``export RANK=0`` in a batch
    script, which would give every task the same rank.
    """
    if "TORCHELASTIC_RUN_ID" in env or "HPC_RUN_ID" in env:
        return
    others = [e for e in ORDER[1:-1] if e.detect(env)]
    for other in others:
        if other is SlurmEnvironment and not in_step(env):
            continue
        try:
            theirs = other.read(env)
        except LaunchEnvironmentError:
            continue
        if (theirs.world_size, theirs.rank) != (world, rank):
            raise InconsistentEnvironmentError(
                f"RANK={rank} WORLD_SIZE={world} vs "
                f"{other.rank_var}={theirs.rank} ({other.name}, world size "
                f"{theirs.world_size}).\n"
                "The RANK/WORLD_SIZE variables were not set by torchrun (no "
                "TORCHELASTIC_RUN_ID) and contradict the launcher that started this "
                "process, usually because they were exported in a batch script.\n"
                "HINT: unset RANK, WORLD_SIZE and LOCAL_RANK before launching, or set "
                f"HPC_LAUNCHER={other.name} (or torchrun) to choose explicitly."
            )
