"""Launch-environment detection on real dumps and on hand-built variable sets.

Every case is a plain mapping handed to :func:`hpc.environments.detect`: no ``os.environ``
patching, no processes (except one subprocess proving that mpi4py is never imported).
"""

from __future__ import annotations

import json
import subprocess
import sys
import types
from collections import Counter
from typing import Any, Optional

import pytest

from hpc.environments import ORDER, by_name, detect
from hpc.environments.base import PORT_BASE, PORT_SPAN, DistInfo
from hpc.environments.local import LocalEnvironment
from hpc.environments.slurm import SlurmEnvironment, expand_hostnames, slurm_port
from hpc.environments.torchrun import TorchrunEnvironment
from hpc.errors import InconsistentEnvironmentError, LaunchEnvironmentError
from tests.helpers.envdumps import dump_files, load, parse_header
from tests.helpers.paths import ROOT

# What each real dump must give, from how it was launched (tests/fixtures/env/README.md).
# ``port``: the documented derivation 15000 + (job * 64 + step) % 17000 for Slurm steps.
EXPECTED: dict[str, dict[str, Any]] = {
    "sbatch_srun_tasks_env.txt": dict(launcher="slurm", world=4, nodes=2, master="node1",
                                      port=15000 + (30 * 64 + 0) % 17000, job_id="30.0"),
    "srun_from_login_env.txt": dict(launcher="slurm", world=4, nodes=2, master="node1",
                                    port=15000 + (31 * 64 + 0) % 17000, job_id="31.0"),
    "openmpi_mpirun_local.txt": dict(launcher="openmpi", world=4, nodes=1, master=None,
                                     port=None, job_id="1138622465"),
    "mpich_mpiexec_local.txt": dict(launcher="mpich", world=4, nodes=1, master=None,
                                    port=None, job_id=None),
    "sbatch_batchstep_env.txt": dict(launcher="slurm", world=1, nodes=1, master="127.0.0.1",
                                     port=15000 + (30 * 64 + 4094) % 17000, job_id="30.batch"),
    # Captures on the local test cluster (the fixtures' README: how each was launched).
    # MPI inside an allocation: the MPI variables win over the launcher step's SLURM_*.
    "mpirun_openmpi_salloc_env.txt": dict(launcher="openmpi", world=4, nodes=2, master=None,
                                          port=None, job_id="2055929857"),
    "mpiexec_mpich_salloc_env.txt": dict(launcher="mpich", world=4, nodes=2, master=None,
                                         port=None, job_id=None),
    # srun direct launch of MPI programs is read as Slurm tasks.
    "srun_pmix_env.txt": dict(launcher="slurm", world=4, nodes=2, master="node1",
                              port=15000 + (57 * 64 + 0) % 17000, job_id="57.0"),
    "srun_pmi2_env.txt": dict(launcher="slurm", world=4, nodes=2, master="node1",
                              port=15000 + (58 * 64 + 0) % 17000, job_id="58.0"),
    "srun_gpus_per_task_env.txt": dict(launcher="slurm", world=4, nodes=2, master="node1",
                                       port=15000 + (59 * 64 + 0) % 17000, job_id="59.0"),
    # torchrun inside srun: the workers' variables win; the master is the agents' store.
    "srun_torchrun_env.txt": dict(launcher="torchrun", world=4, nodes=2, master="node1",
                                  port=38097, job_id="envdump"),
    # torchrun inside srun WITHOUT --nnodes/rendezvous (issue 30): one 2-rank world per
    # node, two rank 0s; 4 blocks, every one refused by detect.
    "srun_torchrun_no_rdzv_env.txt": dict(launcher="torchrun", world=4, refused=True),
    # Issue 13: launchers that cannot run here, fixtures built from their documentation
    # (tests/fixtures/env/README.md cites it); the master is found at init (master hook).
    "pals_mpiexec_env.txt": dict(launcher="pals", world=4, nodes=2, master=None, port=None,
                                 job_id="1234567.polaris-pbs-01.hsn.cm.polaris.alcf.anl.gov"),
    "flux_run_env.txt": dict(launcher="flux", world=4, nodes=2, master=None, port=None,
                             job_id="fA2bSjh3f"),
    "lsf_jsrun_env.txt": dict(launcher="lsf", world=4, nodes=2, master=None, port=None,
                              job_id="1234567"),
    # salloc's own shell on the login host: like the batch script, one process.
    "salloc_shell_env.txt": dict(launcher="slurm", world=1, nodes=1, master="127.0.0.1",
                                 port=15000 + (61 * 64 + 4094) % 17000, job_id="61.batch"),
}
MULTI_RANK = sorted(n for n, e in EXPECTED.items() if e["world"] > 1 and not e.get("refused"))


