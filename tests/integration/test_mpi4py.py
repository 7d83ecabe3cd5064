"""mpi4py as the source of the layout (``HPC_LAUNCHER=mpi4py``) and as the master
broadcast that MPICH's ``mpiexec`` cannot use with the default mpi4py wheel.

The mpi4py wheel installed here loads Open MPI unless ``MPI4PY_LIBMPI`` points it at
another library; in a process started by ``mpiexec.mpich`` that would be the wrong MPI,
so hpc must not import it there and must find the master another way.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.demo import DEMO, check_demo
from tests.helpers.mpi import launcher, no_mpi4py
from tests.helpers.paths import ROOT
from tests.helpers.processes import clean_env, run_group
from tests.helpers.requires import require

pytestmark = pytest.mark.background  # see setup.cfg

pytest.importorskip("mpi4py")


@pytest.mark.mpi
@pytest.mark.timeout(120)
def test_hpc_launcher_mpi4py_reads_the_layout_from_mpi4py(tmp_path: Path) -> None:
    prefix, env = launcher("openmpi", tmp_path, 2, with_mpi4py=True)
    env["HPC_LAUNCHER"] = "mpi4py"
    proc = run_group([*prefix, *DEMO], timeout=100, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    check_demo(proc.stdout, 2, "mpi4py")


@pytest.mark.timeout(60)
def test_hpc_launcher_mpi4py_without_mpi4py_is_refused(tmp_path: Path) -> None:
    env = clean_env(HPC_LAUNCHER="mpi4py", PYTHONPATH=no_mpi4py(tmp_path))
    proc = run_group(DEMO, timeout=50, env=env, cwd=ROOT)
    assert proc.returncode != 0
    assert "HPC_LAUNCHER=mpi4py but mpi4py cannot be imported" in proc.stderr, proc.stderr
    assert "HINT: pip install 'torch-hpc[mpi]'" in proc.stderr


@pytest.mark.mpi
@pytest.mark.timeout(120)
def test_mpich_with_the_default_mpi4py_wheel_falls_back_to_the_local_master() -> None:
    exe = require("mpiexec.mpich", "MPICH (Debian mpich)")
    env = clean_env()  # mpi4py importable, no MPI4PY_LIBMPI: the wheel would load Open MPI
    proc = run_group([exe, "-n", "2", *DEMO], timeout=100, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = check_demo(proc.stdout, 2, "mpich")
    assert rows[0][9].startswith("127.0.0.1:"), rows[0][9]
    warning = ("mpi4py would load the openmpi library but mpich started this process; "
               "not using it to find the master.")
    assert proc.stderr.count(warning) == 2, proc.stderr  # once per rank
    assert "export MPI4PY_LIBMPI=<dir>/libmpi.so.12" in proc.stderr


@pytest.mark.mpi
@pytest.mark.timeout(120)
def test_hpc_launcher_mpi4py_under_mpich_with_the_default_wheel_is_refused() -> None:
    """It used to run every process alone as rank 0 of 1 and exit 0."""
    exe = require("mpiexec.mpich", "MPICH (Debian mpich)")
    proc = run_group([exe, "-n", "2", *DEMO], timeout=100, cwd=ROOT,
                     env=clean_env(HPC_LAUNCHER="mpi4py"))
    assert proc.returncode != 0, proc.stdout
    assert "DEMO rank=" not in proc.stdout, proc.stdout
    assert proc.stderr.count("HPC_LAUNCHER=mpi4py but mpi4py cannot be imported or would "
                             "load another MPI library than mpich's.") == 2, proc.stderr
