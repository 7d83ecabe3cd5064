"""A submitted job: where its logs are, how to watch and cancel it, and its result.

Wraps a submitit ``Job``. Waiting polls ``sacct`` every few seconds (submitit's own
watcher may wait up to 10 minutes between two polls, which hides a failure), follows the
job through its requeues, and a failure is reported as a :class:`~hpc.errors.SubmitError`
that names the rank that failed first (from srun's ``task N: ...`` lines).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import IO, Any

from hpc.errors import SubmitError
from hpc.submit import watch as jobwatch
from hpc.submit.options import marks_dir

__all__ = ["SubmittedJob"]


class SubmittedJob:
    """One multi-task Slurm job submitted by :func:`hpc.submit.submit`.

    Attributes:
        job: The submitit job (``job.task(r)`` is rank ``r``).
        options: The :class:`~hpc.submit.SubmitOptions` it was submitted with.
        run_dir: The pretrain run directory (checkpoints, ``metrics.csv``), if any.
        excluded: The bad-node ledger's ``excluding HOST (...)`` lines (:mod:`hpc.ledger`).
    """

    def __init__(self, job: Any, options: Any, run_dir: str | None = None,
                 excluded: list[str] | None = None) -> None:
        self.job, self.options, self.run_dir = job, options, run_dir
        self.excluded = list(excluded or [])

    @property
    def job_id(self) -> str:
        """Slurm's job id (the same across requeues)."""
        return str(self.job.job_id)

    @property
    def num_tasks(self) -> int:
        """Tasks (ranks) of the job."""
        return int(self.job.num_tasks)

    def logs(self, rank: int = 0) -> tuple[Path, Path]:
        """``(stdout, stderr)`` files of ``rank``; rank 0's stderr also has srun's messages."""
        paths = self.job.task(rank).paths
        return Path(paths.stdout), Path(paths.stderr)

    def describe(self) -> str:
        """What ``hpc submit`` prints: layout, logs, how to watch, requeue and cancel."""
        o, jid = self.options, self.job_id
        out, err = self.logs(0)
        gpus = f"{o.gpus_per_node} GPUs/node, " if o.gpus_per_node else ""
        lines = [
            (f"submitted job {jid}: {o.nodes} node(s) x {o.ntasks_per_node} task(s) "
             + (f"+ {o.spare_nodes} spare node(s) under hpc supervise " if o.spare_nodes else "")
             + f"({gpus}"
             f"{o.cpus_per_task} CPU/task), time limit {o.time_min} min, {o.signal} "
             f"{o.signal_delay_s} s before it, up to {o.max_requeues} requeue(s)"),
            *(f"  {line}" for line in self.excluded),
            f"  logs:   {err} (rank 0: log lines, srun errors)",
            (f"          {out} (rank 0 stdout); rank r: {jid}_<r>_log.out/.err in "
             f"{out.parent}"),
        ]
        if self.run_dir:
            lines.append(f"  run:    {self.run_dir} (checkpoints, metrics.csv, pretrain.log)")
        lines += [
            f"  watch:  squeue -j {jid}  |  tail -f {err}  |  sacct -j {jid} -D  (requeues)",
            (f"  cancel: scancel {jid}  |  checkpoint and requeue now: "
             f"scancel --signal={o.signal} {jid}"),
        ]
        return "\n".join(lines)

    def history(self) -> list[jobwatch.Run]:
        """Every run of the job so far (one more per requeue), from ``sacct -D``."""
        return jobwatch.history(self.job_id)

    def state(self) -> str:
        """The current state (``PENDING``, ``RUNNING``, ``REQUEUED``, ``COMPLETED``...)."""
        return jobwatch.current(self.job_id).state

    def wait(self, timeout: float | None = None, poll: float = 2.0) -> jobwatch.Run:
        """Block until the job is over, through requeues; return its last run."""
        return jobwatch.wait(self.job_id, timeout=timeout, poll=poll)

    def follow(self, out: IO[str] = sys.stdout, timeout: float | None = None,
               poll: float = 2.0) -> int:
        """Print rank 0's logs as they grow until the job is over; return its exit status."""
        stdout, stderr = self.logs(0)
        return jobwatch.follow(self.job_id, [stderr, stdout], out=out, timeout=timeout,
                               poll=poll, marks=self.marks)

    def marks(self, restart: int = 0) -> Path:
        """The failure-mark directory (``HPC_ERROR_DIR``) of the run after ``restart``
        requeues: the ranks' marks name the rank that failed first by time."""
        return marks_dir(self.options.log_dir, self.job_id, restart)

    def cancel(self, signal: str | None = None) -> None:
        """``scancel`` the job, or send ``signal`` to every task (``USR2``: requeue now)."""
        cmd = ["scancel", self.job_id] if signal is None else \
            ["scancel", f"--signal={signal}", self.job_id]
        subprocess.run(cmd, check=False, timeout=30)

    def result(self, timeout: float | None = None) -> Any:
        """Rank 0's return value (a ``PretrainResult`` for pretrain); waits for the end.

        Raises:
            SubmitError: the job failed, was cancelled or timed out; the message names
                the rank that failed first and the log files.
        """
        run = self.wait(timeout)
        return self._task_result(0, run)

    def results(self, timeout: float | None = None) -> list[Any]:
        """Every rank's return value, rank order (see :meth:`result`)."""
        run = self.wait(timeout)
        return [self._task_result(r, run) for r in range(self.num_tasks)]

    def _task_result(self, rank: int, run: jobwatch.Run) -> Any:
        task = self.job.task(rank)
        out, err = self.logs(0)
        summary = jobwatch.failure_summary(run, [err, out],
                                           self.marks(max(0, len(self.history()) - 1)))
        where = f"HINT: read {err} (and {out.parent}/{self.job_id}_<rank>_log.err)."
        if not Path(task.paths.result_pickle).exists():
            raise SubmitError(f"{summary}\nrank {rank} left no result.\n{where}")
        try:
            return task.result()
        except Exception as e:  # submitit's FailedJobError carries the remote traceback
            trace = [ln for ln in str(e).splitlines() if ln.strip() and not ln.startswith("-")]
            last = next((ln for ln in reversed(trace) if "Error" in ln or "Exception" in ln),
                        trace[-1] if trace else repr(e))
            raise SubmitError(f"{summary}\nrank {rank} raised {last.strip()}\n{where}") from e

    def __repr__(self) -> str:
        return f"SubmittedJob(job_id={self.job_id!r}, tasks={self.num_tasks})"
