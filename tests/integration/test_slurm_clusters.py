"""Issue 13 on the real 2-node test cluster: enroot's PyTorch hook (a real srun
``--task-prolog`` exporting exactly the hook's variables), CPU binding under
``TaskPlugin=task/affinity``, heterogeneous jobs, and rank 0 off the master host.

No container runtime runs here: the task prolog stands in for enroot's hook
(``conf/hooks/extra/50-slurm-pytorch.sh``), which exports the same variables the same way.

Run (2 shared cores: one heavy run at a time)::

    flock /tmp/hpc-heavy.lock python -m pytest -m slurm tests/integration/test_slurm_clusters.py
"""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.paths import script
from tests.helpers.slurm import run, sbatch, slurm_env

pytestmark = [pytest.mark.slurm, pytest.mark.usefixtures("cluster")]

PY = sys.executable
ENV_ALL = [PY, "-m", "hpc", "env", "--all"]
ROW = re.compile(r"^\s*(\d+)\s+(\d+)\s+(\d+)\s+(node\d)\s+(\S+)\s+(\d+)\s+(\d+)\s+(\S+)\s+(\d+)",
                 re.MULTILINE)

# What enroot's 50-slurm-pytorch.sh exports, as a task prolog prints it.
ENROOT_HOOK = r"""#!/bin/bash
echo "export PYTORCH_VERSION=2.3.0a0"
echo "export RANK=$SLURM_PROCID"
echo "export LOCAL_RANK=$SLURM_LOCALID"
echo "export WORLD_SIZE=$SLURM_NTASKS"
echo "export MASTER_ADDR=$(scontrol show hostnames "$SLURM_STEP_NODELIST" | head -n1)"
echo "export MASTER_PORT=$((SLURM_JOB_ID % 4536 + 61000))"
[ "$SLURM_NTASKS" -gt "$SLURM_JOB_NUM_NODES" ] && echo "export OMP_NUM_THREADS=1"
exit 0
"""


def env_all_rows(out: str, world: int) -> list[tuple[str, ...]]:
    """The rank table of ``hpc env --all``, checked to have ``world`` rows and no mismatch."""
    rows = ROW.findall(out)
    assert len(rows) == world, out
    assert f"{world} ranks" in out and "no mismatches" in out, out
    return sorted(rows, key=lambda r: int(r[0]))


@pytest.mark.timeout(120)
def test_enroot_hook_gets_the_step_layout(job: str, tmp_path: Path) -> None:
    prolog = tmp_path / "enroot-hook.sh"
    prolog.write_text(ENROOT_HOOK)
    prolog.chmod(0o755)
    proc = run(["srun", "-N2", "--ntasks-per-node=2", f"--task-prolog={prolog}", *ENV_ALL],
               job, tmp_path, slurm_env())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = env_all_rows(proc.stdout, 4)
    # rank local node host launcher world local_world master port
    assert [(r[1], r[2], r[3], r[4], r[6]) for r in rows] == [
        ("0", "0", "node1", "slurm", "2"), ("1", "0", "node1", "slurm", "2"),
        ("0", "1", "node2", "slurm", "2"), ("1", "1", "node2", "slurm", "2")], proc.stdout
    ports = {int(r[8]) for r in rows}
    assert len(ports) == 1 and 61000 <= ports.pop() < 65536, "the hook's MASTER_PORT is kept"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("ntasks,cpus", [(2, 1), (1, 2)])
def test_srun_binds_cpus_and_threads_follow(ntasks: int, cpus: int, job: str,
                                            tmp_path: Path) -> None:
    proc = run(["srun", "-N1", f"-n{ntasks}", f"-c{cpus}", PY, script("threads_probe.py")],
               job, tmp_path, slurm_env())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    got = sorted(re.findall(r"THREADS rank=(\d) cpus=(\d+) threads=(\d+) omp=(\S+)",
                            proc.stdout))
    assert got == [(str(r), str(cpus), str(cpus), str(cpus)) for r in range(ntasks)], proc.stdout


@pytest.mark.timeout(120)
def test_srun_exact_without_cpus_per_task_inside_sbatch_c2_warns(job: str,
                                                                 tmp_path: Path) -> None:
    """Slurm 22.05: srun does not take -c from sbatch (SLURM_CPUS_PER_TASK=2 is only
    inherited); a step of exactly its own request (--exact) is bound to 1 CPU."""
    batch = tmp_path / "c2.sh"
    batch.write_text(f"#!/bin/bash\nsrun -n1 --exact {PY} {script('threads_probe.py')}\n")
    _, code, out = sbatch(["-N1", "-n1", "-c2", str(batch)], job, tmp_path)
    assert code == 0, out
    assert "THREADS rank=0 cpus=1 threads=1" in out, out
    assert "SLURM_CPUS_PER_TASK=2 but this task may run on only 1 CPU" in out, out
    assert "SRUN_CPUS_PER_TASK" in out


@pytest.mark.timeout(120)
def test_het_job_srun(job: str, tmp_path: Path) -> None:
    """``srun -N1 -n1 : -N1 -n2``: one job of two components, 3 ranks."""
    proc = run(["srun", "-N1", "-n1", ":", "-N1", "-n2", *ENV_ALL], job, tmp_path, slurm_env())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = env_all_rows(proc.stdout, 3)
    assert [(r[1], r[2], r[3], r[6]) for r in rows] == [
        ("0", "0", "node1", "1"), ("0", "1", "node2", "2"), ("1", "1", "node2", "2")], proc.stdout


@pytest.mark.timeout(120)
def test_het_job_sbatch_het_group(job: str, tmp_path: Path) -> None:
    batch = tmp_path / "het.sh"
    batch.write_text("#!/bin/bash\n#SBATCH -N1 -n1\n#SBATCH hetjob\n#SBATCH -N1 -n2\n"
                     f"srun --het-group=0,1 {' '.join(ENV_ALL)}\n")
    _, code, out = sbatch([str(batch)], job, tmp_path)
    assert code == 0, out
    rows = env_all_rows(out, 3)
    assert [(r[3], r[6]) for r in rows] == [("node1", "1"), ("node2", "2"), ("node2", "2")], out


@pytest.mark.timeout(120)
def test_rank0_off_the_master_host_fails_at_once(job: str, tmp_path: Path) -> None:
    """SLURM_HOSTFILE + --distribution=arbitrary puts rank 0 on node2."""
    hostfile = tmp_path / "hosts"
    hostfile.write_text("node2\nnode1\n")
    env = slurm_env(SLURM_HOSTFILE=str(hostfile), HPC_CONNECT_TIMEOUT="60")
    start = time.monotonic()
    proc = run(["srun", "-n2", "--distribution=arbitrary", "--kill-on-bad-exit=1", *ENV_ALL],
               job, tmp_path, env)
    elapsed = time.monotonic() - start
    assert proc.returncode != 0
    assert "rank 0 runs on node2 but the master address is node1" in proc.stderr, proc.stderr
    assert elapsed < 30, f"took {elapsed:.0f}s: peers waited for the connect timeout"
