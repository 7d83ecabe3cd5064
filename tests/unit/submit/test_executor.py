"""hpc.submit.executor: the sbatch script submitit would submit (rendered, not submitted)."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import pytest

from hpc.submit import SubmitOptions, make_executor
from hpc.submit.executor import COMPOSED


def test_executor_script_has_signal_requeue_kill_on_bad_exit_and_cpus(tmp_path: Path) -> None:
    pytest.importorskip("submitit")
    if shutil.which("srun") is None:
        pytest.skip("no srun: submitit refuses to build a Slurm executor")
    ex = make_executor(SubmitOptions(nodes=2, gpus_per_node=2, time_min=30, cpus_per_task=3,
                                     signal="USR2", signal_delay_s=90, max_requeues=5,
                                     log_dir=str(tmp_path), env={"A": "b c"}))
    text = ex._executor._make_submission_file_text("CMD", "uid")  # what sbatch would get
    for line in ("#SBATCH --signal=USR2@90", "#SBATCH --requeue", "#SBATCH --nodes=2",
                 "#SBATCH --ntasks-per-node=2", "#SBATCH --gpus-per-node=2",
                 "#SBATCH --open-mode=append", "#SBATCH --time=30",
                 "export SUBMITIT_PREEMPT_SIGNAL=USR2", "export HPC_MAX_REQUEUES=5",
                 "export A='b c'", "--kill-on-bad-exit=1", "--cpus-per-task=3"):
        assert line in text, f"{line!r} missing:\n{text}"


def test_every_field_reaches_submitit() -> None:
    for f in dataclasses.fields(SubmitOptions):
        assert (f.metadata["submitit"] is None) == (f.name in COMPOSED), (
            f"SubmitOptions.{f.name}: give it a submitit parameter or compose it in "
            "make_executor (and list it in COMPOSED)")


def test_array_task_gets_its_own_run_directory_and_arguments() -> None:
    pytest.importorskip("submitit")
    from hpc.pretrain.config import PretrainConfig
    from hpc.submit.executor import for_task
    from hpc.submit.pretrain_job import PretrainJob

    cfg, args = for_task(PretrainConfig(out="runs/sweep/{task}"), ["x"], 3)
    assert cfg.out == "runs/sweep/3" and args == ["x"]
    job, _ = for_task(PretrainJob(PretrainConfig(out="runs/s/{task}")), [], 1)
    assert job.config.out.endswith("/runs/s/1")
    assert for_task("pkg.mod", ["--seed", "{task}", "--out=r/{task}"], 2)[1] == [
        "--seed", "2", "--out=r/2"]


def test_array_refuses_one_run_directory_for_every_task_and_submit_refuses_arrays() -> None:
    pytest.importorskip("submitit")
    from hpc.errors import SubmitError
    from hpc.pretrain.config import PretrainConfig
    from hpc.submit.executor import submit, submit_array

    with pytest.raises(SubmitError, match=r"--array 2: every task would write the run "
                       r"directory runs/x .*\nHINT: put \{task\} in it"):
        submit_array(PretrainConfig(out="runs/x"), array=2)
    with pytest.raises(SubmitError, match="array=0: a job array needs at least 1 task"):
        submit_array(PretrainConfig(out="runs/{task}"))
    with pytest.raises(SubmitError, match="HINT: call hpc.submit.executor.submit_array"):
        submit(PretrainConfig(out="runs/x"), array=2)
    with pytest.raises(SubmitError, match=r"array=-1 \(must be >= 0\)"):
        SubmitOptions(array=-1).validate()


def test_a_negative_array_is_refused_as_invalid_not_sent_to_the_other_entry(
        capsys: pytest.CaptureFixture[str]) -> None:
    """submit() and hpc submit ask SubmitOptions.is_array: -1 is no array, and invalid."""
    pytest.importorskip("submitit")
    from hpc.errors import SubmitError
    from hpc.pretrain.config import PretrainConfig
    from hpc.submit.cli import main
    from hpc.submit.executor import submit

    with pytest.raises(SubmitError, match=r"array=-1 \(must be >= 0\)"):
        submit(PretrainConfig(out="runs/x"), array=-1)
    assert main(["--array", "-1", "--", "-m", "json.tool"]) == 2
    assert "array=-1 (must be >= 0)" in capsys.readouterr().err


def _strike_twice(host: str, at: float | None = None) -> None:
    """Two strikes against ``host``, 5 s apart, the second at ``at`` (default now)."""
    import time

    from hpc.ledger import Ledger

    t = time.time() if at is None else at
    Ledger(clock=lambda: t - 5).add(host, f"slow node {host}: busbw 1 MB/s", "check")
    Ledger(clock=lambda: t).add(host, f"straggler: {host} (rank 2) 3.0x the median",
                                "straggler")


def _script(options: SubmitOptions, **kw: object) -> str:
    pytest.importorskip("submitit")
    if shutil.which("srun") is None:
        pytest.skip("no srun: submitit refuses to build a Slurm executor")
    return make_executor(options, **kw)._executor._make_submission_file_text("CMD", "uid")


def test_a_host_with_two_live_strikes_is_excluded_beside_the_users_own(tmp_path: Path) -> None:
    """The ledger's hosts join --sbatch exclude=...; bad= overrides the ledger."""
    from hpc.ledger import Ledger

    _strike_twice("node7")
    Ledger().add("node8", "one strike only", "check")
    text = _script(SubmitOptions(log_dir=str(tmp_path), sbatch={"exclude": "node1"}),
                   bad={"node7": []})
    assert "#SBATCH --exclude=node1,node7" in text, text
    assert "--exclude" not in _script(SubmitOptions(log_dir=str(tmp_path)), bad={})


