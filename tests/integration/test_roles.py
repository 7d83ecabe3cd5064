"""Roles, rank-aware logging and `hpc env --all` with real processes."""

from __future__ import annotations

import sys

import pytest

from tests.helpers.paths import ROOT, script
from tests.helpers.processes import clean_env, hpc_run, run_group

pytestmark = pytest.mark.background  # see setup.cfg


@pytest.mark.timeout(120)
def test_logging_and_master_only(tmp_path) -> None:
    log_file = tmp_path / "run.log"
    proc = hpc_run(3, [script("log_roles.py"), str(log_file)], timeout=100)
    assert proc.returncode == 0, proc.stderr
    err = proc.stderr.splitlines()
    # INFO only from the local master (all ranks share this node), WARNING from all; on
    # the console under hpc run each line carries hpc run's [rank r] prefix only.
    infos = [line for line in err if "INFO roles: info line" in line]
    assert len(infos) == 1 and infos[0].startswith("[rank 0] ")
    assert all(line.count("[rank ") == 1 for line in infos)
    warns = [line for line in err if "WARNING roles: warning line" in line]
    assert sorted(line.split("]")[0] for line in warns) == ["[rank 0", "[rank 1", "[rank 2"]
    assert all(line.count("[rank ") == 1 for line in warns)
    # The file belongs to the global master: its own lines only.
    text = log_file.read_text()
    assert "info line from rank 0" in text and "rank 1" not in text and "rank 2" not in text
    assert "[rank 0/3 " in text  # the file keeps the full [rank r/w host] prefix
    assert (tmp_path / "run.log.marker").read_text() == "0\n"
    results = sorted(line.split("MARKER ")[1] for line in proc.stdout.splitlines()
                     if "MARKER" in line)
    assert results == ["rank=0 result=written", "rank=1 result=None", "rank=2 result=None"]


@pytest.mark.timeout(120)
def test_env_all_gathers_every_rank() -> None:
    proc = hpc_run(3, [sys.executable, "-m", "hpc", "env", "--all"], timeout=100)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "3 ranks, 1 hosts, no mismatches" in proc.stdout
    table = [line for line in proc.stdout.splitlines() if "hpc-run" in line]
    assert len(table) == 3


def test_import_has_no_side_effects() -> None:
    code = ("import logging, sys; import hpc; "
            "assert 'torch' not in sys.modules, 'hpc imported torch'; "
            "assert not logging.getLogger().handlers, 'hpc added handlers'; "
            "import hpc.environments, hpc.launch, hpc.cli.main; "
            "assert 'torch' not in sys.modules; print('clean')")
    proc = run_group([sys.executable, "-c", code], timeout=60, env=clean_env(), cwd=ROOT)
    assert proc.returncode == 0 and "clean" in proc.stdout, proc.stderr
