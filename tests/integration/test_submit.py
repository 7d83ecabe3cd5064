"""``hpc submit`` / :func:`hpc.submit.submit` and preemption-safe requeue on the real cluster.

Every job is 2 nodes x 2 tasks (``--gpus-per-node 2``, fake GPUs, gloo on CPU) running a
tiny pretrain (2 epochs x 11 steps, checkpoint every 3 steps). One uninterrupted run is
the reference; preempted runs must end with bitwise-identical weights and a metrics.csv
holding each step exactly once. A step hook (``HPC_STEP_HOOK``, see
tests/helpers/step_hooks.py) slows the first run of a job so a signal lands mid-run;
sleeping does not change the math.

Run under the shared lock: ``flock /tmp/hpc-heavy.lock pytest -m slurm tests/integration/test_submit.py``
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Optional

import pytest

from tests.conftest import LAUNCHER_VARS
from tests.helpers.paths import ROOT
from tests.helpers.preemption import assert_no_failure_marks
from tests.helpers.requires import in_ci
from tests.helpers.slurm import slurm_env, wait_for_file
from tests.helpers.step_hooks import slowed
from tests.helpers.tiny_pretrain import (
    ENV,
    STEPS,
    TINY,
    TINY_ARGS,
    assert_each_step_once,
    assert_same_final_weights,
)

pytestmark = pytest.mark.slurm

try:
    import submitit  # noqa: F401
except ImportError:  # pragma: no cover - submitit is in the test extra
    if in_ci():
        raise
    pytest.skip("submitit not installed (pip install submitit)", allow_module_level=True)
torch = pytest.importorskip("torch")
pytest.importorskip("sklearn")

from hpc.checkpoint.files import load_latest  # noqa: E402
from hpc.errors import SubmitError  # noqa: E402
from hpc.pretrain import PretrainConfig  # noqa: E402
from hpc.submit import SubmittedJob, submit  # noqa: E402
from hpc.submit import watch as jobwatch  # noqa: E402

LAYOUT = dict(nodes=2, gpus_per_node=2, time_min=5, signal_delay_s=60)
SLOW_FIRST_RUN = slowed(0.5, runs=1)

#: The time-limit test: ``--time 2 --signal-delay 60``. Slurm sends the signal 60 s
#: before the limit and, its timer having a 60 s granularity, up to 60 s earlier: at most
#: 60 s after the start. The first run's steps sleep so long that it lasts well past that
#: even with no start-up time at all (2.5 s x 22 steps = 55 s left start-up as the only
#: margin), and it still gets the signal well before the limit.
TIME_LIMIT_S, SIGNAL_DELAY_S, TIME_LIMIT_STEP_SLEEP_S = 120, 60, 4.0
SIGNAL_DUE_S = TIME_LIMIT_S - SIGNAL_DELAY_S
assert TIME_LIMIT_STEP_SLEEP_S * STEPS >= SIGNAL_DUE_S + 25


def _submit(out: Path, log_dir: Path, **env: str) -> SubmittedJob:
    return submit(PretrainConfig(**TINY, out=str(out)), log_dir=str(log_dir),
                  env={**ENV, **env}, **LAYOUT)


def assert_requeued_once_or_more(job_id: str) -> list[jobwatch.Run]:
    runs = jobwatch.history(job_id)
    assert [r.word for r in runs[:-1]] and all(r.word == "REQUEUED" for r in runs[:-1]), runs
    assert runs[-1].word == "COMPLETED", runs
    return runs


def stop_step(run_dir: Path) -> int:
    text = (run_dir / "pretrain.log").read_text()
    m = re.search(r"stopping at step (\d+) \(stop requested\)", text)
    assert m, text[-2000:]
    return int(m.group(1))


@pytest.fixture(scope="module")
def reference(cluster: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """One uninterrupted submitit run: (run dir, rank 0's result, the job)."""
    base = tmp_path_factory.mktemp("reference")
    with pytest.MonkeyPatch.context() as mp:  # module fixtures run before conftest's clearing
        for key in [k for k in os.environ if LAUNCHER_VARS.match(k)]:
            mp.delenv(key)
        job = _submit(base / "run", base / "logs")
    try:
        result = job.result(timeout=150)
    except BaseException:
        job.cancel()
        raise
    yield base / "run", result, job


@pytest.mark.timeout(200)
def test_submitit_job_runs_pretrain_and_returns_its_result(reference: Any) -> None:
    run_dir, result, job = reference
    assert result.status == "completed" and result.step == STEPS
    assert result.world_size == 4 and len(result.val_acc) == 2
    assert result.resumed_from is None
    assert [r.word for r in job.history()] == ["COMPLETED"]
    assert_no_failure_marks(run_dir.parent / "logs" / job.job_id)  # a clean run: none
    ranks = job.results(timeout=30)
    assert len(ranks) == 4 and {r.step for r in ranks} == {STEPS}
    assert {tuple(r.val_acc) for r in ranks} == {tuple(result.val_acc)}
    assert_each_step_once(run_dir)
    log = job.logs(0)[1].read_text()
    assert "pretrain completed at step 22" in log


@pytest.mark.timeout(300)
def test_usr2_checkpoints_requeues_and_resumes_exactly(reference: Any, tmp_path: Path,
                                                        cancel_after: list[str]) -> None:
    out = tmp_path / "run"
    job = _submit(out, tmp_path / "logs", **SLOW_FIRST_RUN)
    cancel_after.append(job.job_id)
    wait_for_file(out / "checkpoints" / "ckpt-00000006.pt", job.job_id)
    job.cancel(signal="USR2")  # scancel --signal=USR2: every task of the step
    result = job.result(timeout=180)
    assert result.status == "completed" and result.step == STEPS
    stopped = stop_step(out)
    assert 6 <= stopped < STEPS
    assert result.resumed_from and result.resumed_from.endswith(f"ckpt-{stopped:08d}.pt")
    runs = assert_requeued_once_or_more(job.job_id)
    assert len(runs) == 2
    log = job.logs(0)[1].read_text()
    # one INFO line, logged as soon as scontrol requeued the job (before Slurm ends the step)
    assert log.count(f"INFO hpc.preempt.requeue: requeued job {job.job_id} after step "
                     f"{stopped} (SIGUSR2; ") == 1, log[-3000:]
    assert "requeueing" not in log and "Traceback" not in log, log[-3000:]
    assert "DUE TO JOB REQUEUE" in log  # the log was appended to, not truncated
    assert_no_failure_marks(tmp_path / "logs" / job.job_id)
    assert_each_step_once(out)
    assert_same_final_weights(out, reference[0])
    assert_sacct_as_documented(job.job_id, "test_usr2_checkpoints_requeues_and_resumes_exactly")


def documented_sacct(test: str) -> tuple[str, list[str]]:
    """The ``sacct -j ID -D`` sample docs/submit.md marks as checked by ``test``:
    (its job id, its rows)."""
    text = (ROOT / "docs" / "submit.md").read_text()
    m = re.search(rf"^<!-- checked by tests/integration/test_submit.py::{test} -->\n```text\n"
                  r"\$ sacct -j (\d+) -D -P -o JobID,State,ExitCode\n(.*?)^```", text,
                  re.MULTILINE | re.DOTALL)
    assert m, f"docs/submit.md lost the sacct sample {test} checks"
    return m.group(1), m.group(2).splitlines()


#: How the batch step of a requeued run may end: the shell's own ``exit 75`` after the step,
#: or Slurm's signal when the requeue takes effect first (SIGTERM, then SIGKILL once
#: KillWait, 5 s on the test cluster, has passed while the ranks were still exiting).
#: Which one wins is a race inside Slurm, not something the template decides.
REQUEUED_BATCH_ENDS = ("FAILED|75:0", "CANCELLED|0:15", "CANCELLED|0:9")


def _requeued_batch_as_one(rows: list[str]) -> list[str]:
    """``rows`` with the batch step of each REQUEUED run's ending written as one word."""
    out, requeued = [], False
    for row in rows:
        job, _, rest = row.partition("|")
        if "." not in job:
            requeued = rest.startswith("REQUEUED|")
        elif requeued and job.endswith(".batch") and rest in REQUEUED_BATCH_ENDS:
            row = f"{job}|(ended by the requeue)"
        out.append(row)
    return out


def assert_sacct_as_documented(job_id: str, test: str) -> None:
    """The job's runs and steps are what docs/submit.md shows (job id aside; the batch
    step of a requeued run in any of :data:`REQUEUED_BATCH_ENDS`)."""
    doc_id, rows = documented_sacct(test)
    expected = _requeued_batch_as_one(
        [re.sub(rf"^{doc_id}(?=[.|])", job_id, r) for r in rows])
    cmd = ["sacct", "-j", job_id, "-D", "-P", "-o", "JobID,State,ExitCode"]
    for _ in range(15):  # slurmdbd records the last steps a little after the job ends
        real = subprocess.run(cmd, check=False, capture_output=True, text=True,
                              timeout=30).stdout.splitlines()
        if _requeued_batch_as_one(real) == expected:
            return
        time.sleep(1)
    assert _requeued_batch_as_one(real) == expected, \
        f"docs/submit.md shows {rows}, sacct printed {real}"


@pytest.mark.timeout(330)
def test_time_limit_signal_requeues_through_hpc_submit_wait(
        reference: Any, tmp_path: Path, cancel_after: list[str]) -> None:
    """``--time 2 --signal-delay 60``: Slurm itself sends USR2 30-60 s into the run."""
    out = tmp_path / "run"
    env = slurm_env()
    hook = [a for k, v in slowed(TIME_LIMIT_STEP_SLEEP_S, runs=1).items()
            for a in ("--env", f"{k}={v}")]
    cmd = [sys.executable, "-m", "hpc", "submit", "--nodes", "2", "--gpus-per-node", "2",
           "--time", str(TIME_LIMIT_S // 60), "--signal-delay", str(SIGNAL_DELAY_S),
           "--log-dir", str(tmp_path / "logs"),
           "--env", "OMP_NUM_THREADS=1", *hook, "--wait", "--wait-timeout", "240",
           "--", *TINY_ARGS, "--out", str(out)]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        text, _ = proc.communicate(timeout=280)
    finally:
        if proc.poll() is None:
            proc.kill()
            text = proc.communicate()[0]
        m = re.search(r"submitted job (\d+)", text or "")
        if m:
            cancel_after.append(m.group(1))
    assert proc.returncode == 0, text[-4000:]
    job_id = m.group(1)
    for expected in (f"squeue -j {job_id}", f"scancel {job_id}", "tail -f ",
                     f"hpc submit: job {job_id} REQUEUED", "got SIGUSR2",
                     f"hpc submit: job {job_id} COMPLETED"):
        assert expected in text, f"{expected!r} missing from:\n{text[-4000:]}"
    stopped = stop_step(out)
    # the signal came by SIGNAL_DUE_S, well before the slowed run could end by itself
    assert 1 <= stopped <= SIGNAL_DUE_S / TIME_LIMIT_STEP_SLEEP_S + 1 < STEPS, stopped
    assert_requeued_once_or_more(job_id)
    assert_each_step_once(out)
    assert_same_final_weights(out, reference[0])


@pytest.mark.timeout(300)
def test_sbatch_template_requeues_with_scontrol_and_resumes_exactly(
        reference: Any, tmp_path: Path, cancel_after: list[str]) -> None:
    out = tmp_path / "run"
    env = slurm_env(**ENV, **SLOW_FIRST_RUN)
    proc = subprocess.run(["sbatch", "--parsable", str(ROOT / "slurm" / "pretrain.sbatch"),
                           *TINY_ARGS, "--out", str(out)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    job_id = proc.stdout.strip().split(";")[0]
    cancel_after.append(job_id)
    wait_for_file(out / "checkpoints" / "ckpt-00000006.pt", job_id)
    subprocess.run(["scancel", "--signal=USR2", job_id], check=True, timeout=20)
    last = jobwatch.wait(job_id, timeout=180)
    log = (tmp_path / f"hpc-srun-{job_id}.out").read_text()
    assert last.word == "COMPLETED", log[-4000:]
    stopped = stop_step(out)
    # one INFO line, once scontrol did it; a requeue is not a failure
    assert log.count(f"INFO hpc.preempt.requeue: requeued job {job_id} after step "
                     f"{stopped} (SIGUSR2; ") == 1, log[-3000:]
    assert "requeueing" not in log and "first failure" not in log, log[-3000:]
    assert_no_failure_marks(tmp_path / "hpc-logs" / job_id)
    assert log.count(f"hpc: job {job_id} on") == 2  # both runs appended to one log
    assert f"resumed from {out}/checkpoints/ckpt-{stopped:08d}.pt" in log
    assert len(assert_requeued_once_or_more(job_id)) == 2
    assert_each_step_once(out)
    assert_same_final_weights(out, reference[0])
    assert_sacct_as_documented(
        job_id, "test_sbatch_template_requeues_with_scontrol_and_resumes_exactly")


def _pid_of(job_id: str, rank: int, marker: bytes) -> Optional[int]:
    """The pid of ``rank`` of ``job_id`` (same pid namespace as the node namespaces)."""
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{name}/cmdline").read_bytes()
            environ = Path(f"/proc/{name}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if marker in cmdline and f"SLURM_JOB_ID={job_id}".encode() in environ \
                and f"SLURM_PROCID={rank}".encode() in environ:
            return int(name)
    return None


@pytest.mark.timeout(200)
def test_sigkilled_rank_fails_the_job_fast_naming_it(cluster: None, tmp_path: Path,
                                                      cancel_after: list[str]) -> None:
    out = tmp_path / "run"
    job = _submit(out, tmp_path / "logs", **slowed(0.5))
    cancel_after.append(job.job_id)
    wait_for_file(out / "checkpoints" / "ckpt-00000006.pt", job.job_id)
    pid = _pid_of(job.job_id, 3, b"submitit.core._submit")
    assert pid is not None, "rank 3's process not found"
    os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    last = job.wait(timeout=60)
    took = time.monotonic() - killed
    assert last.word == "FAILED" and took < 60, (last, took)
    with pytest.raises(SubmitError) as e:
        job.result(timeout=30)
    assert re.search(r"first failure: rank 3 on node2\b", str(e.value)), str(e.value)
    path, payload = load_latest(out / "checkpoints")  # sha256-verified, weights_only=True
    assert payload["step"] >= 6
    raw = torch.load(path, map_location="cpu", weights_only=True)
    assert set(raw["model"]) == set(payload["model"])