def srun_task(rank: int, name: str = "srun_from_login_env.txt") -> dict[str, str]:
    """A copy of the real environment of task ``rank`` of an srun dump."""
    return dict(load(name)[rank][1])


def message(excinfo: pytest.ExceptionInfo[BaseException]) -> str:
    return str(excinfo.value)


# --- real dumps --------------------------------------------------------------------


def test_every_dump_has_expectations() -> None:
    names = {p.name for p in dump_files()}
    assert names == set(EXPECTED), "describe every new capture in EXPECTED"


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_dump_parses_into_blocks(name: str) -> None:
    blocks = load(name)
    assert len(blocks) == EXPECTED[name]["world"]
    for label, env in blocks:
        parse_header(label)
        assert env, label


@pytest.mark.parametrize("name", MULTI_RANK)
def test_dump_every_rank(name: str) -> None:
    """Each rank's view against what its header (rank, host) says independently."""
    want = EXPECTED[name]
    blocks = load(name)
    hosts = [parse_header(label).host for label, _ in blocks]
    node_order = list(dict.fromkeys(hosts))  # block distribution: nodes in rank order
    infos = []
    for label, env in blocks:
        header = parse_header(label)
        info = detect(env)
        infos.append(info)
        assert info.launcher == want["launcher"], label
        assert info.rank == header.rank, label
        assert info.world_size == want["world"] == (header.size or want["world"]), label
        same_host = [r for r, h in enumerate(hosts) if h == header.host]
        assert info.local_rank == same_host.index(header.rank), label
        assert info.local_world_size == len(same_host), label
        assert info.node_rank == node_order.index(header.host), label
        assert info.num_nodes == want["nodes"] == len(node_order), label
        assert info.master_addr == want["master"], label
        assert info.master_port == want["port"], label
        assert info.job_id == want["job_id"], label
        assert info.warnings == (), label
    assert sorted(i.rank for i in infos) == list(range(want["world"]))
    assert sum(i.is_master for i in infos) == 1
    local_masters = Counter(i.node_rank for i in infos if i.is_local_master)
    assert local_masters == Counter(range(want["nodes"]))


@pytest.mark.parametrize("name", ["sbatch_srun_tasks_env.txt", "srun_from_login_env.txt"])
def test_srun_master_is_first_step_host(name: str) -> None:
    blocks = load(name)
    for _, env in blocks:
        info = detect(env)
        assert info.master_addr == expand_hostnames(env["SLURM_STEP_NODELIST"])[0]
        assert info.master_addr == parse_header(blocks[0][0]).host  # where rank 0 runs
        assert PORT_BASE <= info.master_port < PORT_BASE + PORT_SPAN
        assert info.master_port == slurm_port(env)


def test_srun_port_differs_between_jobs_and_steps() -> None:
    job30 = detect(srun_task(0, "sbatch_srun_tasks_env.txt")).master_port
    job31 = detect(srun_task(0, "srun_from_login_env.txt")).master_port
    assert job30 != job31  # both are step 0
    ports = set()
    for step in range(4):
        for rank in range(4):
            env = srun_task(rank)
            env["SLURM_STEP_ID"] = env["SLURM_STEPID"] = str(step)
            ports.add((step, detect(env).master_port))
    per_step = {step: {p for s, p in ports if s == step} for step in range(4)}
    assert all(len(p) == 1 for p in per_step.values()), "ranks of a step disagree"
    assert len({p.pop() for p in per_step.values()}) == 4, "steps share a port"


