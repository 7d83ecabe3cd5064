"""hpc.requeue.requeue: warning signal -> stop request -> requeue decision, without a job.

Real signals are sent to this process; ``scontrol`` is used where installed.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from hpc.errors import PreemptError, SubmitError
from hpc.preempt import guard as guard_mod
from hpc.preempt import requeue


@pytest.mark.parametrize("name", ["USR2", "SIGUSR2", "usr2", str(int(signal.SIGUSR2))])
def test_parse_signal_accepts_the_usual_spellings(name: str) -> None:
    assert guard_mod.parse_signal(name) == signal.SIGUSR2


@pytest.mark.parametrize("name", ["KILL", "STOP", "FOO", "9"])
def test_parse_signal_rejects_uncatchable_and_unknown_listing_valid(name: str) -> None:
    with pytest.raises(PreemptError, match=r"HINT: use one of: USR2, USR1") as raised:
        guard_mod.parse_signal(name)
    # a bad signal under torchrun or mpirun is not a submitit error
    assert not isinstance(raised.value, SubmitError)


def test_budget_compares_restart_count_with_max_requeues() -> None:
    assert requeue.read_budget({}) == requeue.Budget(0, requeue.DEFAULT_MAX_REQUEUES)
    b = requeue.read_budget({"SLURM_RESTART_COUNT": "2", "HPC_MAX_REQUEUES": "2"})
    assert (b.restarts, b.max_requeues, b.left) == (2, 2, False)
    assert requeue.read_budget({"SLURM_RESTART_COUNT": "1", "HPC_MAX_REQUEUES": "2"}).left
    with pytest.raises(PreemptError, match="HPC_MAX_REQUEUES='x'"):
        requeue.read_budget({"HPC_MAX_REQUEUES": "x"})


def test_guard_turns_a_real_signal_into_a_stop_request() -> None:
    guard = guard_mod.PreemptGuard(environ={"HPC_PREEMPT_SIGNAL": "USR2"}).install()
    try:
        assert guard() is False
        os.kill(os.getpid(), signal.SIGUSR2)
        time.sleep(0.05)  # the Python-level handler runs at the next bytecode boundary
        assert guard() is True and guard.received_at is not None
        assert guard.signal_name == "SIGUSR2"
    finally:
        guard.uninstall()
    assert signal.getsignal(signal.SIGUSR2) != guard.request


POLLS: list[int] = []


def _record_poll() -> None:
    POLLS.append(1)


def test_guard_calls_its_step_hook_at_every_poll() -> None:
    polls: list[int] = []
    guard = guard_mod.PreemptGuard(environ={}, step_hook=lambda: polls.append(1))
    assert (guard(), guard(), polls) == (False, False, [1, 1])
    POLLS.clear()
    guard = guard_mod.PreemptGuard(environ={"HPC_STEP_HOOK": f"{__name__}:_record_poll"})
    guard()
    assert POLLS == [1]
    assert guard_mod.PreemptGuard(environ={}).step_hook is None


@pytest.mark.parametrize("spec, match", [
    ("nocolon", "is not module:function"),
    ("no_such_module_x:f", "cannot be loaded.*HINT: put the module on PYTHONPATH"),
    ("os:no_such_function", "cannot be loaded"),
    ("os:sep", "is a str, not a function"),
])
def test_bad_step_hook_is_an_error_naming_it(spec: str, match: str) -> None:
    with pytest.raises(PreemptError, match=f"(?s)HPC_STEP_HOOK='{spec}' {match}"):
        guard_mod.load_step_hook({"HPC_STEP_HOOK": spec})


def test_cluster_tests_step_hook_sleeps_only_in_the_first_runs() -> None:
    from tests.helpers.step_hooks import slowed

    with pytest.MonkeyPatch.context() as mp:  # undone before conftest's leak check
        for key, value in slowed(0.2, runs=1).items():
            mp.setenv(key, value)
        start = time.monotonic()
        guard_mod.PreemptGuard()()
        assert time.monotonic() - start >= 0.2
        mp.setenv("SLURM_RESTART_COUNT", "1")
        start = time.monotonic()
        guard_mod.PreemptGuard()()
        assert time.monotonic() - start < 0.1


def test_stopped_by_request_is_not_max_steps() -> None:
    assert requeue.stopped_by_request("stopped", 7, None)
    assert requeue.stopped_by_request("stopped", 7, 10)
    assert not requeue.stopped_by_request("stopped", 10, 10)
    assert not requeue.stopped_by_request("completed", 22, None)


def test_requeue_outside_slurm_just_stops() -> None:
    out = requeue.requeue_after_stop(5, "ck.pt", environ={})
    assert (out.kind, out.exit_code) == ("not-slurm", 0)
    assert "rerun the same command" in out.message


def test_requeue_budget_exhausted_is_an_error_without_requeue() -> None:
    called = []
    out = requeue.requeue_after_stop(
        5, "ck.pt", before_requeue=lambda: called.append(1),
        environ={"SLURM_JOB_ID": "1", "SLURM_RESTART_COUNT": "3", "HPC_MAX_REQUEUES": "3"})
    assert (out.kind, out.exit_code, called) == ("exhausted", 1, [])
    assert "SLURM_RESTART_COUNT=3 reached HPC_MAX_REQUEUES=3" in out.message
    assert "HINT: resubmit" in out.message


def test_requeue_hook_failure_cancels_the_requeue() -> None:
    def fail() -> None:
        raise OSError("disk full")

    out = requeue.requeue_after_stop(5, None, before_requeue=fail,
                                     environ={"SLURM_JOB_ID": "1"})
    assert out.kind == "failed" and "disk full" in out.message


def _records(caplog: pytest.LogCaptureFixture) -> list[tuple[str, str]]:
    return [(r.levelname, r.getMessage()) for r in caplog.records
            if r.name == "hpc.preempt.requeue"]


@pytest.mark.skipif(shutil.which("scontrol") is None, reason="no scontrol")
def test_requeue_of_an_unknown_job_reports_scontrols_error(
        caplog: pytest.LogCaptureFixture) -> None:
    """The message carries scontrol's own words (here 'Invalid job id specified'), as
    scontrol printed them, not only that it failed."""
    caplog.set_level(logging.INFO, logger="hpc.preempt.requeue")
    said = subprocess.run(["scontrol", "requeue", "999999999"], capture_output=True,
                          text=True, timeout=60)
    assert said.returncode != 0 and said.stderr.strip(), said
    out = requeue.requeue_after_stop(5, None, environ={"SLURM_JOB_ID": "999999999"})
    assert out.kind == "failed" and "`scontrol requeue 999999999` failed: " in out.message
    assert said.stderr.strip() in out.message, (said.stderr, out.message)
    assert "HINT:" in out.message
    # one line, the error, and no "requeueing job ..." announced before scontrol failed
    assert _records(caplog) == [("ERROR", out.message)], _records(caplog)


def test_guard_handles_sigterm_too_by_default_and_names_the_signal_received() -> None:
    guard = guard_mod.PreemptGuard(environ={}).install()
    try:
        assert guard.signums == (signal.SIGUSR2, signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)  # real preemption sends TERM: no death
        time.sleep(0.05)
        assert guard() is True and guard.signal_name == "SIGTERM"
    finally:
        guard.uninstall()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_preempt_signals_list_overrides_the_default() -> None:
    assert guard_mod.preempt_signals({"HPC_PREEMPT_SIGNAL": "XCPU"}) == (
        signal.SIGXCPU, signal.SIGTERM)
    assert guard_mod.preempt_signals({"HPC_PREEMPT_SIGNALS": "usr1, SIGHUP,USR1"}) == (
        signal.SIGUSR1, signal.SIGHUP)
    with pytest.raises(PreemptError, match="names no signal"):
        guard_mod.parse_signals(" , ")
    with pytest.raises(PreemptError, match="HPC_PREEMPT_SIGNALS='USR2,KILL' names 'KILL'"):
        guard_mod.preempt_signals({"HPC_PREEMPT_SIGNALS": "USR2,KILL"})


def test_array_task_requeues_itself_not_the_whole_array() -> None:
    # measured: `scontrol requeue $SLURM_JOB_ID` from task 0 (JOB_ID == ARRAY_JOB_ID)
    # requeued both tasks of --array=0-1
    env = {"SLURM_JOB_ID": "40", "SLURM_ARRAY_JOB_ID": "40", "SLURM_ARRAY_TASK_ID": "0"}
    assert requeue.requeue_target(env) == "40_0"
    assert requeue.requeue_target({"SLURM_JOB_ID": "41"}) == "41"
    assert requeue.requeue_target({"SLURM_JOBID": "42"}) == "42"
    assert requeue.requeue_target({}) is None


def test_without_scontrol_the_master_hands_the_requeue_to_the_batch_shell(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="hpc.preempt.requeue")
    monkeypatch.setenv("PATH", str(tmp_path))  # no scontrol on PATH, as in a container
    marker = tmp_path / "requeue-me"
    env = {"SLURM_JOB_ID": "7", "SLURM_ARRAY_JOB_ID": "6", "SLURM_ARRAY_TASK_ID": "1"}
    out = requeue.requeue_after_stop(5, "ck.pt", environ={**env,
                                                          "HPC_REQUEUE_MARKER": str(marker)})
    assert (out.kind, out.exit_code) == ("requeued", requeue.EXIT_REQUEUED)
    assert "the batch shell requeues it" in out.message
    assert marker.read_text() == "6_1\n"
    # a requeue is a normal event: one INFO line, said once it is done
    assert _records(caplog) == [("INFO", out.message)], _records(caplog)
    assert out.message.startswith("requeued job 6_1 ")
    caplog.clear()
    out = requeue.requeue_after_stop(5, "ck.pt", environ=env)  # no shell to hand it to
    assert (out.kind, out.exit_code) == ("failed", 1)
    assert "FileNotFoundError" in out.message and "HINT:" in out.message
