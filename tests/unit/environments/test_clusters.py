"""Issue 13: clusters beyond ours — Cray PALS, Flux, LSF jsrun, PBS + hydra, enroot's
PyTorch hook, the guard against silent single processes, and Slurm's odd corners.

PALS, Flux and LSF cannot run here: their dumps in ``tests/fixtures/env/`` are built from
each launcher's documentation (the README cites it); the generic dump tests in
``test_detect.py`` check every rank's layout, these check the master rules and errors.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from hpc.bootstrap.master import resolve_master
from hpc.environments import GUARD_VARIABLES, detect
from hpc.environments.base import derive_port
from hpc.environments.lsf import compute_hosts
from hpc.errors import LaunchEnvironmentError, MasterAddressError
from tests.helpers.envdumps import load


def task(name: str, rank: int, **extra: str) -> dict[str, str]:
    return dict(load(name)[rank][1], **extra)


@pytest.fixture
def no_mpi4py(monkeypatch: pytest.MonkeyPatch) -> None:
    """mpi4py unusable: the broadcast fallback gives nothing (no MPI init in pytest)."""
    monkeypatch.setattr("hpc.environments.mpi.broadcast_master", lambda info: None)


# --- PBS / Cray PALS ---------------------------------------------------------------


def test_pals_master_is_first_host_of_pbs_nodefile(tmp_path: Path) -> None:
    nodefile = tmp_path / "nodefile"
    nodefile.write_text("x3006c0s13b0n0.hsn.cm.polaris\nx3006c0s19b1n0.hsn.cm.polaris\n")
    envs = [task("pals_mpiexec_env.txt", r, PBS_NODEFILE=str(nodefile)) for r in range(4)]
    infos = [resolve_master(detect(env), env) for env in envs]
    assert {(i.master_addr, i.master_port) for i in infos} == {
        ("x3006c0s13b0n0.hsn.cm.polaris", derive_port("1234567", "pbs"))}
    assert [(i.node_rank, i.local_rank) for i in infos] == [(0, 0), (0, 1), (1, 0), (1, 1)]


def test_pals_unreadable_nodefile_is_a_clear_error(tmp_path: Path) -> None:
    env = task("pals_mpiexec_env.txt", 1, PBS_NODEFILE=str(tmp_path / "missing"))
    with pytest.raises(MasterAddressError, match="PBS_NODEFILE") as e:
        resolve_master(detect(env), env)
    assert "HINT" in str(e.value)


def test_hydra_under_pbs_without_mpi4py_uses_pbs_nodefile(tmp_path: Path,
                                                          no_mpi4py: None) -> None:
    """PBS/Torque + MPICH mpiexec on 2 nodes: hydra gives the ranks, PBS the master."""
    nodefile = tmp_path / "nodefile"
    nodefile.write_text("cn01\ncn01\ncn02\ncn02\n")
    env = {"PMI_RANK": "2", "PMI_SIZE": "4", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "2",
           "PBS_NODEFILE": str(nodefile), "PBS_JOBID": "77.torque01",
           "PBS_ENVIRONMENT": "PBS_BATCH"}
    info = resolve_master(detect(env), env)
    assert (info.launcher, info.rank, info.node_rank, info.num_nodes) == ("mpich", 2, 1, 2)
    assert (info.master_addr, info.master_port) == ("cn01", derive_port("77", "pbs"))


# --- Flux --------------------------------------------------------------------------


def test_flux_uneven_layout_warns() -> None:
    env = {"FLUX_TASK_RANK": "2", "FLUX_TASK_LOCAL_ID": "0", "FLUX_JOB_SIZE": "3",
           "FLUX_JOB_NNODES": "2", "FLUX_JOB_ID": "f2"}
    info = detect(env)
    assert (info.local_world_size, info.node_rank, info.num_nodes) == (2, 1, 2)
    assert len(info.warnings) == 1 and "uneven" in info.warnings[0]
    assert "HINT" in info.warnings[0]


def test_flux_without_mpi4py_on_two_nodes_is_a_clear_error(no_mpi4py: None) -> None:
    env = task("flux_run_env.txt", 3)
    with pytest.raises(MasterAddressError, match="Flux exports no host list") as e:
        resolve_master(detect(env), env)
    assert "MASTER_ADDR" in str(e.value) and "HINT" in str(e.value)


def test_flux_on_one_node_needs_no_mpi4py(no_mpi4py: None) -> None:
    env = {"FLUX_TASK_RANK": "1", "FLUX_TASK_LOCAL_ID": "1", "FLUX_JOB_SIZE": "2",
           "FLUX_JOB_NNODES": "1", "FLUX_JOB_ID": "f3"}
    info = resolve_master(detect(env), env)
    assert info.master_addr == "127.0.0.1" and info.master_port is not None


# --- LSF jsrun ---------------------------------------------------------------------


def test_lsf_master_skips_the_launch_node(tmp_path: Path) -> None:
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("batch3\n" + "h41n04\n" * 42 + "h41n05\n" * 42)
    env = task("lsf_jsrun_env.txt", 2, LSB_DJOB_HOSTFILE=str(hostfile))
    info = resolve_master(detect(env), env)
    assert (info.master_addr, info.master_port) == ("h41n04", derive_port("1234567", "lsf"))


def test_lsf_master_from_mcpu_hosts_when_hostfile_is_unreadable(tmp_path: Path) -> None:
    env = task("lsf_jsrun_env.txt", 0, LSB_DJOB_HOSTFILE=str(tmp_path / "gone"))
    assert resolve_master(detect(env), env).master_addr == "h41n04"
    del env["LSB_MCPU_HOSTS"]
    with pytest.raises(MasterAddressError, match="LSB_DJOB_HOSTFILE"):
        resolve_master(detect(env), env)


def test_lsf_compute_hosts() -> None:
    assert compute_hosts(["batch3", "h1", "h1", "h2"]) == ["h1", "h2"]
    assert compute_hosts(["h1", "h1"]) == ["h1"]  # one host only: it is the compute host
    assert compute_hosts([]) == []


# --- the guard against silent single processes --------------------------------------


@pytest.mark.parametrize("env,named", [
    ({"PMI_SIZE": "4", "PMI_RANK": "1"}, "PMI_SIZE=4"),     # a PMI launcher we do not know
    ({"FLUX_JOB_SIZE": "8"}, "FLUX_JOB_SIZE=8"),             # a Flux job's shell, no task rank
    ({"PALS_LOCAL_SIZE": "2"}, "PALS_LOCAL_SIZE=2"),
    ({"JSM_NAMESPACE_RANK": "3"}, "JSM_NAMESPACE_RANK=3"),
    ({"WORLD_SIZE": "2"}, "WORLD_SIZE=2"),                   # half a torchrun set
    ({"PMI_LOCAL_SIZE": "4", "PMI_LOCAL_RANK": "2"}, "PMI_LOCAL_RANK=2"),
])
def test_guard_refuses_silent_single_process(env: dict[str, str], named: str) -> None:
    with pytest.raises(LaunchEnvironmentError, match="no launcher detected") as e:
        detect(env)
    text = str(e.value)
    assert named in text and "HINT" in text and "HPC_LAUNCHER" in text


def test_guard_lets_single_process_values_and_the_override_through() -> None:
    assert detect({"PMI_SIZE": "1", "PMI_RANK": "0", "LOCAL_RANK": "0"}).launcher == "local"
    assert detect({"PMI_SIZE": "4", "HPC_LAUNCHER": "local"}).launcher == "local"
    assert detect({"PMI_SIZE": "x"}).launcher == "local"  # not a number: not a claim


def test_guard_variables_belong_to_declared_launchers() -> None:
    """conftest clears what environments declare: every guard variable is among them."""
    from tests.conftest import LAUNCHER_VARS

    assert all(LAUNCHER_VARS.match(v) for v in GUARD_VARIABLES)


# --- enroot's PyTorch hook (NGC containers under pyxis) ------------------------------


def enroot_hook(env: dict[str, str]) -> dict[str, str]:
    """What enroot's 50-slurm-pytorch.sh exports into an srun task (NVIDIA/enroot)."""
    first = env["SLURM_STEP_NODELIST"].replace("node[1-2]", "node1")
    return dict(env, RANK=env["SLURM_PROCID"], LOCAL_RANK=env["SLURM_LOCALID"],
                WORLD_SIZE=env["SLURM_NTASKS"], MASTER_ADDR=first,
                MASTER_PORT=str(int(env["SLURM_JOB_ID"]) % 4536 + 61000),
                OMP_NUM_THREADS="1", PYTORCH_VERSION="2.3.0a0")


