"""While training runs: a slow or stopped rank is named, a corrupt replica stops the job,
and every ``HPC_FAULT`` kind ends a job naming its rank (issue #28; real ranks).

Each test runs ``scripts/health_train.py`` (an MLP trained data-parallel, watched by
``hpc.AgreedStop(model=, optimizer=)``) under ``hpc run`` on gloo, or ``hpc pretrain``.
Straggler windows are ``HPC_STRAGGLER_EVERY=20`` steps (the first is 1-20, 19 steps: the first
boundary only starts the clock); the verdict line and ``stragglers.json`` come from the
global master only.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.helpers.paths import script
from tests.helpers.processes import clean_env, hpc_run, kill_group, start_hpc_run

TRAIN = script("health_train.py")
#: The master's verdict line: the ranks named and the window's steps.
VERDICT = re.compile(r"^\[rank (\d+)\] .*WARNING hpc\.health\.step: straggler: \S+ "
                     r"\((ranks? [\d,-]+)\) .* over steps (\d+)-(\d+)", re.MULTILINE)
#: The collective timeout of the runs that hang (seconds).
PG_TIMEOUT = 10


def train(nproc: int, timeout: float = 60, **env: str) -> subprocess.CompletedProcess[str]:
    """``hpc run --nproc N -- python health_train.py`` with ``env`` added."""
    return hpc_run(nproc, ["python", TRAIN], timeout=timeout, env=clean_env(**env))


def verdicts(out: str) -> list[tuple[int, str, int, int]]:
    """Every verdict line: (the logging rank, "rank 2", first step, last step)."""
    return [(int(m[1]), m[2], int(m[3]), int(m[4])) for m in VERDICT.finditer(out)]


def windows(out: str) -> list[tuple[int, int]]:
    """The straggler windows the master judged (its DEBUG lines)."""
    return [(int(a), int(b)) for a, b in
            re.findall(r"DEBUG hpc\.health\.step: straggler window (\d+)-(\d+)", out)]


# --- stragglers ----------------------------------------------------------------------

@pytest.mark.timeout(60)
@pytest.mark.alone  # see setup.cfg
def test_slow_rank_is_named_soon_after_its_fault_and_only_then(tmp_path: Path) -> None:
    """``slow:3`` on rank 2 from step 40 (its steps 41 on): named over a window within two
    windows of the fault (a verdict may need two windows in a row), rank 2 alone; the two
    healthy windows judged before it name nobody; stragglers.json says the same."""
    proc = train(3, HPC_FAULT="2:40:slow:3", STEPS="100", WORK="6", LOG_LEVEL="DEBUG",
                 HPC_LOG_DIR=str(tmp_path))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "done 100 steps" in proc.stdout, out
    assert {(1, 20), (21, 40)} <= set(windows(out)), out  # the healthy windows were judged
    found = verdicts(out)
    assert found, f"no verdict named the slow rank:\n{out}"
    assert all(who == 0 and ranks == "rank 2" for who, ranks, _, _ in found), found
    _, _, start, end = found[0]
    assert start > 40, f"a window before the fault named a rank: {found}"
    assert end <= 40 + 2 * 20, f"rank 2 named only after steps {start}-{end}"
    findings = json.loads((tmp_path / "stragglers.json").read_text())["findings"]
    assert findings and all(f["ranks"] == [2] for f in findings), findings
    assert findings[0]["steps"] == [start, end] and findings[0]["kind"] == "relative"
    assert findings[0]["factor"] > 1.5, findings[0]


def _start_with_pids(nproc: int, pid_dir: Path, **env: str) -> tuple[subprocess.Popen[str],
                                                                    list[int]]:
    """``hpc run`` of the training script in a session of its own; every rank's pid."""
    return start_hpc_run(pid_dir, ["python", TRAIN], nproc=nproc,
                         env=clean_env(PID_DIR=str(pid_dir), **env), merge_stderr=True)


