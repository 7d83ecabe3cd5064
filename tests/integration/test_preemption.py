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
to an uninterrupted run of the same template, with each step in metrics.csv once.

Run under the shared lock: ``flock /tmp/hpc-heavy.lock pytest -m slurm tests/integration/test_preemption.py``
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from hpc.submit import watch as jobwatch
from tests.helpers.paths import ROOT
from tests.helpers.requires import in_ci
from tests.helpers.slurm import require_slurm, sbatch_wait, slurm_env
from tests.helpers.step_hooks import slowed
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


@pytest.fixture(scope="module")
def partitions() -> None:
    require_slurm()
    out = subprocess.run(["sinfo", "-h", "-o", "%P"], check=False, capture_output=True, text=True,
                         timeout=20).stdout.split()
    if "preemptible" not in out or "urgent" not in out:
        msg = (f"the test cluster has no preemptible/urgent partitions (sinfo: {out}); "
               "restart it from this checkout: bin/hpc-testcluster down && bin/hpc-testcluster up")
        if in_ci():
            pytest.fail(msg)
        pytest.skip(msg)


@pytest.fixture
def jobs() -> Iterator[list[str]]:
    """Job ids to scancel at teardown (a failed test leaves nothing running)."""
    ids: list[str] = []
    yield ids
    for job_id in ids:
        subprocess.run(["scancel", job_id], check=False, timeout=20)


def _sbatch(args: list[str], cwd: Path, env: dict[str, str], jobs: list[str]) -> str:
    proc = subprocess.run(["sbatch", "--parsable", *args], check=False, cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    job_id = proc.stdout.strip().split(";")[0]
    jobs.append(job_id)
    return job_id


def _until(what: str, check, job_id: str, timeout: float = 120) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline or jobwatch.is_terminal(jobwatch.current(job_id)):
            pytest.fail(f"{what} did not happen (job {job_id}: {jobwatch.current(job_id)})")
        time.sleep(0.5)


def _preempt(tmp_path: Path, env: dict[str, str], jobs: list[str]) -> str:
    """An urgent 2-node exclusive job: Slurm preempts the preemptible job for it."""
    return _sbatch(["-p", "urgent", "-N2", "--exclusive", "-o", str(tmp_path / "urgent-%j.out"),
                    "--wrap", "sleep 8"], tmp_path, env, jobs)


def _sacct(job_ids: list[str]) -> str:
    return subprocess.run(["sacct", "-j", ",".join(job_ids), "--duplicates", "-X", "-n", "-P",
                           "-o", "JobID,Partition,State,ExitCode,Start,End"],
                          check=False, capture_output=True, text=True, timeout=30).stdout


@pytest.mark.timeout(420)
def test_sigterm_preemption_requeues_once_each_time_and_resumes_exactly(
        partitions: None, tmp_path: Path, jobs: list[str]) -> None:
    env = slurm_env(**ENV)
    ref = tmp_path / "reference"
    job_id, rc, text = sbatch_wait(["-p", "debug", TEMPLATE, *TINY_ARGS, "--out", str(ref)],
                                   tmp_path, timeout=180, env=env)
    assert rc == 0, text[-3000:]

    # Run 0 sees no scontrol (PATH = the venv's bin only); later runs see the normal PATH.
    venv_bin = str(Path(sys.executable).parent)
    assert shutil.which("scontrol", path=venv_bin) is None
    out = tmp_path / "run"
    train = shlex.join([sys.executable, "-m", "hpc", "pretrain", *TINY_ARGS, "--out", str(out)])
    ranks = (f'if [ "${{SLURM_RESTART_COUNT:-0}}" = 0 ]; then export PATH={venv_bin}; fi; '
             f"exec {train}")
    job_env = slurm_env(**ENV, **slowed(0.5, runs=2))
    job_id = _sbatch(["-p", "preemptible", TEMPLATE, "bash", "-c", ranks], tmp_path, job_env,
                     jobs)
    log = tmp_path / f"hpc-pretrain-{job_id}.out"
    ckpts = out / "checkpoints"

    _until("checkpoint 6", lambda: (ckpts / "ckpt-00000006.pt").exists(), job_id)
    urgent = [_preempt(tmp_path, env, jobs)]
    _until("the second run", lambda: log.exists() and log.read_text().count(
        f"hpc: job {job_id} on") == 2, job_id, timeout=150)
    first_stop = max(train_steps(out))
    _until("a checkpoint of the second run", lambda: any(
        int(p.name[5:13]) >= first_stop + 3 for p in ckpts.glob("ckpt-*.pt")), job_id)
    urgent.append(_preempt(tmp_path, env, jobs))
    last = jobwatch.wait(job_id, timeout=200)
    text = log.read_text()
    history = _sacct([job_id, *urgent])
    print(f"sacct:\n{history}", file=sys.stderr)
    assert last.word == "COMPLETED", text[-4000:]

    # one line per node (local rank 0) per preemption
    assert text.count("got SIGTERM: stopping at the next step boundary") == 4, text[-4000:]
    assert text.count("on SIGTERM; ") == 2  # "stopped at step N on SIGTERM; checkpoint ..."
    assert f"requeued job {job_id} (scontrol is missing here: the batch shell" in text
    assert f"hpc: requeueing job {job_id} for the ranks (no scontrol" in text
    assert f"requeueing job {job_id} (restart 2 of" in text  # run 1: scontrol by rank 0
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


EXAMPLE = str(ROOT / "docs" / "examples" / "train_preemptible.py")
DONE = r"rank (\d): done step (\d+) digest (\w+)"


def _final_digests(text: str) -> set[tuple[str, str]]:
    rows = re.findall(DONE, text)
    assert sorted(r for r, _, _ in rows) == ["0", "1", "2", "3"], text[-3000:]
    return {(s, d) for _, s, d in rows}


@pytest.mark.timeout(300)
def test_preemptible_example_script_is_requeued_once_and_resumes_bitwise(
        partitions: None, tmp_path: Path, jobs: list[str]) -> None:
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
    job_id = _sbatch(["-p", "preemptible", TEMPLATE, "python", EXAMPLE, "--out", str(out)],
                     tmp_path, slurm_env(**ENV, **slowed(0.2, runs=1)), jobs)
    _until("checkpoint 20", lambda: (out / "checkpoints" / "ckpt-00000020.pt").exists(),
           job_id)
    urgent = _preempt(tmp_path, env, jobs)
    last = jobwatch.wait(job_id, timeout=200)
    text = (tmp_path / f"hpc-pretrain-{job_id}.out").read_text()
    history = _sacct([job_id, urgent])
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
    assert f"requeueing job {job_id} (restart 1 of" in text
    assert f"resumed from {out}/checkpoints/ckpt-{int(stop_step):08d}.pt" in text
    runs = [r.word for r in jobwatch.history(job_id)]
    assert runs == ["REQUEUED", "COMPLETED"], (runs, history)  # requeued exactly once
    assert "Restarts=1" in show, show
    assert jobwatch.current(urgent).word == "COMPLETED", history
    assert _final_digests(text) == reference  # bitwise equal to the uninterrupted run
    a = final_state(out)["model"]
    b = final_state(ref)["model"]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
