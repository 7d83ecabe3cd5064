"""The pre-flight's one-GPU-per-rank check with made-up GPU identities (runs on CPU).

Every rank joins the real pre-flight store with a :class:`hpc.bootstrap.gpubind.GpuClaim`:
``--same`` claims one GPU on every rank (the one-GPU machine under ``hpc run --nproc 2``),
``--distinct`` one GPU per rank. Prints ``RESULT ok`` when the pre-flight passed,
``RESULT raised <type>`` (exit 3) when it refused.

Usage: gpu_claims.py --same|--distinct
"""

from __future__ import annotations

import os
import socket
import sys
from datetime import timedelta

from hpc.bootstrap.gpubind import GpuClaim
from hpc.bootstrap.master import resolve_master
from hpc.bootstrap.preflight import preflight
from hpc.environments import detect
from hpc.errors import HPCError


def main() -> int:
    same = sys.argv[1:] == ["--same"]
    info = resolve_master(detect(), os.environ)
    uuid = "GPU-0f0e0d0c-fake" if same else f"GPU-0f0e0d0c-fake-{info.local_rank}"
    claim = GpuClaim(rank=info.rank, local_rank=info.local_rank, host=socket.gethostname(),
                     index=0, uuid=uuid, name="Fake GPU 80GB",
                     visible=os.environ.get("CUDA_VISIBLE_DEVICES"))
    try:
        store = preflight(info, 30.0, timedelta(seconds=30), gpu=claim)
    except HPCError as e:
        print(f"RESULT raised {type(e).__name__} rank={info.rank}", flush=True)
        print(f"{type(e).__name__}: {e}", file=sys.stderr, flush=True)
        return 3
    print(f"RESULT ok rank={info.rank}", flush=True)
    # Rank 0 serves the store: it leaves last, once every rank has read its verdict.
    if store.add("test/done", 1) == info.world_size:
        store.set("test/all-done", "1")
    if info.rank == 0:
        store.wait(["test/all-done"], timedelta(seconds=30))
    return 0


if __name__ == "__main__":
    sys.exit(main())
