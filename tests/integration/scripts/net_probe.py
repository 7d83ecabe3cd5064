"""init_torch over gloo, one all_reduce, then one line per rank: the interface variables
as init left them and the interfaces this node has (for the network tests)."""

from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist

import hpc
from hpc.bootstrap import interfaces

info = hpc.init_torch(backend="gloo", timeout=30)
t = torch.ones(1) * (info.rank + 1)
dist.all_reduce(t)
names = ",".join(n for n, _, _ in interfaces.addresses())
print(f"net rank={info.rank} host={socket.gethostname()} sum={int(t.item())} "
      f"GLOO_SOCKET_IFNAME={os.environ.get('GLOO_SOCKET_IFNAME', '-')} "
      f"NCCL_SOCKET_IFNAME={os.environ.get('NCCL_SOCKET_IFNAME', '-')} ifaces={names}",
      flush=True)
