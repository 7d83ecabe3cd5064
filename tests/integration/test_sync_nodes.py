"""sync_gradients across nodes of the test cluster: node by node where it applies.

Each node of ``bin/hpc-testcluster`` is its own network namespace with its own
``/dev/shm``, so ranks on different nodes share no memory, as on a real cluster. With the
same number of ranks (2+) on every node the gradients are reduced inside each node
through shared memory and exchanged between nodes slice by slice
(:mod:`hpc.sync._nodes`, ``across_nodes=1`` in the RESULT lines): the script checks the
gradients against ``DDP(find_unused_parameters=True)`` every step (within rounding: the
sums run in another order) and the weights bitwise across ranks at the end. With
different rank counts per node every rank keeps the process group's transport
(``across_nodes=0``), and ``shm=True`` fails on every rank, saying why.
"""

from __future__ import annotations

import re
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers.paths import script
from tests.helpers.slurm import job_on_four, run, slurm_env

SYNC = script("sync_grads_vs_ddp.py")


@pytest.fixture
def job() -> Iterator[str]:
    """A unique job name on the 4-node partition; its jobs are cancelled afterwards."""
    yield from job_on_four("hpct-nodes")


def _srun(job: str, tmp: Path, layout: list[str], *args: str):  # type: ignore[no-untyped-def]
    return run(["srun", "-p", "four", *layout, sys.executable, str(SYNC), "--expect", "close",
                *args], job, tmp, slurm_env(), timeout=100)


@pytest.mark.slurm
@pytest.mark.timeout(150)
@pytest.mark.parametrize("layout,args,ranks,across", [
    (["-N2", "--ntasks-per-node=2"], [], 4, 1),
    (["-N2", "--ntasks-per-node=2"], ["--api", "backward", "--users"], 4, 1),
    (["-N2", "--ntasks-per-node=2"], ["--comm-dtype", "bfloat16", "--users"], 4, 1),
    (["-N4", "--ntasks-per-node=2"], ["--users"], 8, 1),
    (["-N2", "-n3"], [], 3, 0),  # 2 ranks on node1, 1 on node2: no node-by-node path
], ids=["2x2", "2x2-backward", "2x2-bf16", "4x2", "2+1-fallback"])
def test_sync_across_nodes(job: str, tmp_path: Path, layout: list[str], args: list[str],
                           ranks: int, across: int) -> None:
    proc = _srun(job, tmp_path, layout, *args)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    results = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ok")]
    assert len(results) == ranks, out
    for line in results:
        assert f"across_nodes={across}" in line, line
        assert f"shared_memory={across}" in line, line
        assert "bitwise_vs_ddp" in line


@pytest.mark.slurm
@pytest.mark.timeout(150)
def test_required_across_uneven_nodes_fails_on_every_rank(job: str, tmp_path: Path) -> None:
    proc = _srun(job, tmp_path, ["-N2", "-n3"], "--shm", "on")
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    said = set(re.findall(r"\[rank(\d)\]: hpc\.errors\.HPCError: sync_gradients: shm=True, "
                          r"but the shared-memory exchange across 2 nodes cannot be opened: "
                          r"the nodes run different numbers of ranks \(2, 1\)", out))
    assert said == {"0", "1", "2"}, out
    assert "--ntasks-per-node" in out


MODEL = script("sync_model_check.py")


@pytest.mark.slurm
@pytest.mark.timeout(150)
@pytest.mark.parametrize("layout,src,once", [
    (["-N2", "--ntasks-per-node=2"], 0, True),
    (["-N2", "--ntasks-per-node=2"], 3, True),   # local rank 1 of node2
    (["-N2", "-n3"], 2, False),                  # uneven nodes: gloo's flat broadcast
], ids=["2x2-src0", "2x2-src3", "2+1-src2"])
def test_sync_model_across_nodes(job: str, tmp_path: Path, layout: list[str], src: int,
                                 once: bool) -> None:
    """Every flag and bucket layout correct on every rank; a broadcast leaves the
    source's node once (two ranks on the other node: gloo's flat broadcast sends it
    twice) and a mean costs each node 1x its bytes (the flat ring: 1.5x), read from the
    nodes' interface counters."""
    proc = run(["srun", "-p", "four", *layout, sys.executable, str(MODEL), "--src", str(src),
                "--iface", "eth0"], job, tmp_path, slurm_env(), timeout=100)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert proc.stdout.count("RESULT ok") == (4 if once else 3), out
    m = re.search(r"RESULT bytes payload=(\d+) node1=(\d+) node2=(\d+)", proc.stdout)
    assert m, out
    payload, node1, node2 = map(int, m.groups())
    sender = node1 if src < 2 else node2
    assert max(node1, node2) == sender, out
    if once:
        assert payload <= sender < 1.1 * payload, out
    # the mean: node by node each node sends 2(N-1)/N = 1x the bytes; the flat ring 1.5x
    m = re.search(r"RESULT reduce_bytes payload=(\d+) node1=(\d+) node2=(\d+)", proc.stdout)
    assert m, out
    payload, node1, node2 = map(int, m.groups())
    if once:
        assert max(node1, node2) < 1.1 * payload, out


@pytest.mark.slurm
@pytest.mark.timeout(150)
def test_rank_frozen_before_the_exchange_is_named_and_the_job_ends(job: str,
                                                                   tmp_path: Path) -> None:
    """The node-by-node exchange runs on subgroups (not wrapped by the watchdog): it is
    counted as one world collective per step, so a rank asleep before it is named, and
    its subgroups inherit the world's 10 s timeout (torch's default for a new group is
    30 minutes), so the job ends."""
    env = slurm_env(HANG_OP="sync_gradients", HANG_RANK="3", HANG_STEP="20",
                    HANG_MODE="sleep", PG_TIMEOUT="10", HPC_HANG_TIMEOUT="5")
    start = time.monotonic()
    proc = run(["srun", "-p", "four", "-N2", "--ntasks-per-node=2", sys.executable,
                str(script("hang.py"))], job, tmp_path, env, timeout=120)
    elapsed = time.monotonic() - start
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert "UNREACHABLE" not in out
    assert re.search(r"rank 3 \(node2, pid \d+\) never entered sync_gradients across nodes "
                     r"#\d+: .* it is at hang\.py:\d+ in <module>", out), out
    assert re.search(r"sync_gradients across nodes #\d+ timed out \(reported by rank \d\)", out), out
    assert elapsed < 60, elapsed
