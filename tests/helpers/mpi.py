"""Environments for running MPI launchers with and without mpi4py."""

from __future__ import annotations

import os
from pathlib import Path

from tests.helpers.processes import clean_env
from tests.helpers.requires import require

MPICH_LIB = Path("/usr/lib/x86_64-linux-gnu/libmpich.so.12")


def no_mpi4py(tmp: Path) -> str:
    """A directory whose ``mpi4py`` package fails to import, like a missing install."""
    pkg = tmp / "blocked" / "mpi4py"
    pkg.mkdir(parents=True, exist_ok=True)
    (pkg / "__init__.py").write_text("raise ImportError('mpi4py blocked for this test')\n")
    return str(tmp / "blocked")


def launcher(kind: str, tmp: Path, nproc: int, with_mpi4py: bool) -> tuple[list[str], dict[str, str]]:
    """``(argv prefix, env)`` for ``kind`` in {'openmpi', 'mpich'}."""
    env = clean_env()
    if not with_mpi4py:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [no_mpi4py(tmp), env.get("PYTHONPATH")]))
    if kind == "openmpi":
        exe = require("mpirun.openmpi", "Open MPI (Debian openmpi-bin)")
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
                   OMPI_MCA_rmaps_base_oversubscribe="1")
        return [exe, "-np", str(nproc)], env
    exe = require("mpiexec.mpich", "MPICH (Debian mpich)")
    if with_mpi4py:
        # The mpi4py wheel loads Open MPI unless told otherwise; Debian ships only
        # libmpich.so.12, so give it the libmpi.so.12 name it looks for.
        link = tmp / "mpichlib" / "libmpi.so.12"
        link.parent.mkdir(exist_ok=True)
        if not link.exists():
            link.symlink_to(MPICH_LIB)
        env["MPI4PY_LIBMPI"] = str(link)
        env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [str(link.parent), env.get("LD_LIBRARY_PATH")]))
    return [exe, "-n", str(nproc)], env