def test_batch_step_is_one_process_with_hint() -> None:
    (label, env), = load("sbatch_batchstep_env.txt")
    info = detect(env)
    assert (info.launcher, info.rank, info.world_size, info.local_world_size) == ("slurm", 0, 1, 1)
    assert info.job_id == "30.batch"
    assert info.master_port == EXPECTED["sbatch_batchstep_env.txt"]["port"]  # batch slot
    assert info.master_addr == "127.0.0.1"
    assert len(info.warnings) == 1
    assert "HINT" in info.warnings[0] and "srun" in info.warnings[0]
    assert "SLURM_NTASKS=4" in info.warnings[0]


def test_batch_step_port_differs_from_step_zero() -> None:
    """The batch script and step 0 of the same job may run at once on node1."""
    (_, batch), = load("sbatch_batchstep_env.txt")
    step0 = srun_task(0, "sbatch_srun_tasks_env.txt")
    assert slurm_port(batch) != slurm_port(step0)


def test_salloc_shell_is_one_process_with_hint() -> None:
    """``salloc -N2 -n4 python train.py``: the command runs once, on the login host."""
    (label, env), = load("salloc_shell_env.txt")
    assert parse_header(label).host == "vm" and "SLURMD_NODENAME" not in env
    info = detect(env)
    assert (info.launcher, info.world_size, info.job_id) == ("slurm", 1, "61.batch")
    assert len(info.warnings) == 1
    assert "SLURM_NTASKS=4" in info.warnings[0] and "HINT" in info.warnings[0]
    assert "srun" in info.warnings[0]


def test_batch_step_with_one_task_has_no_warning() -> None:
    (_, env), = load("sbatch_batchstep_env.txt")
    env = dict(env, SLURM_NTASKS="1", SLURM_NPROCS="1")
    assert detect(env).warnings == ()


# --- torchrun ----------------------------------------------------------------------

ELASTIC = {
    "RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
    "GROUP_RANK": "1", "MASTER_ADDR": "node1", "MASTER_PORT": "29500",
    "TORCHELASTIC_RUN_ID": "run42", "TORCHELASTIC_RESTART_COUNT": "0",
}


def test_torchrun_elastic() -> None:
    info = detect(ELASTIC)
    assert info == DistInfo(launcher="torchrun", rank=5, local_rank=1, world_size=8,
                            local_world_size=4, node_rank=1, num_nodes=2,
                            master_addr="node1", master_port=29500, job_id="run42")


def test_torchrun_without_run_id_group_rank_or_local_world_size() -> None:
    """The legacy launch utility with --use-env: RANK, WORLD_SIZE, LOCAL_RANK only."""
    env = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    info = detect(env)
    assert (info.launcher, info.rank, info.local_rank, info.world_size) == ("torchrun", 1, 1, 2)
    assert (info.local_world_size, info.node_rank, info.num_nodes) == (2, 0, 1)
    assert info.job_id is None


def test_torchrun_node_rank_from_local_world_size() -> None:
    env = {k: v for k, v in ELASTIC.items() if k not in ("GROUP_RANK", "TORCHELASTIC_RUN_ID")}
    info = detect(env)
    assert (info.node_rank, info.num_nodes, info.local_world_size) == (1, 2, 4)
    env["NODE_RANK"] = "1"
    assert detect(env).node_rank == 1


def test_torchrun_single_process_without_local_rank() -> None:
    info = detect({"RANK": "0", "WORLD_SIZE": "1"})
    assert (info.launcher, info.rank, info.local_rank, info.master_addr) == ("torchrun", 0, 0, None)


def test_torchrun_missing_local_rank() -> None:
    with pytest.raises(LaunchEnvironmentError, match="LOCAL_RANK") as e:
        detect({"RANK": "1", "WORLD_SIZE": "2"})
    assert "HINT" in message(e)


def test_hand_set_rank_and_world_size_say_no_launcher_was_found() -> None:
    """``WORLD_SIZE=2 RANK=0 python train.py``: exporting LOCAL_RANK (the old HINT) only
    leads to a timeout, since nothing starts rank 1; say how to start N ranks instead."""
    with pytest.raises(LaunchEnvironmentError) as e:
        detect({"RANK": "0", "WORLD_SIZE": "2"})
    text = message(e)
    assert text.startswith("no launcher found: RANK=0 WORLD_SIZE=2 are set")
    assert "hpc run --nproc N" in text and "torchrun --nproc-per-node N" in text
    assert "export LOCAL_RANK" not in text


