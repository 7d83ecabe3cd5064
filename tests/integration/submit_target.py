"""A user program for the ``hpc submit`` tests: ``-m tests.integration.submit_target ARGS``
and the function target ``tests.integration.submit_target:main``.

Every task all-reduces its rank and prints one line the test checks; the function
returns the same facts (rank 0's value is the job's result).
"""

from __future__ import annotations

import logging
import sys
from typing import Any


def main(*args: str) -> dict[str, Any]:
    """init_torch, all-reduce the ranks, print ``target rank r/w host sum=S args=A``."""
    import socket

    import torch
    import torch.distributed as dist

    import hpc

    info = hpc.init_torch(seed=0)
    hpc.setup_logging(info)  # as the docs' own scripts do: a root handler on stderr
    total = torch.tensor([float(info.rank)])
    dist.all_reduce(total)
    line = (f"target rank {info.rank}/{info.world_size} local {info.local_rank} "
            f"{socket.gethostname()} device {hpc.device()} sum={int(total.item())} "
            f"args={' '.join(args)}")
    print(line, flush=True)
    logging.getLogger("submit_target").info("logged by rank %d", info.rank)
    dist.destroy_process_group()
    return {"rank": info.rank, "world_size": info.world_size, "sum": int(total.item()),
            "args": list(args), "launcher": info.launcher}


if __name__ == "__main__":
    main(*sys.argv[1:])
