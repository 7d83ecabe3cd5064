"""The pre-flight on a real TCPStore, its ranks as threads of this process."""

from __future__ import annotations

import json
import threading
from datetime import timedelta
from typing import Any

import pytest

from hpc.bootstrap import interfaces
from hpc.bootstrap import preflight as preflight_module
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


def _run_nodes(reports: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch,
               backend: str = "gloo") -> list[Any]:
    """preflight() of one rank per node, rank r publishing ``reports[r]`` as its node's
    network (plain data); the ranks are threads of this process on a real TCPStore."""
    port = free_port("127.0.0.1")
    ws = len(reports)
    mine = {f"rank{r}": report for r, report in enumerate(reports)}
    monkeypatch.setattr(interfaces, "local_report",
                        lambda environ, pinned=None: dict(mine[threading.current_thread().name]))
    out: list[Any] = [None] * ws

    def rank(r: int) -> None:
        info = DistInfo(launcher="local", rank=r, local_rank=0, world_size=ws,
                        local_world_size=1, node_rank=r, num_nodes=ws,
                        master_addr="127.0.0.1", master_port=port)
        try:
            out[r] = preflight(info, 20.0, timedelta(minutes=1), {}, backend=backend)
        except Exception as e:  # noqa: BLE001 - the test inspects it
            out[r] = e

    threads = [threading.Thread(target=rank, args=(r,), name=f"rank{r}", daemon=True)
               for r in range(ws)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "preflight hung"
    return out


def _report(host: str, addrs: list[tuple[str, str, int]], resolved: str) -> dict[str, Any]:
    return {"host": host, "resolved": resolved, "addrs": addrs, "ifnames": {},
            "by_hand": False}


def test_a_routed_node_probes_the_masters_address_and_passes(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """node2 shares no subnet with the master, whose gloo address is not MASTER_ADDR
    (127.0.0.1 here): node2 connects to it (a real address of this host, where rank 0's
    store listens on every interface) and the run goes on."""
    own = interfaces.addresses()
    if not own:
        pytest.skip("this host has no non-loopback IPv4 address to stand for the master's")
    name, addr, prefix = own[0]
    master = _report("node1", [(name, addr, prefix)], addr)
    node2 = _report("node2", [("eth9", "10.99.0.2", 24)], "10.99.0.2")
    stores = _run_nodes([master, node2], monkeypatch)
    assert not any(isinstance(s, Exception) for s in stores), stores
    published = json.loads(stores[0].get("hpc/pf/net/1").decode())
    assert [(p["for"], p["addr"], p["error"]) for p in published["probes"]] == [
        ("gloo", addr, None)]


def test_a_failed_probe_stops_every_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(preflight_module, "_reach",
                        lambda addr, port, deadline: "[Errno 111] Connection refused")
    master = _report("node1", [("eth0", "10.1.0.11", 24)], "10.1.0.11")
    node2 = _report("node2", [("eth0", "10.2.0.12", 24)], "10.2.0.12")
    results = _run_nodes([master, node2], monkeypatch)
    for r, e in enumerate(results):
        assert isinstance(e, LaunchEnvironmentError), (r, e)
        assert "node2 cannot reach the master's gloo address 10.1.0.11" in str(e), e
        assert "Connection refused" in str(e)
    assert "rank 1: rank 0 aborted start-up" in str(results[1])


def test_on_one_node_no_network_report_is_published() -> None:
    """Every rank on this node: nothing crosses a network, nothing to check or probe."""
    stores = _run_ranks(["gloo", "gloo"], 20.0, timedelta(minutes=1))
    assert not any(isinstance(s, Exception) for s in stores), stores
    assert not stores[0].check(["hpc/pf/net/master"])
    assert int(stores[0].add("hpc/pf/net/n", 0)) == 0