def test_a_size_alone_hints_hpc_run_and_every_launcher_name() -> None:
    """``WORLD_SIZE=2 python train.py``: the HINT shows ``hpc run --nproc N`` and the one
    list of HPC_LAUNCHER names (the same as docs/troubleshooting.md, a docs test checks)."""
    from hpc.environments import launcher_names

    with pytest.raises(LaunchEnvironmentError) as e:
        detect({"WORLD_SIZE": "2"})
    text = message(e)
    assert "hpc run --nproc N" in text
    assert f"(one of: {', '.join(launcher_names())})" in text
    assert set(launcher_names()) >= {env.name for env in ORDER} | {"hpc-run", "mpi4py"}


def test_hpc_run_marker() -> None:
    env = dict(ELASTIC, HPC_RUN_ID="abc")
    del env["TORCHELASTIC_RUN_ID"]
    info = detect(env)
    assert (info.launcher, info.job_id) == ("hpc-run", "abc")


def test_torchrun_inside_srun_wins() -> None:
    """srun -N2 --ntasks-per-node=1 torchrun --nnodes 2 --nproc-per-node 2 --rdzv-...:
    worker 3 on node2."""
    env = srun_task(2)  # node2's task of the dump's 4-task step, made the 2-task step
    env.update(SLURM_STEP_NUM_TASKS="2", SLURM_STEP_TASKS_PER_NODE="1(x2)", SLURM_PROCID="1",
               SLURM_LOCALID="0")
    env.update(RANK="3", WORLD_SIZE="4", LOCAL_RANK="1", LOCAL_WORLD_SIZE="2",
               GROUP_RANK="1", MASTER_ADDR="node1", MASTER_PORT="29400",
               TORCHELASTIC_RUN_ID="job31")
    info = detect(env)
    assert (info.launcher, info.rank, info.local_rank, info.node_rank) == ("torchrun", 3, 1, 1)
    assert (info.master_addr, info.master_port) == ("node1", 29400)


def test_torchrun_without_rendezvous_under_srun_is_refused_on_every_rank() -> None:
    """The real dump of ``srun -N2 --ntasks-per-node=1 torchrun --nproc-per-node 2``: each
    node's torchrun formed its own world (GROUP_WORLD_SIZE=1, a rank 0 on each node)."""
    blocks = load("srun_torchrun_no_rdzv_env.txt")
    assert [parse_header(label).rank for label, _ in blocks] == [0, 1, 0, 1]  # two rank 0s
    for label, env in blocks:
        with pytest.raises(InconsistentEnvironmentError) as e:
            detect(env)
        text = message(e)
        assert text.startswith("torchrun formed a world of 2 rank(s) on 1 node(s) "
                               "(WORLD_SIZE=2, GROUP_WORLD_SIZE=1) inside a Slurm step of 2 "
                               "tasks on 2 node(s)"), label
        hint = text.split("HINT: ", 1)[1]
        assert "--nnodes $SLURM_NNODES" in hint and "--rdzv-endpoint $(hostname):29500" in hint
        assert "slurm/torchrun.sbatch" in hint and "HPC_LAUNCHER=torchrun" in hint
        # the escape hatch: HPC_LAUNCHER=torchrun takes the variables as they are
        assert detect({**env, "HPC_LAUNCHER": "torchrun"}).world_size == 2


def test_torchrun_with_rendezvous_under_srun_is_one_world() -> None:
    """The legit launch (torchrun.sbatch's): GROUP_WORLD_SIZE equals the step's tasks."""
    for _, env in load("srun_torchrun_env.txt"):
        assert env["GROUP_WORLD_SIZE"] == env["SLURM_STEP_NUM_TASKS"] == "2"
        assert detect(env).world_size == 4


