"""hpc.setup_logging: who logs INFO to the console, and with which prefix."""

from __future__ import annotations

import io
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from hpc.environments.base import DistInfo
from hpc.log import setup_logging
from tests.helpers.paths import ROOT
from tests.helpers.processes import clean_env


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


# --- init_torch before setup_logging (issue 30): its start-up lines are replayed ------

DOCUMENTED_ORDER = """import logging, hpc
info = hpc.init_torch()
{setup}
logging.getLogger("script").warning("script's first line")
"""


def _script(tmp_path: Path, setup: str, **env: str) -> str:
    """stderr of a one-process script calling init_torch, then ``setup``."""
    proc = subprocess.run([sys.executable, "-c", DOCUMENTED_ORDER.format(setup=setup)],
                          capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env=clean_env(PYTHONPATH=str(ROOT), HPC_LOG_DIR=str(tmp_path),
                                        **env))
    assert proc.returncode == 0, proc.stderr
    return proc.stderr


def test_init_lines_are_replayed_by_setup_logging_after_init(tmp_path: Path) -> None:
    """The documented order (init_torch, then setup_logging): before the fix the
    'initialised ...' line was dropped."""
    err = _script(tmp_path, "hpc.setup_logging(info)").splitlines()
    init = [i for i, line in enumerate(err)
            if "INFO hpc.bootstrap.distributed: initialised local rank 0/1" in line]
    mine = [i for i, line in enumerate(err) if "script's first line" in line]
    assert len(init) == 1 and len(mine) == 1 and init[0] < mine[0], err
    assert "[rank 0/1 " in err[init[0]]  # through setup_logging's own format
    rank_log = (tmp_path / "rank0.log").read_text()
    assert rank_log.index("initialised local rank 0/1") < rank_log.index("script's first")


def test_held_warning_is_shown_once(tmp_path: Path) -> None:
    """A warning of init is printed when it happens (as before) and not again by the
    replay; the rank's file gets it too."""
    gpus = dict(CUDA_VISIBLE_DEVICES="0,1", HPC_ALLOW_CPU="1")
    for setup in ("hpc.setup_logging(info)", "pass"):
        err = _script(tmp_path, setup, **gpus)
        assert err.count("training on the CPU, as HPC_ALLOW_CPU=1 asks") == 1, err
    assert "initialised" not in err  # no setup_logging: INFO stays silent, as before
    assert "HPC_ALLOW_CPU=1 asks" in (tmp_path / "rank0.log").read_text()


def test_nothing_held_when_logging_is_configured(tmp_path: Path) -> None:
    """logging.basicConfig before init_torch: the records go there, live, once."""
    code = ("import logging; logging.basicConfig(level=logging.INFO)\n"
            "import hpc; info = hpc.init_torch(); hpc.setup_logging(info)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, cwd=ROOT, env=clean_env(PYTHONPATH=str(ROOT)))
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.count("initialised local rank 0/1") == 1, proc.stderr
    assert "INFO:hpc.bootstrap.distributed:initialised" in proc.stderr  # basicConfig's
