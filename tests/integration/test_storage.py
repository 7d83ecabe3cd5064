"""The storage pre-flight with two real ranks under ``hpc run`` (gloo): a shared directory
passes; a tmpfs nearly full (mounted by the test, root) and a directory that rank 1 sees
in a ``/dev/shm`` of its own (a mount namespace, as in a per-rank container) are refused
on both ranks with one message. Each check must answer within 5 s on every rank.

The same on the 4-node test cluster, where /dev/shm is each node's own:
``tests/integration/test_storage_cluster.py``.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.paths import script
from tests.helpers.processes import hpc_run
from tests.helpers.tmpfs import nearly_full_tmpfs

CHECK = script("storage_preflight.py")
BUDGET_S = 5.0


def checks(out: str, ranks: int, times: int = 1) -> list[dict[str, Any]]:
    """The ``STORAGE`` rows the script printed (after ``hpc run``'s ``[rank r]`` prefix),
    asserting one per rank and check, each within the budget."""
    rows = [json.loads(line.split("STORAGE ", 1)[1]) for line in out.splitlines()
            if "STORAGE {" in line]
    assert sorted(r["rank"] for r in rows) == sorted(list(range(ranks)) * times), out
    assert all(r["s"] < BUDGET_S for r in rows), [r["s"] for r in rows]
    return rows


def refused_alike(out: str, ranks: int) -> str:
    """The one message every rank was refused with."""
    rows = checks(out, ranks)
    assert not any(r["ok"] for r in rows), out
    messages = {r["error"] for r in rows}
    assert len(messages) == 1, messages
    return messages.pop()


@pytest.mark.timeout(120)
def test_a_shared_directory_passes_on_both_ranks(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    proc = hpc_run(2, [CHECK, str(ckpt), str(1 << 20), "--times", "3"], timeout=100)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    rows = checks(out, 2, times=3)
    assert all(r["ok"] and r["error"] is None and r["fsync_s"] > 0 for r in rows), out
    assert list(ckpt.iterdir()) == []  # no token left


@pytest.mark.timeout(120)
def test_a_nearly_full_filesystem_is_refused_on_both_ranks_alike(tmp_path: Path) -> None:
    with nearly_full_tmpfs(tmp_path / "fs", size_mib=8, fill_mib=6) as fs:
        proc = hpc_run(2, [CHECK, str(fs / "ckpt"), str(4 << 20)], timeout=100)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    msg = refused_alike(out, 2)
    assert msg.startswith(f"checkpoint directory {fs / 'ckpt'} has too little room: "), msg
    assert " MiB free, needs 8.0 MiB.\n" in msg and "\nHINT: " in msg, msg


@pytest.mark.timeout(120)
def test_a_directory_rank_1_sees_in_its_own_dev_shm_is_refused_naming_rank_1() -> None:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare(1) to give rank 1 a /dev/shm of its own")
    ckpt = f"/dev/shm/hpc-test-ckpt-{uuid.uuid4().hex[:8]}"
    try:
        proc = hpc_run(2, [script("own_dev_shm.sh"), sys.executable, CHECK, ckpt, "1",
                           "--remove"], timeout=100)
    finally:
        shutil.rmtree(ckpt, ignore_errors=True)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    msg = refused_alike(out, 2)
    assert msg.startswith(f"checkpoint directory {ckpt} is not the same directory on "
                          "every node: "), msg
    assert "cannot read: " in msg and "(rank 1: No such file or directory).\n" in msg, msg
    assert "(rank 0" not in msg and "\nHINT: put the checkpoints on a filesystem" in msg
