"""A CPU-only torch where GPUs were granted (issue 30): the rule on plain mappings, and
``init_torch`` in a real process with this machine's CPU-only torch."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from hpc.bootstrap import build
from hpc.errors import LaunchEnvironmentError
from tests.helpers.envdumps import load
from tests.helpers.paths import ROOT
from tests.helpers.processes import clean_env

GPU_TASK = dict(load("sbatch_srun_tasks_env.txt")[0][1])  # --gpus-per-node=2, real dump


def test_real_gpu_dump_is_granted_gpus() -> None:
    said = build.granted_gpus(GPU_TASK, device_files=[])
    assert "SLURM_GPUS_ON_NODE=2" in said and "CUDA_VISIBLE_DEVICES=0,1" in said, said


@pytest.mark.parametrize("env", [{}, {"CUDA_VISIBLE_DEVICES": ""},
                                 {"CUDA_VISIBLE_DEVICES": "-1"},
                                 {"CUDA_VISIBLE_DEVICES": "NoDevFiles"},
                                 {"SLURM_GPUS_ON_NODE": "0"}])
def test_nothing_granted(env: dict[str, str]) -> None:
    assert build.granted_gpus(env, device_files=[]) == []
    assert build.check("2.13.0+cpu", None, None, env, device_files=[]) is None


def test_device_files_alone_are_gpus() -> None:
    assert build.granted_gpus({}, device_files=["/dev/nvidia0"]) == ["/dev/nvidia0"]


def test_cpu_build_with_gpus_is_refused_naming_build_evidence_and_fix() -> None:
    with pytest.raises(LaunchEnvironmentError) as e:
        build.check("2.13.0+cpu", None, None, GPU_TASK, device_files=[])
    text = str(e.value)
    first, cause, hint = text.split("\n")
    assert first.startswith("torch 2.13.0+cpu is a CPU-only build (torch.version.cuda is "
                            "None) but this process was granted GPUs: ")
    assert "SLURM_GPUS_ON_NODE=2" in first and "CUDA_VISIBLE_DEVICES=0,1" in first
    assert hint.startswith("HINT: install torch's CUDA build") and "--index-url" in hint
    assert "HPC_ALLOW_CPU=1" in hint


@pytest.mark.parametrize("cuda, hip", [("12.6", None), (None, "6.2.4")])
def test_gpu_builds_pass(cuda: str | None, hip: str | None) -> None:
    assert build.check("2.13.0", cuda, hip, GPU_TASK, device_files=[]) is None


def test_allow_cpu_gives_a_warning() -> None:
    warning = build.check("2.13.0+cpu", None, None, {**GPU_TASK, "HPC_ALLOW_CPU": "1"},
                          device_files=[])
    assert warning is not None and "training on the CPU, as HPC_ALLOW_CPU=1 asks" in warning
    assert build.check("2.13.0+cpu", None, None, {"HPC_ALLOW_CPU": "1"}, device_files=[]) \
        is None  # nothing granted: nothing to warn about


def test_allow_cpu_bad_value_names_variable_and_accepted_form() -> None:
    # The envvars table's parse and message, like every HPC_* variable's.
    with pytest.raises(LaunchEnvironmentError,
                       match=r"HPC_ALLOW_CPU='yes' is not one of 0, 1") as e:
        build.check("2.13.0+cpu", None, None, {"HPC_ALLOW_CPU": "yes"}, device_files=[])
    assert "HINT: set HPC_ALLOW_CPU to 1 or 0 (default 0)" in str(e.value)


INIT = ("import json, hpc\n"
        "info = hpc.init_torch()\n"
        "print(json.dumps({'device': str(hpc.device()), 'warnings': list(info.warnings)}))\n")


def _init(**env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", INIT], capture_output=True, text=True,
                          timeout=120, cwd=ROOT, env=clean_env(PYTHONPATH=str(ROOT), **env))


torch = pytest.importorskip("torch")
cpu_torch = pytest.mark.skipif(torch.version.cuda is not None or torch.cuda.is_available(),
                               reason="this torch has CUDA: nothing to refuse")


@cpu_torch
def test_init_torch_refuses_cpu_torch_with_visible_gpus() -> None:
    """Before the fix: device cpu, no warning, exit 0."""
    proc = _init(CUDA_VISIBLE_DEVICES="0,1")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert f"torch {torch.__version__} is a CPU-only build" in proc.stderr, proc.stderr
    assert "CUDA_VISIBLE_DEVICES=0,1" in proc.stderr and "HINT:" in proc.stderr


@cpu_torch
def test_init_torch_allow_cpu_warns_in_info() -> None:
    proc = _init(CUDA_VISIBLE_DEVICES="0,1", HPC_ALLOW_CPU="1")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.splitlines()[-1])
    assert out["device"] == "cpu" and len(out["warnings"]) == 1, out
    assert "HPC_ALLOW_CPU=1" in out["warnings"][0]


@cpu_torch
def test_init_torch_with_explicit_gloo_is_a_choice() -> None:
    code = INIT.replace("hpc.init_torch()", "hpc.init_torch(backend='gloo')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, cwd=ROOT,
                          env=clean_env(PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="0,1"))
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.splitlines()[-1])["warnings"] == []
