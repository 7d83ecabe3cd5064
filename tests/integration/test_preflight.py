"""The pre-flight's own error paths (hpc/bootstrap/preflight.py), each triggered by real
processes on loopback: the master port taken, two processes with one rank, rank 0 dying
before it confirms the start, and a rank that stalls after init_process_group.

Every rank is a real ``python`` running hpc.init_torch (gloo) with hand-set
RANK/WORLD_SIZE/MASTER_* variables, as a job script that exports them would; each test
checks the message a user sees and that it came within seconds, not after the 30-minute
default.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import timedelta

import pytest

from tests.helpers.paths import ROOT, script
from tests.helpers.processes import clean_env, kill_group

torch = pytest.importorskip("torch")

RANK = [sys.executable, script("preflight_rank.py")]


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[str]]]:
    """Started ranks; whatever still runs at teardown is killed with its group."""
    started: list[subprocess.Popen[str]] = []
    yield started
    for p in started:
        if p.poll() is None:
            kill_group(p)
        p.communicate()


def start(procs: list[subprocess.Popen[str]], rank: int, world: int, port: int,
          **extra: str) -> subprocess.Popen[str]:
    env = clean_env(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                    MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), **extra)
    p = subprocess.Popen(RANK, env=env, cwd=ROOT, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, start_new_session=True)
    procs.append(p)
    return p


def finish(p: subprocess.Popen[str], timeout: float = 40) -> tuple[int, str]:
    out, err = p.communicate(timeout=timeout)
    return p.returncode, out + err


def free_port() -> int:
    from hpc.environments.base import free_port as free

    return free("127.0.0.1")


def joined(port: int, rank: int, timeout: float = 40) -> None:
    """Until ``rank`` has reported in to rank 0's store (read as one more client)."""
    store = torch.distributed.TCPStore("127.0.0.1", port, None, False,
                                       timeout=timedelta(seconds=timeout))
    deadline = time.monotonic() + timeout
    while not store.check([f"hpc/pf/{rank}"]):  # unscoped: rank 0 serves this store
        assert time.monotonic() < deadline, f"rank {rank} never joined"
        time.sleep(0.1)


@pytest.mark.timeout(60)
def test_master_port_taken(procs: list[subprocess.Popen[str]]) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        t0 = time.monotonic()
        code, text = finish(start(procs, 0, 2, port))
    assert code != 0 and time.monotonic() - t0 < 30, text
    assert f"rank 0: cannot listen on 127.0.0.1:{port}" in text, text
    assert "HINT: export MASTER_PORT=<a free port>" in text


@pytest.mark.timeout(90)
def test_two_processes_with_one_rank(procs: list[subprocess.Popen[str]]) -> None:
    port = free_port()
    master = start(procs, 0, 3, port, HPC_CONNECT_TIMEOUT="20")  # waits for rank 2
    first = start(procs, 1, 3, port)
    joined(port, 1)
    t0 = time.monotonic()
    code, text = finish(start(procs, 1, 3, port), timeout=30)
    assert code != 0 and time.monotonic() - t0 < 20, text
    assert f"rank 1: another process already joined 127.0.0.1:{port} as rank 1" in text, text
    assert "HINT: unset RANK/LOCAL_RANK" in text
    for p in (master, first):
        kill_group(p)


@pytest.mark.timeout(90)
def test_rank0_dies_before_confirming(procs: list[subprocess.Popen[str]]) -> None:
    port = free_port()
    master = start(procs, 0, 3, port, HPC_CONNECT_TIMEOUT="60")  # waits for rank 2
    worker = start(procs, 1, 3, port, HPC_CONNECT_TIMEOUT="60")
    joined(port, 1)
    kill_group(master)
    t0 = time.monotonic()
    code, text = finish(worker, timeout=40)
    assert code != 0 and time.monotonic() - t0 < 20, text  # not the 60 s wait
    assert f"rank 1: connected to 127.0.0.1:{port} but rank 0 never confirmed" in text, text
    assert "HINT: check rank 0's log." in text


@pytest.mark.timeout(90)
def test_rank_stalled_after_init_times_out_the_confirmation(
        procs: list[subprocess.Popen[str]]) -> None:
    port = free_port()
    master = start(procs, 0, 2, port, HPC_CONNECT_TIMEOUT="4")
    start(procs, 1, 2, port, HPC_CONNECT_TIMEOUT="4", HPC_TEST_STALL_AFTER_INIT="40")
    code, text = finish(master, timeout=60)
    assert code != 0, text
    assert ("rank 0: initialised, but not every rank of 2 finished init_process_group "
            "within 4s") in text, text
    assert "HINT: check the other ranks' logs" in text
