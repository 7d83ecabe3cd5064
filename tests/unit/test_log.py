"""hpc.setup_logging: who logs INFO to the console, and with which prefix."""

from __future__ import annotations

import io
import logging
import sys
from pathlib import Path

import pytest

from hpc.environments.base import DistInfo
from hpc.log import setup_logging


def _info(rank: int, local_rank: int) -> DistInfo:
    return DistInfo(launcher="slurm", rank=rank, local_rank=local_rank, world_size=4,
                    local_world_size=2, node_rank=rank // 2, num_nodes=2,
                    master_addr="node1", master_port=15000)


def _console(monkeypatch: pytest.MonkeyPatch, info: DistInfo, **kwargs: object) -> str:
    stream = io.StringIO()
    monkeypatch.setattr(sys, "stderr", stream)
    log = setup_logging(info, logger_name="hpc.test.log", **kwargs)
    try:
        logging.getLogger("hpc.test.log.x").info("epoch 1 done")
        logging.getLogger("hpc.test.log.x").warning("slow rank")
    finally:
        setup_logging(info, logger_name="hpc.test.log", environ={})
        for h in list(log.handlers):
            log.removeHandler(h)
    return stream.getvalue()


@pytest.mark.parametrize(("rank", "local", "local_info", "global_info"), [
    (0, 0, True, True), (2, 0, True, False), (3, 1, False, False)])
def test_console_local_or_global_master(monkeypatch: pytest.MonkeyPatch, rank: int,
                                        local: int, local_info: bool,
                                        global_info: bool) -> None:
    out = _console(monkeypatch, _info(rank, local), environ={})
    assert ("epoch 1 done" in out) is local_info and "slow rank" in out
    out = _console(monkeypatch, _info(rank, local), console="global", environ={})
    assert ("epoch 1 done" in out) is global_info and "slow rank" in out
    out = _console(monkeypatch, _info(rank, local), environ={"HPC_LOG_CONSOLE": "global"})
    assert ("epoch 1 done" in out) is global_info


def test_console_choice_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match=r"(?s)HPC_LOG_CONSOLE='node' .*not one of local, global\.\n.*HINT:"):
        _console(monkeypatch, _info(0, 0), environ={"HPC_LOG_CONSOLE": "node"})


def test_one_rank_prefix_under_hpc_run(monkeypatch: pytest.MonkeyPatch) -> None:
    out = _console(monkeypatch, _info(0, 0), environ={})
    assert "[rank 0/4 " in out
    out = _console(monkeypatch, _info(0, 0), environ={"HPC_RUN_PREFIXED": "1"})
    assert "epoch 1 done" in out and "[rank" not in out


@pytest.mark.parametrize("how", ["env", "argument"])
def test_every_rank_writes_its_own_log_in_the_run_directory(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, how: str) -> None:
    run_dir = tmp_path / "run"
    for rank, local in ((0, 0), (3, 1)):
        kwargs = {"environ": {"HPC_LOG_DIR": str(run_dir)}} if how == "env" else \
            {"environ": {}, "rank_log_dir": run_dir}
        _console(monkeypatch, _info(rank, local), **kwargs)
    mine = (run_dir / "rank3.log").read_text()
    # rank 3 is no local master: no INFO on the console, but all of it in its own file
    assert "[rank 3/4 " in mine and "INFO hpc.test.log.x: epoch 1 done" in mine
    assert "WARNING hpc.test.log.x: slow rank" in mine and "rank 0/4" not in mine
    assert "[rank 0/4 " in (run_dir / "rank0.log").read_text()
    assert sorted(p.name for p in run_dir.iterdir()) == ["rank0.log", "rank3.log"]


def test_no_rank_log_without_a_run_directory(monkeypatch: pytest.MonkeyPatch,
                                             tmp_path: Path) -> None:
    monkeypatch.chdir(tmp_path)
    _console(monkeypatch, _info(1, 1), environ={"HPC_LOG_DIR": "x"}, rank_log_dir="")
    assert not list(tmp_path.iterdir())
