"""Preemption and time limits: warning signal -> agreed stop -> checkpoint -> requeue.

Slurm sends a warning signal before it ends a job (``--signal=USR2@120``: USR2, 120 s
before the time limit; ``scancel --signal=USR2 ID`` sends it by hand; with
``PreemptParameters=send_user_signal`` also on preemption). Real preemption in the common
setup (``PreemptType=preempt/partition_prio``, ``PreemptMode=REQUEUE``) sends SIGTERM to
every task instead and SIGKILL ``GraceTime`` seconds later; a job that ends within the
grace time is *not* requeued by Slurm. So the guard handles both (``HPC_PREEMPT_SIGNALS``,
default the warning signal and TERM) and hpc requeues the job itself. The flow:

1. :class:`~hpc.preempt.guard.PreemptGuard` turns the signal
   into a stop request on every rank that receives it (the handler only assigns a flag,
   so it is signal-safe).
2. The training loop polls the guard once per step and agrees across ranks (one tiny
   all_reduce), so every rank stops after the same step; the global master writes a
   checkpoint (:func:`hpc.pretrain.pretrain` does both).
3. :func:`requeue_after_stop` (collective; :func:`hpc.preempt.ending.finish_after_stop`
   calls it once a save still in flight is on disk): the global master checks the
   requeue budget, runs an optional hook (submitit: write the resubmission), runs
   ``scontrol requeue`` on this job (``<array job>_<task>`` for an array task, not the
   whole array) and tells every rank the outcome, so no rank exits before the job is
   requeued (with ``srun --kill-on-bad-exit`` an early non-zero exit would end the step
   first). Ranks then exit with :data:`EXIT_REQUEUED`. Where ``scontrol`` is missing
   (containers) and the batch script offers it (``HPC_REQUEUE_MARKER``, set by the
   templates in ``slurm/``), the master writes the job id to that file instead and the
   batch shell, which runs outside the container, requeues the job.
4. Slurm restarts the job (``SLURM_RESTART_COUNT`` counts restarts); it resumes from the
   newest checkpoint of its run directory, so every step runs exactly once. Before it
   does, while the requeued job is pending (the only state in which Slurm changes it),
   the master adds the hosts of the bad-node ledger (:mod:`hpc.ledger`: two live
   strikes) to the job's ``ExcNodeList``
   (:func:`hpc.preempt.exclude.exclude_bad_nodes`); not where the batch shell requeues
   (``HPC_REQUEUE_MARKER``).

The ``HPC_*`` settings of this flow (``HPC_PREEMPT_SIGNAL``, ``HPC_PREEMPT_SIGNALS``,
``HPC_MAX_REQUEUES``, ``HPC_STOP_FILE``, ``HPC_REQUEUE_MARKER``, ``HPC_STEP_HOOK``) are in
the table of :mod:`hpc.envvars`; the other variables it reads:

==================================  ======================================================
``SLURM_ARRAY_JOB_ID``              with ``SLURM_ARRAY_TASK_ID``: an array task requeues
``SLURM_ARRAY_TASK_ID``             ``<array job>_<task>``, not the whole array
``SLURM_RESTART_COUNT``             set by Slurm in a restarted job (absent = 0)
``SLURM_JOB_ID``                    the job to requeue (``SLURM_JOBID`` on old releases)
``SLURM_PROCID``/``RANK``           rank named in the "got SIGUSR2" line
``SLURM_LOCALID``/``LOCAL_RANK``    only local rank 0 prints that line
``SUBMITIT_PREEMPT_SIGNAL``         set by ``hpc submit`` to the same signal, so submitit's
                                    own handler (active until the guard replaces it) agrees
``SUBMITIT_FOLDER``                 set by submitit in its jobs: the resubmission is written
                                    there (:mod:`hpc.submit.payload`)
==================================  ======================================================
"""

from __future__ import annotations

import dataclasses
import logging
import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from typing import Callable, Optional

from hpc import envvars
from hpc.errors import EXIT_REQUEUED, PreemptError

__all__ = ["Budget", "Outcome", "Requeued", "read_budget", "requeue_target", "requeue_job",
           "requeue_after_stop", "stopped_by_request", "DEFAULT_MAX_REQUEUES",
           "EXIT_REQUEUED"]

logger = logging.getLogger(__name__)

DEFAULT_MAX_REQUEUES: int = envvars.VARIABLES["HPC_MAX_REQUEUES"].default


def requeue_target(environ: Mapping[str, str]) -> Optional[str]:
    """The id ``scontrol requeue`` needs for this job; ``None`` outside Slurm jobs.

    An array task's ``SLURM_JOB_ID`` equals ``SLURM_ARRAY_JOB_ID`` for one of its tasks,
    and requeueing that id requeues the whole array: array tasks use
    ``<SLURM_ARRAY_JOB_ID>_<SLURM_ARRAY_TASK_ID>``.
    """
    array, task = environ.get("SLURM_ARRAY_JOB_ID"), environ.get("SLURM_ARRAY_TASK_ID")
    if array and task:
        return f"{array}_{task}"
    return environ.get("SLURM_JOB_ID") or environ.get("SLURM_JOBID") or None


