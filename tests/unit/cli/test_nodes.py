"""``hpc nodes``: the ledger's strikes per host, which hosts the next submission
excludes, and clearing them (a real ledger in the test's HPC_STATE_DIR)."""

from __future__ import annotations

import time

import pytest

from hpc.cli import nodes
from hpc.cli.main import main as hpc_main
from hpc.ledger import Ledger


def _at(seconds_ago: float) -> Ledger:
    return Ledger(clock=lambda: time.time() - seconds_ago)


def _fill() -> None:
    _at(30 * 3600).add("node4", "slow compute on node4", "check")  # expired
    _at(3 * 3600).add("node3", "slow node node3", "check", "41")
    _at(60).add("node3", "straggler: node3 (rank 2) 3.1x the median", "straggler", "57")
    _at(30).add("node2", "slow compute on node2", "check")


def test_lists_live_strikes_per_host_and_the_hosts_excluded(
        capsys: pytest.CaptureFixture[str]) -> None:
    _fill()
    assert hpc_main(["nodes"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert "a strike counts 24 h, 2 exclude a host from hpc submit" in lines[0]
    row3 = next(ln for ln in lines if ln.startswith("node3"))
    assert row3.split()[1] == "2" and row3.endswith(
        "straggler  straggler: node3 (rank 2) 3.1x the median")
    assert next(ln for ln in lines if ln.startswith("node2")).split()[1:3] == ["1", "-"]
    assert "node4" not in out
    assert lines[-1] == "the next hpc submit excludes: node3"


def test_all_shows_expired_strikes(capsys: pytest.CaptureFixture[str]) -> None:
    _fill()
    assert nodes.main(["--all"]) == 0
    row4 = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("node4"))
    assert row4.split()[1] == "0" and row4.endswith("slow compute on node4 (expired)")


def test_clear_a_host_and_all(capsys: pytest.CaptureFixture[str]) -> None:
    _fill()
    assert nodes.main(["--clear", "node3", "--clear", "node9"]) == 0
    out = capsys.readouterr().out
    assert "cleared 2 strike(s) against node3" in out
    assert "no strikes against node9 (hosts in the ledger: node2, node4)" in out
    assert out.splitlines()[-1] == "the next hpc submit excludes: none"
    assert list(Ledger().live()) == ["node2"]
    assert nodes.main(["--clear-all"]) == 0
    assert "cleared 2 strike(s)" in capsys.readouterr().out
    assert Ledger().strikes(include_expired=True) == []


def test_an_empty_or_switched_off_ledger_says_so(monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    assert nodes.main([]) == 0
    assert capsys.readouterr().out.splitlines()[-2:] == [
        "no live strikes", "the next hpc submit excludes: none"]
    monkeypatch.setenv("HPC_LEDGER_TTL", "0")
    assert nodes.main([]) == 0
    assert "the ledger is off (HPC_LEDGER_TTL=0)" in capsys.readouterr().out
    monkeypatch.setenv("HPC_LEDGER_TTL", "1d")
    assert nodes.main([]) == 2
    assert "hpc nodes: HPC_LEDGER_TTL='1d' is not a number of seconds" in \
        capsys.readouterr().err
