"""The same demo under every local launcher: hpc run, torchrun, mpirun, mpiexec."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.demo import DEMO, check_demo
from tests.helpers.mpi import launcher
from tests.helpers.paths import ROOT, script
from tests.helpers.processes import clean_env, hpc_run, run_group
from tests.helpers.requires import require


@pytest.mark.timeout(120)
def test_hpc_run_four_ranks() -> None:
    proc = hpc_run(4, DEMO, timeout=100)
    assert proc.returncode == 0, proc.stderr
    rows = check_demo(proc.stdout, 4, "hpc-run")
    assert all(line.startswith("[rank ") for line in proc.stdout.splitlines() if line)
    assert len(rows) == 4


@pytest.mark.timeout(120)
def test_torchrun_two_ranks() -> None:
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or require(
        "torchrun", "torchrun (comes with torch)")
    proc = run_group([torchrun, "--nproc-per-node", "2", "-m", "hpc", "demo"],
                     timeout=100, env=clean_env(), cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    check_demo(proc.stdout, 2, "torchrun")


@pytest.mark.mpi
@pytest.mark.timeout(120)
@pytest.mark.parametrize("with_mpi4py", [True, False], ids=["mpi4py", "no-mpi4py"])
@pytest.mark.parametrize("kind", ["openmpi", "mpich"])
def test_mpi_launchers(kind: str, with_mpi4py: bool, tmp_path: Path) -> None:
    prefix, env = launcher(kind, tmp_path, 4, with_mpi4py)
    proc = run_group([*prefix, *DEMO], timeout=100, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = check_demo(proc.stdout, 4, kind)
    port = int(rows[0][9].rsplit(":", 1)[1])
    # With mpi4py rank 0 broadcasts a port it found free (ephemeral range); without
    # it the port is derived from the launcher (documented range 15000-31999).
    assert (port >= 32768) if with_mpi4py else (15000 <= port < 32000), port
    if not with_mpi4py:
        assert "mpi4py" not in proc.stderr or "blocked" not in proc.stderr


@pytest.mark.timeout(90)
def test_hpc_run_rank_failure_stops_job() -> None:
    start = time.monotonic()
    proc = hpc_run(4, [script("launch_fail.py")], timeout=80,
                   env=clean_env(FAIL_RANK="2"))
    elapsed = time.monotonic() - start
    assert proc.returncode == 3, proc.stderr
    assert elapsed < 60
    assert "hpc run: rank 2 (pid" in proc.stderr and "failed first with exit code 3" in proc.stderr
    assert "UNREACHABLE" not in proc.stdout


@pytest.mark.mpi
@pytest.mark.timeout(90)
def test_mpirun_rank_failure_stops_job(tmp_path: Path) -> None:
    prefix, env = launcher("openmpi", tmp_path, 4, True)
    env["FAIL_RANK"] = "1"
    start = time.monotonic()
    proc = run_group([*prefix, sys.executable, script("launch_fail.py")],
                     timeout=80, env=env, cwd=ROOT)
    assert proc.returncode != 0
    assert time.monotonic() - start < 60
    assert "rank 1 failing on purpose" in proc.stdout
    assert "UNREACHABLE" not in proc.stdout


def _single(env_extra: dict[str, str], timeout: float = 60) -> tuple[subprocess.CompletedProcess[str], float]:
    start = time.monotonic()
    proc = run_group(DEMO, timeout=timeout, env=clean_env(**env_extra), cwd=ROOT)
    return proc, time.monotonic() - start


@pytest.mark.timeout(60)
def test_unreachable_master_fails_fast() -> None:
    from hpc.environments.base import free_port

    port = free_port("127.0.0.1")  # nobody listens there
    proc, elapsed = _single({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1",
                             "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                             "HPC_CONNECT_TIMEOUT": "3"})
    assert proc.returncode != 0
    assert elapsed < 20
    assert f"rank 1: master 127.0.0.1:{port} is unreachable" in proc.stderr
    assert "HINT:" in proc.stderr


@pytest.mark.timeout(60)
def test_unresolvable_master_fails_at_once() -> None:
    proc, elapsed = _single({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1",
                             "MASTER_ADDR": "no-such-host.invalid", "MASTER_PORT": "29999"})
    assert proc.returncode != 0 and elapsed < 20
    assert "cannot resolve master address 'no-such-host.invalid'" in proc.stderr


@pytest.mark.timeout(60)
def test_missing_ranks_are_named() -> None:
    from hpc.environments.base import free_port

    proc, elapsed = _single({"RANK": "0", "WORLD_SIZE": "3", "LOCAL_RANK": "0",
                             "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
                             "HPC_CONNECT_TIMEOUT": "3"})
    assert proc.returncode != 0 and elapsed < 20
    assert "2 of 3 ranks did not join" in proc.stderr
    assert "missing rank(s) 1, 2" in proc.stderr


@pytest.mark.timeout(60)
def test_inconsistent_variables_fail_before_init() -> None:
    proc, elapsed = _single({
        "RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29500", "SLURM_JOB_ID": "77", "SLURM_STEP_ID": "0",
        "SLURM_PROCID": "1", "SLURM_LOCALID": "1", "SLURM_NODEID": "0",
        "SLURM_STEP_NUM_TASKS": "4", "SLURM_STEP_NUM_NODES": "2",
        "SLURM_STEP_TASKS_PER_NODE": "2(x2)", "SLURM_STEP_NODELIST": "node[1-2]"})
    assert proc.returncode != 0 and elapsed < 20
    assert "RANK=3 WORLD_SIZE=4 vs SLURM_PROCID=1" in proc.stderr
    assert "HINT:" in proc.stderr


@pytest.mark.timeout(60)
def test_plain_python_is_one_process_and_exits_cleanly() -> None:
    proc, _ = _single({})
    assert proc.returncode == 0, proc.stderr
    check_demo(proc.stdout, 1, "local")


@pytest.mark.mpi
@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["openmpi", "mpich"])
def test_bin_mpirun_wrapper_with_hostfile(kind: str, tmp_path: Path) -> None:
    """bin/hpc-mpirun passes the hostfile's first host as master: no mpi4py needed."""
    from hpc.environments.base import free_port

    prefix, env = launcher(kind, tmp_path, 2, with_mpi4py=False)
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# bare cluster\nlocalhost slots=2\n")
    port = free_port()
    env.update(HPC_MPIRUN=prefix[0], HPC_MASTER_PORT=str(port))
    proc = run_group([str(ROOT / "bin" / "hpc-mpirun"), str(hostfile), "2", *DEMO],
                     timeout=100, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = check_demo(proc.stdout, 2, kind)
    assert {m[9] for m in rows} == {f"localhost:{port}"}


@pytest.mark.timeout(60)
def test_hpc_run_sigterm_stops_all_ranks(tmp_path: Path) -> None:
    """scancel or a CI timeout SIGTERMs the launcher: no rank may be left behind."""
    import os
    import signal

    marker = tmp_path / "pids"
    code = (f"import os, time; open({str(marker)!r} + os.environ['RANK'], 'w')"
            ".write(str(os.getpid())); time.sleep(120)")
    proc = subprocess.Popen([sys.executable, "-m", "hpc", "run", "--nproc", "2", "--",
                             sys.executable, "-c", code], env=clean_env(), cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 30
    while not all((tmp_path / f"pids{r}").exists() for r in range(2)):
        assert time.monotonic() < deadline, "ranks did not start"
        time.sleep(0.1)
    pids = [int((tmp_path / f"pids{r}").read_text()) for r in range(2)]
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 143, err
    assert "all 2 ranks stopped on SIGUSR2 (asked by SIGTERM)" in err, err
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