def test_one_torchrun_per_step_is_one_world() -> None:
    """``srun -N1 -n1 torchrun --nproc-per-node 2`` (or torchrun in the batch script): the
    step started one agent, so a one-node world is all of it."""
    env = srun_task(0)
    env.update(SLURM_STEP_NUM_TASKS="1", SLURM_STEP_NUM_NODES="1", SLURM_NTASKS="1",
               SLURM_STEP_TASKS_PER_NODE="1", SLURM_STEP_NODELIST="node1", RANK="1",
               WORLD_SIZE="2", LOCAL_RANK="1", LOCAL_WORLD_SIZE="2", GROUP_RANK="0",
               GROUP_WORLD_SIZE="1", MASTER_ADDR="node1", MASTER_PORT="29500",
               TORCHELASTIC_RUN_ID="x")
    assert detect(env).world_size == 2
    batch = dict(load("sbatch_batchstep_env.txt")[0][1])  # no SLURM_STEP_ID: no step
    batch.update({k: env[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                                      "GROUP_RANK", "GROUP_WORLD_SIZE", "MASTER_ADDR",
                                      "MASTER_PORT", "TORCHELASTIC_RUN_ID")})
    assert detect(batch).world_size == 2


def test_hpc_run_per_srun_task_is_refused() -> None:
    """``srun -N2 --ntasks-per-node=1 hpc run --nproc 2``: hpc run is one node, NNODES=1."""
    env = srun_task(2)
    env.update(SLURM_STEP_NUM_TASKS="2", SLURM_STEP_TASKS_PER_NODE="1(x2)", SLURM_PROCID="1",
               RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", LOCAL_WORLD_SIZE="2",
               GROUP_RANK="0", NNODES="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29500",
               HPC_RUN_ID="r1")
    with pytest.raises(InconsistentEnvironmentError) as e:
        detect(env)
    assert message(e).startswith("hpc run formed a world of 2 rank(s) on 1 node(s) "
                                 "(WORLD_SIZE=2, NNODES=1)")
    assert "`hpc run` is one node only" in message(e)


def test_hand_set_rank_contradicting_slurm() -> None:
    env = srun_task(1)  # SLURM_PROCID=1, SLURM_STEP_NUM_TASKS=4
    env.update(RANK="3", WORLD_SIZE="4", LOCAL_RANK="1")
    with pytest.raises(InconsistentEnvironmentError) as e:
        detect(env)
    text = message(e)
    assert "RANK=3" in text and "SLURM_PROCID=1" in text and "HINT" in text


def test_hand_set_rank_without_local_rank_contradicting_slurm() -> None:
    """``export RANK=3 WORLD_SIZE=4`` in a batch script: name the conflict, not LOCAL_RANK."""
    env = srun_task(1)
    env.update(RANK="3", WORLD_SIZE="4")
    with pytest.raises(InconsistentEnvironmentError) as e:
        detect(env)
    assert "RANK=3" in message(e) and "SLURM_PROCID=1" in message(e)
    assert "LOCAL_RANK" in str(e.value.__cause__)  # the torchrun reader's own complaint
    env.update(RANK="5", LOCAL_RANK="1")  # out of range for WORLD_SIZE=4
    with pytest.raises(InconsistentEnvironmentError, match="RANK=5 WORLD_SIZE=4 vs SLURM_PROCID=1"):
        detect(env)


def test_hand_set_rank_agreeing_with_slurm_is_accepted() -> None:
    env = srun_task(1)
    env.update(RANK="1", WORLD_SIZE="4", LOCAL_RANK="1")
    assert detect(env).rank == 1


def test_hand_set_rank_contradicting_openmpi() -> None:
    env = dict(load("openmpi_mpirun_local.txt")[2][1], RANK="0", WORLD_SIZE="4", LOCAL_RANK="0")
    with pytest.raises(InconsistentEnvironmentError) as e:
        detect(env)
    assert "RANK=0" in message(e) and "OMPI_COMM_WORLD_RANK=2" in message(e)


# --- MPI -----------------------------------------------------------------------------


def allocation_vars() -> dict[str, str]:
    """What mpirun/mpiexec inherit inside an allocation: the batch env plus the step
    Open MPI's daemons run in (srun of one orted per node: procid/localid 0)."""
    (_, env), = load("sbatch_batchstep_env.txt")
    return dict(env, SLURM_STEP_ID="0", SLURM_STEPID="0", SLURM_PROCID="0",
                SLURM_LOCALID="0", SLURM_NODEID="0", SLURM_STEP_NUM_TASKS="2",
                SLURM_STEP_NUM_NODES="2", SLURM_STEP_NODELIST="node[1-2]",
                SLURM_STEP_TASKS_PER_NODE="1(x2)")


