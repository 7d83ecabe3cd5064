"""The storage pre-flight on the 4-node test cluster (one rank per node, gloo, ``srun``).

Each node mounts a ``/dev/shm`` of its own (docs/testcluster.md), so a directory there is
really node-local: the check must fail on every rank within 5 s, naming node2-node4 (the
nodes that are not the master's) and the path, and leave no directory on any node. The
test's tmp dir (``/tmp``, which all node namespaces share, as every cluster test's output
does) must pass, three checks in a row, with no false alarm.

Run (2 shared cores: one heavy run at a time)::

    flock /tmp/hpc-heavy.lock python -m pytest tests/integration/test_storage_cluster.py
"""

from __future__ import annotations

import json
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.paths import script
from tests.helpers.slurm import FOUR, job_on_four, run, slurm_env

pytestmark = pytest.mark.slurm

CHECK = script("storage_preflight.py")
BUDGET_S = 5.0


@pytest.fixture
def job() -> Iterator[str]:
    yield from job_on_four("hpct-storage")


def _on_four(job: str, tmp: Path, *args: str) -> tuple[list[dict[str, Any]], str]:
    """The script on node1-node4 (one rank each): its STORAGE and LEFT rows, and the
    output. Every check must have answered within the budget on every rank."""
    proc = run(["srun", "-p", "four", "-N4", "--ntasks-per-node=1", sys.executable, CHECK,
                *args], job, tmp, slurm_env(), timeout=100)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    rows = [{"kind": line.split(" ", 1)[0], **json.loads(line.split(" ", 1)[1])}
            for line in proc.stdout.splitlines() if line.startswith(("STORAGE {", "LEFT {"))]
    checks = [r for r in rows if r["kind"] == "STORAGE"]
    assert {r["host"] for r in checks} == set(FOUR), out
    assert all(r["host"] == r["gethostname"] for r in checks), checks  # slurmd -N nodeX
    assert all(r["s"] < BUDGET_S for r in checks), [(r["host"], r["s"]) for r in checks]
    return rows, out


@pytest.mark.timeout(150)
def test_a_node_local_directory_fails_on_every_rank_naming_the_other_nodes(
        job: str, tmp_path: Path) -> None:
    ckpt = f"/dev/shm/hpc-test-ckpt-{uuid.uuid4().hex[:8]}"
    rows, out = _on_four(job, tmp_path, ckpt, str(1 << 20), "--remove")
    checks = [r for r in rows if r["kind"] == "STORAGE"]
    assert len(checks) == 4 and not any(r["ok"] for r in checks), out
    messages = {r["error"] for r in checks}
    assert len(messages) == 1, messages  # the same words on every rank
    msg = messages.pop()
    assert msg.startswith(f"checkpoint directory {ckpt} is not the same directory on every "
                          "node: the global master (node1) wrote a file there that these "
                          "ranks cannot read: node2, node3, node4 (ranks 1-3: No such file "
                          "or directory).\n"), msg
    assert "/dev/shm and $TMPDIR on a compute node are not shared" in msg
    assert "\nHINT: put the checkpoints on a filesystem every node mounts" in msg
    left = [r for r in rows if r["kind"] == "LEFT"]
    assert len(left) == 4 and not any(r["exists"] for r in left), left  # /dev/shm clean


@pytest.mark.timeout(150)
def test_a_shared_directory_passes_three_times_without_a_false_alarm(
        job: str, tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    rows, out = _on_four(job, tmp_path, str(ckpt), str(1 << 20), "--times", "3")
    assert len(rows) == 12, out
    assert [r for r in rows if not r["ok"]] == [], out
    assert all(r["hosts"] == list(FOUR) and r["fsync_s"] > 0 for r in rows), rows
    assert list(ckpt.iterdir()) == []  # every token removed
