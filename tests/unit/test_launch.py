"""hpc run's per-rank environment (hpc.launch.rank_env)."""

from __future__ import annotations

import dataclasses
import sys

import pytest

from hpc.cli.env import find_mismatches
from hpc.environments import detect
from hpc.environments.base import DistInfo
from hpc.errors import InconsistentEnvironmentError
from hpc.launch import loopback_interface, rank_env, resolve_command
from tests.helpers.envdumps import load

EXPORTED = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK",
            "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK", "NNODES")
INFO = DistInfo(launcher="slurm", rank=3, local_rank=1, world_size=8, local_world_size=4,
                node_rank=0, num_nodes=2, master_addr="node1", master_port=15042)



def test_rank_env_gives_hpc_run_layout() -> None:
    base = {"PATH": "/usr/bin"}
    envs = [rank_env(r, 4, 29555, "run1", base=base) for r in range(4)]
    assert base == {"PATH": "/usr/bin"}  # not modified
    infos = [detect(env) for env in envs]
    assert [i.rank for i in infos] == [0, 1, 2, 3] == [i.local_rank for i in infos]
    assert {(i.launcher, i.world_size, i.local_world_size, i.num_nodes, i.master_addr,
             i.master_port, i.job_id) for i in infos} == {
        ("hpc-run", 4, 4, 1, "127.0.0.1", 29555, "run1")}
    rows = [dict(dataclasses.asdict(i), host="localhost") for i in infos]
    assert find_mismatches(rows) == []
    assert all(env["PATH"] == "/usr/bin" and env["PYTHONUNBUFFERED"] == "1" for env in envs)
    assert all(int(env["OMP_NUM_THREADS"]) >= 1 for env in envs)


def test_rank_env_keeps_user_threads_and_reads_os_environ(
        monkeypatch: pytest.MonkeyPatch) -> None:
    assert rank_env(0, 2, 1, "r", base={"OMP_NUM_THREADS": "7"})["OMP_NUM_THREADS"] == "7"
    monkeypatch.setenv("HPC_TEST_MARKER", "yes")
    assert rank_env(0, 2, 1, "r")["HPC_TEST_MARKER"] == "yes"


def test_rank_env_keeps_gloo_on_loopback_with_two_lanes() -> None:
    assert rank_env(0, 2, 1, "r", base={}, loopback="lo")["GLOO_SOCKET_IFNAME"] == "lo,lo"
    user = {"GLOO_SOCKET_IFNAME": "eth0"}
    assert rank_env(0, 2, 1, "r", base=user, loopback="lo")["GLOO_SOCKET_IFNAME"] == "eth0"
    assert "GLOO_SOCKET_IFNAME" not in rank_env(0, 2, 1, "r", base={})


def test_loopback_interface_exists_on_linux() -> None:
    if not sys.platform.startswith("linux"):
        pytest.skip("the loopback interface is called lo on Linux only")
    assert loopback_interface() == "lo"


def test_rank_env_inside_slurm_is_not_an_inconsistency() -> None:
    """``hpc run`` inside a one-task srun step: its ranks carry the task's SLURM_* too."""
    task = dict(load("srun_from_login_env.txt")[1][1], SLURM_STEP_NUM_TASKS="1",
                SLURM_NTASKS="1", SLURM_STEP_NUM_NODES="1", SLURM_NNODES="1")
    info = detect(rank_env(3, 4, 29555, "run1", base=task))
    assert (info.launcher, info.rank, info.world_size) == ("hpc-run", 3, 4)


def test_hpc_run_in_every_task_of_a_four_task_step_is_refused() -> None:
    """The same in each task of ``srun -N2 -n4``: four worlds, each with a rank 0."""
    task = load("srun_from_login_env.txt")[1][1]
    with pytest.raises(InconsistentEnvironmentError, match="Every srun task started its own "
                       "hpc run"):
        detect(rank_env(3, 4, 29555, "run1", base=task))


PY = "/venv/bin/python"


@pytest.mark.parametrize(("cmd", "argv"), [
    (["python", "train.py", "--lr", "1"], [PY, "train.py", "--lr", "1"]),
    (["python3", "-m", "pkg.train"], [PY, "-m", "pkg.train"]),
    (["train.py", "-x"], [PY, "train.py", "-x"]),
    (["/usr/bin/python3", "train.py"], ["/usr/bin/python3", "train.py"]),  # the way out
    (["python3.11", "t.py"], ["python3.11", "t.py"]),
    (["bash", "-c", "true"], ["bash", "-c", "true"]),
])
def test_resolve_command_a_leading_python_is_this_interpreter(cmd: list[str],
                                                              argv: list[str]) -> None:
    assert resolve_command(cmd, environ={}, executable=PY) == argv


def test_resolve_command_hpc_python_wins() -> None:
    env = {"HPC_PYTHON": "/other/python"}
    assert resolve_command(["python", "t.py"], environ=env, executable=PY) == [
        "/other/python", "t.py"]
    assert resolve_command(["t.py"], environ=env, executable=PY) == ["/other/python", "t.py"]


def test_resolve_command_finds_a_console_script_beside_the_interpreter(tmp_path) -> None:
    (tmp_path / "hpc-only-here").write_text("#!/bin/sh\n")
    exe = str(tmp_path / "python")
    assert resolve_command(["hpc-only-here", "env"], environ={}, executable=exe) == [
        str(tmp_path / "hpc-only-here"), "env"]


def test_rank_env_says_whether_hpc_run_prefixes_lines() -> None:
    assert rank_env(0, 2, 1, "r", base={}, prefixed=True)["HPC_RUN_PREFIXED"] == "1"
    assert rank_env(0, 2, 1, "r", base={"HPC_RUN_PREFIXED": "1"})["HPC_RUN_PREFIXED"] == "0"


def test_hpc_run_refuses_an_unknown_launcher_before_it_starts_a_rank(
        monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """``HPC_LAUNCHER=pbs hpc run``: the environments' list of names, once, no rank."""
    from hpc import launch
    from hpc.errors import LaunchEnvironmentError

    started = tmp_path / "started"
    with monkeypatch.context() as m, pytest.raises(
            LaunchEnvironmentError, match=r"HPC_LAUNCHER='pbs' is not a known launcher "
            r"\(one of: torchrun, hpc-run, "):
        m.setenv("HPC_LAUNCHER", "pbs")
        launch.run([sys.executable, "-c", f"open({str(started)!r}, 'w')"], 2)
    assert not started.exists()
