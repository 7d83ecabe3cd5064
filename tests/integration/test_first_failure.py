"""Per-rank logs and the first failure under Slurm (issue 15, part 5), on the real cluster.

``slurm/pretrain.sbatch`` runs a job whose rank 1 fails first but exits last, so srun's
``task N`` lines put rank 0 first; the template's closing line must name rank 1 from the
failure marks, every line carries srun's ``--label`` rank, and each rank wrote its own
log into the run directory.

Run::

    flock /tmp/hpc-heavy.lock timeout 900 python -m pytest -m slurm tests/integration/test_first_failure.py
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.paths import ROOT, script
from tests.helpers.processes import run_group
from tests.helpers.slurm import require_slurm, sbatch, slurm_env

pytestmark = pytest.mark.slurm


@pytest.mark.timeout(150)
def test_template_names_the_rank_that_failed_first_not_srun_first(
        job: str, tmp_path: Path) -> None:
    require_slurm()
    job_id, code, out = sbatch(["-N2", "--ntasks-per-node=1", str(ROOT / "slurm" / "pretrain.sbatch"),
                                sys.executable, script("slurm_first_failure.py")], job, tmp_path)
    assert code != 0, out
    srun = re.findall(r"srun: error: (\S+): task (\d+): (.*)", out)
    assert srun and srun[0][1] == "0", out  # srun saw rank 0's exit first
    first = re.search(r"^hpc: first failure: (.*)$", out, re.MULTILINE)
    assert first, out
    assert re.match(r"rank 1 on node2 \(pid \d+\) at [\d:.]+: RuntimeError: rank 1 broke first "
                    r"\(by the failure marks in ", first[1]), first[1]
    assert re.search(r"^0: .*RuntimeError: rank 0 failed because its peer did", out, re.MULTILINE), out
    assert re.search(r"^1: .*RuntimeError: rank 1 broke first", out, re.MULTILINE), out
    run_dir = tmp_path / "hpc-logs" / str(job_id)
    for rank in (0, 1):
        mine = (run_dir / f"rank{rank}.log").read_text()
        assert f"[rank {rank}/2 node{rank + 1}] WARNING first_failure: rank {rank} about" in mine


@pytest.mark.timeout(200)
def test_submit_wait_names_the_rank_that_failed_first(tmp_path: Path) -> None:
    require_slurm()
    scripts = str(Path(script("slurm_first_failure.py")).parent)
    env = slurm_env()
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [scripts, env.get("PYTHONPATH")]))
    cmd = [sys.executable, "-m", "hpc", "submit", "-N", "2", "-G", "0", "--tasks-per-node",
           "1", "--time", "3", "--log-dir", str(tmp_path / "logs"), "--wait",
           "--wait-timeout", "150", "--", "-m", "slurm_first_failure"]
    proc = run_group(cmd, timeout=180, cwd=tmp_path, env=env)
    text = proc.stdout + proc.stderr
    job_id = re.search(r"submitted job (\d+)", text)
    try:
        assert proc.returncode != 0, text
        srun = re.findall(r"hpc submit:\s+srun: rank (\d+) on", text)
        first = re.search(r"hpc submit: first failure: (.*)", text)
        assert first and first[1].startswith("rank 1 on node2 (pid "), text[-3000:]
        assert "RuntimeError: rank 1 broke first" in first[1]
        assert srun[:1] == ["0"], text[-3000:]  # srun itself saw rank 0 fail first
    finally:
        if job_id:
            subprocess.run(["scancel", job_id[1]], check=False, timeout=30)