@pytest.mark.parametrize("rank", range(4))
def test_enroot_hook_layout_comes_from_the_step(rank: int) -> None:
    env = enroot_hook(task("srun_from_login_env.txt", rank))
    info = detect(env)
    assert info.launcher == "slurm"
    assert (info.rank, info.world_size, info.local_rank) == (rank, 4, rank % 2)
    assert (info.local_world_size, info.node_rank, info.num_nodes) == (2, rank // 2, 2)
    assert (info.master_addr, info.master_port) == ("node1", 31 % 4536 + 61000)  # hook's


def test_enroot_hook_without_step_agreement_is_still_refused() -> None:
    env = enroot_hook(task("srun_from_login_env.txt", 1))
    env["RANK"] = "3"
    with pytest.raises(LaunchEnvironmentError, match="RANK=3"):
        detect(env)


def test_torchrun_agent_inside_srun_is_not_a_hook() -> None:
    env = enroot_hook(task("srun_from_login_env.txt", 1))
    # one agent per srun task, 4 in one rendezvous (a one-node world of 4 workers per
    # agent would be 4 separate worlds in this 4-task step, refused)
    env.update(TORCHELASTIC_RUN_ID="r1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", GROUP_RANK="1",
               GROUP_WORLD_SIZE="4")
    assert detect(env).launcher == "torchrun"


# --- Slurm's odd corners -------------------------------------------------------------


def test_rank_variables_without_a_step_are_refused() -> None:
    (_, batch), = load("sbatch_batchstep_env.txt")
    env = dict(batch, SLURM_PROCID="2", SLURM_LOCALID="0")
    with pytest.raises(LaunchEnvironmentError, match="SLURM_PROCID=2 but no SLURM_STEP_ID") as e:
        detect(env)
    assert "HINT" in str(e.value) and "srun" in str(e.value)
    assert detect(dict(batch, SLURM_PROCID="0")).world_size == 1  # the batch script itself


def test_rank0_off_the_master_host_fails_at_once() -> None:
    """SLURM_HOSTFILE + --distribution=arbitrary put rank 0 on node2."""
    env = task("srun_from_login_env.txt", 0, SLURMD_NODENAME="node2")
    with pytest.raises(LaunchEnvironmentError, match="rank 0 runs on node2") as e:
        detect(env)
    assert "node1" in str(e.value) and "MASTER_ADDR" in str(e.value)
    assert detect(dict(env, MASTER_ADDR="node2")).master_addr == "node2"
    assert detect(task("srun_from_login_env.txt", 1, SLURMD_NODENAME="node2")).rank == 1
