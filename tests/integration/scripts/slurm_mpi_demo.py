"""An MPI program running the demo: ``srun --mpi=pmix|pmi2 python slurm_mpi_demo.py``.

MPI is initialised first (mpi4py), as a real MPI program does; then ``hpc demo`` runs
and one more line compares mpi4py's view with hpc's and names the launcher variables
the process got (direct launch: no ``OMPI_COMM_WORLD_*``, no ``MPI_LOCALRANKID``).
"""

import os
import sys

from mpi4py import MPI

import hpc
from hpc.cli.demo import main

MARKERS = ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK", "MPI_LOCALRANKID")

code = main()
comm = MPI.COMM_WORLD
present = ",".join(k for k in MARKERS if k in os.environ) or "none"
sys.stdout.write(f"MPI comm_rank={comm.Get_rank()} comm_size={comm.Get_size()} "
                 f"hpc_rank={hpc.get_rank()} vars={present}\n")
sys.stdout.flush()
sys.exit(code)