@pytest.mark.parametrize("rank", range(4))
def test_openmpi_inside_allocation_wins(rank: int) -> None:
    env = dict(allocation_vars(), **load("openmpi_mpirun_local.txt")[rank][1])
    assert SlurmEnvironment.read(env).rank == 0  # the launcher step's view, all 0
    info = detect(env)
    assert (info.launcher, info.rank, info.local_rank) == ("openmpi", rank, rank)
    assert info.world_size == 4 and info.master_addr is None


@pytest.mark.parametrize("rank", range(4))
def test_mpich_inside_allocation_wins(rank: int) -> None:
    env = dict(allocation_vars(), **load("mpich_mpiexec_local.txt")[rank][1])
    info = detect(env)
    assert (info.launcher, info.rank, info.world_size) == ("mpich", rank, 4)


@pytest.mark.parametrize("name,kind", [("mpirun_openmpi_salloc_env.txt", "openmpi"),
                                       ("mpiexec_mpich_salloc_env.txt", "mpich")])
def test_real_mpi_inside_allocation_wins_over_launcher_step(name: str, kind: str) -> None:
    """The ranks inherit the SLURM_* of the step that started the MPI daemons (one per
    node): that step's view is wrong for half the ranks, the MPI view is right."""
    for label, env in load(name):
        header = parse_header(label)
        step = SlurmEnvironment.read(env)
        assert (step.world_size, step.rank) == (2, header.rank // 2)  # the daemons' step
        assert env["SLURM_LOCALID"] == "0"
        info = detect(env)
        assert (info.launcher, info.rank, info.local_rank) == (kind, header.rank, header.rank % 2)


@pytest.mark.parametrize("name,key,absent", [
    ("srun_pmix_env.txt", "PMIX_RANK", "OMPI_COMM_WORLD_RANK"),
    ("srun_pmi2_env.txt", "PMI_RANK", "MPI_LOCALRANKID"),
])
def test_real_srun_direct_mpi_launch(name: str, key: str, absent: str) -> None:
    """srun --mpi=pmix/pmi2: no MPI launcher variables beyond the PMI rank; Slurm reads."""
    for label, env in load(name):
        assert absent not in env and env[key] == env["SLURM_PROCID"], label
        assert not any(k.startswith("OMPI_COMM_WORLD") for k in env)
        assert detect(env).rank == int(env[key])


def test_real_gpus_per_task() -> None:
    """--gpus-per-task=1: each task sees one device (no cgroups here: not renumbered)."""
    blocks = load("srun_gpus_per_task_env.txt")
    assert [env["CUDA_VISIBLE_DEVICES"] for _, env in blocks] == ["0", "1", "0", "1"]
    assert [env["SLURM_STEP_GPUS"] for _, env in blocks] == ["0", "1", "0", "1"]
    assert [detect(env).local_rank for _, env in blocks] == [0, 1, 0, 1]


def test_real_torchrun_inside_srun() -> None:
    """The agents' step says 2 tasks (one per node); the workers are 4 torchrun ranks."""
    for label, env in load("srun_torchrun_env.txt"):
        header = parse_header(label)
        assert env["SLURM_STEP_NUM_TASKS"] == "2" and env["SLURM_PROCID"] == str(header.rank // 2)
        info = detect(env)
        assert (info.launcher, info.rank, info.node_rank) == ("torchrun", header.rank,
                                                             header.rank // 2)


def pmix_task(rank: int, pmix_rank: Optional[int] = None) -> dict[str, str]:
    """srun --mpi=pmix: Open MPI ranks get PMIX_* but no OMPI_COMM_WORLD_*."""
    return dict(srun_task(rank), PMIX_RANK=str(rank if pmix_rank is None else pmix_rank),
                PMIX_NAMESPACE="slurm.pmix.31.0", PMIX_SERVER_URI41="pmix-server.1;x")


def pmi2_task(rank: int, pmi_rank: Optional[int] = None) -> dict[str, str]:
    """srun --mpi=pmi2 with MPICH: PMI_RANK/PMI_SIZE/PMI_FD, no MPI_LOCALRANKID."""
    return dict(srun_task(rank), PMI_RANK=str(rank if pmi_rank is None else pmi_rank),
                PMI_SIZE="4", PMI_FD="7", PMI_JOBID="31.0")


@pytest.mark.parametrize("make", [pmix_task, pmi2_task], ids=["pmix", "pmi2"])
def test_srun_direct_mpi_launch_is_read_by_slurm(make: Any) -> None:
    infos = [detect(make(rank)) for rank in range(4)]
    assert {i.launcher for i in infos} == {"slurm"}
    assert [(i.rank, i.local_rank, i.node_rank) for i in infos] == [
        (0, 0, 0), (1, 1, 0), (2, 0, 1), (3, 1, 1)]
    assert {i.master_addr for i in infos} == {"node1"}


@pytest.mark.parametrize("make,key", [(pmix_task, "PMIX_RANK"), (pmi2_task, "PMI_RANK")])
def test_srun_direct_mpi_rank_mismatch(make: Any, key: str) -> None:
    with pytest.raises(InconsistentEnvironmentError) as e:
        detect(make(1, 2))
    assert f"{key}=2" in message(e) and "SLURM_PROCID=1" in message(e) and "HINT" in message(e)


def test_mvapich2() -> None:
    env = {"MV2_COMM_WORLD_RANK": "5", "MV2_COMM_WORLD_SIZE": "8",
           "MV2_COMM_WORLD_LOCAL_RANK": "1", "MV2_COMM_WORLD_LOCAL_SIZE": "4",
           "MPIRUN_RSH_LAUNCH": "1"}
    info = detect(env)
    assert info == DistInfo(launcher="mvapich2", rank=5, local_rank=1, world_size=8,
                            local_world_size=4, node_rank=1, num_nodes=2)


def test_intel_mpi_hydra() -> None:
    env = {"PMI_RANK": "3", "PMI_SIZE": "4", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2",
           "PMI_FD": "9", "I_MPI_ROOT": "/opt/intel/mpi", "I_MPI_HYDRA_TOPOLIB": "hwloc"}
    info = detect(env)
    assert (info.launcher, info.rank, info.local_rank, info.node_rank, info.num_nodes) == (
        "mpich", 3, 1, 1, 2)
    assert info.master_addr is None and info.master_port is None


def test_mpi_master_from_environment() -> None:
    env = dict(load("mpich_mpiexec_local.txt")[1][1], MASTER_ADDR="vm", MASTER_PORT="29501")
    info = detect(env)
    assert (info.master_addr, info.master_port) == ("vm", 29501)


# --- overrides -----------------------------------------------------------------------


def test_order_innermost_first() -> None:
    assert ORDER[0] is TorchrunEnvironment
    assert ORDER.index(SlurmEnvironment) > max(ORDER.index(by_name(n))
                                               for n in ("openmpi", "mpich", "mvapich2"))
    assert ORDER[-1] is LocalEnvironment


def test_launcher_override() -> None:
    env = srun_task(2)
    env.update(RANK="3", WORLD_SIZE="4", LOCAL_RANK="1", HPC_LAUNCHER=" slurm ")
    info = detect(env)  # no inconsistency error: the user chose
    assert (info.launcher, info.rank) == ("slurm", 2)
    assert detect({"HPC_LAUNCHER": "local", **ELASTIC}).launcher == "local"
    assert by_name("hpc-run") is TorchrunEnvironment
    assert by_name("intelmpi") is by_name("hydra") is by_name("mpich")


def test_launcher_override_runtime_mpi4py() -> None:
    info = detect({"HPC_LAUNCHER": "mpi4py"})
    assert (info.launcher, info.rank, info.world_size) == ("mpi4py", 0, 1)


def test_unknown_launcher_lists_valid_names() -> None:
    with pytest.raises(LaunchEnvironmentError) as e:
        detect({"HPC_LAUNCHER": "pbs"})
    text = message(e)
    assert "'pbs'" in text and "HINT" in text
    for name in ("torchrun", "hpc-run", "slurm", "openmpi", "mpich", "mvapich2", "local",
                 "mpi4py"):
        assert name in text


def test_master_port_override() -> None:
    env = dict(srun_task(3), MASTER_PORT="29400", MASTER_ADDR="10.0.0.1")
    info = detect(env)
    assert (info.master_addr, info.master_port) == ("10.0.0.1", 29400)
    (_, batch), = load("sbatch_batchstep_env.txt")
    assert detect(dict(batch, MASTER_PORT="29401")).master_port == 29401
    assert detect({"MASTER_PORT": "29402"}).master_port == 29402


def test_local_default() -> None:
    info = detect({})
    assert info == DistInfo(launcher="local", master_addr="127.0.0.1")


# --- malformed -----------------------------------------------------------------------

MALFORMED = {
    "rank not an integer": dict(ELASTIC, RANK="abc"),
    "rank >= world size": dict(ELASTIC, RANK="8"),
    "local rank >= local world size": dict(ELASTIC, LOCAL_RANK="4"),
    "port out of range": dict(ELASTIC, MASTER_PORT="70000"),
    "port not an integer": dict(srun_task(0), MASTER_PORT="auto"),
    "tasks per node vs ntasks": dict(srun_task(0), SLURM_STEP_TASKS_PER_NODE="3(x2)"),
    "tasks per node vs nodes": dict(srun_task(0), SLURM_STEP_TASKS_PER_NODE="1(x4)"),
    "tasks per node unparsable": dict(srun_task(0), SLURM_STEP_TASKS_PER_NODE="2(x"),
    "step ntasks not an integer": dict(srun_task(0), SLURM_STEP_NUM_TASKS="four"),
    "step nodes not an integer": dict(srun_task(0), SLURM_STEP_NUM_NODES="2 nodes"),
    "procid missing": {k: v for k, v in srun_task(0).items() if k != "SLURM_PROCID"},
    "procid not an integer": dict(srun_task(0), SLURM_PROCID="x"),
    "nodeid out of range": dict(srun_task(0), SLURM_NODEID="2"),
    "nodelist unparsable": dict(srun_task(0), SLURM_STEP_NODELIST="node[2-1]"),
    "openmpi size not an integer": dict(load("openmpi_mpirun_local.txt")[0][1],
                                        OMPI_COMM_WORLD_SIZE="4.0"),
    "mpich local rank too large": dict(load("mpich_mpiexec_local.txt")[0][1],
                                       MPI_LOCALRANKID="4"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_values_give_hint(case: str) -> None:
    with pytest.raises(LaunchEnvironmentError) as e:
        detect(MALFORMED[case])
    assert "HINT:" in message(e), message(e)


def test_malformed_value_is_named() -> None:
    with pytest.raises(LaunchEnvironmentError, match=r"RANK='abc'"):
        detect(MALFORMED["rank not an integer"])
    with pytest.raises(LaunchEnvironmentError, match=r"'3\(x2\)'"):
        detect(MALFORMED["tasks per node vs ntasks"])


# --- purity --------------------------------------------------------------------------


def test_mapping_is_the_only_input(monkeypatch: pytest.MonkeyPatch) -> None:
    """With a mapping given, os.environ is not read (its conflicting values are ignored)."""
    srun = types.MappingProxyType(srun_task(1))  # any read-only Mapping works
    expected = detect(srun)
    with monkeypatch.context() as m:
        for key, value in {"RANK": "7", "WORLD_SIZE": "8", "LOCAL_RANK": "3",
                           "MASTER_PORT": "1234", "HPC_LAUNCHER": "bogus",
                           "SLURM_PROCID": "3"}.items():
            m.setenv(key, value)
        assert detect(srun) == expected
        assert detect({}) == DistInfo(launcher="local", master_addr="127.0.0.1")
        with pytest.raises(LaunchEnvironmentError, match="bogus"):
            detect()  # the default really reads os.environ


def test_detect_does_not_import_mpi4py() -> None:
    envs = [env for path in dump_files() if not EXPECTED[path.name].get("refused")
            for _, env in load(path.name)]
    code = (
        "import json, sys\n"
        "from hpc.environments import detect\n"
        "infos = [detect(env) for env in json.load(sys.stdin)]\n"
        "print(json.dumps({'launchers': sorted({i.launcher for i in infos}),\n"
        "                  'mpi4py': 'mpi4py' in sys.modules, 'torch': 'torch' in sys.modules}))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], input=json.dumps(envs), text=True,
                          capture_output=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result == {"launchers": ["flux", "lsf", "mpich", "openmpi", "pals", "slurm", "torchrun"],
                      "mpi4py": False,
                      "torch": False}