def test_the_ledger_excludes_only_hosts_this_cluster_has(monkeypatch: pytest.MonkeyPatch,
                                                         tmp_path: Path) -> None:
    from hpc.submit import executor

    _strike_twice("node7")
    _strike_twice("elsewhere9")
    _strike_twice("node8", at=1e9)  # 2001: long expired
    monkeypatch.setattr(executor, "_slurm_nodes", lambda: {"node7", "node8"})
    bad = executor.bad_nodes()
    assert list(bad) == ["node7"]
    assert executor.exclusion_lines(bad) == [
        "excluding node7 (2 strikes in 24 h from check, straggler, last: straggler: node7 "
        "(rank 2) 3.0x the median; hpc nodes --clear node7 to allow it)"]
    text = _script(SubmitOptions(log_dir=str(tmp_path)))
    assert "#SBATCH --exclude=node7\n" in text, text
    monkeypatch.setenv("HPC_LEDGER_TTL", "0")
    assert executor.bad_nodes() == {}


def test_spare_nodes_allocate_more_and_run_the_tasks_under_the_supervisor(
        tmp_path: Path) -> None:
    pytest.importorskip("submitit")
    if shutil.which("srun") is None:
        pytest.skip("no srun: submitit refuses to build a Slurm executor")
    opts = SubmitOptions(nodes=2, spare_nodes=1, tasks_per_node=2, cpus_per_task=3,
                         log_dir=str(tmp_path))
    ex = make_executor(opts, bad={})
    text = ex._executor._make_submission_file_text("CMD", "uid")
    assert "#SBATCH --nodes=3" in text and "#SBATCH --no-kill" in text, text
    command = ex._executor._submitit_command_str  # the script's last line: no srun of its own
    head, _, tail = command.partition(" -- ")
    assert head.split()[1:5] == ["-m", "hpc", "supervise", "--spare-nodes=1"], command
    for arg in ("--unbuffered", f"--output={tmp_path}/%j/%j_%t_log.out",
                f"--error={tmp_path}/%j/%j_%t_log.err", "--cpus-per-task=3"):
        assert f"--srun-arg={arg}" in head.split(), command
    assert tail.endswith(f"-u -m submitit.core._submit {tmp_path}/%j"), command
    array = make_executor(dataclasses.replace(opts, array=2), bad={})
    assert f"--srun-arg=--output={tmp_path}/%A_%a/%A_%a_%t_log.out" in \
        array._executor._submitit_command_str
    plain = make_executor(dataclasses.replace(opts, spare_nodes=0), bad={})
    assert "supervise" not in plain._executor._submitit_command_str
    assert "--no-kill" not in plain._executor._make_submission_file_text("CMD", "uid")
