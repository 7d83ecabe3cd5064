"""Slurm: tasks started by ``srun`` (from a batch script, ``salloc`` or a login node).

Step variables describe the running ``srun`` step and win over the job (allocation)
variables, which describe what ``sbatch``/``salloc`` asked for.

==============================  ======================================================
``SLURM_JOB_ID``                marks a Slurm job (required)
``SLURM_STEP_ID``               present only inside an ``srun`` step; missing in the
                                batch script itself (then: one process, with a warning;
                                an error if ``SLURM_PROCID``/``LOCALID``/``NODEID`` are
                                non-zero there)
``SLURM_PROCID``                global rank
``SLURM_LOCALID``               rank on this node
``SLURM_NODEID``                node index within the step
``SLURM_STEP_NUM_TASKS``        world size (else ``SLURM_NTASKS``)
``SLURM_STEP_NUM_NODES``        node count (else ``SLURM_NNODES``)
``SLURM_STEP_NODELIST``         hosts of the step (else ``SLURM_NODELIST``); the master
                                is its first host, expanded like ``scontrol show hostnames``
``SLURM_STEP_TASKS_PER_NODE``   e.g. ``2(x3),1`` (else ``SLURM_TASKS_PER_NODE``); gives
                                the local world size
``SLURMD_NODENAME``             this task's node: rank 0 must run on the master host
``SLURM_CPUS_PER_TASK``         CPUs of each task: its thread count (read at init by
                                :mod:`hpc.bootstrap.threads`)
``MASTER_ADDR``                 override the derived master address
``MASTER_PORT``                 override the derived master port
==============================  ======================================================

The derived master port is ``15000 + (job_id * 64 + step_id) % 17000``: every step of
a job and consecutive jobs get distinct ports below the ephemeral range. The batch script
(no ``SLURM_STEP_ID``) counts as step 4094, the extern step as 4095.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import hostlist

from hpc.environments.base import (
    DistInfo,
    Environment,
    derive_port,
    env_int,
    node_local_master,
)
from hpc.errors import LaunchEnvironmentError

__all__ = ["SlurmEnvironment", "allocation_master", "expand_hostnames", "expand_tasks_per_node",
           "slurm_port"]

_TPN = re.compile(r"^(\d+)(?:\(x(\d+)\))?$")
_BLANKS = re.compile(r"\s*,\s*|\s+")
# SLURM_STEP_ID of the batch and extern steps (SLURM_BATCH_SCRIPT / SLURM_EXTERN_CONT).
# Special step ids of Slurm >= 20.11 (0xfffffffa..0xfffffffd) and older releases.
_SPECIAL_STEPS = {
    "4294967290": "interactive", "4294967291": "batch", "4294967292": "extern",
    "4294967293": "pending", "4294967294": "batch", "4294967295": "extern",
}


def expand_hostnames(nodelist: str) -> list[str]:
    """Expand a Slurm hostlist exactly like ``scontrol show hostnames``.

    Order and duplicates are kept, zero padding is preserved, several bracket groups
    in one name (``a[1-2]-b[3-4]``) expand as a product, and comma-separated groups
    are concatenated. Blanks separate names as commas do (``"a, b"`` is ``a`` and
    ``b``, as for ``scontrol``). No ``scontrol`` is needed.
    """
    cleaned = _BLANKS.sub(",", nodelist.strip()).strip(",")
    try:
        return list(hostlist.expand_hostlist(cleaned, allow_duplicates=True, sort=False))
    except hostlist.BadHostlist as e:
        raise LaunchEnvironmentError(
            f"slurm: cannot expand the nodelist {nodelist!r}: {e}.\n"
            "HINT: check SLURM_STEP_NODELIST / SLURM_NODELIST."
        ) from e


def expand_tasks_per_node(spec: str) -> list[int]:
    """Expand ``SLURM_TASKS_PER_NODE`` syntax: ``2(x3),1`` -> ``[2, 2, 2, 1]``."""
    out: list[int] = []
    for part in spec.split(","):
        m = _TPN.match(part.strip())
        if not m:
            raise LaunchEnvironmentError(
                f"slurm: cannot parse tasks-per-node {spec!r} (part {part!r}).\n"
                "HINT: the expected form is like '2(x3),1'."
            )
        out.extend([int(m.group(1))] * int(m.group(2) or 1))
    return out


def slurm_port(environ: Mapping[str, str], step: int | None = None) -> int:
    """The master port for this job step, see the module docstring.

    Args:
        environ: The job's variables.
        step: A step slot to use instead of the environment's step id;
            ``slurm/torchrun.sbatch`` asks for slot 63 (srun steps use 0..62) for its
            rendezvous, through this same rule.
    """
    job = environ.get("SLURM_JOB_ID") or environ.get("SLURM_JOBID") or "0"
    if step is not None:
        return derive_port(job, step)
    # No step id: the batch script (or an salloc shell), which is not step 0 and may run
    # beside it on the same node; it gets the batch step's port.
    step_id = environ.get("SLURM_STEP_ID") or environ.get("SLURM_STEPID") or "4294967294"
    if step_id in _SPECIAL_STEPS:  # keep special steps off the slots of srun steps 0..
        step_id = str(4090 + int(step_id) - 4294967290)
    return derive_port(job, step_id)


def allocation_master(info: DistInfo, environ: Mapping[str, str]) -> DistInfo | None:
    """Inside a Slurm job: the first host of the allocation and a port derived from the
    job id (the fallback of launchers started inside ``sbatch``/``salloc``), else None.
    Known values are kept."""
    job = environ.get("SLURM_JOB_ID")
    if not (job and environ.get("SLURM_JOB_NODELIST")):
        return None
    host = expand_hostnames(environ["SLURM_JOB_NODELIST"])[0]
    return info.replace(master_addr=info.master_addr or host,
                        master_port=info.master_port or derive_port(job, "mpi"))


def in_step(environ: Mapping[str, str]) -> bool:
    """True inside an ``srun`` step, False in the batch script or ``salloc`` shell."""
    step = environ.get("SLURM_STEP_ID", environ.get("SLURM_STEPID"))
    return step is not None and step not in _SPECIAL_STEPS


class SlurmEnvironment(Environment):
    """Tasks of an ``srun`` step, or the batch script of an allocation."""

    name = "slurm"
    rank_var = "SLURM_PROCID"
    variables = ("MASTER_ADDR", "MASTER_PORT", "SLURMD_NODENAME")
    # PMIX_*/PMI_*: srun --mpi=pmix/pmi2 steps, compared with SLURM_PROCID.
    patterns = ("SLURM_*", "PMIX_*", "PMI_*")

    @staticmethod
    def detect(environ: Mapping[str, str]) -> bool:
        return "SLURM_JOB_ID" in environ or "SLURM_JOBID" in environ

    @staticmethod
    def read(environ: Mapping[str, str]) -> DistInfo:
        src = "slurm"
        job = environ.get("SLURM_JOB_ID") or environ.get("SLURM_JOBID")
        user_port = environ.get("MASTER_PORT")
        port = env_int(environ, "MASTER_PORT", source=src) if user_port else slurm_port(environ)
        if not in_step(environ):
            return _batch_script(environ, job, port)

        def pick(step_key: str, job_key: str) -> str | None:
            return environ.get(step_key) or environ.get(job_key)

        def pick_int(step_key: str, job_key: str) -> int:
            key = step_key if environ.get(step_key) else job_key
            return env_int(environ, key, default=1, source=src)

        world = pick_int("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS")
        rank = env_int(environ, "SLURM_PROCID", source=src)
        local_rank = env_int(environ, "SLURM_LOCALID", source=src)
        node_rank = env_int(environ, "SLURM_NODEID", default=0, source=src)
        num_nodes = pick_int("SLURM_STEP_NUM_NODES", "SLURM_NNODES")
        tpn_raw = pick("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE")
        tpn = expand_tasks_per_node(tpn_raw) if tpn_raw else [world]
        if len(tpn) != num_nodes or sum(tpn) != world:
            raise LaunchEnvironmentError(
                f"slurm: tasks per node {tpn_raw!r} (= {sum(tpn)} tasks on {len(tpn)} "
                f"nodes) does not match SLURM_STEP_NUM_TASKS={world} on {num_nodes} nodes.\n"
                "HINT: do not export SLURM_* variables by hand; launch with srun."
            )
        if not 0 <= node_rank < num_nodes:
            raise LaunchEnvironmentError(
                f"slurm: SLURM_NODEID={node_rank} but the step has {num_nodes} nodes.\n"
                "HINT: do not export SLURM_* variables by hand; launch with srun."
            )
        nodelist = pick("SLURM_STEP_NODELIST", "SLURM_NODELIST") or ""
        hosts = expand_hostnames(nodelist) if nodelist else []
        addr = environ.get("MASTER_ADDR") or (hosts[0] if hosts else None)
        if rank == 0 and not environ.get("MASTER_ADDR"):
            _check_rank0_host(environ, hosts)
        return DistInfo(
            launcher="slurm",
            rank=rank,
            local_rank=local_rank,
            world_size=world,
            local_world_size=tpn[node_rank],
            node_rank=node_rank,
            num_nodes=num_nodes,
            master_addr=addr,
            master_port=port,
            job_id=f"{job}.{environ.get('SLURM_STEP_ID', environ.get('SLURM_STEPID'))}",
        )

    @classmethod
    def master(cls, info: DistInfo, environ: Mapping[str, str]) -> DistInfo | None:
        # Only a step without any nodelist gets here (the port is always derived).
        return node_local_master(info) or allocation_master(info, environ)


def _check_rank0_host(environ: Mapping[str, str], hosts: list[str]) -> None:
    """Rank 0 serves the store on the step's first host: refuse to start elsewhere.

    With ``SLURM_HOSTFILE`` and ``--distribution=arbitrary`` rank 0 may run on another
    node than the first of the (sorted) step nodelist; its peers would then wait the
    whole connect timeout for an "unreachable master". Rank 0 fails at once instead.
    """
    here = environ.get("SLURMD_NODENAME")
    if not (here and hosts) or here == hosts[0]:
        return
    raise LaunchEnvironmentError(
        f"slurm: rank 0 runs on {here} but the master address is {hosts[0]}, the first "
        f"host of the step's nodelist {environ.get('SLURM_STEP_NODELIST')!r}.\n"
        "Rank 0 serves the rendezvous store, so the other ranks would wait for a master "
        "that never listens there; the task layout is not block order (SLURM_HOSTFILE "
        "with --distribution=arbitrary, or a custom --distribution).\n"
        "HINT: export MASTER_ADDR=<rank 0's host> to every task, e.g. "
        "MASTER_ADDR=$(head -n1 \"$SLURM_HOSTFILE\") before srun, or use block "
        "distribution."
    )


def _batch_script(environ: Mapping[str, str], job: str | None, port: int) -> DistInfo:
    """``python train.py`` run by the batch script itself: one process, never N."""
    task_vars = [f"{k}={environ[k]}" for k in ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID")
                 if environ.get(k, "0").strip() not in ("", "0")]
    if task_vars:
        raise LaunchEnvironmentError(
            f"slurm: {' '.join(task_vars)} but no SLURM_STEP_ID: job {job} has no srun "
            "step here, yet this process claims to be a task other than the first.\n"
            "Only srun writes these variables, together with SLURM_STEP_ID; they were "
            "exported by hand or copied from another process (a wrapper, a container "
            "runtime, ssh).\n"
            "HINT: start the tasks with srun (which sets all of them), or unset "
            "SLURM_PROCID/SLURM_LOCALID/SLURM_NODEID; HPC_LAUNCHER=local runs one process."
        )
    ntasks = environ.get("SLURM_NTASKS", "1")
    warnings: tuple[str, ...] = ()
    if ntasks not in ("", "1"):
        warnings = (
            f"slurm: running in the batch script of job {job} (no srun step) although "
            f"the allocation has SLURM_NTASKS={ntasks}; starting as a single process "
            "instead of waiting for ranks that will never come.\n"
            "HINT: start the ranks with `srun python ...` in the batch script "
            "(see slurm/pretrain.sbatch).",
        )
    return DistInfo(
        launcher="slurm",
        master_addr=environ.get("MASTER_ADDR") or "127.0.0.1",
        master_port=port,
        job_id=f"{job}.batch",
        warnings=warnings,
    )
