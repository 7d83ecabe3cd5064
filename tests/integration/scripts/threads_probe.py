"""Print what init_torch gave this rank: ``THREADS rank=R cpus=N threads=T omp=O``.

``cpus`` is ``len(os.sched_getaffinity(0))`` (what srun's task/affinity bound), ``threads``
is ``torch.get_num_threads()`` after ``hpc.init_torch()``.
"""

import os

import torch

import hpc

info = hpc.init_torch()
print(f"THREADS rank={info.rank} cpus={len(os.sched_getaffinity(0))} "
      f"threads={torch.get_num_threads()} omp={os.environ.get('OMP_NUM_THREADS')}", flush=True)
