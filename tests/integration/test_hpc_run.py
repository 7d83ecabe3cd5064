"""``hpc run`` as a new user meets it: which Python runs, signals, root cause (real processes)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.paths import script
from tests.helpers.processes import clean_env, hpc_run, kill_group, start_hpc_run

pytestmark = pytest.mark.timeout(90)


def _start(tmp_path: Path, *cmd: str, nproc: int = 2,
           env: dict[str, str] | None = None) -> tuple[subprocess.Popen[str], list[int]]:
    """Start ``hpc run`` in a session of its own; wait until every rank wrote its pid."""
    return start_hpc_run(tmp_path, cmd, nproc=nproc, env=env)


def _gone(pids: list[int], within: float = 5.0) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        alive = []
        for pid in pids:
            try:
                os.kill(pid, 0)
                alive.append(pid)
            except ProcessLookupError:
                pass
        if not alive:
            return True
        time.sleep(0.05)
    return False


def _finish(proc: subprocess.Popen[str], timeout: float = 30) -> tuple[str, str]:
    try:
        return proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_group(proc)
        raise


def test_leading_python_is_hpc_runs_interpreter_without_a_venv_on_path(tmp_path: Path) -> None:
    """An unactivated venv: `python` on PATH is another one, yet the ranks get ours."""
    other = tmp_path / "python"
    other.write_text("#!/bin/sh\necho 'the python on PATH ran'; exit 7\n")
    other.chmod(0o755)
    env = clean_env(PATH=f"{tmp_path}:/usr/bin:/bin")
    proc = hpc_run(2, ["python", "-c", "import sys, hpc; print(sys.executable)"], env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count(f"] {sys.executable}\n") == 2, proc.stdout


def test_missing_module_names_the_interpreter_and_the_fix() -> None:
    """A Python without hpc (the base interpreter, isolated): the summary says so."""
    base = os.path.join(sys.base_prefix, "bin", "python3")
    if not os.path.exists(base):
        base = sys.executable  # -I -S hide PYTHONPATH and every site-packages anyway
    proc = hpc_run(2, [base, "-I", "-S", "-c", "import hpc"])
    assert proc.returncode == 1, proc.stderr
    assert f"ran {base}, which cannot import 'hpc'.\nHINT: install torch-hpc" in proc.stderr
    assert f"a leading `python` means {sys.executable}" in proc.stderr


def test_usr2_is_relayed_and_a_guarded_script_exits_0(tmp_path: Path) -> None:
    proc, _ = _start(tmp_path, "python", script("run_signals.py"), str(tmp_path), "guard")
    os.kill(proc.pid, signal.SIGUSR2)
    out, err = _finish(proc)
    assert proc.returncode == 0, err
    assert out.count("stopped at the agreed step") == 2, out
    assert "[rank 0] hpc: rank 0 got SIGUSR2: stopping at the next step boundary" in err


def test_one_ctrl_c_is_graceful_a_second_stops_now(tmp_path: Path) -> None:
    proc, pids = _start(tmp_path, "python", script("run_signals.py"), str(tmp_path),
                        "ignore-usr2")
    os.kill(proc.pid, signal.SIGINT)
    time.sleep(0.5)
    assert proc.poll() is None, "one Ctrl-C must only ask the ranks to stop"
    os.kill(proc.pid, signal.SIGINT)
    _, err = _finish(proc)
    assert proc.returncode == 130, err
    assert ("hpc run: got SIGINT: asking all 2 ranks to stop at the next step (SIGUSR2); "
            "SIGINT again stops them now") in err
    assert "hpc run: got SIGINT again: stopped all 2 ranks" in err
    assert "Traceback" not in err and _gone(pids)


def test_no_rank_outlives_a_killed_hpc_run(tmp_path: Path) -> None:
    """SIGKILL (OOM killer): PR_SET_PDEATHSIG takes the ranks down too."""
    proc, pids = _start(tmp_path, "python", script("run_signals.py"), str(tmp_path),
                        "ignore-usr2")
    os.kill(proc.pid, signal.SIGKILL)  # hpc run only: the ranks have sessions of their own
    proc.communicate(timeout=10)
    assert _gone(pids), f"ranks {pids} outlived hpc run"


def test_the_rank_that_failed_first_is_named_even_if_it_exits_last() -> None:
    proc = hpc_run(2, ["python", script("slow_first_failure.py")], timeout=60)
    assert proc.returncode == 1, proc.stderr
    assert "hpc run: rank 1 " in proc.stderr and "RuntimeError: rank 1 broke first" \
        in proc.stderr.splitlines()[-1], proc.stderr
    assert "ranks failing after it: 0;" in proc.stderr


def test_a_rank_killed_before_printing_is_said_to_have_printed_nothing() -> None:
    """SIGKILL (the OOM killer) before any output: the summary does not send the reader
    to output that does not exist; a rank that printed is pointed to its prefix."""
    code = ("import os, signal, time\n"
            "if os.environ['RANK'] == '1':\n"
            "    os.kill(os.getpid(), signal.SIGKILL)\n"
            "print('rank 0 waits', flush=True); time.sleep(30)\n")
    for first, ending in (("", "It printed nothing."),
                          ("print('hello', flush=True)\n",
                           "Its output above is prefixed [rank 1].")):
        proc = hpc_run(2, ["python", "-c", first + code], timeout=60)
        last = proc.stderr.splitlines()[-1]
        assert proc.returncode == 137, proc.stderr
        assert "rank 1 " in last and "failed first with signal SIGKILL" in last, proc.stderr
        assert last.endswith(ending), last
