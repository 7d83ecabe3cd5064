"""Exact resume for the scripts users write (issue #27 item 5), on 4 real ranks.

``scripts/resume_exact.py`` is such a script: a CNN with BatchNorm and dropout, Adam +
StepLR, gradient accumulation, ``AgreedStop(every=4)`` and a shuffled
``ResumableSampler``. Each test runs it uninterrupted, then with SIGTERM to rank 2 only
after step 6 (every rank stops at the agreed step 8 and the master checkpoints) and a
rerun that resumes; then compares, rank by rank, the weights and buffers and the
rank's own loss history (``rank_extra``) with the uninterrupted run's.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.helpers.paths import script
from tests.helpers.processes import clean_env, hpc_run

pytestmark = [pytest.mark.timeout(150), pytest.mark.background]  # see setup.cfg

NPROC = 4
DONE = re.compile(r"rank (\d): done step (\d+) digest (\w+) history (\w+)")
ENV = {"HPC_ALLOW_CPU": "1", "OMP_NUM_THREADS": "1"}


def _run(out: Path, *args: str) -> str:
    proc = hpc_run(NPROC, [script("resume_exact.py"), "--out", str(out), *args],
                   timeout=90, env=clean_env(**ENV))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout + proc.stderr


def _finals(text: str) -> dict[int, tuple[str, str, str]]:
    """rank -> (step, digest, history digest) of every rank's last line."""
    rows = {int(r): (s, d, h) for r, s, d, h in DONE.findall(text)}
    assert sorted(rows) == list(range(NPROC)), text
    return rows


def uninterrupted_and_resumed(tmp_path: Path, *args: str) -> tuple[dict, dict, str]:
    """(reference finals, resumed finals, the resumed run's output)."""
    ref = _finals(_run(tmp_path / "reference", *args))
    stopped = _run(tmp_path / "run", *args, "--kill-at", "6", "--kill-rank", "2")
    stops = re.findall(r"rank (\d): stopped at step (\d+)", stopped)
    assert sorted(stops) == [(str(r), "8") for r in range(NPROC)], stopped
    assert "done step" not in stopped, stopped
    resumed = _run(tmp_path / "run", *args)
    assert "ckpt-00000008.pt: step 8 done" in resumed, resumed
    return ref, _finals(resumed), resumed


def test_sync_gradients_with_batchnorm_resumes_bitwise_on_every_rank(tmp_path: Path) -> None:
    """Nothing syncs BatchNorm's running statistics under sync_gradients: each rank's
    are its own, and the checkpoint keeps them per rank (before: rank 0's on every rank
    after a restore; ranks 1-3 ended differently)."""
    ref, resumed, _ = uninterrupted_and_resumed(tmp_path, "--sync", "grads")
    assert len({d for _, d, _ in ref.values()}) == NPROC, "ranks' buffers should differ"
    assert resumed == ref


def test_ddp_resumes_bitwise_with_a_fixed_bucket_layout(tmp_path: Path) -> None:
    """DDP(find_unused_parameters=True) never rebuilds its buckets: the first step after
    the resume reduces in the layout the uninterrupted run used at that step."""
    ref, resumed, _ = uninterrupted_and_resumed(tmp_path, "--sync", "ddp",
                                                "--ddp", "find_unused")
    assert resumed == ref


def test_ddp_with_its_bucket_rebuild_is_not_bitwise_and_says_so(tmp_path: Path) -> None:
    """Plain DDP on 4 ranks: its first iteration reduces every gradient in one bucket,
    later ones in the rebuilt (ready-order) buckets, and a ring all-reduce over 3+
    ranks rounds differently per layout. The resumed run's first step is a first
    iteration: every rank's weights differ by rounding (docs/preemptible.md), and the
    master says why at the resume."""
    ref, resumed, text = uninterrupted_and_resumed(tmp_path, "--sync", "ddp")
    assert all(resumed[r][0] == ref[r][0] == "32" for r in range(NPROC))
    assert all(resumed[r][1] != ref[r][1] for r in range(NPROC)), (ref, resumed)
    assert text.count("rebuilds its gradient buckets") == 1, text
    assert "HINT: construct it with DistributedDataParallel(..., " \
        "find_unused_parameters=True)" in text, text
