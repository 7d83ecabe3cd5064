"""Watching a Slurm job from outside: state and requeue history (``sacct``), log
following, and a failure summary that names the rank that failed first.

Torch- and submitit-free; used by ``hpc submit --wait`` and
:class:`hpc.submit.SubmittedJob`.
"""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO

from hpc.errors import SubmitError
from hpc.watchdog import failure

__all__ = [
    "Run",
    "current",
    "exit_status",
    "failure_summary",
    "first_by_marks",
    "follow",
    "history",
    "is_terminal",
    "wait",
]

#: States after which the job never runs again (sacct spelling, first word).
TERMINAL = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL",
            "BOOT_FAIL", "DEADLINE")
_SRUN_ERROR = re.compile(r"srun: error: (?P<node>[\w.-]+): tasks? (?P<tasks>[\d,\-]+): "
                         r"(?P<what>.+)")
_STEPD = re.compile(r"\*\*\* (?:JOB|STEP) [\d.]+ ON \S+ CANCELLED AT \S+(?P<why>.*?)\*\*\*")


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


def _ranks(tasks: str) -> str:
    word = "ranks" if ("," in tasks or "-" in tasks) else "rank"
    return f"{word} {tasks}"


def _expand(tasks: str) -> list[int]:
    """``0-2,5`` -> ``[0, 1, 2, 5]``."""
    out: list[int] = []
    for part in tasks.split(","):
        low, _, high = part.partition("-")
        if low.isdigit() and (not high or high.isdigit()):
            out.extend(range(int(low), int(high or low) + 1))
    return out


def first_by_marks(marks: str | Path | None, failed: Sequence[int] = ()) -> str | None:
    """``rank 1 on node2 (pid 42) at 12:00:01.234: <message>``: the rank whose failure
    began first by the failure marks in ``marks`` (:func:`hpc.watchdog.failure.first_failure`
    with ``failed``, the ranks srun reported in its order), or None when there is none.

    None too when srun's first failed rank left no mark: killed by a signal (SIGKILL, the
    OOM killer), it ran no Python to write one, and srun saw its exit first.
    """
    if not marks or (failed and failure.read_mark(str(marks), failed[0]) is None):
        return None
    first = failure.first_failure(str(marks), dict.fromkeys(failed))
    if first is None:
        return None
    where = f" on {first.host}" if first.host else ""
    pid = f" (pid {first.pid})" if first.pid else ""
    when = time.strftime("%H:%M:%S", time.localtime(first.began)) + f"{first.began % 1:.3f}"[1:]
    return f"rank {first.rank}{where}{pid} at {when}: {first.message.splitlines()[-1]}"


def describe_failure(logs: Sequence[Path], marks: str | Path | None = None) -> list[str]:
    """``first failure: ...`` and srun's error lines, from the job's output files and
    its failure marks (``marks``: the run's ``HPC_ERROR_DIR``).

    The first failure comes from the marks when there are any: srun prints ``srun:
    error: node2: task 3: Killed`` in the order it learns of the exits, and a rank that
    failed first but took long to exit comes later there. Without marks (or when srun's
    first failed rank has none, see :func:`first_by_marks`), srun's first line is taken.
    """
    found: list[str] = []
    tasks: list[int] = []
    for path in logs:
        try:
            text = Path(path).read_text(errors="replace")
        except OSError:
            continue
        for line in text.splitlines():
            m = _SRUN_ERROR.search(line)
            if m:
                found.append(f"{_ranks(m['tasks'])} on {m['node']}: {m['what'].strip()}")
                tasks.extend(_expand(m["tasks"]))
            s = _STEPD.search(line)
            if s and s["why"].strip():
                found.append(f"slurm: cancelled{s['why'].rstrip()}")
    first = first_by_marks(marks, tasks)
    if first is not None:
        return [f"first failure: {first} (by the failure marks in {marks})",
                *(f"  srun: {f}" for f in dict.fromkeys(found))]
    if found:
        return [f"first failure: {found[0]}", *(f"  then: {f}" for f in dict.fromkeys(found[1:]))]
    return []


def failure_summary(run: Run, logs: Sequence[Path], marks: str | Path | None = None) -> str:
    """Why a finished job failed: its state and ``describe_failure``'s lines."""
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
