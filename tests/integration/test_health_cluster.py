"""Stragglers and silent corruption named while ``hpc pretrain`` runs on the 4-node test
cluster (2 ranks per node, 8 in all; ``hpc/health``):

* node3's link shaped by ``tc`` (tbf, 20 Mbit/s out of its eth0) once step 60 is done:
  named as node3's slow link (sending) within 40 steps (two windows);
* one rank of node3 really frozen 30 % of the time (SIGSTOP 60 ms / SIGCONT 140 ms, from
  this process) from step 60 on: that rank and node3 named within 40 steps;
* ``HPC_FAULT=4:30:bitflip``: the job fails at the check of step 30 naming rank 4, node3,
  the step and the tensor.

In the first two, the windows before the fault name nobody (the healthy part of the same
run), and no other host is ever named. The fault starts when the master has logged the
window ending at step 60 (``tests/helpers/health.py``), not after a guessed sleep.
The thresholds' noise floor over 10 healthy runs: ``bench/stragglers.py``.

Run (2 shared cores: one heavy run at a time)::

    flock /tmp/hpc-heavy.lock python -m pytest tests/integration/test_health_cluster.py
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers.health import TBF, duty_cycle, pretrain_on_four, rank_pid, tc_node3
from tests.helpers.requires import require
from tests.helpers.slurm import job_on_four, slurm_env

pytestmark = pytest.mark.alone  # see setup.cfg

AT = 60  #: the fault starts after this step (three healthy windows: the baselines)
WITHIN = 40  #: named by the window ending at AT + WITHIN


@pytest.fixture
def job() -> Iterator[str]:
    yield from job_on_four("hpct-health")


def _shaped(added) -> None:
    assert added.returncode == 0, added.stderr  # an unshaped link would name nobody


def _assert_named_node3_after(run, what: str) -> None:
    assert run.triggered_at is not None, run.output[-3000:]
    assert run.returncode == 0, run.output[-3000:]
    before = [v for v in run.verdicts if v.end <= AT]
    assert before == [], f"healthy windows named {before}"
    assert run.verdicts, f"nothing named after the fault:\n{run.output[-3000:]}"
    first = run.verdicts[0]
    assert first.hosts == ["node3"] and what in first.what, first
    assert AT < first.end <= AT + WITHIN, first
    assert all(v.hosts == ["node3"] for v in run.verdicts), run.verdicts


@pytest.mark.slurm
@pytest.mark.timeout(240)
def test_a_slow_link_is_named_as_node3s(job: str, tmp_path: Path) -> None:
    require("tc", "iproute2's tc")
    tc_node3("del")  # a leftover of a killed run
    try:
        # 10 epochs = 110 steps: the verdict is due by step AT + WITHIN = 100
        run = pretrain_on_four(tmp_path / "run", job, slurm_env(), epochs=10, at=AT,
                               trigger=lambda: _shaped(tc_node3("add", *TBF)))
    finally:
        tc_node3("del")
    _assert_named_node3_after(run, "slow link (sending)")
    assert run.verdicts[0].ranks == "ranks 4-5"
    data = (tmp_path / "run" / "stragglers.json").read_text()
    assert '"kind": "link"' in data and '"node3"' in data


@pytest.mark.slurm
@pytest.mark.timeout(240)
def test_a_rank_frozen_30_percent_of_the_time_is_named(job: str, tmp_path: Path) -> None:
    out = tmp_path / "run"
    with duty_cycle(lambda: rank_pid(str(out), 5)) as start:
        run = pretrain_on_four(out, job, slurm_env(), epochs=12, at=AT, trigger=start)
    _assert_named_node3_after(run, "compute time")
    assert run.verdicts[0].ranks == "rank 5"


@pytest.mark.slurm
@pytest.mark.timeout(240)
def test_a_flipped_bit_on_node3_ends_the_job_naming_it(job: str, tmp_path: Path) -> None:
    env = slurm_env(HPC_FAULT="4:30:bitflip", HPC_SDC_EVERY="10")
    run = pretrain_on_four(tmp_path / "run", job, env, epochs=5)
    assert run.returncode != 0, run.output[-3000:]
    assert "HPC_FAULT 4:30:bitflip: flipped" in run.output
    lines = [x for x in run.lines if "silent corruption: after step 30 the replicated state"
             in x]
    assert lines, run.output[-3000:]
    assert all("of rank 4 on node3 differs" in x for x in lines), lines
    assert "SilentCorruptionError" in run.output
