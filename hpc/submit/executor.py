"""``hpc submit`` and :func:`submit`: multi-node Slurm jobs through submitit, requeue-safe.

Python::

    from hpc.pretrain import PretrainConfig
    from hpc.submit import submit

    job = submit(PretrainConfig(epochs=5, out="runs/x"), nodes=2, gpus_per_node=4)
    print(job.describe())            # job id, logs, how to watch and cancel
    result = job.result()            # rank 0's PretrainResult (waits; follows requeues)

Shell::

    hpc submit --nodes 2 --gpus-per-node 4 --time 120 -- --epochs 5 --out runs/x
    hpc submit --nodes 2 --tasks-per-node 8 --gpus-per-node 0 -- -m mypkg.train --lr 0.1
    hpc submit --nodes 1 --gpus-per-node 2 --wait -- mypkg.jobs:main arg1

One task per GPU (``--gpus-per-node``); with ``--gpus-per-node 0`` give
``--tasks-per-node``. Jobs get the warning signal ``--signal`` (default USR2)
``--signal-delay`` seconds before the time limit, ``--requeue``, append-mode logs and
``srun --kill-on-bad-exit=1``; see :mod:`hpc.preempt.requeue` for the stop/requeue flow and
``docs/submit.md`` for the whole story.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import shlex
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpc.errors import SubmitError
from hpc.preempt.guard import parse_signal
from hpc.submit.options import (
    SubmitOptions,
    field_parameters,
    job_dir,
    marks_dir,
    parse_sbatch,
)

if TYPE_CHECKING:
    from hpc.ledger import Strike
    from hpc.submit.handle import SubmittedJob

__all__ = ["bad_nodes", "exclusion_lines", "for_task", "make_executor", "submit",
           "submit_array"]

logger = logging.getLogger(__name__)


#: submitit parameters of the ``AutoExecutor`` constructor; the others go to
#: ``update_parameters``.
_CONSTRUCTOR = ("slurm_max_num_timeout", "slurm_python")
#: Fields without a submitit parameter of their own: :func:`make_executor` composes them
#: (the log folder, the exported variables, the signal and the extra sbatch options), and
#: ``array`` becomes :func:`submit_array`'s one batch of submissions.
COMPOSED = ("sbatch", "env", "log_dir", "signal", "array", "spare_nodes")


def _shell_marks_dir(log_dir: str | Path) -> str:
    """:func:`marks_dir` as words of the batch script: the log dir quoted (it may hold a
    space or a ``$``), the job id and the restart count left for the shell to expand."""
    root = Path(log_dir).resolve()
    run = marks_dir(root, "${SLURM_JOB_ID}", "${SLURM_RESTART_COUNT:-0}").relative_to(root)
    return f"{shlex.quote(str(root))}/{run.as_posix()}"


def _slurm_nodes() -> set[str] | None:
    """Every node this cluster knows (``sinfo -N``), None when sinfo cannot say."""
    try:
        proc = subprocess.run(["sinfo", "-h", "-N", "-o", "%N"], capture_output=True,
                              text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    nodes = {line.strip() for line in proc.stdout.splitlines() if line.strip()}
    return nodes if proc.returncode == 0 and nodes else None


def bad_nodes() -> dict[str, list[Strike]]:
    """The hosts of the bad-node ledger (:mod:`hpc.ledger`) the next job leaves out:
    those with two live strikes that this cluster has (sbatch refuses to exclude a node
    it does not know, and the ledger may hold another cluster's)."""
    from hpc.ledger import Ledger

    found = Ledger().excluded()
    known = _slurm_nodes() if found else None
    return {h: ss for h, ss in found.items() if known is None or h in known}


def exclusion_lines(bad: Mapping[str, list[Strike]]) -> list[str]:
    """One ``excluding node3 (2 strikes in 24 h ...)`` line per host of ``bad``."""
    from hpc.ledger import Ledger, describe_exclusion

    ttl = Ledger().ttl
    return [describe_exclusion(host, strikes, ttl) for host, strikes in bad.items()]


def _excluded(sbatch: dict[str, Any], bad: Mapping[str, Any]) -> dict[str, Any]:
    """``sbatch`` with the hosts of ``bad`` added to its ``exclude`` (the user's first)."""
    if not bad:
        return sbatch
    user = sbatch.get("exclude")
    mine = [h for h in user.split(",") if h] if isinstance(user, str) else []
    return {**sbatch, "exclude": ",".join(dict.fromkeys([*mine, *bad]))}


def make_executor(options: SubmitOptions,
                  bad: Mapping[str, list[Strike]] | None = None) -> Any:
    """A submitit ``AutoExecutor`` (cluster ``slurm``) configured from ``options``.

    Args:
        options: The job's layout.
        bad: Hosts to exclude besides a ``--sbatch exclude=...`` (default:
            :func:`bad_nodes`, the ledger's).
    """
    options.validate()
    try:
        import submitit
    except ImportError as e:
        raise SubmitError("submitit is not installed.\n"
                          "HINT: pip install 'torch-hpc[submit]' (or pip install submitit)."
                          ) from e
    sig = parse_signal(options.signal).name[3:]
    folder = job_dir(options.log_dir, "%j")
    params = field_parameters(options)
    cpus = f"--cpus-per-task={options.cpus_per_task}"
    supervised: dict[str, Any] = {}
    if options.spare_nodes:  # the supervisor's srun has --kill-on-bad-exit of its own
        params["nodes"] = options.nodes + options.spare_nodes
        params["slurm_python"] = _supervisor(options, folder, [cpus], submitit)
        supervised = {"slurm_use_srun": False}
    try:
        ex = submitit.AutoExecutor(folder=folder, cluster="slurm",
                                   **{k: params.pop(k) for k in _CONSTRUCTOR if k in params})
    except RuntimeError as e:
        raise SubmitError(f"submitit cannot use Slurm here: {e}.\n"
                          "HINT: run hpc submit on a login node of the cluster.") from e
    env = {"SUBMITIT_PREEMPT_SIGNAL": sig, "HPC_PREEMPT_SIGNAL": sig,
           "HPC_MAX_REQUEUES": str(options.max_requeues), "PYTHONUNBUFFERED": "1",
           **{k: str(v) for k, v in options.env.items()}}
    ex.update_parameters(
        **params,
        # submitit writes --signal=<its SUBMITIT_PREEMPT_SIGNAL>@delay; ours wins.
        slurm_additional_parameters=_excluded(
            {"signal": f"{sig}@{options.signal_delay_s}", "requeue": True,
             **({"no_kill": True} if options.spare_nodes else {}),
             **parse_sbatch(options.sbatch)}, bad_nodes() if bad is None else bad),
        # failure marks per run, so --wait names the rank that failed first by time
        slurm_setup=[f'export HPC_ERROR_DIR={_shell_marks_dir(options.log_dir)}',
                     *(f"export {k}={shlex.quote(v)}" for k, v in env.items())],
        # srun of Slurm 22.05-23.02 does not inherit --cpus-per-task from sbatch: pass it.
        slurm_srun_args=["--kill-on-bad-exit=1", cpus], **supervised)
    return ex


def _supervisor(options: SubmitOptions, folder: Path, srun_args: Sequence[str],
                submitit: Any) -> str:
    """The job's "python" with spare nodes: ``PY -m hpc supervise --spare-nodes K
    --srun-arg=... -- PY``, which submitit's batch script runs itself (no srun of its own)
    before ``-u -m submitit.core._submit FOLDER``; each attempt's srun writes the tasks'
    logs where submitit's own srun would (``%j_%t_log.out``; ``%A_%a`` in an array)."""
    python = options.python or shlex.quote(sys.executable)
    paths = submitit.core.utils.JobPaths(folder=folder)
    logs = [str(paths.stdout), str(paths.stderr)]
    if options.is_array:
        logs = [x.replace("%j", "%A_%a") for x in logs]
    args = ["--unbuffered", f"--output={logs[0]}", f"--error={logs[1]}", *srun_args]
    return " ".join([python, "-m", "hpc", "supervise", f"--spare-nodes={options.spare_nodes}",
                     *(shlex.quote(f"--srun-arg={a}") for a in args), "--", python])


def _callable(target: Any, args: Sequence[str]) -> tuple[Any, str | None]:
    """(the submitted callable, the pretrain run dir or None)."""
    from hpc.pretrain.config import PretrainConfig
    from hpc.submit import payload as jobs
    from hpc.submit.pretrain_job import PretrainJob

    if isinstance(target, PretrainConfig):
        job = PretrainJob(target)
        return job, job.config.out
    if isinstance(target, PretrainJob):
        return target, target.config.out
    if isinstance(target, str):
        if ":" in target:
            return jobs.FunctionJob(target, args), None
        return jobs.ModuleJob(target, args), None
    if callable(target):
        return (functools.partial(target, *args) if args else target), None
    raise SubmitError(f"cannot submit a {type(target).__name__}.\nHINT: submit a "
                      "PretrainConfig, 'pkg.mod:func', 'pkg.mod' (run as -m) or a callable.")


def _merged(options: SubmitOptions | None, kwargs: dict[str, Any]) -> SubmitOptions:
    base = dataclasses.asdict(options) if options is not None else {}
    return SubmitOptions.from_kwargs(**{**base, **kwargs})


def submit(target: Any, args: Sequence[str] = (), *,
           options: SubmitOptions | None = None, **kwargs: Any) -> SubmittedJob:
    """Submit ``target`` as one multi-node Slurm job; every task runs it in-process.

    Args:
        target: A :class:`~hpc.pretrain.PretrainConfig` (runs the pretrain loop with
            preemption-safe requeue), ``"pkg.mod:func"`` (``func(*args)``),
            ``"pkg.mod"`` (``python -m pkg.mod *args``) or any picklable callable.
        args: Strings passed to a module or function target.
        options: A :class:`SubmitOptions`; keywords override its fields.
        **kwargs: Fields of :class:`SubmitOptions` (unknown ones are rejected).

    Returns:
        A :class:`SubmittedJob`.

    Raises:
        SubmitError: invalid options, an ``array`` (use :func:`submit_array`), or sbatch
            refused the job.
    """
    opts = _merged(options, kwargs)
    if opts.is_array:
        raise SubmitError(f"submit() submits one job, but array={opts.array}.\n"
                          "HINT: call hpc.submit.executor.submit_array() for a job array.")
    fn, run_dir = _callable(target, args)
    bad = bad_nodes()
    executor = make_executor(opts, bad)
    try:
        job = executor.submit(fn)
    except Exception as e:  # submitit raises bare errors carrying sbatch's stderr
        raise SubmitError(f"sbatch refused the job: {e}.{_refused_because(bad)}\nHINT: "
                          "check the partition, time limit and --sbatch options against "
                          "`sinfo`.") from e
    from hpc.submit.handle import SubmittedJob

    return SubmittedJob(job, opts, run_dir=run_dir, excluded=_announce(bad))


def _announce(bad: Mapping[str, list[Strike]]) -> list[str]:
    lines = exclusion_lines(bad)
    for line in lines:
        logger.info("%s", line)
    return lines


def _refused_because(bad: Mapping[str, list[Strike]]) -> str:
    if not bad:
        return ""
    return (f"\nThe bad-node ledger excluded {', '.join(bad)}: too few nodes may be left "
            "in the partition; `hpc nodes` lists the strikes, `hpc nodes --clear HOST` "
            "allows a host again.")


def for_task(target: Any, args: Sequence[str], task: int) -> tuple[Any, list[str]]:
    """``target`` and ``args`` of array task ``task``: ``{task}`` replaced by its index
    in the run directory of a pretrain target and in every argument."""
    from hpc.pretrain.config import PretrainConfig
    from hpc.submit.pretrain_job import PretrainJob

    def sub(text: Any) -> Any:
        return text.replace("{task}", str(task)) if isinstance(text, str) else text

    if isinstance(target, PretrainConfig):
        target = dataclasses.replace(target, out=sub(target.out))
    elif isinstance(target, PretrainJob):
        target = PretrainJob(dataclasses.replace(target.config, out=sub(target.config.out)),
                             target.log_level)
    return target, [sub(a) for a in args]


def _shared_run_dir(target: Any) -> str | None:
    """The run directory every task of an array would share (no ``{task}`` in it)."""
    config = getattr(target, "config", target)
    out = getattr(config, "out", None)
    return out if isinstance(out, str) and "{task}" not in out else None


def submit_array(target: Any, args: Sequence[str] = (), *,
                 options: SubmitOptions | None = None, **kwargs: Any) -> list[SubmittedJob]:
    """Submit ``target`` as a job array of ``options.array`` tasks, one per index.

    Task ``i`` runs :func:`for_task` ``(target, args, i)``: ``{task}`` in the run
    directory (``--out runs/sweep/{task}``) and in the arguments becomes ``i``. Each task
    is a job of its own (``<array job>_<i>``): preempted, checkpointed and requeued on
    its own.

    Returns:
        One :class:`SubmittedJob` per task, in index order.

    Raises:
        SubmitError: invalid options, ``array`` < 1, a pretrain run directory without
            ``{task}`` (every task would write the same checkpoints), or sbatch refused.
    """
    opts = _merged(options, kwargs)
    if not opts.is_array:
        raise SubmitError(f"array={opts.array}: a job array needs at least 1 task.\n"
                          "HINT: pass array=N (hpc submit --array N), or call submit().")
    shared = _shared_run_dir(target)
    if shared is not None:
        raise SubmitError(
            f"--array {opts.array}: every task would write the run directory {shared} "
            "(checkpoints, metrics.csv), and resume from the others' checkpoints.\n"
            "HINT: put {task} in it, e.g. --out runs/sweep/{task} (it becomes 0.."
            f"{opts.array - 1}).")
    tasks = [for_task(target, args, i) for i in range(opts.array)]
    calls = [_callable(t, a) for t, a in tasks]
    bad = bad_nodes()
    executor = make_executor(opts, bad)
    try:
        with executor.batch():
            jobs = [executor.submit(fn) for fn, _ in calls]
    except Exception as e:  # submitit raises bare errors carrying sbatch's stderr
        raise SubmitError(f"sbatch refused the job array: {e}.{_refused_because(bad)}\n"
                          "HINT: check the partition, time limit and --sbatch options "
                          "against `sinfo`.") from e
    from hpc.submit.handle import SubmittedJob

    excluded = _announce(bad)
    return [SubmittedJob(job, opts, run_dir=run_dir, excluded=excluded)
            for job, (_, run_dir) in zip(jobs, calls)]
