"""The local Slurm test cluster (``bin/hpc-testcluster up``) as the tests use it."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest

from hpc.submit import watch as jobwatch
from tests.helpers.processes import clean_env, run_group
from tests.helpers.requires import in_ci, require

#: The time limit run() and sbatch() give every job, in minutes: a stuck job cannot
#: outlive the test run by much. Not 2: pretrain.sbatch asks for USR2 120 s before the
#: limit, which would kill a payload without a handler (the demo) at once.
LIMIT = "--time=3"


def require_slurm() -> None:
    """Skip (fail in CI) unless the local test cluster answers with two idle nodes."""
    require("sbatch", "Slurm client (bin/hpc-testcluster up installs it)")
    if Path("/run/hpc-testcluster.statedir").exists() and not Path("/sys/class/net/hpcbr0").exists():
        # The test cluster's clients would look for 10.200.0.x beyond this machine.
        msg = "the test cluster's bridge hpcbr0 is gone; run bin/hpc-testcluster down && up"
        if in_ci():
            pytest.fail(msg)
        pytest.skip(msg)
    try:
        out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %T"], check=False,
                             capture_output=True,
                             text=True, timeout=20).stdout
    except subprocess.TimeoutExpired:
        out = ""
    nodes = [line.split() for line in out.splitlines() if line.strip()]
    if len(nodes) < 2:
        msg = f"no 2-node Slurm cluster answering (sinfo: {out.strip() or 'nothing'}); run bin/hpc-testcluster up"
        if in_ci():
            pytest.fail(msg)
        pytest.skip(msg)


#: The nodes of the test cluster's 4-node partition ``four``.
FOUR = ("node1", "node2", "node3", "node4")


def require_four() -> None:
    """Skip (fail in CI) unless partition ``four`` has node1-node4 up."""
    require("srun", "Slurm client (bin/hpc-testcluster up installs it)")
    out = subprocess.run(["sinfo", "-h", "-N", "-p", "four", "-o", "%N %T"], check=False,
                         capture_output=True, text=True, timeout=20).stdout
    up = {line.split()[0] for line in out.splitlines()
          if line.split()[-1:] and line.split()[-1] in ("idle", "mixed", "allocated",
                                                         "completing")}
    if not set(FOUR) <= up:
        msg = (f"no 4-node partition 'four' with node1-node4 up (sinfo: "
               f"{out.strip() or 'nothing'}); run bin/hpc-testcluster up (this version)")
        if in_ci():
            pytest.fail(msg)
        pytest.skip(msg)


def job_on_four(prefix: str) -> Iterator[str]:
    """For a fixture: a unique job name on partition ``four`` (skipped, or failed in CI,
    without it); every job of that name is cancelled afterwards."""
    require_four()
    name = f"{prefix}-{uuid.uuid4().hex[:8]}"
    yield name
    subprocess.run(["scancel", f"--name={name}"], check=False, capture_output=True, timeout=30)


def slurm_env(**extra: str) -> dict[str, str]:
    """Environment for sbatch/srun from tests: this venv first on PATH, root-safe MPI."""
    env = clean_env(**extra)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env.setdefault("HPC_PYTHON", sys.executable)
    # The test cluster's GPUs are fake (gres) and torch is the CPU build: the templates'
    # --gpus-per-node=2 jobs train on the CPU on purpose (hpc.bootstrap.build).
    env.setdefault("HPC_ALLOW_CPU", "1")
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    return env


#: Job states after which a job runs no more (:data:`hpc.submit.watch.TERMINAL`, and a job
#: preempted for good). A requeued job is PENDING again, not ended (``sbatch --wait`` waits
#: on through requeues too).
ENDED = frozenset({*jobwatch.TERMINAL, "PREEMPTED"})
#: Seconds between two looks at a job that sbatch_wait waits for.
POLL_S = 0.5


def job_ended(job_id: str) -> tuple[str, int] | None:
    """``(state, exit status)`` of a job that has ended, None while it may still run.

    The exit status is what ``sbatch --wait`` returns: the batch script's exit code, 1 when
    a signal ended it. Read from ``scontrol`` (slurmctld, at once); from ``sacct``
    (:func:`hpc.submit.watch.current`) when the controller has forgotten the job."""
    out = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True,
                         text=True, timeout=20).stdout
    fields = dict(f.split("=", 1) for f in out.split() if "=" in f)
    state, code = fields.get("JobState"), fields.get("ExitCode", "")
    if state is None:  # purged (MinJobAge): the accounting record
        run = jobwatch.current(job_id)
        state, code = run.word, run.exit_code
    if state not in ENDED:
        return None
    exit_code, _, sig = code.partition(":")
    return state, (1 if sig not in ("", "0") else int(exit_code or 0))


def sbatch_wait(args: Sequence[str], workdir: Path, *, timeout: float = 240,
                env: dict[str, str] | None = None) -> tuple[int, int, str]:
    """Like ``sbatch --wait ARGS`` from ``workdir``: (job id, exit code, output file text).

    Polls the job every :data:`POLL_S` seconds: ``sbatch --wait`` sleeps 2 s, then 8 s,
    then 32 s between its looks (Slurm's ``_job_wait``), so a 12 s job cost a test 42 s.
    The job's output goes to ``workdir/slurm-<id>.out`` unless ARGS set ``--output``.
    On a timeout the job is cancelled and :class:`subprocess.TimeoutExpired` raised.
    """
    proc = subprocess.run(["sbatch", "--parsable", *args], cwd=workdir,
                          env=env or slurm_env(), capture_output=True, text=True, timeout=30)
    job_id = proc.stdout.strip().split(";")[0].splitlines()[0] if proc.stdout.strip() else ""
    if proc.returncode != 0 or not job_id.isdigit():
        raise RuntimeError(f"sbatch failed (rc {proc.returncode}): {proc.stderr}")
    deadline = time.monotonic() + timeout
    while (ended := job_ended(job_id)) is None:
        if time.monotonic() > deadline:
            subprocess.run(["scancel", job_id], check=False, timeout=20)
            raise subprocess.TimeoutExpired(["sbatch", "--wait", *args], timeout)
        time.sleep(POLL_S)
    outputs = sorted(workdir.glob(f"*{job_id}*.out"))
    text = "\n".join(p.read_text(errors="replace") for p in outputs)
    return int(job_id), ended[1], text


def run(argv: Sequence[str], name: str, tmp: Path, env: dict[str, str],
        timeout: float = 90) -> subprocess.CompletedProcess[str]:
    """``srun``/``salloc`` ARGV as job ``name`` (the ``job`` fixture) under :data:`LIMIT`,
    from ``tmp``; a timeout kills the client and its process group."""
    require(argv[0], "Slurm client")
    full = [argv[0], f"--job-name={name}", LIMIT, *argv[1:]]
    return run_group(full, timeout=timeout, cwd=tmp, env=env)


def sbatch(args: Sequence[str], name: str, tmp: Path, env: dict[str, str] | None = None,
           timeout: float = 100) -> tuple[int, int, str]:
    """sbatch_wait(ARGS) as job ``name`` under :data:`LIMIT`, run from and writing its
    output to ``tmp``: (job id, exit code, output)."""
    return sbatch_wait([f"--job-name={name}", LIMIT, f"--chdir={tmp}",
                        f"--output={tmp}/%x-%j.out", *args], tmp,
                       timeout=timeout, env=env or slurm_env())


def sbatch_nowait(args: Sequence[str], cwd: Path, env: dict[str, str],
                  cancel_after: list[str]) -> str:
    """``sbatch ARGS`` from ``cwd`` without waiting; the job id, also appended to
    ``cancel_after`` (the fixture of that name cancels them at teardown)."""
    proc = subprocess.run(["sbatch", "--parsable", *args], check=False, cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    job_id = proc.stdout.strip().split(";")[0]
    cancel_after.append(job_id)
    return job_id


def until(what: str, check: Callable[[], object], job_id: str, timeout: float = 120) -> None:
    """Until ``check()`` is true (polled every 0.2 s); fail, naming ``what``, on a timeout or
    once job ``job_id`` is over (its state, a sacct call, is read every 5 s)."""
    deadline, polls = time.monotonic() + timeout, 0
    while not check():
        polls += 1
        if time.monotonic() > deadline or (
                polls % 25 == 0 and jobwatch.is_terminal(jobwatch.current(job_id))):
            pytest.fail(f"{what} did not happen within {timeout:g} s or before job "
                        f"{job_id} ended: {jobwatch.current(job_id)}")
        time.sleep(0.2)


def wait_for_file(path: Path, job_id: str, timeout: float = 90) -> None:
    """Until ``path`` exists; fail early when job ``job_id`` is over."""
    until(f"{path} appearing", path.exists, job_id, timeout)
