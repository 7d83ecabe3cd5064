"""After init: a frozen or killed rank is named, and the whole job ends, per launcher.

``scripts/hang.py``: rank ``HANG_RANK`` stops making progress before step ``HANG_STEP``
(sleeps in Python, SIGSTOPs itself, or ``os._exit(9)``) while the others ``all_reduce``
with a 10 s collective timeout and ``HPC_HANG_TIMEOUT=5``. Every launcher must end the
job non-zero within timeout + 30 s and name the culprit; srun runs without
``--kill-on-bad-exit`` (as users type it), where the job used to hold its allocation
until the time limit.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.mpi import launcher
from tests.helpers.paths import ROOT, script
from tests.helpers.processes import clean_env, hpc_run
from tests.helpers.requires import require
from tests.helpers.slurm import slurm_env

PG_TIMEOUT = 10
#: A job must end within the collective timeout plus this (the issue's bound).
SLACK = 30
HANG = script("hang.py")
HANG_LINE = next(i for i, line in enumerate(Path(HANG).read_text().splitlines(), 1)
                 if "HANG-LINE" in line)


def hang_env(mode: str, rank: int = 1, **extra: str) -> dict[str, str]:
    return clean_env(HANG_MODE=mode, HANG_RANK=str(rank), HANG_STEP="20",
                     PG_TIMEOUT=str(PG_TIMEOUT), HPC_HANG_TIMEOUT="5", **extra)


def timed(argv: list[str], env: dict[str, str], timeout: float = 90,
          cwd: Path = ROOT) -> tuple[subprocess.CompletedProcess[str], float]:
    start = time.monotonic()
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env,
                          check=False,
                          cwd=cwd)
    return proc, time.monotonic() - start


def assert_named(out: str, rank: int, mode: str) -> None:
    """The report names ``rank`` as never having entered the collective, and why."""
    assert re.search(rf"rank {rank} \(\S+, pid \d+\) never entered all_reduce #\d+", out), out
    if mode == "sleep":
        assert f"it is at hang.py:{HANG_LINE} in <module>" in out, out
    if mode == "stop":
        assert "its watchdog did not answer" in out, out
    assert "UNREACHABLE" not in out


@pytest.mark.timeout(90)
@pytest.mark.parametrize("mode", ["sleep", "stop"])
def test_hpc_run_frozen_rank_is_named_and_blamed(mode: str) -> None:
    start = time.monotonic()
    proc = hpc_run(3, [HANG], timeout=80, env=hang_env(mode))
    elapsed = time.monotonic() - start
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert elapsed < PG_TIMEOUT + SLACK, elapsed
    assert_named(out, 1, mode)
    # hpc run blames the rank that stopped, not the rank 0 that only waited for it.
    assert "hpc run: rank 1 (pid" in proc.stderr and "failed first" in proc.stderr, proc.stderr
    if mode == "sleep":  # the early warning came first, and did not end the job
        assert out.index("possible hang (HPC_HANG_TIMEOUT=5s") < out.index("timed out")


@pytest.mark.timeout(90)
@pytest.mark.parametrize("shm,op", [("1", "barrier"), ("0", "broadcast")])
def test_frozen_rank_in_two_rank_sync_gradients_is_named(shm: str, op: str) -> None:
    """At world size 2 the sync's collectives are sends and receives (or one barrier of
    the shared-memory exchange), not wrapped ``dist`` calls: the watchdog must still
    see rank 0 waiting in one, and name rank 1."""
    env = hang_env("sleep", HANG_OP="sync_gradients", HPC_SYNC_SHM=shm)
    proc = hpc_run(2, [HANG], timeout=80, env=env)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert re.search(rf"rank 1 \(\S+, pid \d+\) never entered {op} #\d+", out), out
    assert f"it is at hang.py:{HANG_LINE} in <module>" in out, out
    assert "UNREACHABLE" not in out


@pytest.mark.timeout(90)
def test_hpc_run_killed_rank_is_blamed() -> None:
    proc = hpc_run(3, [HANG], timeout=80, env=hang_env("exit"))
    assert proc.returncode == 9, proc.stderr
    assert "hpc run: rank 1 (pid" in proc.stderr and "failed first with exit code 9" in proc.stderr


@pytest.mark.timeout(90)
def test_torchrun_frozen_rank_is_named() -> None:
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or require(
        "torchrun", "torchrun (comes with torch)")
    proc, elapsed = timed([torchrun, "--nproc-per-node", "3", HANG], hang_env("sleep"))
    assert proc.returncode != 0
    assert elapsed < PG_TIMEOUT + SLACK, elapsed
    assert_named(proc.stdout + proc.stderr, 1, "sleep")
    assert "hpc.errors.CollectiveError" in proc.stderr


@pytest.mark.mpi
@pytest.mark.timeout(90)
@pytest.mark.parametrize("mode", ["sleep", "exit"])
def test_mpirun_frozen_or_killed_rank(mode: str, tmp_path: Path) -> None:
    prefix, env = launcher("openmpi", tmp_path, 3, True)
    env.update({k: v for k, v in hang_env(mode).items() if k.startswith(("HANG", "PG_", "HPC_"))})
    proc, elapsed = timed([*prefix, sys.executable, HANG], env)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert elapsed < PG_TIMEOUT + SLACK, elapsed
    if mode == "sleep":
        assert_named(out, 1, mode)
    else:  # the job ends at once; mpirun names the rank that exited
        assert re.search(r"rank 1 .*exit|exit.*rank 1|Exit code:\s+9", out, re.DOTALL), out


# --- srun on the test cluster, without --kill-on-bad-exit ------------------------------

@pytest.mark.slurm
@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["sleep", "stop", "exit"])
def test_srun_job_ends_and_names_the_rank(mode: str, job: str, tmp_path: Path) -> None:
    """Rank 3 (node2) freezes or dies; bare srun must still end, the culprit named."""
    env = slurm_env(**{k: v for k, v in hang_env(mode, rank=3).items()
                       if k.startswith(("HANG", "PG_", "HPC_"))})
    require("srun", "Slurm client")
    proc, elapsed = timed(["srun", f"--job-name={job}", "--time=3", "-N2",
                           "--ntasks-per-node=2", sys.executable, HANG], env, timeout=100,
                          cwd=tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert elapsed < PG_TIMEOUT + SLACK, f"{elapsed:.1f}s\n{out}"
    assert_named(out, 3, mode)


# --- what is not a job failure ------------------------------------------------------------

CAUGHT_LOCAL_ERROR = """
import threading, time
import torch, torch.distributed as dist
import hpc
from hpc.watchdog import monitor

