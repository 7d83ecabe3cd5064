"""Teardown with real ranks over gloo: a failing rank aborts its process group."""

from __future__ import annotations

import pytest

from tests.helpers import hpc_run, script


@pytest.mark.timeout(90)
def test_failing_rank_aborts_its_group_and_the_clean_one_destroys_it() -> None:
    """On torch >= 2.6 destroy_process_group() flushes pending NCCL work and can hang a
    rank whose peers are gone (pytorch/pytorch#141510); a failing rank aborts instead."""
    proc = hpc_run(2, [script("exit_abort.py")], timeout=80)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert "DONE rank=0 sum=2.0" in out, out
    assert "TEARDOWN destroy rank=0" in out and "TEARDOWN abort rank=0" not in out, out
    assert "TEARDOWN abort rank=1" in out and "TEARDOWN destroy rank=1" not in out, out
    assert "rank 1 failing on purpose" in out, out
