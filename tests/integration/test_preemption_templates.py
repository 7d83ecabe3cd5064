"""Real Slurm preemption of ``slurm/torchrun.sbatch`` and ``slurm/mpirun.sbatch``.

The sequence of :mod:`tests.integration.test_preemption` (an ``urgent`` job over the nodes
of a running ``preemptible`` one: Slurm sends SIGTERM to every process of the job's
steps, SIGKILL after GraceTime), once per template, with ``hpc pretrain`` as payload:

* torchrun: the agents and their workers get the SIGTERM; torchrun shuts its workers down
  with it, which each worker's PreemptGuard turns into the agreed stop;
* mpirun (Open MPI): the ``orted`` step gets it, and would end the MPI job at once;
  the template starts ``mpirun`` and ``orted`` with SIGTERM blocked
  (``python -m hpc.preempt.shield``), so only the ranks act on it.

Each job must be requeued exactly once (history REQUEUED, COMPLETED), resume, and end
bitwise equal to an uninterrupted run (the reference of ``slurm/pretrain.sbatch``, 4 ranks
as well), each step in metrics.csv once.

Run under the shared lock: ``flock /tmp/hpc-heavy.lock pytest -m slurm tests/integration/test_preemption_templates.py``
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from hpc.submit import watch as jobwatch
from tests.helpers.paths import ROOT
from tests.helpers.preemption import preempt, sacct_history
from tests.helpers.requires import require
from tests.helpers.slurm import sbatch_nowait, slurm_env, until
from tests.helpers.step_hooks import slowed
from tests.helpers.tiny_pretrain import (
    ENV,
    STEPS,
    TINY_ARGS,
    assert_each_step_once,
    assert_same_final_weights,
    train_steps,
)

pytestmark = pytest.mark.slurm
torch = pytest.importorskip("torch")
pytest.importorskip("sklearn")

CASES = {"torchrun": ("torchrun.sbatch", "hpc-torchrun", None),
         "mpirun": ("mpirun.sbatch", "hpc-mpirun", "mpirun.openmpi")}


@pytest.mark.timeout(360)
@pytest.mark.parametrize("case", list(CASES))
def test_template_survives_sigterm_preemption_and_resumes_exactly(
        case: str, preemption_partitions: None, tiny_reference: Path, tmp_path: Path,
        cancel_after: list[str]) -> None:
    template, name, mpirun = CASES[case]
    job_env = slurm_env(**ENV, **slowed(0.5, runs=1))
    if mpirun:
        job_env["HPC_MPIRUN"] = require(mpirun, "Open MPI")
    out = tmp_path / "run"
    job_id = sbatch_nowait(["-p", "preemptible", str(ROOT / "slurm" / template), *TINY_ARGS,
                      "--out", str(out)], tmp_path, job_env, cancel_after)
    log = tmp_path / f"{name}-{job_id}.out"
    ckpts = out / "checkpoints"
    until("checkpoint 6", lambda: (ckpts / "ckpt-00000006.pt").exists(), job_id)
    urgent = preempt(tmp_path, slurm_env(**ENV), cancel_after)
    last = jobwatch.wait(job_id, timeout=240)
    text = log.read_text()
    history = sacct_history([job_id, urgent])
    shown = subprocess.run(["scontrol", "show", "job", job_id], check=False,
                           capture_output=True, text=True, timeout=20).stdout
    print(f"sacct:\n{history}\n{shown}", file=sys.stderr)
    assert last.word == "COMPLETED", text[-4000:]
    assert "got SIGTERM: stopping at the next step boundary" in text, text[-4000:]
    # one agreed stop, one INFO line once scontrol requeued the job ("(SIG...;": the
    # signal rank 0 saw; under mpirun only node2's ranks, in the orted step, get the
    # SIGTERM, and node1's stop with them)
    assert len(re.findall(rf"INFO hpc.preempt.requeue: requeued job {job_id} after step \d+ "
                          r"\(SIG\w+; .*; restart 1 of at most", text)) == 1, text[-4000:]
    assert "requeueing" not in text and "first failure" not in text, text[-4000:]
    assert text.count(f"resumed from {ckpts}/ckpt-") == 1, text[-4000:]
    runs = [r.word for r in jobwatch.history(job_id)]
    assert runs == ["REQUEUED", "COMPLETED"], (runs, history)  # requeued exactly once
    assert "Restarts=1" in shown, shown
    assert jobwatch.current(urgent).word == "COMPLETED", history
    assert_each_step_once(out)
    assert_same_final_weights(out, tiny_reference)
    assert STEPS == max(train_steps(out))