def _duty_cycle(proc: subprocess.Popen[str], pid: int, stopped: float, running: float,
                timeout: float = 40) -> str:
    """SIGSTOP ``pid`` for ``stopped`` seconds in every ``stopped + running`` until the
    job ends; its output."""
    deadline = time.monotonic() + timeout
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                os.kill(pid, signal.SIGSTOP)
                time.sleep(stopped)
            finally:
                try:
                    os.kill(pid, signal.SIGCONT)
                except ProcessLookupError:
                    break
            time.sleep(running)
        return proc.communicate(timeout=max(1.0, deadline - time.monotonic()))[0]
    finally:
        if proc.poll() is None:
            kill_group(proc)


@pytest.mark.timeout(60)
@pytest.mark.alone  # see setup.cfg
def test_rank_sigstopped_half_the_time_is_named(tmp_path: Path) -> None:
    """A real stop (SIGSTOP 100 ms in every 200 ms) of rank 1, mostly while it waits in
    a collective: the stall meter counts it as rank 1's compute, not its wait, so rank 1
    is named, not the ranks that waited for it. Steps of ~45 ms (WORK=30): each stop
    spans steps."""
    proc, pids = _start_with_pids(3, tmp_path, STEPS="60", WORK="30")
    out = _duty_cycle(proc, pids[1], 0.10, 0.10)
    assert proc.returncode == 0, out
    found = verdicts(out)
    assert found, f"no verdict named the stopped rank:\n{out}"
    assert all(ranks == "rank 1" for _, ranks, _, _ in found), found


@pytest.mark.timeout(60)
@pytest.mark.alone  # see setup.cfg
def test_rank_sigstopped_30_percent_of_short_steps_is_named(tmp_path: Path) -> None:
    """SIGSTOP 60 ms in every 200 ms of rank 1 while steps take ~12 ms: a stop lands in
    one step of a window, ~3 ms a step on average, and two windows in a row over 1.3x,
    2 ms and 15 % name it (the window's mean keeps every stop: no trimming)."""
    proc, pids = _start_with_pids(3, tmp_path, STEPS="200", WORK="3")
    out = _duty_cycle(proc, pids[1], 0.06, 0.14)
    assert proc.returncode == 0, out
    found = verdicts(out)
    assert found and all(ranks == "rank 1" for _, ranks, _, _ in found), out


# --- silent corruption ---------------------------------------------------------------

CORRUPT = ("hpc.errors.SilentCorruptionError: silent corruption: after step 30 the "
           r"replicated state of rank 1 on \S+ differs from the other ranks', in {}\.$")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode,tensor", [("sync", "0.weight"), ("ddp", "module.0.weight")])
def test_bitflip_stops_every_rank_naming_rank_step_and_tensor(mode: str, tensor: str) -> None:
    """Rank 1's first weight gets a bit flipped after step 30; the check of step 30 (every
    10 steps) fails on all 3 ranks with the rank, the step and the tensor; the checks
    before it agreed."""
    proc = train(3, MODE=mode, HPC_FAULT="1:30:bitflip", HPC_SDC_EVERY="10", STEPS="60",
                 LOG_LEVEL="DEBUG")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert "done" not in proc.stdout, out
    for r in range(3):
        assert re.search(rf"^\[rank {r}\] \[rank{r}\]: " + CORRUPT.format(re.escape(tensor)),
                         out, re.MULTILINE), f"rank {r} did not fail on it:\n{out}"
    assert re.findall(r"replicas agree at step (\d+) \(16 tensors\)", out) == ["10", "20"], out
    assert re.search(r"hpc run: rank \d \(pid \d+\) failed first with exit code 1: "
                     r"hpc\.errors\.SilentCorruptionError", proc.stderr), proc.stderr


