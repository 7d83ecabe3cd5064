"""The srun command lines the sbatch templates build, run with a fake ``srun`` that
prints its arguments (no cluster, no container runtime: pyxis and Apptainer cannot run
here, so this is how their templates are checked)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.helpers.paths import ROOT

FAKE_SRUN = '#!/bin/sh\nfor a in "$@"; do echo "ARG $a"; done\n'


def srun_args(template: str, tmp_path: Path, *args: str, **env: str) -> list[str]:
    (tmp_path / "srun").write_text(FAKE_SRUN)
    (tmp_path / "srun").chmod(0o755)
    full = dict(os.environ, PATH=f"{tmp_path}{os.pathsep}{os.environ['PATH']}",
                SLURM_JOB_ID="7", SLURM_JOB_NODELIST="node[1-2]", **env)
    proc = subprocess.run(["bash", str(ROOT / "slurm" / template), *args], check=False,
                          env=full, cwd=tmp_path, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    return [line[4:] for line in proc.stdout.splitlines() if line.startswith("ARG ")]


@pytest.mark.parametrize("template", ["pretrain.sbatch", "pyxis.sbatch", "apptainer.sbatch"])
def test_templates_pass_cpus_per_task_to_srun(template: str, tmp_path: Path) -> None:
    args = srun_args(template, tmp_path, "--epochs", "1", SLURM_CPUS_PER_TASK="6")
    assert "--cpus-per-task=6" in args and "--kill-on-bad-exit=1" in args
    assert args[-4:] == ["hpc", "pretrain", "--epochs", "1"]


def test_pyxis_template(tmp_path: Path) -> None:
    args = srun_args("pyxis.sbatch", tmp_path, "python", "train.py",
                     HPC_CONTAINER_IMAGE="nvcr.io#nvidia/pytorch:24.01-py3",
                     HPC_CONTAINER_MOUNTS="/scratch:/scratch",
                     HPC_CONTAINER_PYTHONPATH="/opt/torch-hpc")
    assert "--container-image=nvcr.io#nvidia/pytorch:24.01-py3" in args
    assert f"--container-mounts={tmp_path}:{tmp_path},/scratch:/scratch" in args
    assert f"--container-workdir={tmp_path}" in args
    assert "--export=ALL,PYTHONUNBUFFERED=1,PYTHONPATH=/opt/torch-hpc" in args
    assert args[-2:] == ["python", "train.py"]


def test_apptainer_template(tmp_path: Path) -> None:
    args = srun_args("apptainer.sbatch", tmp_path, "python", "train.py",
                     HPC_CONTAINER_IMAGE="/images/pt.sif")
    i = args.index("apptainer")
    assert args[i:] == ["apptainer", "exec", "--nv", "--bind", str(tmp_path), "--pwd",
                        str(tmp_path), "/images/pt.sif", "python", "train.py"]


# --- slurm/lib/preempt.sh: the batch shell's preemption block -------------------------

PREEMPT_SH = ROOT / "slurm" / "lib" / "preempt.sh"
#: Records its arguments, as `scontrol requeue JOB` would be run.
FAKE_SCONTROL = '#!/bin/sh\necho "$@" >> "$SCONTROL_CALLS"\n'
#: The step: waits until the test lets it end, then plays rank 0 without scontrol.
STEP = '''
touch "$WORK/started"
until [ -e "$WORK/go" ]; do sleep 0.05; done
echo "${HPC_STOP_FILE:-unset}" > "$WORK/step-stop-file"
[ -n "${HPC_STOP_FILE:-}" ] && cat "$HPC_STOP_FILE" > "$WORK/step-saw" 2>/dev/null
echo 42 > "$HPC_REQUEUE_MARKER"
exit 3
'''


def _batch_shell(tmp_path: Path, setup: str) -> subprocess.Popen[str]:
    """A batch shell as the templates use the block: setup, step in the background, wait,
    requeue; stderr goes to tmp_path/err."""
    (tmp_path / "scontrol").write_text(FAKE_SCONTROL)
    (tmp_path / "scontrol").chmod(0o755)
    (tmp_path / "step.sh").write_text(STEP)
    script = (f'set -euo pipefail\n. "{PREEMPT_SH}"\n{setup}\nbash "$WORK/step.sh" &\n'
              'hpc_preempt_wait $!\necho "RC=$RC"\nhpc_preempt_requeue\nexit "$RC"\n')
    env = dict(os.environ, PATH=f"{tmp_path}{os.pathsep}{os.environ['PATH']}",
               SLURM_JOB_ID="42", SLURM_SUBMIT_DIR=str(tmp_path), WORK=str(tmp_path),
               SCONTROL_CALLS=str(tmp_path / "calls"))
    env.pop("HPC_STOP_FILE", None)
    with (tmp_path / "err").open("w") as err:
        return subprocess.Popen(["bash", "-c", script], env=env, cwd=tmp_path, text=True,
                                stdout=subprocess.PIPE, stderr=err)


def _until(check, what: str, timeout: float = 20) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


@pytest.mark.parametrize("signame", ["TERM", "USR2"])
def test_preempt_block_outlives_the_signal_tells_the_ranks_and_requeues(
        signame: str, tmp_path: Path) -> None:
    stop_file = tmp_path / ".hpc-stop-42"
    stop_file.write_text("stale")  # left by an earlier run of the job: removed
    shell = _batch_shell(tmp_path, "hpc_preempt_setup --stop-file")
    try:
        _until((tmp_path / "started").exists, "the step did not start")
        shell.send_signal(getattr(signal, f"SIG{signame}"))  # the shell only, not the step
        _until(lambda: "batch shell got" in (tmp_path / "err").read_text(), "no trap")
        (tmp_path / "go").touch()
        out, _ = shell.communicate(timeout=20)
    finally:
        shell.kill()
    err = (tmp_path / "err").read_text()
    assert shell.returncode == 3 and "RC=3" in out, (out, err)  # the step's status
    assert f"hpc: batch shell got SIG{signame}: told the ranks ({stop_file})" in err
    assert (tmp_path / "step-saw").read_text().strip() == signame
    # said once it is done, not before scontrol ran
    assert "hpc: requeued job 42 for the ranks (no scontrol where they run)" in out
    assert "requeueing" not in out + err
    assert (tmp_path / "calls").read_text() == "requeue 42\n"
    assert not stop_file.exists() and not (tmp_path / ".hpc-requeue-42").exists()


def test_preempt_block_names_scontrols_error_when_its_requeue_fails(tmp_path: Path) -> None:
    shell = _batch_shell(tmp_path, "hpc_preempt_setup")
    (tmp_path / "scontrol").write_text(  # what scontrol says for a job it cannot requeue
        '#!/bin/sh\necho "Requested operation is presently disabled for job $2" >&2\nexit 1\n')
    try:
        _until((tmp_path / "started").exists, "the step did not start")
        (tmp_path / "go").touch()
        out, _ = shell.communicate(timeout=20)
    finally:
        shell.kill()
    err = (tmp_path / "err").read_text()
    assert shell.returncode == 1, (out, err)  # the job failed: it was not requeued
    assert "hpc: requeued" not in out + err and "hpc: requeueing" not in out + err, (out, err)
    assert ("hpc: `scontrol requeue 42` failed: Requested operation is presently disabled "
            "for job 42") in err, err
    assert "HINT: " in err, err


def test_preempt_block_without_stop_file_only_waits(tmp_path: Path) -> None:
    """pretrain.sbatch's use: the ranks get Slurm's signals themselves."""
    shell = _batch_shell(tmp_path, "hpc_preempt_setup")
    try:
        _until((tmp_path / "started").exists, "the step did not start")
        shell.send_signal(signal.SIGTERM)
        _until(lambda: "batch shell got" in (tmp_path / "err").read_text(), "no trap")
        (tmp_path / "go").touch()
        out, _ = shell.communicate(timeout=20)
    finally:
        shell.kill()
    err = (tmp_path / "err").read_text()
    assert shell.returncode == 3, (out, err)
    assert "hpc: batch shell got SIGTERM: waiting for the ranks to checkpoint" in err
    assert (tmp_path / "step-stop-file").read_text().strip() == "unset"
    assert (tmp_path / "calls").read_text() == "requeue 42\n"


#: srun that exits with $FAKE_SRUN_RC, and a Python that only records what it ran.
FAKE_STEP = '#!/bin/sh\necho "srun: error: node1: task 0: Exited with exit code $FAKE_SRUN_RC"\n' \
    'exit "$FAKE_SRUN_RC"\n'
FAKE_PYTHON = '#!/bin/sh\necho "PYTHON $*"\n'


@pytest.mark.parametrize("status, reported", [(75, False), (1, True), (0, False)],
                         ids=["requeued", "failed", "completed"])
def test_pretrain_template_reports_a_first_failure_only_for_a_failed_step(
        tmp_path: Path, status: int, reported: bool) -> None:
    """75 is every rank's agreed exit after a requeue: a normal end, not a failure."""
    for name, text in (("srun", FAKE_STEP), ("python", FAKE_PYTHON), ("scontrol", "")):
        (tmp_path / name).write_text(text or "#!/bin/sh\nexit 1\n")
        (tmp_path / name).chmod(0o755)
    env = dict(os.environ, PATH=f"{tmp_path}{os.pathsep}{os.environ['PATH']}",
               SLURM_JOB_ID="7", SLURM_JOB_NODELIST="node[1-2]", SLURM_SUBMIT_DIR=str(tmp_path),
               HPC_PYTHON=str(tmp_path / "python"), FAKE_SRUN_RC=str(status))
    env.pop("HPC_LOG_DIR", None)
    proc = subprocess.run(["bash", str(ROOT / "slurm" / "pretrain.sbatch"), "--epochs", "1"],
                          check=False, env=env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=30)
    assert proc.returncode == status, proc.stderr  # the job's status is the step's
    ran = [line for line in proc.stdout.splitlines() if line.startswith("PYTHON -m hpc first")]
    assert bool(ran) == reported, proc.stdout
    if reported:
        assert ran == [f"PYTHON -m hpc first-failure {tmp_path}/hpc-logs/7/failures-0"], ran


