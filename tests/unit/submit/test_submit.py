"""hpc.submit.preempt, hpc.submit, hpc.submit.cli and hpc.submit.watch without running a job.

Real signals are sent to this process; ``scontrol``/``sbatch``/submitit are used where
installed (the sbatch script submitit would submit is rendered, not submitted).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpc.errors import SubmitError
from hpc.submit import SubmitOptions, make_executor, parse_sbatch, preempt
from hpc.submit import watch as jobwatch
from hpc.submit.cli import parse_time, split_target
from tests.helpers import ROOT


@pytest.mark.parametrize("name", ["USR2", "SIGUSR2", "usr2", str(int(signal.SIGUSR2))])
def test_parse_signal_accepts_the_usual_spellings(name: str) -> None:
    assert preempt.parse_signal(name) == signal.SIGUSR2


@pytest.mark.parametrize("name", ["KILL", "STOP", "FOO", "9"])
def test_parse_signal_rejects_uncatchable_and_unknown_listing_valid(name: str) -> None:
    with pytest.raises(SubmitError, match=r"HINT: use one of: USR2, USR1"):
        preempt.parse_signal(name)


def test_budget_compares_restart_count_with_max_requeues() -> None:
    assert preempt.read_budget({}) == preempt.Budget(0, preempt.DEFAULT_MAX_REQUEUES)
    b = preempt.read_budget({"SLURM_RESTART_COUNT": "2", "HPC_MAX_REQUEUES": "2"})
    assert (b.restarts, b.max_requeues, b.left) == (2, 2, False)
    assert preempt.read_budget({"SLURM_RESTART_COUNT": "1", "HPC_MAX_REQUEUES": "2"}).left
    with pytest.raises(SubmitError, match="HPC_MAX_REQUEUES='x'"):
        preempt.read_budget({"HPC_MAX_REQUEUES": "x"})


def test_guard_turns_a_real_signal_into_a_stop_request() -> None:
    guard = preempt.PreemptGuard(environ={"HPC_PREEMPT_SIGNAL": "USR2"}).install()
    try:
        assert guard() is False
        os.kill(os.getpid(), signal.SIGUSR2)
        time.sleep(0.05)  # the Python-level handler runs at the next bytecode boundary
        assert guard() is True and guard.received_at is not None
        assert guard.signal_name == "SIGUSR2"
    finally:
        guard.uninstall()
    assert signal.getsignal(signal.SIGUSR2) != guard.request


def test_guard_test_sleep_only_in_the_first_runs() -> None:
    env = {"HPC_TEST_STEP_SLEEP": "0.2", "HPC_TEST_SLEEP_RUNS": "1"}
    start = time.monotonic()
    preempt.PreemptGuard(environ=env)()
    assert time.monotonic() - start >= 0.2
    start = time.monotonic()
    preempt.PreemptGuard(environ={**env, "SLURM_RESTART_COUNT": "1"})()
    assert time.monotonic() - start < 0.1


def test_stopped_by_request_is_not_max_steps() -> None:
    assert preempt.stopped_by_request("stopped", 7, None)
    assert preempt.stopped_by_request("stopped", 7, 10)
    assert not preempt.stopped_by_request("stopped", 10, 10)
    assert not preempt.stopped_by_request("completed", 22, None)


def test_requeue_outside_slurm_just_stops() -> None:
    out = preempt.requeue_after_stop(5, "ck.pt", environ={})
    assert (out.kind, out.exit_code) == ("not-slurm", 0)
    assert "rerun the same command" in out.message


def test_requeue_budget_exhausted_is_an_error_without_requeue() -> None:
    called = []
    out = preempt.requeue_after_stop(
        5, "ck.pt", before_requeue=lambda: called.append(1),
        environ={"SLURM_JOB_ID": "1", "SLURM_RESTART_COUNT": "3", "HPC_MAX_REQUEUES": "3"})
    assert (out.kind, out.exit_code, called) == ("exhausted", 1, [])
    assert "SLURM_RESTART_COUNT=3 reached HPC_MAX_REQUEUES=3" in out.message
    assert "HINT: resubmit" in out.message


def test_requeue_hook_failure_cancels_the_requeue() -> None:
    def fail() -> None:
        raise OSError("disk full")

    out = preempt.requeue_after_stop(5, None, before_requeue=fail,
                                     environ={"SLURM_JOB_ID": "1"})
    assert out.kind == "failed" and "disk full" in out.message


@pytest.mark.skipif(shutil.which("scontrol") is None, reason="no scontrol")
def test_requeue_of_an_unknown_job_reports_scontrols_error() -> None:
    out = preempt.requeue_after_stop(5, None, environ={"SLURM_JOB_ID": "999999999"})
    assert out.kind == "failed" and "scontrol requeue 999999999" in out.message
    assert "HINT:" in out.message


def test_options_reject_unknown_keywords_listing_the_valid_ones() -> None:
    with pytest.raises(SubmitError, match=r"(?s)nodez.*nodez -> nodes\?.*valid options: nodes"):
        SubmitOptions.from_kwargs(nodez=2)


@pytest.mark.parametrize("kwargs, match", [
    (dict(gpus_per_node=2, tasks_per_node=4), "one task per GPU"),
    (dict(time_min=1, signal_delay_s=60), "signal_delay_s=60 >= time limit 60 s"),
    (dict(nodes=0), "nodes=0"),
    (dict(env={"1X": "a"}), "env names"),
    (dict(signal="KILL"), "use one of"),
])
def test_options_validate(kwargs: dict, match: str) -> None:
    with pytest.raises(SubmitError, match=match):
        SubmitOptions(**kwargs).validate()


def test_tasks_per_node_defaults_to_one_per_gpu() -> None:
    assert SubmitOptions(gpus_per_node=4).ntasks_per_node == 4
    assert SubmitOptions().ntasks_per_node == 1
    assert SubmitOptions(tasks_per_node=3).ntasks_per_node == 3


@pytest.mark.skipif(shutil.which("sbatch") is None, reason="no sbatch")
def test_sbatch_extras_are_validated_against_sbatch_help() -> None:
    assert parse_sbatch(["mail_type=END", "exclusive"]) == {"mail-type": "END",
                                                           "exclusive": True}
    with pytest.raises(SubmitError, match=r"(?s)did you mean account.*valid sbatch options"):
        parse_sbatch({"acount": "x"})
    with pytest.raises(SubmitError, match="HINT: use --time instead"):
        parse_sbatch(["time=5"])


@pytest.mark.parametrize("cmd, expected", [
    ([], ("pretrain", [])),
    (["--", "--epochs", "2"], ("pretrain", ["--epochs", "2"])),
    (["pretrain", "--epochs", "2"], ("pretrain", ["--epochs", "2"])),
    (["--", "-m", "pkg.mod", "a"], ("module:pkg.mod", ["a"])),
    (["pkg.mod:main", "a", "b"], ("function:pkg.mod:main", ["a", "b"])),
])
def test_split_target(cmd: list, expected: tuple) -> None:
    assert split_target(cmd) == expected


def test_split_target_rejects_the_unknown_listing_forms() -> None:
    with pytest.raises(SubmitError, match="pkg.mod:func"):
        split_target(["train.py"])


@pytest.mark.parametrize("text, minutes", [("90", 90), ("1:30", 2), ("1:30:00", 90),
                                           ("1-12:00", 2160), ("2-0", 2880)])
def test_parse_time(text: str, minutes: int) -> None:
    assert parse_time(text) == minutes


def test_parse_time_rejects_garbage() -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        parse_time("soon")


def test_failure_summary_names_the_first_failing_rank(tmp_path: Path) -> None:
    log = tmp_path / "0.err"
    log.write_text("RuntimeError: Connection closed by peer\n"
                   "srun: error: node2: task 3: Killed\n"
                   "srun: error: node1: tasks 0-1: Exited with exit code 1\n")
    run = jobwatch.Run("26", "FAILED", "9:0", "", "", "node[1-2]")
    text = jobwatch.failure_summary(run, [log, tmp_path / "missing"])
    assert "first failure: rank 3 on node2: Killed" in text
    assert "then: ranks 0-1 on node1: Exited with exit code 1" in text
    assert jobwatch.exit_status(run) == 9
    assert jobwatch.exit_status(jobwatch.Run("1", "CANCELLED by 0", "0:15", "", "", "")) == 143
    assert jobwatch.exit_status(jobwatch.Run("1", "COMPLETED", "0:0", "", "", "")) == 0
    assert not jobwatch.is_terminal(jobwatch.Run("1", "REQUEUED", "0:0", "", "", ""))


def test_executor_script_has_signal_requeue_and_kill_on_bad_exit(tmp_path: Path) -> None:
    pytest.importorskip("submitit")
    if shutil.which("srun") is None:
        pytest.skip("no srun: submitit refuses to build a Slurm executor")
    ex = make_executor(SubmitOptions(nodes=2, gpus_per_node=2, time_min=30,
                                     signal="USR2", signal_delay_s=90, max_requeues=5,
                                     log_dir=str(tmp_path), env={"A": "b c"}))
    text = ex._executor._make_submission_file_text("CMD", "uid")  # what sbatch would get
    for line in ("#SBATCH --signal=USR2@90", "#SBATCH --requeue", "#SBATCH --nodes=2",
                 "#SBATCH --ntasks-per-node=2", "#SBATCH --gpus-per-node=2",
                 "#SBATCH --open-mode=append", "#SBATCH --time=30",
                 "export SUBMITIT_PREEMPT_SIGNAL=USR2", "export HPC_MAX_REQUEUES=5",
                 "export A='b c'", "--kill-on-bad-exit=1"):
        assert line in text, f"{line!r} missing:\n{text}"


def test_cli_rejects_unknown_options_listing_valid_ones() -> None:
    proc = subprocess.run([sys.executable, "-m", "hpc", "submit", "--nodez", "2"],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 2
    assert "--nodez -> --nodes?" in proc.stderr and "--gpus-per-node" in proc.stderr


def test_cli_modules_import_neither_torch_nor_submitit() -> None:
    code = ("import sys, hpc.cli.main; hpc.cli.main.build_parser(); import hpc.submit, hpc.submit.watch;"
            "print(sorted(m for m in ('torch', 'submitit') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, cwd=ROOT).stdout.strip()
    assert out == "[]"
