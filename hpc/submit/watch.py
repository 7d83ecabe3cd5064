"""Watching a Slurm job from outside: state and requeue history (``sacct``), log
following, and a failure summary (the rank that failed first comes from
:mod:`hpc.watchdog.failure`, which the batch templates use too).

Torch- and submitit-free; used by ``hpc submit --wait`` and
:class:`hpc.submit.SubmittedJob`.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO

from hpc.errors import SubmitError
from hpc.watchdog.failure import describe_failure

__all__ = [
    "Run",
    "current",
    "exit_status",
    "failure_summary",
    "follow",
    "history",
    "is_terminal",
    "wait",
]

#: States after which the job never runs again (sacct spelling, first word).
TERMINAL = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL",
            "BOOT_FAIL", "DEADLINE")


@dataclasses.dataclass(frozen=True)
class Run:
    """One run of a job (a requeued job has several), as ``sacct -D`` reports it."""

    job_id: str
    state: str
    exit_code: str
    start: str
    end: str
    nodes: str

    @property
    def word(self) -> str:
        """The state's first word (``CANCELLED by 0`` -> ``CANCELLED``)."""
        return self.state.split()[0] if self.state else "UNKNOWN"


def history(job_id: str, timeout: float = 30) -> list[Run]:
    """Every run of ``job_id``, oldest first (empty until slurmdbd knows the job).

    Raises:
        SubmitError: ``sacct`` is missing or failed.
    """
    cmd = ["sacct", "-j", str(job_id), "-X", "-D", "-n", "-P",
           "-o", "JobID,State,ExitCode,Start,End,NodeList"]
    try:
        proc = subprocess.run(cmd, check=False, capture_output=True, text=True,
                              timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise SubmitError(f"`{' '.join(cmd)}` failed: {e}.\n"
                          "HINT: check that the Slurm client tools (sacct) are on PATH and "
                          "accounting (slurmdbd) answers.") from e
    if proc.returncode != 0:
        raise SubmitError(f"`{' '.join(cmd)}` exited with {proc.returncode}: "
                          f"{proc.stderr.strip()}.\nHINT: sacct needs job accounting "
                          "(slurmdbd); try `squeue -j ID` instead.")
    runs = []
    for line in proc.stdout.splitlines():
        parts = line.split("|")
        if len(parts) >= 6 and parts[0] == str(job_id):
            runs.append(Run(*parts[:6]))
    return runs


def current(job_id: str) -> Run:
    """The latest run of the job (``PENDING`` while sacct does not list it yet)."""
    runs = history(job_id)
    return runs[-1] if runs else Run(str(job_id), "PENDING", "", "", "", "")


def is_terminal(run: Run) -> bool:
    """True when the job is over (it will not be requeued any more)."""
    return run.word in TERMINAL


def exit_status(run: Run) -> int:
    """Shell-style status of a finished run: 0 when COMPLETED, else the code (or 128+signal)."""
    if run.word == "COMPLETED":
        return 0
    code, _, sig = run.exit_code.partition(":")
    try:
        number, signum = int(code or 0), int(sig or 0)
    except ValueError:
        return 1
    return number or (128 + signum if signum else 1)


def failure_summary(run: Run, logs: Sequence[Path], marks: str | Path | None = None) -> str:
    """Why a finished job failed: its state and
    :func:`~hpc.watchdog.failure.describe_failure`'s lines."""
    return "\n".join([f"job {run.job_id} {run.state} (exit code {run.exit_code or '?'})",
                      *describe_failure(logs, marks)])


def wait(job_id: str, timeout: float | None = None, poll: float = 2.0,
         on_poll: Callable[[list[Run], Run, bool], None] | None = None) -> Run:
    """Poll ``sacct`` until the job is over (requeues are followed); return its last run.

    Args:
        job_id: The job.
        timeout: Seconds to wait at most (default: no limit).
        poll: Seconds between two ``sacct`` calls.
        on_poll: Called after each poll with all runs, the latest, and whether the
            number of runs or the state changed since the previous poll.

    Raises:
        SubmitError: ``timeout`` seconds passed first (the job keeps running).
    """
    deadline = None if timeout is None else time.monotonic() + timeout
    seen: tuple[int, str] | None = None
    while True:
        runs = history(job_id)
        run = runs[-1] if runs else Run(str(job_id), "PENDING", "", "", "", "")
        key = (max(len(runs), 1), run.state)  # not listed yet = the first run PENDING
        if on_poll is not None:
            on_poll(runs, run, key != seen)
        seen = key
        if is_terminal(run):
            return run
        if deadline is not None and time.monotonic() > deadline:
            raise SubmitError(f"job {job_id} is still {run.state} after {timeout:.0f} s.\n"
                              f"HINT: keep watching with `squeue -j {job_id}`, or "
                              f"`scancel {job_id}` to stop it.")
        time.sleep(poll)


class _Tail:
    """New bytes of a file that may not exist yet and is only ever appended to."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset = Path(path), 0

    def read(self) -> str:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except OSError:
            return ""
        self.offset += len(data)
        return data.decode(errors="replace")


def follow(job_id: str, logs: Sequence[Path], out: IO[str] = sys.stdout,
           timeout: float | None = None, poll: float = 2.0,
           marks: Callable[[int], Path] | None = None) -> int:
    """Print the master's logs as they grow until the job is over; return its exit status.

    Requeues are reported as they happen (the logs are appended to across restarts). A
    failed job ends with :func:`failure_summary`; ``marks(restart)`` is the failure-mark
    directory of the run after ``restart`` requeues.
    """
    tails = [_Tail(p) for p in logs]

    def drain() -> None:
        for t in tails:
            text = t.read()
            if text:
                out.write(text)
        out.flush()

    def polled(runs: list[Run], run: Run, changed: bool) -> None:
        drain()
        if changed:
            restart = f" (run {len(runs)})" if len(runs) > 1 else ""
            out.write(f"hpc submit: job {job_id} {run.state}{restart}\n")
            out.flush()

    runs: list[int] = [0]

    def counted(all_runs: list[Run], run: Run, changed: bool) -> None:
        runs[0] = len(all_runs)
        polled(all_runs, run, changed)

    run = wait(job_id, timeout=timeout, poll=poll, on_poll=counted)
    time.sleep(min(poll, 1.0))  # the last lines of the logs land after the state changes
    drain()
    status = exit_status(run)
    if status != 0:
        where = marks(max(0, runs[0] - 1)) if marks is not None else None
        out.write("hpc submit: " + failure_summary(run, logs, where)
                  .replace("\n", "\nhpc submit: ") + "\n")
        out.flush()
    return status
