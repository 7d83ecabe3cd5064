"""``hpc check`` on real processes: ``hpc run``, Open MPI's ``mpirun``, and ``srun`` on the
4-node test cluster, healthy, with node3's link throttled by ``tc`` (tbf, 50 Mbit/s), and
with only the link node3 -> node4 throttled (htb with a u32 filter on node4's address).

The throttled run is the issue's test: non-zero exit, the verdict naming node3 and no
other node. On this machine the veth links carry ~0.3-0.6 GB/s and the throttled pairs
~0.006 GB/s (100x), far outside the 0.5x threshold, so the noise of the shared 2 cores
does not decide the outcome.

Run (2 shared cores: one heavy run at a time)::

    flock /tmp/hpc-heavy.lock python -m pytest tests/integration/test_check.py
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from hpc.ledger import Ledger
from tests.helpers.mpi import launcher
from tests.helpers.paths import ROOT
from tests.helpers.processes import hpc_run, run_group
from tests.helpers.requires import require
from tests.helpers.slurm import FOUR as NODES
from tests.helpers.slurm import job_on_four, run, slurm_env

pytestmark = pytest.mark.alone  # see setup.cfg

CHECK = ["python", "-m", "hpc", "check"]


def verdict(out: str) -> str:
    lines = [line for line in out.splitlines() if "VERDICT:" in line]
    assert len(lines) == 1, out  # the master alone prints it
    return lines[0].split("VERDICT:", 1)[1].strip()


@pytest.mark.timeout(120)
def test_hpc_run_two_ranks_healthy(tmp_path: Path) -> None:
    proc = hpc_run(2, [*CHECK, "--out", str(tmp_path)], timeout=100)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert verdict(proc.stdout).startswith("OK: 2 ranks, 1 pairs, no outliers"), proc.stdout
    assert re.search(r"rank 0 \(\S+\) rank 1 \(\S+\)\s+2\s+[\d.]+\s+[\d.]+", proc.stdout)
    data = json.loads((tmp_path / "hpc-check.json").read_text())
    assert [r["rank"] for r in data["ranks"]] == [0, 1] and data["findings"] == []
    assert all(r["gemm"] > 1e8 and r["copy"] > 1e7 for r in data["ranks"]), data["ranks"]
    assert data["ring"]["ranks"] == 2 and data["pairs"][0]["busbw"] > 0
    assert (tmp_path / "hpc-check.png").stat().st_size > 1000


@pytest.mark.mpi
@pytest.mark.timeout(120)
def test_mpirun_three_ranks(tmp_path: Path) -> None:
    prefix, env = launcher("openmpi", tmp_path, 3, with_mpi4py=True)
    # 3 ranks on this machine's 2 cores time their GEMM and copy at the same time: one is
    # always short of a core. A clean CI run flagged rank 0's copy at 0.46x the median
    # (twice timed) with the default --threshold 0.5; this test is about mpirun's 3 ranks
    # and 3 pairs, so it leaves the oversubscribed compute figures more room.
    proc = run_group([*prefix, sys.executable, "-m", "hpc", "check", "--serial",
                      "--threshold", "0.3", "--out", str(tmp_path)], timeout=100, env=env,
                     cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert verdict(proc.stdout).startswith("OK: 3 ranks, 3 pairs"), proc.stdout
    data = json.loads((tmp_path / "hpc-check.json").read_text())
    assert len(data["pairs"]) == 3 and data["settings"]["serial"] is True


# -- the 4-node cluster -------------------------------------------------------------------

def _srun_check(job: str, tmp: Path) -> subprocess.CompletedProcess[str]:
    return run(["srun", "-p", "four", "-N4", "--ntasks-per-node=1", sys.executable, "-m", "hpc",
                "check", "--out", str(tmp)], job, tmp, slurm_env(), timeout=100)


@pytest.fixture
def job() -> Iterator[str]:
    """A unique job name on the 4-node partition; its jobs are cancelled afterwards."""
    yield from job_on_four("hpct-check")


@pytest.mark.slurm
@pytest.mark.timeout(120)
def test_four_nodes_healthy(job: str, tmp_path: Path) -> None:
    proc = _srun_check(job, tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert verdict(proc.stdout).startswith("OK: 4 nodes, 6 pairs, no outliers"), proc.stdout
    assert [r["host"] for r in json.loads((tmp_path / "hpc-check.json").read_text())["ranks"]] \
        == list(NODES)
    assert Ledger().strikes() == []  # a healthy node never enters the bad-node ledger


def _tc(action: str, *qdisc: str, what: str = "qdisc") -> subprocess.CompletedProcess[str]:
    """``tc WHAT ACTION dev eth0 [root] ...`` inside node3's network namespace."""
    where = ["root"] if what == "qdisc" else []
    return subprocess.run(["ip", "netns", "exec", "hpc-node3", "tc", what, action, "dev",
                           "eth0", *where, *qdisc], check=False, capture_output=True,
                          text=True, timeout=20)


