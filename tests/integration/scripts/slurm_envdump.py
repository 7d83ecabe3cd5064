"""Write this task's launcher variables as one block of a fixture dump.

Usage: ``python slurm_envdump.py OUTDIR TRUTH`` where TRUTH says how the task learns its
own rank independently of :mod:`hpc.environments`: ``mpi4py`` (``COMM_WORLD``), the
name of a variable (``SLURM_PROCID``, ``RANK``) that the launcher under test sets, or
``label:WHAT`` for a lone process (header ``### WHAT env on NODE``, file ``WHAT.txt``).

Writes ``OUTDIR/task-R.txt`` with the ``### task R on NODE`` header and the sorted
``KEY=VALUE`` lines of ``tests/fixtures/env/*.txt``; the environment is read before
mpi4py is imported (initialising MPI must not change what is recorded).
Concatenate the files in rank order to make a fixture.
"""

from __future__ import annotations

import os
import re
import socket
import sys
from pathlib import Path

KEEP = re.compile(
    r"^(SLURM_\w+|SLURMD_NODENAME|CUDA_VISIBLE_DEVICES|GPU_DEVICE_ORDINAL|OMPI_\w+|"
    r"PMI_\w+|PMIX_\w+|MPI_LOCAL\w+|MPIR_\w+|HYDI_\w+|HYDRA_\w+|MV2_\w+|TORCHELASTIC_\w+|"
    r"RANK|WORLD_SIZE|LOCAL_RANK|LOCAL_WORLD_SIZE|GROUP_RANK|GROUP_WORLD_SIZE|ROLE_\w+|"
    r"NODE_RANK|NNODES|MASTER_ADDR|MASTER_PORT)$"
)


def main(outdir: str, truth: str) -> int:
    env = {k: v for k, v in os.environ.items() if KEEP.match(k) and "\n" not in v}
    host = socket.gethostname()
    if truth.startswith("label:"):
        what = truth.split(":", 1)[1]
        header, fname = f"### {what} env on {host}", f"{what}.txt"
    else:
        if truth == "mpi4py":
            from mpi4py import MPI

            rank = MPI.COMM_WORLD.Get_rank()
        else:
            rank = int(os.environ[truth])
        header, fname = f"### task {rank} on {host}", f"task-{rank}.txt"
    lines = [header] + [f"{k}={env[k]}" for k in sorted(env)]
    Path(outdir, fname).write_text("\n".join(lines) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