def test_preempt_block_rejects_an_unknown_option(tmp_path: Path) -> None:
    script = f'set -eu; . "{PREEMPT_SH}"; hpc_preempt_setup --stop'
    proc = subprocess.run(["bash", "-c", script], check=False, cwd=tmp_path,
                          env=dict(os.environ, SLURM_JOB_ID="42"), capture_output=True,
                          text=True, timeout=30)
    assert proc.returncode == 2
    assert "got '--stop', expected no argument or --stop-file" in proc.stderr


# --- the templates share that one block -----------------------------------------------

PREEMPTIBLE = {"pretrain.sbatch": "", "torchrun.sbatch": " --stop-file",
               "mpirun.sbatch": " --stop-file"}
#: The lines that find and source the block; the same in every template that uses it.
LOOKUP = re.compile(r"^PREEMPT_LIB=.*?^\. \"\$PREEMPT_LIB\"$", re.MULTILINE | re.DOTALL)


@pytest.mark.parametrize("path", sorted((ROOT / "slurm").rglob("*.s*")),
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_every_template_and_lib_file_parses(path: Path) -> None:
    proc = subprocess.run(["bash", "-n", str(path)], check=False, capture_output=True,
                          text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("template", list(PREEMPTIBLE))
def test_template_sources_the_one_preemption_block(template: str) -> None:
    text = (ROOT / "slurm" / template).read_text()
    lookups = {LOOKUP.search((ROOT / "slurm" / t).read_text())[0] for t in PREEMPTIBLE}
    assert len(lookups) == 1, "the templates find slurm/lib/preempt.sh each their own way"
    body = "\n".join(line.split("  # ")[0] for line in text.replace(next(iter(lookups)), "")
                     .splitlines() if not line.lstrip().startswith("#")) + "\n"  # the code
    assert f"\nhpc_preempt_setup{PREEMPTIBLE[template]}\n" in body
    assert "\nhpc_preempt_wait $!\n" in body and "\nhpc_preempt_requeue\nexit \"$RC\"\n" in body
    for own in ("trap ", "until wait", "scontrol requeue", "HPC_STOP_FILE=",
                "HPC_REQUEUE_MARKER=", "exec srun"):
        assert own not in body, f"{template} carries its own {own!r}"
    assert "slurm/lib/preempt.sh" in text.split("#SBATCH")[0]  # the header says so


def test_container_templates_have_no_copy_of_the_block() -> None:
    for template in ("pyxis.sbatch", "apptainer.sbatch"):
        text = (ROOT / "slurm" / template).read_text()
        assert "trap " not in text and "HPC_REQUEUE_MARKER" not in text, template


def _spool_copy(template: str, tmp_path: Path, command: str | None) -> Path:
    """The template as sbatch runs it: a copy in the node's spool directory, with
    ``scontrol show job`` naming the script as submitted (or failing: ``None``)."""
    spool = tmp_path / "spool" / "job00007"
    spool.mkdir(parents=True)
    copy = spool / "slurm_script"
    copy.write_text((ROOT / "slurm" / template).read_text())
    show = (f'echo "JobId=7 JobName=x Command={command} WorkDir=/elsewhere StdOut=/x.out"'
            if command else "exit 1")
    (tmp_path / "scontrol").write_text(f"#!/bin/sh\n{show}\n")
    (tmp_path / "scontrol").chmod(0o755)
    return copy


@pytest.mark.parametrize("submit_dir, command", [
    ("tmp", str(ROOT / "slurm" / "pretrain.sbatch")),  # sbatch /abs/path/slurm/X.sbatch
    ("docs", "../slurm/pretrain.sbatch"),              # relative to the submit directory
    ("root", None),                                    # no answer: SLURM_SUBMIT_DIR/slurm
])
def test_template_finds_the_block_from_the_spool_copy(submit_dir: str, command: str | None,
                                                      tmp_path: Path) -> None:
    copy = _spool_copy("pretrain.sbatch", tmp_path, command)
    cwd = {"tmp": tmp_path, "docs": ROOT / "docs", "root": ROOT}[submit_dir]
    (tmp_path / "srun").write_text(FAKE_SRUN)
    (tmp_path / "srun").chmod(0o755)
    env = dict(os.environ, PATH=f"{tmp_path}{os.pathsep}{os.environ['PATH']}",
               SLURM_JOB_ID="7", SLURM_JOB_NODELIST="node[1-2]", SLURM_SUBMIT_DIR=str(cwd),
               HPC_LOG_DIR=str(tmp_path / "logs"))
    proc = subprocess.run(["bash", str(copy), "true"], check=False, env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    assert "ARG true" in proc.stdout


def test_template_without_the_block_says_where_it_looked(tmp_path: Path) -> None:
    copy = _spool_copy("torchrun.sbatch", tmp_path, str(tmp_path / "mine.sbatch"))
    env = dict(os.environ, PATH=f"{tmp_path}{os.pathsep}{os.environ['PATH']}",
               SLURM_JOB_ID="7", SLURM_SUBMIT_DIR=str(tmp_path))
    proc = subprocess.run(["bash", str(copy)], check=False, env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 1
    fact, cause, hint = proc.stderr.splitlines()
    assert fact == (f"hpc: lib/preempt.sh, the batch shell's preemption block, is neither "
                    f"beside the submitted script ({tmp_path}/mine.sbatch) nor at "
                    f"{tmp_path}/slurm/lib/preempt.sh.")
    assert f"sbatch runs a copy of the script ({copy})" in cause
    assert hint.startswith("HINT: copy torch-hpc's slurm/lib/ beside the script you submit")
