"""The pre-flight on a real TCPStore, its ranks as threads of this process."""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

from hpc.bootstrap.preflight import mixed_backend_error, preflight
from hpc.environments.base import DistInfo, free_port
from hpc.errors import LaunchEnvironmentError


def _run_ranks(backends: list[str | None], connect: float, pg_timeout: timedelta
               ) -> list[Any]:
    """preflight() of ``len(backends)`` ranks on 127.0.0.1; each slot: store or error."""
    port = free_port("127.0.0.1")
    ws = len(backends)
    out: list[Any] = [None] * ws

    def rank(r: int) -> None:
        info = DistInfo(launcher="local", rank=r, local_rank=r, world_size=ws,
                        local_world_size=ws, master_addr="127.0.0.1", master_port=port)
        try:
            out[r] = preflight(info, connect, pg_timeout, {}, backend=backends[r])
        except Exception as e:  # noqa: BLE001 - the test inspects it
            out[r] = e

    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(ws)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "preflight hung"
    return out


def test_store_timeout_is_reset_to_the_collective_timeout() -> None:
    """The worker's store was opened with what was left of a 20 s window; NCCL's unique
    id travels through it, so it must leave with the collective timeout (7 min)."""
    stores = _run_ranks([None, None, None], 20.0, timedelta(minutes=7))
    for s in stores:
        assert not isinstance(s, Exception), s
        assert s.timeout == timedelta(minutes=7)


def test_mixed_backends_fail_on_every_rank() -> None:
    """Rank 2 saw no GPU and fell back to gloo: every rank fails, naming it."""
    nccl = "cpu:gloo,cuda:nccl"
    results = _run_ranks([nccl, nccl, "gloo"], 20.0, timedelta(minutes=1))
    for r, e in enumerate(results):
        assert isinstance(e, LaunchEnvironmentError), (r, e)
        text = str(e)
        assert "different torch.distributed backends" in text, text
        assert "gloo: rank(s) 2 (" in text and f"{nccl}: rank(s) 0 (" in text, text
        assert "HINT" in text


def test_agreeing_backends_pass() -> None:
    stores = _run_ranks(["gloo", "gloo"], 20.0, timedelta(minutes=1))
    assert not any(isinstance(s, Exception) for s in stores), stores


def test_mixed_backend_error_lists_the_minority_last() -> None:
    ranks = [(r, "nccl", "gpu1", str(r)) for r in range(12)] + [(12, "gloo", "gpu2", None)]
    text = str(mixed_backend_error(ranks))
    assert text.index("nccl: rank(s) 0 (gpu1") < text.index("gloo: rank(s) 12 (gpu2")
    assert "and 4 more" in text and "CUDA_VISIBLE_DEVICES=None" in text
