"""Lightning (Trainer, Fabric) and Accelerate on hpc's bootstrap, on the real test cluster.

* A Lightning Trainer fit (docs/examples/train_lightning.py) in the ``preemptible``
  partition, 2 nodes x 2 tasks under ``slurm/pretrain.sbatch``, is preempted by an urgent
  job (Slurm's SIGTERM to every task). Every rank stops after the same step through
  :class:`~hpc.integrations.lightning.HPCPreemption`; the job is requeued once and resumes
  from the stop's checkpoint under the same run id (the TensorBoard version) to the last
  step.
* At the same time, a Fabric loop (docs/examples/train_fabric.py) in partition ``four``,
  2 nodes x 2 tasks: Lightning sees the layout hpc detected (4 ranks, node ranks 0 and 1).

Under ``hpc run`` the three examples are stopped with USR2 and resumed by
``tests/integration/test_docs_examples.py``.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpc.submit import watch as jobwatch
from tests.helpers.paths import ROOT
from tests.helpers.preemption import assert_no_failure_marks, preempt, sacct_history
from tests.helpers.slurm import sbatch_nowait, slurm_env, until
from tests.helpers.step_hooks import slowed
from tests.helpers.tiny_pretrain import ENV

pytest.importorskip("torch")

TEMPLATE = str(ROOT / "slurm" / "pretrain.sbatch")
EXAMPLES = ROOT / "docs" / "examples"
LAYOUT = (r"rank (\d): layout 4 ranks, (?:\d+ nodes, )?(?:global_rank \d )?local_rank (\d) "
          r"node_rank (\d); done step (\d+)")


def _require_lightning() -> None:
    from tests.helpers.trackers import require_package

    require_package("lightning")


def _layout(text: str) -> dict[str, tuple[str, str, str]]:
    """Each rank's (local rank, node rank, final step) as the framework reported it."""
    return {r: (local, node, step) for r, local, node, step in re.findall(LAYOUT, text)}


@pytest.mark.slurm
@pytest.mark.timeout(360)
def test_a_preempted_lightning_fit_is_requeued_and_resumes_under_its_run_id(
        preemption_partitions: None, tmp_path: Path, cancel_after: list[str]) -> None:
    _require_lightning()
    env = slurm_env(**ENV)
    out, fabric_out = tmp_path / "lit", tmp_path / "fabric"
    job_id = sbatch_nowait(["-p", "preemptible", TEMPLATE, "python",
                            str(EXAMPLES / "train_lightning.py"), "--out", str(out)],
                           tmp_path, slurm_env(**ENV, **slowed(0.2, runs=1)), cancel_after)
    fabric_id = sbatch_nowait(["-p", "four", "-N2", "--ntasks-per-node=2", TEMPLATE, "python",
                               str(EXAMPLES / "train_fabric.py"), "--out", str(fabric_out),
                               "--epochs", "1"], tmp_path, env, cancel_after)
    until("the fit's start", lambda: (out / "run_id").exists(), job_id, timeout=150)
    rid = (out / "run_id").read_text().strip()
    time.sleep(4)  # into the fit: 48 steps of >= 0.2 s in the first run
    urgent = preempt(tmp_path, env, cancel_after)
    last = jobwatch.wait(job_id, timeout=240)
    text = (tmp_path / f"hpc-srun-{job_id}.out").read_text()
    history = sacct_history([job_id, urgent])
    print(f"sacct:\n{history}", file=sys.stderr)
    assert last.word == "COMPLETED", text[-4000:]
    assert text.count("got SIGTERM: stopping at the next step boundary") == 2, text[-4000:]
    stops = set(re.findall(r"stopping after step (\d+) on SIGTERM", text))
    assert len(stops) == 1, text[-4000:]  # rank 0 logs it; one step for all ranks
    (stop_step,) = stops
    assert 0 < int(stop_step) < 48, stop_step
    ckpt = out / "checkpoints" / f"hpc-{int(stop_step):08d}.ckpt"
    assert f"requeued job {job_id} after step {stop_step} (SIGTERM; " in text, text[-4000:]
    assert f"Restored all states from the checkpoint at {ckpt}" in text, text[-4000:]
    assert [r.word for r in jobwatch.history(job_id)] == ["REQUEUED", "COMPLETED"], history
    assert_no_failure_marks(tmp_path / "hpc-logs" / job_id)
    ranks = _layout(text)
    assert ranks == {"0": ("0", "0", "48"), "1": ("1", "0", "48"), "2": ("0", "1", "48"),
                     "3": ("1", "1", "48")}, text[-3000:]
    assert text.count(f"run {rid}") == 4 and (out / "run_id").read_text().strip() == rid
    assert [p.name for p in (out / "tensorboard").iterdir()] == [rid]  # one version

    fabric = jobwatch.wait(fabric_id, timeout=120)
    fabric_text = (tmp_path / f"hpc-srun-{fabric_id}.out").read_text()
    assert fabric.word == "COMPLETED", fabric_text[-3000:]
    assert _layout(fabric_text) == {"0": ("0", "0", "16"), "1": ("1", "0", "16"),
                                    "2": ("0", "1", "16"), "3": ("1", "1", "16")}, \
        fabric_text[-3000:]
    nodes = subprocess.run(["sacct", "-j", fabric_id, "-X", "-n", "-o", "NodeList%30"],
                           capture_output=True, text=True, timeout=30).stdout.strip()
    print(f"fabric ran on {nodes}", file=sys.stderr)


