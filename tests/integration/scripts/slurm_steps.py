"""One of two srun steps of a job that must run at the same time.

Usage: ``srun ... python slurm_steps.py MARKDIR NAME OTHER``. After init, rank 0 (which
holds the step's store on the derived master port) creates ``MARKDIR/NAME`` and waits
until ``MARKDIR/OTHER`` exists, so both steps' stores are open at once; then every rank
all-reduces and prints one ``STEP`` line with the master it used.
"""

import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import hpc

markdir, name, other = sys.argv[1:4]
info = hpc.init_torch()
if info.rank == 0:
    Path(markdir, name).touch()
    deadline = time.monotonic() + 40
    while not Path(markdir, other).exists():
        if time.monotonic() > deadline:
            print(f"STEP name={name}: step {other} never started beside us", flush=True)
            sys.exit(2)
        time.sleep(0.05)
    overlap = "yes"
else:
    overlap = "n/a"
t = torch.tensor([float(info.rank + 1)])
dist.all_reduce(t)
sys.stdout.write(f"STEP name={name} step={os.environ['SLURM_STEP_ID']} rank={info.rank} "
                 f"world={info.world_size} master={info.master_addr}:{info.master_port} "
                 f"sum={t.item():g} overlap={overlap}\n")
sys.stdout.flush()