def _check_shaped(job: str, tmp_path: Path, steps: list[tuple[str, list[str]]]
                  ) -> subprocess.CompletedProcess[str]:
    """Apply ``tc`` ``steps`` ((what, args) pairs) to node3's eth0, run the 4-node check,
    and remove the shaping again whatever happened."""
    require("tc", "iproute2's tc")
    _tc("del")  # a leftover from a killed run
    try:
        for what, args in steps:
            added = _tc(args[0], *args[1:], what=what)
            assert added.returncode == 0, (what, args, added.stderr)
        proc = _srun_check(job, tmp_path)
    finally:
        removed = _tc("del")
    assert removed.returncode == 0, removed.stderr
    return proc


@pytest.mark.slurm
@pytest.mark.timeout(150)
def test_four_nodes_throttled_node3_is_named_alone(job: str, tmp_path: Path) -> None:
    proc = _check_shaped(job, tmp_path, [
        ("qdisc", ["add", "tbf", "rate", "50mbit", "burst", "64kb", "latency", "50ms"])])
    assert proc.returncode == 1, proc.stdout + proc.stderr
    line = verdict(proc.stdout)
    assert line.startswith("FLAGGED node3: slow node node3: busbw of all its 3 pairs"), line
    assert not any(n in line for n in NODES if n != "node3"), line
    # Flagged by the rounds, then timed again alone, and still slow: that is what counts.
    assert "timed again alone, as the rounds flagged them" in proc.stdout, proc.stdout
    pairs = json.loads((tmp_path / "hpc-check.json").read_text())["pairs"]
    again = {(p["a"], p["b"]) for p in pairs if "alone" in p}
    assert again >= {("node1", "node3"), ("node2", "node3"), ("node3", "node4")}, pairs
    assert all(p["alone"]["busbw"] < 0.02e9 for p in pairs if "node3" in (p["a"], p["b"]))
    # the master, on node1, struck node3 once in the test's own ledger (HPC_STATE_DIR)
    (strike,) = Ledger().strikes()
    assert (strike.host, strike.source) == ("node3", "check") and str(strike.job).isdigit()
    assert strike.reason.startswith("slow node node3: busbw of all its 3 pairs"), strike


def _node_address(node: str) -> str:
    out = subprocess.run(["ip", "netns", "exec", f"hpc-{node}", "ip", "-4", "-o", "addr",
                          "show", "dev", "eth0"], check=True, capture_output=True, text=True,
                         timeout=20).stdout
    return out.split(" inet ", 1)[1].split("/", 1)[0]


@pytest.mark.slurm
@pytest.mark.timeout(150)
def test_four_nodes_one_slow_link_is_told_from_a_slow_node(job: str, tmp_path: Path) -> None:
    """Only node3 -> node4 at 50 Mbit/s (htb: a fast default class, a slow one that a u32
    filter picks for node4's address): the pair node3-node4 is slow, node3's other two
    pairs and node4's other two are not, so the verdict is one slow link, no slow node."""
    proc = _check_shaped(job, tmp_path, [
        ("qdisc", ["add", "handle", "1:", "htb", "default", "10"]),
        ("class", ["add", "parent", "1:", "classid", "1:10", "htb", "rate", "10gbit"]),
        ("class", ["add", "parent", "1:", "classid", "1:20", "htb", "rate", "50mbit"]),
        ("filter", ["add", "parent", "1:", "protocol", "ip", "prio", "1", "u32", "match",
                    "ip", "dst", f"{_node_address('node4')}/32", "flowid", "1:20"])])
    assert proc.returncode == 1, proc.stdout + proc.stderr
    line = verdict(proc.stdout)
    assert line.startswith("FLAGGED node3, node4: slow link node3-node4: busbw"), line
    assert "slow node" not in line and "node1" not in line and "node2" not in line, line
    assert Ledger().strikes() == []  # either end of a slow link may be fine: no strike
