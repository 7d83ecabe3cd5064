"""CPU threads per rank (issue 13 part 3): the pure plan, the variables it returns, and
torch's count on this process."""

from __future__ import annotations

import os

import pytest

from hpc.bootstrap import threads
from hpc.bootstrap.threads import plan_threads
from hpc.environments import detect
from tests.helpers.envdumps import load

STEP = dict(load("srun_from_login_env.txt")[1][1])  # an srun task, 2 tasks per node
ONE = detect({})


def test_srun_cpus_per_task_sets_the_count() -> None:
    info = detect(STEP)
    assert plan_threads(info, dict(STEP, SLURM_CPUS_PER_TASK="4"), usable=4, host_cpus=64) \
        == (4, ())


def test_srun_cpus_per_task_bound_to_fewer_cpus_warns() -> None:
    """Slurm 22.05-23.02: srun inside sbatch -c 4 binds 1 CPU per task."""
    info = detect(STEP)
    count, warnings = plan_threads(info, dict(STEP, SLURM_CPUS_PER_TASK="4"), usable=1,
                                   host_cpus=64)
    assert count == 1 and len(warnings) == 1
    assert "SLURM_CPUS_PER_TASK=4" in warnings[0] and "only 1 CPU" in warnings[0]
    assert "HINT" in warnings[0] and "SRUN_CPUS_PER_TASK" in warnings[0]


def test_user_omp_num_threads_is_kept_but_binding_still_warned() -> None:
    info = detect(STEP)
    env = dict(STEP, SLURM_CPUS_PER_TASK="2", OMP_NUM_THREADS="3")
    count, warnings = plan_threads(info, env, usable=1, host_cpus=8)
    assert count is None and len(warnings) == 1


@pytest.mark.parametrize("usable,host,expected", [
    (64, 64, 32),   # not bound: the host's CPUs shared by the node's 2 ranks
    (8, 64, 8),     # bound by the launcher to 8 CPUs: use them
    (1, 2, 1),      # srun -n2 -c1 under task/affinity
    (2, 2, 1),      # unbound on a 2-CPU host with 2 ranks
])
def test_several_ranks_per_node_without_cpus_per_task(usable: int, host: int,
                                                      expected: int) -> None:
    env = {k: v for k, v in STEP.items() if k != "SLURM_CPUS_PER_TASK"}
    assert plan_threads(detect(env), env, usable=usable, host_cpus=host) == (expected, ())


def test_single_process_is_left_alone() -> None:
    assert plan_threads(ONE, {}, usable=64, host_cpus=64) == (None, ())


def test_batch_script_cpus_per_task_is_not_a_step() -> None:
    (_, batch), = load("sbatch_batchstep_env.txt")
    env = dict(batch, SLURM_CPUS_PER_TASK="4")
    assert plan_threads(detect(env), env, usable=1, host_cpus=64) == (None, ())


def test_thread_env_carries_the_count() -> None:
    assert threads.thread_env(4) == {"OMP_NUM_THREADS": "4"}
    assert threads.thread_env(None) == {}  # torch left alone: nothing to export


def test_plan_returns_omp_and_writes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(threads, "usable_cpus", lambda: 1)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    env = dict(STEP, SLURM_CPUS_PER_TASK="1")
    assert threads.plan(detect(env), env) == (1, {"OMP_NUM_THREADS": "1"})
    assert env == dict(STEP, SLURM_CPUS_PER_TASK="1")
    assert "OMP_NUM_THREADS" not in os.environ  # distributed._export writes it
    assert threads.plan(ONE, {}) == (None, {})


def test_set_torch_threads() -> None:
    import torch

    before = torch.get_num_threads()
    try:
        threads.set_torch_threads(1)
        assert torch.get_num_threads() == 1
        threads.set_torch_threads(None)  # left alone
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("ranks,usable,host,share", [
    (2, 2, 2, 1),     # two ranks on a 2-core host: one core each
    (4, 64, 64, 16),  # unbound: an equal part of the host
    (4, 3, 64, 3),    # bound by the launcher to 3 CPUs: those
    (1, 8, 8, 8),     # alone on the host
    (3, 2, 2, 1),     # more ranks than cores: still one thread
])
def test_cpu_share_is_the_rule_init_torch_applies(ranks: int, usable: int, host: int,
                                                   share: int) -> None:
    assert threads.cpu_share(ranks, usable, host) == share
