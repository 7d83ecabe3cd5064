"""The torchrun attempt id on a real TCPStore kept across attempts, ranks as threads."""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist

from hpc.bootstrap import attempt
from hpc.bootstrap.preflight import preflight
from hpc.environments.base import DistInfo, free_port
from hpc.errors import RendezvousError


def _info(rank: int, ws: int, port: int) -> DistInfo:
    return DistInfo(launcher="torchrun", rank=rank, local_rank=0, world_size=ws,
                    local_world_size=1, master_addr="127.0.0.1", master_port=port)


def _attempt(port: int, counts: list[str], delay0: float = 0.0) -> list[Any]:
    """One torchrun attempt: preflight() of every rank against the agent's store, rank r
    with TORCHELASTIC_RESTART_COUNT=counts[r]; rank 0 starts ``delay0`` s late."""
    ws, out = len(counts), [None] * len(counts)

    def rank(r: int) -> None:
        env = {"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": counts[r]}
        if r == 0:
            time.sleep(delay0)
        try:
            store = preflight(_info(r, ws, port), 10.0, timedelta(seconds=10), env)
            out[r] = attempt.remembered(_info(r, ws, port)), store.get("hpc/pf/go")
        except Exception as e:  # noqa: BLE001 - the test inspects it
            out[r] = e

    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(ws)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return out


def test_restart_counts_that_differ_across_nodes_still_meet() -> None:
    port = free_port("127.0.0.1")
    agent = dist.TCPStore("127.0.0.1", port, None, True, timeout=timedelta(seconds=10),
                          wait_for_workers=False)  # the agents' store, kept across attempts
    assert _attempt(port, ["0", "0", "0"]) == [(1, b"ok")] * 3
    # node 2 failed: only its agent counts a restart; the others start late (rank 0 last,
    # so ranks 1 and 2 ask before rank 0 took the new attempt, and find stale keys)
    assert _attempt(port, ["0", "0", "1"], delay0=0.5) == [(2, b"ok")] * 3
    assert _attempt(port, ["1", "0", "2"]) == [(3, b"ok")] * 3
    del agent


def test_a_rank_without_a_rank_0_names_it() -> None:
    port = free_port("127.0.0.1")
    agent = dist.TCPStore("127.0.0.1", port, None, True, timeout=timedelta(seconds=5),
                          wait_for_workers=False)
    with pytest.raises(RendezvousError, match="rank 1: joined torchrun's store at 127.0.0.1:"
                       r"\d+, but rank 0 of this attempt never gave it the attempt id"):
        attempt.ask(agent, _info(1, 2, port), time.monotonic() + 0.3)
