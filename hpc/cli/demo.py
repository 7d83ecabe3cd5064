"""``hpc demo``: the smallest end-to-end check of a launch.

Every rank inits, all-reduces its rank + 1, and prints one line with its role; the sum
must be ``world_size * (world_size + 1) / 2``. Exit code 1 when it is not.
"""

from __future__ import annotations

import argparse
import socket
import sys
from typing import Any

from hpc._command import subcommand

__all__ = ["add_parser", "main"]


def _run(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist

    import hpc

    info = hpc.init_torch(backend=args.backend)
    value = torch.tensor([float(info.rank + 1)], device=hpc.device())
    dist.all_reduce(value)
    expected = info.world_size * (info.world_size + 1) / 2
    roles = [r for r, on in (("master", hpc.is_master()),
                             ("local-master", hpc.is_local_master())) if on]
    ok = value.item() == expected
    line = (f"DEMO rank={info.rank} world={info.world_size} local={info.local_rank}/"
          f"{info.local_world_size} node={info.node_rank}/{info.num_nodes} "
          f"host={socket.gethostname()} launcher={info.launcher} "
          f"master={info.master_addr}:{info.master_port} device={hpc.device()} "
          f"allreduce={value.item():g} expected={expected:g} "
          f"roles={','.join(roles) or 'worker'} {'OK' if ok else 'WRONG'}\n")
    sys.stdout.write(line)  # one write: lines of concurrent ranks never interleave
    sys.stdout.flush()
    return 0 if ok else 1


def add_parser(sub: Any) -> None:
    """Register ``hpc demo`` on the ``hpc`` subparsers ``sub``."""
    p = sub.add_parser("demo", help="init, all_reduce and print one line per rank",
                       description=__doc__)
    p.add_argument("--backend", default=None, help="nccl/gloo (default: auto)")
    p.set_defaults(func=_run)


main = subcommand(add_parser)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