info = hpc.init_torch(timeout=10)
out = [None] * info.world_size
try:
    dist.all_gather_object(out, {"lock": threading.Lock()})
except TypeError as e:
    print(f"rank {info.rank} caught TypeError: {e}", flush=True)
for step in range(8):
    dist.all_reduce(torch.ones(1))
    time.sleep(0.5)  # 4 s in all: longer than a failed job's EXIT_GRACE
    print(f"rank {info.rank} step {step}", flush=True)
p = monitor._CURRENT["dog"].progress
print(f"rank {info.rank} entered {p.entered} completed {p.completed}", flush=True)
"""


@pytest.mark.timeout(90)
def test_a_caught_local_error_does_not_end_the_job(tmp_path: Path) -> None:
    """Issue #25 item 2: ``all_gather_object`` of an unpicklable object raises TypeError
    on every rank before anything is sent; the script catches it and trains on. The job
    used to end at step 2 (every rank's watchdog read a published failure)."""
    path = tmp_path / "caught.py"
    path.write_text(CAUGHT_LOCAL_ERROR)
    proc = hpc_run(2, [str(path)], timeout=80, env=clean_env())
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    for rank in (0, 1):
        assert f"rank {rank} caught TypeError: cannot pickle" in out, out
        assert f"rank {rank} step 7" in out, out
        assert f"rank {rank} entered 9 completed 9" in out, out
    assert "CollectiveError" not in out, out


SUBGROUP_THEN_SLEEP = """
import os, time
import torch, torch.distributed as dist
import hpc

info = hpc.init_torch(timeout=float(os.environ["PG_TIMEOUT"]))
solo = dist.new_group([0])
t = torch.ones(1)
if info.rank == 0:
    dist.all_reduce(t, dist.ReduceOp.SUM, solo)  # the group by position
    dist.all_reduce(t, dist.ReduceOp.SUM, solo)
    print("rank 0 sleeps", flush=True)
    time.sleep(3600)  # SOLO-LINE
dist.barrier()
print("UNREACHABLE", flush=True)
"""


@pytest.mark.timeout(90)
def test_subgroup_collectives_by_position_do_not_shift_the_numbers(tmp_path: Path) -> None:
    """Issue #25 item 3: rank 0 runs two ``all_reduce(t, op, group)`` on a group of its
    own, then sleeps in its own code; rank 1 waits in ``barrier()``. The report used to
    say rank 1 "never entered all_reduce #2" and hpc run named rank 1."""
    path = tmp_path / "solo.py"
    path.write_text(SUBGROUP_THEN_SLEEP)
    line = next(i for i, text in enumerate(SUBGROUP_THEN_SLEEP.splitlines(), 1)
                if "SOLO-LINE" in text)
    proc = hpc_run(2, [str(path)], timeout=80,
                   env=clean_env(PG_TIMEOUT=str(PG_TIMEOUT)))
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert re.search(r"rank 0 \(\S+, pid \d+\) never entered barrier #1: it entered no "
                     rf"collective; it is at solo.py:{line} in <module>", out), out
    assert "hpc run: rank 0 (pid" in proc.stderr and "failed first" in proc.stderr, proc.stderr
    assert "UNREACHABLE" not in out
