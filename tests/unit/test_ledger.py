"""The bad-node ledger (:mod:`hpc.ledger`): strikes, expiry, clearing, concurrent writers
and a corrupt strike, on a real folder with an injected clock."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hpc import ledger
from hpc.ledger import STRIKES, Ledger
from tests.helpers.processes import clean_env, run_group

HOUR = 3600.0


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def book(tmp_path: Path, clock: Clock) -> Ledger:
    return Ledger(tmp_path / "bad-nodes", ttl=24 * HOUR, clock=clock)


def test_two_live_strikes_exclude_a_host_one_does_not(book: Ledger, clock: Clock) -> None:
    assert STRIKES == 2
    book.add("node3", "slow node node3: busbw 1 MB/s", "check", "11")
    assert book.excluded() == {}
    clock.now += HOUR
    book.add("node3", "straggler: node3 (rank 2) 3.1x the median", "straggler")
    book.add("node1", "slow compute on node1", "check")
    bad = book.excluded()
    assert list(bad) == ["node3"]
    assert [s.source for s in bad["node3"]] == ["check", "straggler"]
    assert bad["node3"][0].job == "11" and bad["node3"][1].job is None
    assert {h: len(ss) for h, ss in book.live().items()} == {"node3": 2, "node1": 1}


def test_an_expired_strike_is_ignored_but_listed_on_request(book: Ledger, clock: Clock) -> None:
    book.add("node3", "first", "check")
    clock.now += 23 * HOUR
    book.add("node3", "second", "check")
    assert list(book.excluded()) == ["node3"]
    clock.now += 2 * HOUR  # the first is 25 h old
    assert book.excluded() == {}
    assert [s.reason for s in book.live()["node3"]] == ["second"]
    assert [s.reason for s in book.strikes(include_expired=True)] == ["first", "second"]


def test_expired_strikes_are_deleted_a_week_after_they_expire(book: Ledger,
                                                              clock: Clock) -> None:
    book.add("node3", "old", "check")
    clock.now += 24 * HOUR + ledger.KEEP_EXPIRED_S + 1
    book.add("node4", "new", "check")
    assert [s.host for s in book.strikes(include_expired=True)] == ["node4"]
    assert len(list(book.root.glob("*.json"))) == 1


def test_clear_one_host_or_all(book: Ledger) -> None:
    for host in ("node3", "node3", "node2"):
        book.add(host, "x", "check")
    assert book.clear("node3") == 2
    assert list(book.live()) == ["node2"] and book.excluded() == {}
    assert book.clear("node9") == 0
    assert book.clear() == 1 and book.strikes(include_expired=True) == []


def test_a_corrupt_strike_is_skipped_with_a_warning_and_nothing_else_is_lost(
        book: Ledger, clock: Clock, caplog: pytest.LogCaptureFixture) -> None:
    book.add("node3", "one", "check")
    (book.root / "0000-garbage.json").write_text('{"host": "node3", "ti')
    (book.root / "0001-list.json").write_text('["not", "a strike"]')
    clock.now += 1
    book.add("node3", "two", "check")
    with caplog.at_level(logging.WARNING, logger="hpc.ledger"):
        assert [s.reason for s in book.excluded()["node3"]] == ["one", "two"]
    skipped = [r.getMessage() for r in caplog.records]
    assert len(skipped) == 2 and all("which is not a strike" in m for m in skipped), skipped


def test_no_strike_is_lost_to_concurrent_writers(tmp_path: Path) -> None:
    """Four processes add 50 strikes each at once: all 200 are there, each whole."""
    code = ("import sys\nfrom hpc.ledger import Ledger\nbook = Ledger(sys.argv[1], ttl=3600)\n"
            "for i in range(50):\n    book.add(f'node{i % 3}', f'writer {sys.argv[2]} #{i}', "
            "'test')\n")
    root = tmp_path / "bad-nodes"
    procs = [subprocess.Popen([sys.executable, "-c", code, str(root), str(w)],
                              env=clean_env(), start_new_session=True) for w in range(4)]
    try:
        assert [p.wait(timeout=120) for p in procs] == [0, 0, 0, 0]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    reasons = {s.reason for s in Ledger(root, ttl=3600).strikes()}
    assert reasons == {f"writer {w} #{i}" for w in range(4) for i in range(50)}
    assert not list(root.glob(".*.tmp"))


def test_strike_never_raises_and_respects_ttl_zero(tmp_path: Path,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    env = {"HPC_STATE_DIR": str(tmp_path), "SLURM_JOB_ID": "77"}
    made = ledger.strike(["node3", "node3", "node4"], "slow   node\nnode3", "check", env)
    assert [(s.host, s.reason, s.job) for s in made] == [("node3", "slow node node3", "77"),
                                                         ("node4", "slow node node3", "77")]
    assert len(Ledger(environ=env).live()) == 2
    assert ledger.strike(["node3"], "x", "check", {**env, "HPC_LEDGER_TTL": "0"}) == []
    blocked = tmp_path / "file"
    blocked.write_text("")
    with caplog.at_level(logging.WARNING, logger="hpc.ledger"):
        assert ledger.strike(["node3"], "x", "check", {"HPC_STATE_DIR": str(blocked)}) == []
        assert ledger.strike(["node3"], "x", "check", {"HPC_STATE_DIR": str(tmp_path),
                                                      "HPC_LEDGER_TTL": "1d"}) == []
    assert "could not record a strike against node3" in caplog.text
    assert "HPC_LEDGER_TTL='1d'" in caplog.text


def test_the_state_dir_defaults_under_home(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", "/home/someone")
    assert ledger.state_dir({}) == Path("/home/someone/.local/state/torch-hpc")
    assert Ledger(environ={}).root == Path("/home/someone/.local/state/torch-hpc/bad-nodes")
    assert Ledger(environ={}).ttl == 24 * HOUR
    assert ledger.state_dir({"HPC_STATE_DIR": "/shared/me"}) == Path("/shared/me")
    assert os.environ["HPC_STATE_DIR"]  # conftest: never the user's own ledger in tests


def test_the_exclusion_line_says_why_and_how_to_undo_it(book: Ledger, clock: Clock) -> None:
    book.add("node3", "slow node node3", "check")
    clock.now += 60
    book.add("node3", "straggler: node3 (rank 2)", "straggler")
    line = ledger.describe_exclusion("node3", book.excluded()["node3"], book.ttl)
    assert line == ("excluding node3 (2 strikes in 24 h from check, straggler, last: "
                    "straggler: node3 (rank 2); hpc nodes --clear node3 to allow it)")


def test_importing_the_ledger_imports_no_torch_and_touches_no_file(tmp_path: Path) -> None:
    proc = run_group([sys.executable, "-c", "import sys, hpc.ledger; "
                      "print('torch' in sys.modules)"], timeout=60,
                     env=clean_env(HPC_STATE_DIR=str(tmp_path / "s")))
    assert proc.stdout.strip() == "False", proc.stderr
    assert not (tmp_path / "s").exists()
