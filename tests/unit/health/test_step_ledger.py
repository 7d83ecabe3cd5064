""":class:`hpc.health.step.StepHealth` strikes in the bad-node ledger: a straggler verdict
that persists :data:`~hpc.health.step.STRIKE_AFTER` windows, once per host in a run of
several hosts, and a
corrupt replica, once per job; only the global master writes (the test's HPC_STATE_DIR)."""

from __future__ import annotations

import pytest

from hpc.health import divergence
from hpc.health.step import CLEAR_AFTER, STRIKE_AFTER, StepHealth
from hpc.health.straggler import Finding
from hpc.ledger import Ledger

SLOW = Finding("relative", (2, 3), 3.1, 0.0118, 0.68)


def _health(rank: int) -> StepHealth:
    h = StepHealth(rank, 4, environ={"HPC_STRAGGLER": "0"})
    h.hosts = ["node1", "node1", "node3", "node3"]
    return h


def _windows(h: StepHealth, verdicts: list[Finding], n: int) -> None:
    for _ in range(n):
        h._report(verdicts, 0, 19)


def test_a_persisting_straggler_strikes_its_host_once_per_run() -> None:
    """Two strikes in 24 h exclude a host from hpc submit: one run (a noisy machine's
    two episodes) must not give both."""
    assert STRIKE_AFTER == 3
    h = _health(0)
    _windows(h, [SLOW], STRIKE_AFTER - 1)
    assert Ledger().strikes() == []  # named, not yet persisting
    _windows(h, [SLOW], 1)
    (strike,) = Ledger().strikes()
    assert (strike.host, strike.source) == ("node3", "straggler")
    assert strike.reason == ("straggler: node3 (ranks 2-3) 3.1x the median compute time "
                             "(11.8 ms) over steps 0-19; others waited 68 % of the step")
    _windows(h, [SLOW], 5)
    assert len(Ledger().strikes()) == 1  # the same episode
    _windows(h, [], CLEAR_AFTER)  # cleared
    _windows(h, [SLOW], STRIKE_AFTER)  # a second episode in the same run
    assert [s.host for s in Ledger().strikes()] == ["node3"]
    assert list(Ledger().excluded()) == []


def test_a_job_on_one_host_gives_no_straggler_strike() -> None:
    """``hpc run --nproc 2`` on a loaded host: rank 0 1.8x the median of rank 1 names
    the host, but the ranks were only compared with each other (a CI run struck its
    machine twice that way)."""
    h = StepHealth(0, 2, environ={"HPC_STRAGGLER": "0"})
    h.hosts = ["vm", "vm"]
    _windows(h, [Finding("relative", (0,), 1.8, 0.01, 0.5)], STRIKE_AFTER + 2)
    assert Ledger().strikes() == []


def test_only_the_global_master_strikes() -> None:
    _windows(_health(1), [SLOW], STRIKE_AFTER + 2)
    assert Ledger().strikes() == []


def _mismatch(tied: bool = False) -> divergence.Mismatch:
    return divergence.Mismatch(40, (3,), ("node3",), ("fc.weight",), tied)


@pytest.mark.parametrize("rank, tied, struck", [(0, False, 1), (1, False, 0), (0, True, 0)])
def test_a_corrupt_replica_strikes_its_host_once_unless_the_side_is_a_guess(
        monkeypatch: pytest.MonkeyPatch, rank: int, tied: bool, struck: int) -> None:
    pytest.importorskip("torch")
    monkeypatch.setattr(divergence, "check", lambda *a, **k: _mismatch(tied))
    h = StepHealth(rank, 4, environ={"HPC_STRAGGLER": "0", "HPC_SDC": "warn"})
    h.check_replicas(40)
    h.check_replicas(140)  # HPC_SDC=warn: checked again, still the same corruption
    strikes = Ledger().strikes()
    assert len(strikes) == struck
    if struck:
        assert strikes[0].host == "node3" and strikes[0].source == "sdc"
        assert strikes[0].reason.startswith("silent corruption: after step 40 the "
                                            "replicated state of rank 3 on node3")
