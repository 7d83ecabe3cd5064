"""The small pure helpers around detection: argv, export, ports, master resolution,
``hpc env --all`` mismatch checks, ``hpc run``'s per-rank environment, DistInfo itself."""

from __future__ import annotations

import dataclasses
import sys
from collections import Counter
from typing import Any

import pytest

from hpc.cli.env import find_mismatches
from hpc.bootstrap.distributed import export_env
from hpc.environments import detect, parse_local_rank
from hpc.environments.base import PORT_BASE, PORT_SPAN, DistInfo, derive_port
from hpc.environments.slurm import slurm_port
from hpc.errors import LaunchEnvironmentError, MasterAddressError
from hpc.launch import loopback_interface, rank_env
from hpc.bootstrap.preflight import launcher_pid, resolve_master
from tests.unit.envdumps import load, parse_header

EXPORTED = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK",
            "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK", "NNODES")
INFO = DistInfo(launcher="slurm", rank=3, local_rank=1, world_size=8, local_world_size=4,
                node_rank=0, num_nodes=2, master_addr="node1", master_port=15042)


# --- parse_local_rank ------------------------------------------------------------------


@pytest.mark.parametrize("argv,expected", [
    (["--local_rank=3", "--lr", "0.1"], (3, ["--lr", "0.1"])),
    (["--epochs", "2", "--local-rank", "2", "data/"], (2, ["--epochs", "2", "data/"])),
    (["--local-rank=0"], (0, [])),
    (["--local_rank", "5", "--x=1", "y"], (5, ["--x=1", "y"])),
    (["train.py", "--lr", "1"], (None, ["train.py", "--lr", "1"])),
    ([], (None, [])),
])
def test_parse_local_rank(argv: list[str], expected: tuple[Any, list[str]]) -> None:
    before = list(argv)
    assert parse_local_rank(tuple(argv)) == expected
    assert parse_local_rank(argv) == expected
    assert argv == before  # the caller's list is not modified


# --- export_env ------------------------------------------------------------------------


def test_export_env_sets_every_key() -> None:
    env: dict[str, str] = {"PATH": "/bin"}
    export_env(INFO, env)
    assert env == {"PATH": "/bin", "MASTER_ADDR": "node1", "MASTER_PORT": "15042",
                   "RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1",
                   "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "0", "NODE_RANK": "0",
                   "NNODES": "2"}
    assert set(EXPORTED) <= set(env)
    # what was exported reads back as the same layout
    again = detect(dict(env, TORCHELASTIC_RUN_ID="x"))
    assert dataclasses.replace(again, launcher="slurm", job_id=None) == INFO


def test_export_env_refuses_a_different_value() -> None:
    env = {"RANK": "0", "MASTER_PORT": "29500"}
    with pytest.raises(LaunchEnvironmentError) as e:
        export_env(INFO, env)
    text = str(e.value)
    assert "RANK=0 (set) vs 3" in text and "MASTER_PORT=29500 (set) vs 15042" in text
    assert "slurm" in text and "HINT" in text
    assert env == {"RANK": "0", "MASTER_PORT": "29500"}  # nothing written on refusal


def test_export_env_equal_values_and_overwrite() -> None:
    env = {"RANK": "3", "WORLD_SIZE": "8", "MASTER_ADDR": "node1"}
    export_env(INFO, env)
    assert env["LOCAL_RANK"] == "1"
    env["RANK"] = "0"
    export_env(INFO, env, overwrite=True)
    assert env["RANK"] == "3"


def test_export_env_skips_unknown_master() -> None:
    env = {"MASTER_ADDR": "elsewhere"}
    export_env(DistInfo(launcher="mpich", rank=1, world_size=2, local_rank=1,
                        local_world_size=2), env)
    assert env["MASTER_ADDR"] == "elsewhere" and "MASTER_PORT" not in env
    assert env["RANK"] == "1"


# --- ports -----------------------------------------------------------------------------


def test_derive_port_range_and_distinctness() -> None:
    ports = {(job, step): derive_port(job, step) for job in range(1, 2001) for step in range(4)}
    assert all(PORT_BASE <= p < PORT_BASE + PORT_SPAN for p in ports.values())
    for job in range(1, 2001):
        assert len({ports[job, step] for step in range(4)}) == 4, f"job {job}: steps collide"
    for job in range(1, 2000):
        for step in range(4):
            assert ports[job, step] != ports[job + 1, step], f"jobs {job}, {job + 1} collide"
    # stronger and true for this range: (64 * job + step) % 17000 is injective here
    assert len(set(ports.values())) == len(ports)


def test_derive_port_is_stable_and_takes_strings() -> None:
    assert derive_port(30, 0) == derive_port("30", "0") == 15000 + 30 * 64
    assert derive_port("mpi", "1138622465") == derive_port("mpi", "1138622465")
    assert PORT_BASE <= derive_port("mpi", "1138622465") < PORT_BASE + PORT_SPAN
    assert derive_port("mpi", 1) != derive_port("mpi", 2)


