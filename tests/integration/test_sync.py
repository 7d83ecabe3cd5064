"""sync_model and sync_gradients with real ranks (gloo over loopback, via ``hpc run``).

Each test starts a script from ``tests/integration/scripts/sync_*.py`` under
``hpc run --nproc N``; the scripts check themselves on every rank and print one
``RESULT`` line per rank.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.paths import script
from tests.helpers.processes import clean_env, hpc_run, run_group


def _results(out: str, nproc: int) -> list[str]:
    lines = [line for line in out.splitlines() if "RESULT" in line]
    assert len(lines) == nproc, f"expected {nproc} RESULT lines:\n{out}"
    return lines


def _run_ok(nproc: int, name: str, *args: str, timeout: float = 100) -> list[str]:
    proc = hpc_run(nproc, [script(name), *args], timeout=timeout)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    lines = _results(out, nproc)
    assert all("RESULT ok" in line for line in lines), out
    return lines


@pytest.mark.timeout(120)
@pytest.mark.parametrize("nproc", [2, 3])
def test_sync_model_equal_tensors_and_means(nproc: int) -> None:
    """Broadcast gives rank 0's tensors, the flags give means; int/bool/half included."""
    _run_ok(nproc, "sync_model_check.py")


@pytest.mark.timeout(60)
def test_noop_when_not_distributed() -> None:
    _run_ok(1, "sync_single.py")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("nproc,args", [
    (2, []),                                  # sync_gradients after backward
    (2, ["--api", "backward"]),               # GradSync.backward, overlapped
    (3, ["--match-ddp"]),
    (3, ["--match-ddp", "--api", "backward"]),
    (2, ["--users"]),                         # caller-passed users: no agreement round
    (2, ["--users", "--api", "backward"]),
    (3, ["--match-ddp", "--users"]),
    # 1/3 is not exact in 16 bits: the scale must be applied as DDP does (in float32)
    (3, ["--match-ddp", "--dtype", "bfloat16"]),
    (3, ["--match-ddp", "--dtype", "float16"]),
    (2, ["--shm", "off"]),                    # through the group: isend/irecv, all_reduce
    (2, ["--shm", "off", "--users", "--api", "backward"]),
], ids=["ws2", "ws2-backward", "ws3-match_ddp", "ws3-match_ddp-backward", "ws2-users",
        "ws2-backward-users", "ws3-match_ddp-users", "ws3-match_ddp-bf16",
        "ws3-match_ddp-fp16", "ws2-tcp", "ws2-backward-users-tcp"])
def test_sync_gradients_bitwise_equal_to_ddp(nproc: int, args: list[str]) -> None:
    """Several steps, different unused params per rank, one param unused everywhere."""
    lines = _run_ok(nproc, "sync_grads_vs_ddp.py", "--expect", "bitwise", *args)
    assert all("bitwise_vs_ddp=True" in line for line in lines)
    # one host: shared memory, except where DDP's ring order is asked for (ws 3+)
    tcp = "--shm" in args or "--match-ddp" in args
    assert all(f"shared_memory={0 if tcp else 1}" in line for line in lines)
    if "--match-ddp" not in args:  # DDP-layout buckets also carry unused parameters
        assert all("wire_bytes_per_element=4.0" in line for line in lines)


@pytest.mark.timeout(120)
def test_sync_gradients_ws3_equal_across_ranks() -> None:
    """Default mode at ws 3: bitwise equal across ranks, DDP's values up to rounding,
    through shared memory (three ranks on one host; the process group's path would
    pass the other checks too)."""
    lines = _run_ok(3, "sync_grads_vs_ddp.py", "--expect", "close")
    assert len({line.split("bitwise_vs_ddp=")[1] for line in lines}) == 1
    assert all("shared_memory=1" in line for line in lines), lines


@pytest.mark.timeout(90)
@pytest.mark.parametrize("what,nproc", [("model", 3), ("grads", 2), ("backward", 2)])
def test_unequal_models_fail_fast_with_clear_error(what: str, nproc: int) -> None:
    t0 = time.monotonic()
    proc = hpc_run(nproc, [script("sync_mismatch.py"), "--what", what], timeout=60)
    elapsed = time.monotonic() - t0
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert "UNREACHABLE" not in out
    assert "ModelMismatchError" in out, out
    odd = nproc - 1
    assert "first difference at tensor #2" in out, out
    assert "rank 0: '2.weight' shape (16, 16) float32" in out, out
    assert f"rank {odd}: '2.weight' shape (17, 16) float32" in out, out
    assert "HINT:" in out, out
    assert elapsed < 45, f"took {elapsed:.0f}s: the error should come before any hang"


@pytest.mark.timeout(120)
def test_src_group_parameter_list_and_mixed_dtypes() -> None:
    """src=1, a subgroup (src counted in it), a parameter list, float16/bfloat16/float64."""
    _run_ok(3, "sync_options.py")


@pytest.mark.parametrize("extra", [[], ["--users"]], ids=["agreed", "users"])
def test_bf16_communication_close_to_ddp_bf16_hook(extra: list[str]) -> None:
    """comm_dtype=bfloat16 sends 2 bytes per element; at ws 2 it even matches DDP's
    bf16_compress_hook bit for bit (halving is exact, a sum of two terms is ordered)."""
    lines = _run_ok(2, "sync_grads_vs_ddp.py", "--expect", "close", "--comm-dtype",
                    "bfloat16", *extra)
    assert all("bitwise_vs_ddp=True" in line for line in lines)
    assert all("wire_bytes_per_element=2.0" in line for line in lines)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("case,message", [
    ("omit", ("rank 1 has a gradient for '0.weight' (1 parameter(s) in all) that "
              "users[1] does not list")),
    ("differ", "ranks passed different users on their first call"),
])
def test_wrong_users_fail_fast_with_clear_error(case: str, message: str) -> None:
    t0 = time.monotonic()
    proc = hpc_run(2, [script("sync_users_wrong.py"), "--case", case], timeout=60)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert "UNREACHABLE" not in out
    assert "HPCError" in out and message in out and "HINT:" in out, out
    assert time.monotonic() - t0 < 45, "the error should come before any hang"


@pytest.mark.timeout(90)
def test_a_plain_script_with_a_thread_per_core_is_warned_and_left_as_it_was() -> None:
    """A script that calls init_process_group itself, started with as many torch threads
    as the host has CPUs on each of 2 ranks (srun python, mp.spawn: no OMP_NUM_THREADS):
    the syncs' copies run on each rank's share (their pool spun on the peer's cores:
    sync_model 0.73x a flat broadcast, 0.88x capped, medians of 5), the values are right,
    the script keeps its thread count, and one warning says why and what to set."""
    cpus = os.cpu_count() or 1
    if cpus < 2:
        pytest.skip("needs 2 CPUs: one CPU is every rank's share already")
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    assert torchrun, "torchrun comes with torch"
    proc = run_group([torchrun, "--nproc-per-node", "2", script("sync_plain_threads.py")],
                     timeout=80, env=clean_env(OMP_NUM_THREADS=str(cpus)))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert out.count(f"RESULT ok {cpus} {cpus}") == 2, out
    share = cpus // 2
    assert out.count(f"sync: 2 ranks run on this host, each with {cpus} torch threads, "
                     f"where each has {share} CPU(s) to itself.") == 2, out
    assert f"HINT: export OMP_NUM_THREADS={share} (CPUs per host / ranks per host)" \
        in out, out
