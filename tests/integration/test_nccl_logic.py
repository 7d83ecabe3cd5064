"""The NCCL path's CPU-testable logic with real ranks over gloo: a failing rank aborts
its process group; a rank without a GPU is refused in the pre-flight."""

from __future__ import annotations

import pytest

from tests.helpers.paths import script
from tests.helpers.processes import hpc_run

pytestmark = pytest.mark.background  # see setup.cfg


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


@pytest.mark.timeout(90)
def test_a_rank_without_a_gpu_is_refused_on_every_rank() -> None:
    """The backend is agreed in the pre-flight: real ranks, real TCPStore."""
    proc = hpc_run(3, [script("mixed_backend.py")], timeout=80)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "UNREACHABLE" not in out, out
    assert "ranks picked different torch.distributed backends" in out, out
    assert "cpu:gloo,cuda:nccl: rank(s) 0 (" in out and "gloo: rank(s) 2 (" in out, out
    print(out)