def test_slurm_port() -> None:
    env = {"SLURM_JOB_ID": "1234", "SLURM_STEP_ID": "2"}
    assert slurm_port(env) == 15000 + (1234 * 64 + 2) % 17000
    assert slurm_port({"SLURM_JOBID": "1234", "SLURM_STEPID": "2"}) == slurm_port(env)
    ports = {slurm_port({"SLURM_JOB_ID": str(job), "SLURM_STEP_ID": str(step)})
             for job in range(1, 2001) for step in range(4)}
    assert len(ports) == 8000
    assert all(PORT_BASE <= p < PORT_BASE + PORT_SPAN for p in ports)
    batch = slurm_port({"SLURM_JOB_ID": "1234"})
    assert batch == slurm_port({"SLURM_JOB_ID": "1234", "SLURM_STEP_ID": "4294967294"})
    assert batch not in {slurm_port({"SLURM_JOB_ID": "1234", "SLURM_STEP_ID": str(s)})
                         for s in range(64)}


# --- resolve_master --------------------------------------------------------------------


@pytest.fixture()
def no_mpi4py(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make ``from mpi4py import MPI`` fail, so MPI launchers take the non-mpi4py paths."""
    monkeypatch.setitem(sys.modules, "mpi4py", None)
    monkeypatch.setitem(sys.modules, "mpi4py.MPI", None)


def mpi_info(rank: int, world: int, per_node: int, launcher: str = "mpich",
             **kw: Any) -> DistInfo:
    return DistInfo(launcher=launcher, rank=rank, world_size=world, local_rank=rank % per_node,
                    local_world_size=per_node, node_rank=rank // per_node,
                    num_nodes=world // per_node, **kw)


@pytest.mark.usefixtures("no_mpi4py")
def test_resolve_master_single_node() -> None:
    infos = [resolve_master(detect(env), {}) for _, env in load("openmpi_mpirun_local.txt")]
    assert {(i.master_addr, i.master_port) for i in infos} == {
        ("127.0.0.1", derive_port("mpi", "1138622465"))}  # every rank agrees
    info = resolve_master(mpi_info(1, 4, 4), {})  # MPICH: no job id, the launcher's pid
    assert info.master_addr == "127.0.0.1"
    assert PORT_BASE <= info.master_port < PORT_BASE + PORT_SPAN
    # Inside an allocation too: two mpiexec runs of one job must not share a port.
    inside = resolve_master(mpi_info(1, 4, 4), {"SLURM_JOB_ID": "77"})
    assert inside.master_port == info.master_port == derive_port("mpi", launcher_pid())


@pytest.mark.usefixtures("no_mpi4py")
def test_resolve_master_from_slurm_allocation() -> None:
    environ = {"SLURM_JOB_ID": "30", "SLURM_JOB_NODELIST": "node[1-2]"}
    for rank in range(4):
        info = resolve_master(mpi_info(rank, 4, 2, launcher="openmpi"), environ)
        assert (info.master_addr, info.master_port) == ("node1", derive_port("30", "mpi"))
    kept = resolve_master(mpi_info(2, 4, 2, master_port=29500), environ)
    assert (kept.master_addr, kept.master_port) == ("node1", 29500)


@pytest.mark.usefixtures("no_mpi4py")
def test_resolve_master_error() -> None:
    with pytest.raises(MasterAddressError) as e:
        resolve_master(mpi_info(2, 4, 2), {"SLURM_JOB_ID": "30"})  # no nodelist
    text = str(e.value)
    assert "4 ranks on 2 nodes" in text and "mpi4py" in text and "HINT" in text
    assert "MASTER_ADDR" in text


def test_resolve_master_known_or_single() -> None:
    known = mpi_info(1, 4, 2, master_addr="h", master_port=29500)
    assert resolve_master(known, {}) is known
    single = resolve_master(DistInfo(launcher="openmpi"), {})
    assert single.master_addr == "127.0.0.1"


# --- find_mismatches -------------------------------------------------------------------


def rows_of(name: str) -> list[dict[str, Any]]:
    """``hpc env --all`` rows for a real dump: detected layout plus the header's host."""
    rows = []
    for label, env in load(name):
        row = dataclasses.asdict(detect(env))
        row["host"] = parse_header(label).host
        rows.append(row)
    return rows


@pytest.mark.parametrize("name", ["sbatch_srun_tasks_env.txt", "srun_from_login_env.txt",
                                  "openmpi_mpirun_local.txt", "mpich_mpiexec_local.txt"])
def test_find_mismatches_clean(name: str) -> None:
    assert find_mismatches(rows_of(name)) == []


def test_find_mismatches_duplicate_local_rank() -> None:
    rows = rows_of("srun_from_login_env.txt")
    rows[1]["local_rank"] = 0
    assert find_mismatches(rows) == ["node1: local ranks [0, 0], expected 0..1"]


def test_find_mismatches_different_master() -> None:
    rows = rows_of("srun_from_login_env.txt")
    rows[3]["master_addr"] = "node2"
    rows[2]["master_port"] = 29500
    problems = find_mismatches(rows)
    assert "master_addr differs between ranks: ['node1', 'node2']" in problems
    assert any(p.startswith("master_port differs") and "29500" in p for p in problems)
    assert len(problems) == 2


def test_find_mismatches_wrong_local_world_size() -> None:
    rows = rows_of("srun_from_login_env.txt")
    rows[2]["local_world_size"] = 4
    assert find_mismatches(rows) == ["node2: local_world_size [2, 4] but 2 ranks"]


def test_find_mismatches_ranks_and_nodes() -> None:
    rows = rows_of("srun_from_login_env.txt")
    rows[3]["rank"] = 1
    rows[2]["node_rank"] = 0
    problems = find_mismatches(rows)
    assert "ranks are not 0..3: [0, 1, 1, 2]" in problems
    assert "node2: several node ranks [0, 1]" in problems


# --- rank_env --------------------------------------------------------------------------


def test_rank_env_gives_hpc_run_layout() -> None:
    base = {"PATH": "/usr/bin"}
    envs = [rank_env(r, 4, 29555, "run1", base=base) for r in range(4)]
    assert base == {"PATH": "/usr/bin"}  # not modified
    infos = [detect(env) for env in envs]
    assert [i.rank for i in infos] == [0, 1, 2, 3] == [i.local_rank for i in infos]
    assert {(i.launcher, i.world_size, i.local_world_size, i.num_nodes, i.master_addr,
             i.master_port, i.job_id) for i in infos} == {
        ("hpc-run", 4, 4, 1, "127.0.0.1", 29555, "run1")}
    rows = [dict(dataclasses.asdict(i), host="localhost") for i in infos]
    assert find_mismatches(rows) == []
    assert all(env["PATH"] == "/usr/bin" and env["PYTHONUNBUFFERED"] == "1" for env in envs)
    assert all(int(env["OMP_NUM_THREADS"]) >= 1 for env in envs)


def test_rank_env_keeps_user_threads_and_reads_os_environ(
        monkeypatch: pytest.MonkeyPatch) -> None:
    assert rank_env(0, 2, 1, "r", base={"OMP_NUM_THREADS": "7"})["OMP_NUM_THREADS"] == "7"
    monkeypatch.setenv("HPC_TEST_MARKER", "yes")
    assert rank_env(0, 2, 1, "r")["HPC_TEST_MARKER"] == "yes"


def test_rank_env_keeps_gloo_on_loopback_with_two_lanes() -> None:
    assert rank_env(0, 2, 1, "r", base={}, loopback="lo")["GLOO_SOCKET_IFNAME"] == "lo,lo"
    user = {"GLOO_SOCKET_IFNAME": "eth0"}
    assert rank_env(0, 2, 1, "r", base=user, loopback="lo")["GLOO_SOCKET_IFNAME"] == "eth0"
    assert "GLOO_SOCKET_IFNAME" not in rank_env(0, 2, 1, "r", base={})


def test_loopback_interface_exists_on_linux() -> None:
    if not sys.platform.startswith("linux"):
        pytest.skip("the loopback interface is called lo on Linux only")
    assert loopback_interface() == "lo"


def test_rank_env_inside_slurm_is_not_an_inconsistency() -> None:
    """``hpc run`` inside an srun task: its ranks carry the task's SLURM_* too."""
    task = load("srun_from_login_env.txt")[1][1]
    info = detect(rank_env(3, 4, 29555, "run1", base=task))
    assert (info.launcher, info.rank, info.world_size) == ("hpc-run", 3, 4)


# --- DistInfo --------------------------------------------------------------------------


@pytest.mark.parametrize("fields,bad", [
    (dict(world_size=0, local_world_size=0, num_nodes=0), "world_size"),
    (dict(rank=-1), "rank"),
    (dict(rank=8), "rank"),
    (dict(local_world_size=9), "local_world_size"),
    (dict(local_rank=4), "local_rank"),
    (dict(num_nodes=9), "num_nodes"),
    (dict(node_rank=2), "node_rank"),
])
def test_distinfo_layout_errors(fields: dict[str, int], bad: str) -> None:
    with pytest.raises(LaunchEnvironmentError) as e:
        dataclasses.replace(INFO, **fields)
    text = str(e.value)
    assert f"({bad}" in text or f", {bad}" in text, text
    assert text.startswith("slurm: inconsistent layout") and "HINT" in text


@pytest.mark.parametrize("port", [0, -1, 65536])
def test_distinfo_port_errors(port: int) -> None:
    with pytest.raises(LaunchEnvironmentError, match=f"master port {port} is not a TCP port"):
        INFO.replace(master_port=port)


def test_distinfo_describe_and_roles() -> None:
    assert INFO.describe() == "slurm rank 3/8 local 1/4 node 0/2 master node1:15042"
    assert DistInfo(launcher="mpich").describe() == (
        "mpich rank 0/1 local 0/1 node 0/1 master unresolved")
    assert not INFO.is_master and not INFO.is_local_master
    assert DistInfo(launcher="local").is_master
    with pytest.raises(dataclasses.FrozenInstanceError):
        INFO.rank = 0  # type: ignore[misc]
    assert Counter(INFO.replace(rank=r).is_master for r in range(8)) == {False: 7, True: 1}