def _restart_count(environ: Mapping[str, str]) -> int:
    raw = environ.get("SLURM_RESTART_COUNT", "").strip()
    if not raw:
        return 0
    if not raw.isdigit():
        raise PreemptError(f"SLURM_RESTART_COUNT={raw!r} is not a non-negative integer.\n"
                           "Slurm sets it in a restarted job; this one was set by hand.\n"
                           "HINT: unset SLURM_RESTART_COUNT.")
    return int(raw)


@dataclasses.dataclass(frozen=True)
class Budget:
    """How often this job was restarted, and how often it may be requeued in all."""

    restarts: int
    max_requeues: int

    @property
    def left(self) -> bool:
        """True while another requeue is allowed."""
        return self.restarts < self.max_requeues


def read_budget(environ: Optional[Mapping[str, str]] = None) -> Budget:
    """The requeue budget from ``SLURM_RESTART_COUNT`` and ``HPC_MAX_REQUEUES``."""
    env = os.environ if environ is None else environ
    return Budget(_restart_count(env), envvars.value("HPC_MAX_REQUEUES", env))


def stopped_by_request(status: str, step: int, max_steps: Optional[int]) -> bool:
    """True when a run that returned ``status`` stopped for a stop request, not max_steps."""
    return status == "stopped" and not (max_steps is not None and step >= max_steps)


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What happened after an agreed stop (the same on every rank).

    Attributes:
        kind: ``requeued``, ``not-slurm`` (nothing to requeue), ``exhausted`` (budget
            used up), ``failed`` (``scontrol requeue`` or the hook failed).
        exit_code: What the process should exit with: :data:`EXIT_REQUEUED`, 0 for
            ``not-slurm``, 1 otherwise.
        message: One human sentence (with a ``HINT:`` when something is left to do).
    """

    kind: str
    exit_code: int
    message: str


def _scontrol_requeue(job_id: str, env: Mapping[str, str]) -> tuple[Optional[str], str]:
    """``(error, how)``: run ``scontrol requeue``, or hand it to the batch shell.

    ``how`` is ``scontrol`` or ``marker``: ``scontrol`` is not installed here and
    ``HPC_REQUEUE_MARKER`` names a file the batch shell checks after the step (the
    templates' fallback for containers); the job id is written to it atomically.
    """
    try:
        proc = subprocess.run(["scontrol", "requeue", job_id], capture_output=True,
                              text=True, timeout=60)
    except FileNotFoundError as e:
        marker = envvars.value("HPC_REQUEUE_MARKER", env)
        if not marker:
            return f"{type(e).__name__}: {e}", "scontrol"
        try:
            tmp = f"{marker}.tmp-{os.getpid()}"
            with open(tmp, "w") as f:
                f.write(job_id + "\n")
            os.replace(tmp, marker)
        except OSError as e2:
            return (f"scontrol is missing and HPC_REQUEUE_MARKER={marker} is not "
                    f"writable: {e2}"), "marker"
        return None, "marker"
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"{type(e).__name__}: {e}", "scontrol"
    if proc.returncode != 0:
        return ((proc.stderr or proc.stdout).strip() or f"exit status {proc.returncode}",
                "scontrol")
    return None, "scontrol"


@dataclasses.dataclass(frozen=True)
class Requeued:
    """What :func:`requeue_job` did.

    Attributes:
        error: Why the job was not requeued (scontrol's words), or None: it was.
        how: ``scontrol`` (this process requeued it) or ``marker`` (handed to the batch
            shell through ``HPC_REQUEUE_MARKER``: scontrol is missing here).
        excluding: What :func:`hpc.preempt.exclude.exclude_bad_nodes` excluded from the
            requeued job, or None.
    """

    error: Optional[str]
    how: str
    excluding: Optional[str] = None


def requeue_job(job_id: str, environ: Optional[Mapping[str, str]] = None, *,
                hosts: Sequence[str] = (), nodes: Optional[int] = None) -> Requeued:
    """Requeue ``job_id`` and exclude bad hosts from its next run: the one requeue core.

    ``scontrol requeue`` (or, where scontrol is missing and ``HPC_REQUEUE_MARKER`` is
    set, the batch shell's requeue through that file), then, after a requeue by scontrol,
    ``hosts`` and the bad-node ledger's hosts added to the pending job's ``ExcNodeList``
    (:func:`~hpc.preempt.exclude.exclude_bad_nodes`, at most as many as leave ``nodes``
    nodes). The budget is the caller's to check (:func:`read_budget`): the ranks'
    :func:`requeue_after_stop` and the batch host's ``hpc supervise`` both call this.
    """
    from hpc.preempt.exclude import exclude_bad_nodes

    env = os.environ if environ is None else environ
    error, how = _scontrol_requeue(job_id, env)
    if error is not None or how != "scontrol":
        return Requeued(error, how)
    return Requeued(None, how, exclude_bad_nodes(job_id, hosts, nodes=nodes))


def _decide(step: int, checkpoint: Optional[str], signame: str,
            before_requeue: Optional[Callable[[], None]],
            env: Mapping[str, str]) -> Outcome:
    job = requeue_target(env)
    where = f"checkpoint {checkpoint}" if checkpoint else "no checkpoint (no run directory)"
    if not job:
        return Outcome("not-slurm", 0, f"stopped at step {step} on {signame}; {where}. "
                       "Not a Slurm job, nothing to requeue: rerun the same command to "
                       "resume.")
    try:
        budget = read_budget(env)
    except PreemptError as e:
        return Outcome("failed", 1, str(e))
    if not budget.left:
        return Outcome("exhausted", 1, (
            f"stopped at step {step} on {signame}; {where}. Job {job} was not requeued: "
            f"SLURM_RESTART_COUNT={budget.restarts} reached HPC_MAX_REQUEUES="
            f"{budget.max_requeues}.\nThe requeue budget stops endless preemption loops.\n"
            "HINT: resubmit the same command (it resumes from the run directory), or raise "
            "HPC_MAX_REQUEUES / hpc submit --max-requeues."))
    try:
        if before_requeue is not None:
            before_requeue()
    except Exception as e:  # the resubmission could not be written: do not requeue
        return Outcome("failed", 1, f"preparing the requeue of job {job} failed: "
                       f"{type(e).__name__}: {e}.\nHINT: resubmit the same command; it "
                       "resumes from the run directory.")
    done = requeue_job(job, env)
    error, how = done.error, done.how
    if error is not None:
        return Outcome("failed", 1, (
            f"stopped at step {step} on {signame}; {where}. `scontrol requeue {job}` "
            f"failed: {error}.\nOnly batch jobs that allow requeueing can be requeued.\n"
            "HINT: submit with sbatch --requeue (or hpc submit); where the ranks have no "
            "scontrol, run them from a template in slurm/ (its batch shell requeues); or "
            "resubmit the same command, which resumes from the run directory."))
    by = "" if how == "scontrol" else (" (scontrol is missing here: the batch shell "
                                       f"requeues it, {env['HPC_REQUEUE_MARKER']})")
    excluding = done.excluding
    return Outcome("requeued", EXIT_REQUEUED, (
        f"requeued job {job}{by} after step {step} ({signame}; {where}); restart "
        f"{budget.restarts + 1} of at most {budget.max_requeues} resumes from it"
        + (f"; {excluding}" if excluding else "")))


def requeue_after_stop(step: int, checkpoint: Optional[str] = None, *,
                       signame: str = "the warning signal", rank: int = 0,
                       before_requeue: Optional[Callable[[], None]] = None,
                       environ: Optional[Mapping[str, str]] = None) -> Outcome:
    """After an agreed stop: requeue the Slurm job from the global master (collective).

    Call it on every rank once the checkpoint of ``step`` is on disk: the one ending,
    :func:`hpc.preempt.ending.finish_after_stop`, waits for a save in flight first and
    is what a loop calls. Rank 0 checks
    the budget, calls ``before_requeue`` and runs ``scontrol requeue``; the outcome is
    then broadcast, so no rank exits before the job is requeued. The master logs it
    once it happened: one INFO line after a requeue, an ERROR when none was possible.

    Args:
        step: The step the run stopped after.
        checkpoint: That step's checkpoint (for the message).
        signame: The signal that asked for the stop (for the message).
        rank: This process's global rank.
        before_requeue: Run on rank 0 just before ``scontrol requeue`` (submitit jobs
            write their resubmission here); an exception cancels the requeue.
        environ: Variables to read (default ``os.environ``).

    Returns:
        The same :class:`Outcome` on every rank.
    """
    env = os.environ if environ is None else environ
    outcome = None
    if rank == 0:
        outcome = _decide(step, checkpoint, signame, before_requeue, env)
        _log(outcome)  # at once: Slurm ends the step soon after a requeue
    from hpc.sync.agree import broadcast_object, world  # torch: only after the stop

    if world()[1] > 1:
        box = broadcast_object(dataclasses.astuple(outcome) if outcome is not None else None)
        outcome = Outcome(*box)
    if outcome is None:  # a non-master without a process group cannot learn it
        outcome = Outcome("failed", 1, f"rank {rank}: no process group to learn the "
                          "master's requeue outcome.\nHINT: call it on every rank after "
                          "hpc.init_torch().")
    return outcome


def _log(outcome: Outcome) -> None:
    """The master's one line on the outcome, once it happened: a requeue is a normal
    event (INFO), so is a stop outside Slurm; a requeue that did not happen is an error
    (with scontrol's own words when it failed)."""
    log = logger.info if outcome.kind in ("requeued", "not-slurm") else logger.error
    log("%s", outcome.message)
    sys.stdout.flush()
    sys.stderr.flush()