@pytest.mark.timeout(180)
def test_a_trainer_whose_devices_disagree_with_the_launch_is_refused(tmp_path: Path) -> None:
    """No silent wrong layout: ``devices=1`` under 2 ranks names both sides and the fix."""
    _require_lightning()
    from tests.helpers.processes import hpc_run

    script = tmp_path / "wrong.py"
    script.write_text(
        "import lightning as L\n"
        "from hpc.integrations.lightning import HPCEnvironment\n"
        "env = HPCEnvironment()\n"
        "try:\n"
        "    L.Trainer(accelerator='cpu', devices=1, num_nodes=1, strategy='ddp',\n"
        "              plugins=[env], logger=False)\n"
        "except Exception as e:\n"
        "    print('refused:', type(e).__name__, str(e).replace(chr(10), ' | '))\n")
    proc = hpc_run(2, [str(script)], timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count(
        "refused: LaunchEnvironmentError Lightning computed a world size of 1 (num_nodes x "
        "devices), but the hpc-run launch started 2 ranks on 1 node (2 per node, this is "
        "rank ") == 2, proc.stdout
    assert "HINT: pass **env.trainer_kwargs() (devices=2, num_nodes=1)" in proc.stdout


@pytest.mark.mpi
@pytest.mark.timeout(180)
def test_accelerate_under_real_mpirun_takes_hpcs_layout(tmp_path: Path) -> None:
    """``mpirun -np 2`` (Open MPI), no ``accelerate launch``: Accelerate sees 2 processes
    with hpc's ranks and both end with the same weights and run id."""
    from tests.helpers.mpi import launcher
    from tests.helpers.processes import run_group
    from tests.helpers.trackers import require_package

    require_package("accelerate")
    prefix, env = launcher("openmpi", tmp_path, 2, with_mpi4py=False)
    # Each rank's stdout in its own file (Open MPI's --output-filename DIR writes
    # DIR/1/rank.N/stdout): through mpirun's forwarded stdout two clean CI runs got rank
    # 1's line spliced into the middle of rank 0's ("run 2026...9476e0rank 1: ...").
    outputs = tmp_path / "mpi-out"
    proc = run_group([*prefix, "--output-filename", str(outputs), sys.executable,
                      str(EXAMPLES / "train_accelerate.py"),
                      "--out", str(tmp_path / "acc"), "--epochs", "1"],
                     timeout=150, env=env, cwd=ROOT)  # a timeout kills mpirun's whole group
    stdout = "".join(p.read_text() for p in sorted(outputs.glob("*/rank.*/stdout")))
    assert proc.returncode == 0, proc.stdout + proc.stderr + stdout
    rows = re.findall(r"rank (\d): accelerate 2 processes, index (\d) local (\d) "
                      r"\(DistributedType.MULTI_CPU\); done step 32 digest (\w+) run ([\w-]+)",
                      stdout)
    assert sorted((r, i, loc) for r, i, loc, _, _ in rows) == [("0", "0", "0"), ("1", "1", "1")], \
        stdout[-3000:]
    assert len({(d, rid) for *_, d, rid in rows}) == 1, rows
    assert "initialised openmpi rank 0/2" in proc.stderr, proc.stderr
