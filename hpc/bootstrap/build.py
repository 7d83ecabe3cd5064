"""A CPU-only torch on a node that was granted GPUs: refused, not a silent CPU run.

The most common wrong-wheel mistake on GPU clusters: ``pip install torch`` picked the CPU
build (``2.x.y+cpu``, a CPU index, a conda ``cpuonly`` package), the job asks for GPUs,
and training runs on the CPU while the GPUs stay idle, without a word. ``init_torch``
(default backend, or one that moves CUDA tensors) calls
:func:`~hpc.bootstrap.build.check` when torch sees no GPU; a build without CUDA or ROCm
(``torch.version.cuda`` and ``torch.version.hip`` are None) on a process that was
granted GPUs is refused, with the build and the fix.

Variables read:

=========================  ================================================================
``SLURM_GPUS_ON_NODE``     GPUs Slurm granted on this node (> 0: granted)
``SLURM_JOB_GPUS``         GPU indices of the job on this node
``SLURM_STEP_GPUS``        GPU indices of the step on this node
``SLURM_GPUS``             GPUs of the job (``--gpus``)
``SLURM_GPUS_PER_NODE``    ``--gpus-per-node``
``SLURM_GPUS_PER_TASK``    ``--gpus-per-task``
``CUDA_VISIBLE_DEVICES``   GPUs this process may use (``-1``/``NoDevFiles``: none)
``HPC_ALLOW_CPU``          ``1``: train on the CPU anyway, with a warning in
                           ``info.warnings`` (:class:`hpc.DistInfo`); ``0`` or unset: refuse
=========================  ================================================================

Besides the variables, ``/dev/nvidia<N>`` device files show a node's NVIDIA GPUs.
"""

from __future__ import annotations

import glob
from collections.abc import Mapping, Sequence
from typing import Optional

from hpc import envvars
from hpc.errors import LaunchEnvironmentError

__all__ = ["ALLOW_VARIABLE", "GRANT_VARIABLES", "check", "granted_gpus", "is_cpu_build"]

#: Slurm's variables that say this job or step was granted GPUs.
GRANT_VARIABLES = ("SLURM_GPUS_ON_NODE", "SLURM_JOB_GPUS", "SLURM_STEP_GPUS", "SLURM_GPUS",
                   "SLURM_GPUS_PER_NODE", "SLURM_GPUS_PER_TASK")
#: ``1`` accepts a CPU-only torch where GPUs were granted.
ALLOW_VARIABLE = "HPC_ALLOW_CPU"
_NO_DEVICES = {"", "-1", "none", "nodevfiles", "void"}


def granted_gpus(environ: Mapping[str, str],
                 device_files: Optional[Sequence[str]] = None) -> list[str]:
    """What says this process was granted or can see GPUs, as ``NAME=value`` and device
    file paths (empty: nothing does).

    ``device_files`` are the ``/dev/nvidia<N>`` files (default: globbed from ``/dev``).
    """
    said = [f"{k}={environ[k].strip()}" for k in GRANT_VARIABLES
            if environ.get(k, "").strip() not in ("", "0", "(null)")]
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip().lower() not in _NO_DEVICES:
        said.append(f"CUDA_VISIBLE_DEVICES={visible.strip()}")
    files = sorted(glob.glob("/dev/nvidia[0-9]*")) if device_files is None else device_files
    return said + list(files)


def is_cpu_build(cuda: Optional[str], hip: Optional[str]) -> bool:
    """True when torch was built without CUDA and without ROCm
    (``torch.version.cuda``/``torch.version.hip`` both None)."""
    return cuda is None and hip is None


def check(version: str, cuda: Optional[str], hip: Optional[str],
          environ: Mapping[str, str],
          device_files: Optional[Sequence[str]] = None) -> Optional[str]:
    """Refuse a CPU-only torch ``version`` where GPUs were granted (pure but for the
    default ``/dev`` glob).

    Returns:
        None when torch has CUDA/ROCm or no GPU was granted; the warning text when
        ``HPC_ALLOW_CPU=1`` accepts the CPU run.

    Raises:
        LaunchEnvironmentError: GPUs were granted to a CPU-only torch, or
            ``HPC_ALLOW_CPU`` is neither ``0`` nor ``1``.
    """
    allow = envvars.value(ALLOW_VARIABLE, environ)  # the table's parse and error
    if not is_cpu_build(cuda, hip):
        return None
    granted = granted_gpus(environ, device_files)
    if not granted:
        return None
    evidence = ", ".join(granted[:6]) + (" ..." if len(granted) > 6 else "")
    if allow == "1":
        return (f"torch {version} is a CPU-only build but this process was granted GPUs "
                f"({evidence}): training on the CPU, as {ALLOW_VARIABLE}=1 asks.")
    raise LaunchEnvironmentError(
        f"torch {version} is a CPU-only build (torch.version.cuda is None) but this process "
        f"was granted GPUs: {evidence}.\n"
        "It would train on the CPU and leave the GPUs idle: the torch wheel installed in "
        "this environment is the CPU one (a '+cpu' wheel, a CPU package index, or conda's "
        "cpuonly).\n"
        "HINT: install torch's CUDA build in this environment, e.g. pip install "
        "--force-reinstall torch --index-url https://download.pytorch.org/whl/cu126 (a CUDA "
        "version your driver supports: nvidia-smi), and check with python -c 'import torch; "
        f"print(torch.version.cuda)'; or export {ALLOW_VARIABLE}=1 to train on the CPU "
        "anyway (backend='gloo' in hpc.init_torch() chooses the CPU too).")
