"""The srun command lines the sbatch templates build, run with a fake ``srun`` that
prints its arguments (no cluster, no container runtime: pyxis and Apptainer cannot run
here, so this is how their templates are checked)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.helpers.paths import ROOT

FAKE_SRUN = '#!/bin/sh\nfor a in "$@"; do echo "ARG $a"; done\n'


def srun_args(template: str, tmp_path: Path, *args: str, **env: str) -> list[str]:
    (tmp_path / "srun").write_text(FAKE_SRUN)
    (tmp_path / "srun").chmod(0o755)
    full = dict(os.environ, PATH=f"{tmp_path}{os.pathsep}{os.environ['PATH']}",
                SLURM_JOB_ID="7", SLURM_JOB_NODELIST="node[1-2]", **env)
    proc = subprocess.run(["bash", str(ROOT / "slurm" / template), *args], env=full,
                          cwd=tmp_path, capture_output=True, text=True, timeout=30)
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