@pytest.mark.timeout(60)
def test_bitflip_with_sdc_warn_is_logged_and_training_goes_on() -> None:
    proc = train(3, HPC_FAULT="1:30:bitflip", HPC_SDC="warn", HPC_SDC_EVERY="10",
                 STEPS="50")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "done 50 steps" in proc.stdout, out
    warned = re.findall(r"^\[rank (\d)\] .*WARNING hpc\.health\.step: silent corruption: "
                        r"after step (\d+) the replicated state of rank 1 on ", out, re.M)
    # the master, once per check from the flip on (the flipped weight stays flipped)
    assert warned == [("0", "30"), ("0", "40"), ("0", "50")], out
    assert "SilentCorruptionError" not in out


@pytest.mark.timeout(60)
def test_no_fault_no_corruption_and_every_check_ran() -> None:
    proc = train(3, HPC_SDC_EVERY="10", STEPS="50", LOG_LEVEL="DEBUG")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "silent corruption" not in out
    agreed = re.findall(r"^\[rank (\d)\] .*replicas agree at step (\d+) \(16 tensors\)", out,
                        re.M)
    assert agreed == [("0", str(s)) for s in (10, 20, 30, 40, 50)], out


@pytest.mark.timeout(90)
def test_pretrain_bitflip_fails_naming_rank_1(tmp_path: Path) -> None:
    """``hpc pretrain`` (2 ranks: a tie, the side without rank 0 is named) fails with the
    message on each rank and exit status 1."""
    argv = ["hpc", "pretrain", "--epochs", "2", "--batch-size", "64", "--width", "16",
            "--val-archs", "2", "--recal-samples", "128", "--no-progress",
            "--out", str(tmp_path / "run")]
    proc = hpc_run(2, argv, timeout=80, env=clean_env(
        HPC_FAULT="1:20:bitflip", HPC_SDC_EVERY="10", OMP_NUM_THREADS="1"))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    for r in range(2):
        assert re.search(rf"^\[rank {r}\] .*ERROR hpc\.preempt\.stage: silent corruption: after "
                         r"step 20 the replicated state of rank 1 on \S+ differs from the "
                         r"other ranks' \(no strict majority: the side named is the one "
                         r"without rank 0\), in stem\.0\.weight\.$", out, re.M), out
    assert re.search(r"hpc run: rank \d \(pid \d+\) failed first with exit code 1",
                     proc.stderr), proc.stderr
    assert not (tmp_path / "run" / "result.json").exists()


# --- HPC_FAULT ends the job, naming the rank -------------------------------------------

@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind,how", [
    ("kill", r"with signal SIGKILL"),
    ("exit", r"with exit code 1;"),
    ("exc", r"with exit code 1: hpc\.errors\.InjectedFault: HPC_FAULT 1:20:exc: an "
            r"exception injected on rank 1 at step 20\."),
    ("hang", r"with exit code 1: \S+ #\d+ timed out \(reported by rank 0\): rank 1 "
             r"\(\S+, pid {pid}\) never entered it; ranks failing after it"),
], ids=["kill", "exit", "exc", "hang"])
def test_fault_ends_the_job_and_hpc_run_names_the_rank(kind: str, how: str) -> None:
    """A 2-rank job with ``HPC_FAULT=1:20:<kind>`` ends non-zero and hpc run blames rank 1
    (a hang: the watchdog names it before the collective timeout ends the job)."""
    start = time.monotonic()
    proc = train(2, timeout=50, HPC_FAULT=f"1:20:{kind}", STEPS="60",
                 PG_TIMEOUT=str(PG_TIMEOUT), HPC_HANG_TIMEOUT="5")
    elapsed = time.monotonic() - start
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert "done" not in proc.stdout, out
    m = re.search(r"^hpc run: rank 1 \(pid (\d+)\) failed first (.*)$", proc.stderr, re.M)
    assert m, proc.stderr
    assert re.match(how.format(pid=m[1]), m[2]), m[2]
    if kind == "hang":
        assert re.search(r"possible hang \(HPC_HANG_TIMEOUT=5s.*\n.*: rank 1 \(\S+, pid "
                         rf"{m[1]}\) never entered it\.", out), out
        assert elapsed < PG_TIMEOUT + 30, elapsed
