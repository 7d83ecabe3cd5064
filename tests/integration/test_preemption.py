"""Real Slurm preemption (SIGTERM, not the warning signal) of ``slurm/pretrain.sbatch``.

The test cluster has a ``preemptible`` partition (PriorityTier=1, PreemptMode=REQUEUE,
GraceTime=60) and an ``urgent`` one (PriorityTier=2) over the same two nodes, with
``PreemptType=preempt/partition_prio`` and no ``send_user_signal``: an urgent job makes
Slurm send SIGTERM to every task of the preemptible job (measured: the batch shell is not
signalled, srun keeps waiting; a job that ends within GraceTime is not requeued by Slurm).

One job is preempted twice, so one scenario covers both requeue paths:

1. run 0: the ranks have no ``scontrol`` on PATH (as in a container): rank 0 writes
   ``HPC_REQUEUE_MARKER`` and the batch shell requeues the job;
2. run 1: the ranks requeue it themselves with ``scontrol requeue``;
3. run 2 completes.

Each preemption must requeue the job exactly once (history: REQUEUED, REQUEUED,
COMPLETED), the urgent jobs run in between, and the final weights must be bitwise equal
to an uninterrupted run of the same template, with each step in metrics.csv once, and the
run must be one run to its trackers: one run id over the 3 attempts, one TensorBoard
run, one W&B (offline) run and one MLflow run, each with one point per step.

Run under the shared lock: ``flock /tmp/hpc-heavy.lock pytest -m slurm tests/integration/test_preemption.py``
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpc.submit import watch as jobwatch
from tests.helpers.paths import ROOT
from tests.helpers.preemption import assert_no_failure_marks, preempt, sacct_history
from tests.helpers.slurm import sbatch_nowait, sbatch_wait, slurm_env, until
from tests.helpers.step_hooks import slowed
from tests.helpers.trackers import TRACKER_ARGS, assert_one_tracked_run, tracker_env
from tests.helpers.tiny_pretrain import (
    ENV,
    STEPS,
    TINY_ARGS,
    assert_each_step_once,
    assert_same_final_weights,
    final_state,
    train_steps,
)

pytestmark = pytest.mark.slurm
torch = pytest.importorskip("torch")
pytest.importorskip("sklearn")

TEMPLATE = str(ROOT / "slurm" / "pretrain.sbatch")


@pytest.mark.timeout(420)
def test_sigterm_preemption_requeues_once_each_time_and_resumes_exactly(
        preemption_partitions: None, tiny_reference: Path, tmp_path: Path,
        cancel_after: list[str]) -> None:
    env = slurm_env(**ENV)
    ref = tiny_reference

    # Run 0 sees no scontrol (PATH = the venv's bin only); later runs see the normal PATH.
    venv_bin = str(Path(sys.executable).parent)
    assert shutil.which("scontrol", path=venv_bin) is None
    out = tmp_path / "run"
    train = shlex.join([sys.executable, "-m", "hpc", "pretrain", *TINY_ARGS, "--out", str(out),
                        *TRACKER_ARGS])
    ranks = (f'if [ "${{SLURM_RESTART_COUNT:-0}}" = 0 ]; then export PATH={venv_bin}; fi; '
             f"exec {train}")
    job_env = slurm_env(**ENV, **slowed(0.5, runs=2), **tracker_env(tmp_path))
    job_id = sbatch_nowait(["-p", "preemptible", TEMPLATE, "bash", "-c", ranks], tmp_path, job_env,
                     cancel_after)
    log = tmp_path / f"hpc-srun-{job_id}.out"
    ckpts = out / "checkpoints"

    until("checkpoint 6", lambda: (ckpts / "ckpt-00000006.pt").exists(), job_id)
    urgent = [preempt(tmp_path, env, cancel_after)]
    until("the second run", lambda: log.exists() and log.read_text().count(
        f"hpc: job {job_id} on") == 2, job_id, timeout=150)
    first_stop = max(train_steps(out))
    until("a checkpoint of the second run", lambda: any(
        int(p.name[5:13]) >= first_stop + 3 for p in ckpts.glob("ckpt-*.pt")), job_id)
    urgent.append(preempt(tmp_path, env, cancel_after))
    last = jobwatch.wait(job_id, timeout=200)
    text = log.read_text()
    history = sacct_history([job_id, *urgent])
    print(f"sacct:\n{history}", file=sys.stderr)
    assert last.word == "COMPLETED", text[-4000:]

    # one line per node (local rank 0) per preemption
    assert text.count("got SIGTERM: stopping at the next step boundary") == 4, text[-4000:]
    # one INFO line per requeue, said once it happened ("requeued job N ... (SIGTERM; ...")
    assert text.count(f"INFO hpc.preempt.requeue: requeued job {job_id} ") == 2, text[-4000:]
    assert text.count("(SIGTERM; checkpoint ") == 2
    assert f"requeued job {job_id} (scontrol is missing here: the batch shell" in text
    assert f"hpc: requeued job {job_id} for the ranks (no scontrol" in text
    assert "; restart 2 of at most 3 resumes from it" in text  # run 1: scontrol by rank 0
    assert "requeueing" not in text and "first failure" not in text, text[-4000:]
    assert_no_failure_marks(tmp_path / "hpc-logs" / job_id)  # requeued twice, completed
    assert text.count(f"resumed from {ckpts}/ckpt-") == 2
    runs = [r.word for r in jobwatch.history(job_id)]
    assert runs == ["REQUEUED", "REQUEUED", "COMPLETED"], (runs, history)  # once each time
    restarts = subprocess.run(["scontrol", "show", "job", job_id], check=False,
                              capture_output=True,
                              text=True, timeout=20).stdout
    assert "Restarts=2" in restarts, restarts
    assert all(jobwatch.current(u).word == "COMPLETED" for u in urgent), history
    assert_each_step_once(out)
    assert_same_final_weights(out, ref)
    assert STEPS == max(train_steps(out))
    rid = assert_one_tracked_run(out, tmp_path, steps=STEPS, attempts=3)
    assert json.loads((out / "result.json").read_text())["run_id"] == rid
    assert final_state(out)["run_id"] == rid


EXAMPLE = str(ROOT / "docs" / "examples" / "train_preemptible.py")
DONE = r"rank (\d): done step (\d+) digest (\w+)"


def _final_digests(text: str) -> set[tuple[str, str]]:
    rows = re.findall(DONE, text)
    assert sorted(r for r, _, _ in rows) == ["0", "1", "2", "3"], text[-3000:]
    return {(s, d) for _, s, d in rows}


@pytest.mark.timeout(300)
def test_preemptible_example_script_is_requeued_once_and_resumes_bitwise(
        preemption_partitions: None, tmp_path: Path, cancel_after: list[str]) -> None:
    """docs/examples/train_preemptible.py (own model, optimizer, scheduler, sampler; hpc's
    save/restore/AgreedStop) in ``preemptible``, preempted once by an urgent job."""
    env = slurm_env(**ENV)
    ref = tmp_path / "reference"
    ref_id, rc, ref_text = sbatch_wait(["-p", "debug", TEMPLATE, "python", EXAMPLE, "--out",
                                        str(ref)], tmp_path, timeout=180, env=env)
    assert rc == 0, ref_text[-3000:]
    reference = _final_digests(ref_text)
    assert len(reference) == 1 and next(iter(reference))[0] == "128", reference

    out = tmp_path / "run"
    job_id = sbatch_nowait(["-p", "preemptible", TEMPLATE, "python", EXAMPLE, "--out", str(out),
                            *TRACKER_ARGS], tmp_path,
                           slurm_env(**ENV, **slowed(0.2, runs=1), **tracker_env(tmp_path)),
                           cancel_after)
    until("checkpoint 20", lambda: (out / "checkpoints" / "ckpt-00000020.pt").exists(),
           job_id)
    urgent = preempt(tmp_path, env, cancel_after)
    last = jobwatch.wait(job_id, timeout=200)
    text = (tmp_path / f"hpc-srun-{job_id}.out").read_text()
    history = sacct_history([job_id, urgent])
    show = subprocess.run(["scontrol", "show", "job", job_id], check=False,
                          capture_output=True, text=True, timeout=20).stdout
    print(f"sacct:\n{history}\nscontrol: "
          f"{[w for w in show.split() if w.startswith(('JobState', 'Restarts'))]}\n"
          f"reference {reference}", file=sys.stderr)
    assert last.word == "COMPLETED", text[-4000:]
    assert text.count("got SIGTERM: stopping at the next step boundary") == 2, text[-4000:]
    stops = re.findall(r"rank (\d): stopped at step (\d+)", text)
    assert sorted(r for r, _ in stops) == ["0", "1", "2", "3"], text[-4000:]
    (stop_step,) = {s for _, s in stops}  # every rank at the same step
    assert f"requeued job {job_id} after step {stop_step} (SIGTERM; " in text
    assert "requeueing" not in text and "first failure" not in text, text[-4000:]
    assert_no_failure_marks(tmp_path / "hpc-logs" / job_id)
    assert_no_failure_marks(tmp_path / "hpc-logs" / str(ref_id))
    assert f"resumed from {out}/checkpoints/ckpt-{int(stop_step):08d}.pt" in text
    runs = [r.word for r in jobwatch.history(job_id)]
    assert runs == ["REQUEUED", "COMPLETED"], (runs, history)  # requeued exactly once
    assert "Restarts=1" in show, show
    assert jobwatch.current(urgent).word == "COMPLETED", history
    assert _final_digests(text) == reference  # bitwise equal to the uninterrupted run
    a = final_state(out)["model"]
    b = final_state(ref)["model"]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    rid = assert_one_tracked_run(out, tmp_path, steps=128, attempts=2)  # hpc.open_trackers
    assert text.count(f"digest {next(iter(reference))[1]} run {rid}") == 4, text[-3000:]


def _writer_of(job_id: str) -> int | None:
    """The pid of the job's asynchronous checkpoint writer (rank 0's child, on node1)."""
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            env = environ.read_bytes().split(b"\0")
            cmd = environ.with_name("cmdline").read_bytes()
        except OSError:
            continue
        if b"hpc.checkpoint.writer" in cmd and f"SLURM_JOB_ID={job_id}".encode() in env:
            return int(environ.parent.name)
    return None


@pytest.mark.timeout(300)
def test_a_preemption_during_an_asynchronous_save_waits_for_it_then_resumes_bitwise(
        preemption_partitions: None, tiny_reference: Path, tmp_path: Path,
        cancel_after: list[str]) -> None:
    """``hpc pretrain --ckpt-async --ckpt-every 1``: the writer is frozen (SIGSTOP) with
    a save in flight, so the next save waits for it and training halts; Slurm preempts the
    job: SIGCONT, then SIGTERM, to every process of the step, the writer included (it
    ignores SIGTERM). The writer finished that save, the stop waited for it and wrote its
    own checkpoint, and the job was requeued and resumed bitwise."""
    env = slurm_env(**ENV)
    out = tmp_path / "run"
    job_id = sbatch_nowait(["-p", "preemptible", TEMPLATE, *TINY_ARGS, "--out", str(out),
                            "--ckpt-async", "--ckpt-every", "1"], tmp_path,
                           slurm_env(**ENV, **slowed(0.3, runs=1)), cancel_after)
    ckpts = out / "checkpoints"
    until("checkpoint 4", lambda: (ckpts / "ckpt-00000004.pt").exists(), job_id)
    writer = _writer_of(job_id)
    assert writer is not None, "no checkpoint writer process in the job"
    os.kill(writer, signal.SIGSTOP)
    try:
        time.sleep(3)  # the save in flight cannot end, the next waits for it
        urgent = preempt(tmp_path, env, cancel_after)
        last = jobwatch.wait(job_id, timeout=200)
    finally:
        with contextlib.suppress(ProcessLookupError):  # Slurm's SIGCONT came first
            os.kill(writer, signal.SIGCONT)
    text = (tmp_path / f"hpc-srun-{job_id}.out").read_text()
    print(f"sacct:\n{sacct_history([job_id, urgent])}", file=sys.stderr)
    assert last.word == "COMPLETED", text[-4000:]
    stop = re.search(rf"requeued job {job_id} after step (\d+) \(SIGTERM; ", text)
    assert stop, text[-4000:]
    # A run's first save also waits (~1 s on a loaded machine) while its writer starts;
    # the frozen one is a save after checkpoint 4, in the run that was preempted.
    waited = [(float(s), int(c)) for s, c in re.findall(
        r"waited (\d+\.\d) s for checkpoint ckpt-(\d+)\.pt, still being written",
        text[:stop.start()]) if int(c) > 4]
    assert waited and waited[0][0] >= 2.0, text[-4000:]
    assert int(stop[1]) > waited[0][1]  # the stop's checkpoint came after that save
    assert f"resumed from {ckpts}/ckpt-{int(stop[1]):08d}.pt" in text
    assert "CheckpointError" not in text and "first failure" not in text, text[-4000:]
    assert [r.word for r in jobwatch.history(job_id)] == ["REQUEUED", "COMPLETED"]
    assert_no_failure_marks(tmp_path / "hpc-logs" / job_id)
    assert_each_step_once(out)
    assert_same_final_weights(out, tiny_reference)


RESUME_EXACT = str(ROOT / "tests" / "integration" / "scripts" / "resume_exact.py")
EXACT = r"rank (\d): done step (\d+) digest (\w+) history (\w+)"


@pytest.mark.timeout(300)
def test_a_users_batchnorm_script_preempted_by_slurm_resumes_bitwise_on_every_rank(
        preemption_partitions: None, tmp_path: Path, cancel_after: list[str]) -> None:
    """The own-script case of #27 item 5 under a real partition preemption: a CNN with
    BatchNorm (its running statistics each rank's own under ``hpc.sync_gradients``),
    dropout, Adam + StepLR, gradient accumulation and a ``ResumableSampler``; every
    rank's weights, buffers and loss history end equal to an uninterrupted run's."""
    env = slurm_env(**ENV)
    ref_id, rc, ref_text = sbatch_wait(["-p", "debug", TEMPLATE, "python", RESUME_EXACT,
                                        "--out", str(tmp_path / "reference")], tmp_path,
                                       timeout=180, env=env)
    assert rc == 0, ref_text[-3000:]
    reference = sorted(re.findall(EXACT, ref_text))
    assert [r for r, *_ in reference] == ["0", "1", "2", "3"], ref_text[-3000:]
    assert len({d for _, _, d, _ in reference}) > 1  # the ranks' own BatchNorm statistics

    out = tmp_path / "run"
    job_id = sbatch_nowait(["-p", "preemptible", TEMPLATE, "python", RESUME_EXACT, "--out",
                            str(out)], tmp_path, slurm_env(**ENV, **slowed(0.25, runs=1)),
                           cancel_after)
    log = tmp_path / f"hpc-srun-{job_id}.out"
    until("training", lambda: log.exists() and "initialised slurm rank 0/4" in log.read_text(),
          job_id)
    time.sleep(2)
    urgent = preempt(tmp_path, env, cancel_after)
    last = jobwatch.wait(job_id, timeout=200)
    text = log.read_text()
    print(f"sacct:\n{sacct_history([job_id, urgent])}", file=sys.stderr)
    assert last.word == "COMPLETED", text[-4000:]
    stops = re.findall(r"rank (\d): stopped at step (\d+)", text)
    assert sorted(r for r, _ in stops) == ["0", "1", "2", "3"], text[-4000:]
    assert [r.word for r in jobwatch.history(job_id)] == ["REQUEUED", "COMPLETED"]
    assert "resumed from" in text
    assert sorted(re.findall(EXACT, text)) == reference  # every rank, bitwise


ASYNC_STOP = [str(ROOT / "tests" / "integration" / "scripts" / "async_ckpt.py"),
              "--steps", "24", "--mib", "48", "--blocking", "--ckpt-every", "4"]
#: A witness in front of Slurm's scontrol: it notes the newest complete checkpoint at
#: each ``scontrol requeue``, then runs the real one.
WITNESS_BIN = str(ROOT / "tests" / "helpers" / "bin")


@pytest.mark.timeout(300)
def test_a_users_requeue_after_an_asynchronous_stop_checkpoint_waits_for_it_on_slurm(
        tmp_path: Path, cancel_after: list[str]) -> None:
    """A user's own script under ``slurm/pretrain.sbatch`` (4 ranks, 2 nodes): SIGUSR2 to
    rank 1 before step 10, the stop's checkpoint saved with ``blocking=False`` and
    ``stop.requeue_and_exit`` at once. ``scontrol requeue`` (the real one, behind a
    witness on PATH) runs only once that checkpoint is complete; the requeued run resumes
    from it and completes, every rank at the same weights. Before the one ending waited,
    the requeue ran while the writer was still starting, and Slurm's end of the job
    (SIGTERM, SIGKILL after KillWait) raced it."""
    out, witness = tmp_path / "run", tmp_path / "requeues.txt"
    env = slurm_env(**ENV, STOP_AT="10", SCONTROL_WITNESS=str(witness),
                    SCONTROL_CKPT_DIR=str(out))
    env["PATH"] = os.pathsep.join([WITNESS_BIN, env["PATH"]])
    job_id = sbatch_nowait(["-p", "debug", TEMPLATE, "python", *ASYNC_STOP,
                            "--out", str(out)],
                           tmp_path, env, cancel_after)
    last = jobwatch.wait(job_id, timeout=240)
    text = (tmp_path / f"hpc-srun-{job_id}.out").read_text()
    assert last.word == "COMPLETED", text[-4000:]
    assert witness.read_text().splitlines() == [f"requeue {job_id} newest=ckpt-00000010.pt"], (
        witness.read_text(), text[-4000:])
    assert [r.word for r in jobwatch.history(job_id)] == ["REQUEUED", "COMPLETED"]
    assert "0: rank 0: stopped at step 10" in text and "rank 0: resumed at step 10" in text, \
        text[-4000:]
    done = re.findall(r"rank (\d): done step 24 digest (\w+)", text)
    assert len(done) == 4 and len({d for _, d in done}) == 1, text[-4000:]
    assert "CheckpointError" not in text and "first failure" not in text, text[-4000:]
