"""torchrun --max-restarts after a failure on one node only (pytorch/pytorch#108158).

Two agents (``--nnodes=2``, c10d rendezvous on localhost), one worker each; the worker of
node 1 fails once after init. Only its agent counts a restart, so the second attempt
runs with ``TORCHELASTIC_RESTART_COUNT`` 1 on one node and 0 on the other, in the same
agent store as the first. Scoped by the local restart count, the ranks met under
different prefixes ("another process already joined", then a hang); scoped by the
attempt id they agree on (:mod:`hpc.bootstrap.attempt`), both agents succeed.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.paths import ROOT, script
from tests.helpers.processes import clean_env, kill_group
from tests.helpers.requires import require


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.timeout(150)
def test_restart_after_a_failure_on_one_node_meets_again(tmp_path: Path) -> None:
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or require(
        "torchrun", "torchrun (comes with torch)")
    port = _free_port()
    env = clean_env(FAIL_MARKER=str(tmp_path / "failed"), FAIL_GROUP_RANK="1",
                    HPC_CONNECT_TIMEOUT="40")
    argv = [torchrun, "--nnodes=2", "--nproc-per-node=1", "--max-restarts=1",
            "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=restart",
            "--monitor-interval=0.5", script("fail_once.py")]
    agents = [subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, env=env, cwd=ROOT, start_new_session=True)
              for _ in range(2)]
    outputs = []
    try:
        for proc in agents:
            outputs.append(proc.communicate(timeout=120)[0])
    except subprocess.TimeoutExpired:
        for proc in agents:
            kill_group(proc)
        outputs = [proc.communicate()[0] for proc in agents]
        pytest.fail("torchrun agents hung after the restart:\n" + "\n----\n".join(
            o[-3000:] for o in outputs))
    finally:
        for proc in agents:
            if proc.poll() is None:
                kill_group(proc)
    text = "\n----\n".join(outputs)
    assert [p.returncode for p in agents] == [0, 0], text[-6000:]
    assert "failing once" in text, text[-4000:]
    # the second attempt ran with different local restart counts, and both ranks met
    assert "node 1 restart count 1: sum 1" in text, text[-4000:]
    assert "node 0 restart count 0: sum 1" in text, text[-4000:]
    assert "already joined" not in text
