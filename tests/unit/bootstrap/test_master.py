"""resolve_master: the master address where the launcher gives none."""

from __future__ import annotations

import sys
from typing import Any

import pytest

from hpc.bootstrap.master import resolve_master
from hpc.environments import detect
from hpc.environments.base import (
    PORT_BASE,
    PORT_SPAN,
    DistInfo,
    derive_port,
    launcher_pid,
)
from hpc.errors import MasterAddressError
from tests.helpers.envdumps import load

INFO = DistInfo(launcher="slurm", rank=3, local_rank=1, world_size=8, local_world_size=4,
                node_rank=0, num_nodes=2, master_addr="node1", master_port=15042)



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


@pytest.mark.usefixtures("no_mpi4py")
def test_resolve_master_asks_the_launchers_hook() -> None:
    # Hand-set torchrun variables without MASTER_*: the same fallbacks as before the
    # hooks (every rank here, else the Slurm allocation), now in torchrun.py.
    torchrun = mpi_info(1, 4, 4, launcher="torchrun")
    assert resolve_master(torchrun, {}).master_addr == "127.0.0.1"
    spread = mpi_info(3, 4, 2, launcher="slurm", master_port=15001)
    environ = {"SLURM_JOB_ID": "30", "SLURM_JOB_NODELIST": "node[3-4]"}
    assert (resolve_master(spread, environ).master_addr,
            resolve_master(spread, environ).master_port) == ("node3", 15001)
    # mpi4py layouts take the MPI hook; an unknown launcher has no fallback.
    assert resolve_master(mpi_info(1, 4, 4, launcher="mpi4py"), {}).master_addr == "127.0.0.1"
    with pytest.raises(MasterAddressError):
        resolve_master(mpi_info(1, 4, 4, launcher="lsf"), {})


def test_environment_master_hook_defaults_to_none() -> None:
    from hpc.environments.local import LocalEnvironment

    assert LocalEnvironment.master(mpi_info(1, 4, 4, launcher="local"), {}) is None


# --- an inherited MASTER_PORT in the ephemeral range (issue 13) ------------------------


def test_ephemeral_master_port_warns(tmp_path) -> None:
    from hpc.bootstrap.master import ephemeral_port_warning, ephemeral_range

    ranges = tmp_path / "range"
    ranges.write_text("32768\t60999\n")
    assert ephemeral_range(str(ranges)) == (32768, 60999)
    assert ephemeral_range(str(tmp_path / "none")) is None
    env = dict(load("srun_from_login_env.txt")[1][1], MASTER_PORT="41000")
    info = detect(env)
    text = ephemeral_port_warning(info, env, (32768, 60999))
    assert text and "MASTER_PORT=41000" in text and "32768-60999" in text and "HINT" in text
    assert ephemeral_port_warning(info, dict(env, MASTER_PORT="29500"), (32768, 60999)) is None
    assert ephemeral_port_warning(info, dict(env, HPC_RUN_ID="x"), (32768, 60999)) is None
    assert ephemeral_port_warning(info, env, None) is None


def test_resolve_master_attaches_the_warning(monkeypatch) -> None:
    from hpc.bootstrap import master

    monkeypatch.setattr(master, "ephemeral_range", lambda: (32768, 60999))
    env = dict(load("srun_from_login_env.txt")[1][1], MASTER_PORT="41000")
    info = master.resolve_master(detect(env), env)
    assert info.master_port == 41000 and len(info.warnings) == 1


class _SingletonComm:
    """What mpi4py linked to another MPI sees in a process MPICH started: a world of 1."""

    def Get_size(self) -> int:  # noqa: N802 - mpi4py's spelling
        return 1

    def Get_rank(self) -> int:  # noqa: N802
        return 0


def test_hpc_launcher_mpi4py_refuses_a_world_the_launcher_disagrees_with(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A source-built mpi4py (ABI unknown) on the wrong MPI: not N silent rank-0 runs."""
    from hpc.bootstrap import master

    asked: list[str] = []
    monkeypatch.setattr(master, "mpi4py_world",
                        lambda launcher="": asked.append(launcher) or _SingletonComm())
    env = {"HPC_LAUNCHER": "mpi4py", "PMI_RANK": "1", "PMI_SIZE": "2",
           "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"}
    with pytest.raises(MasterAddressError) as e:
        master.from_mpi4py(env)
    assert asked == ["mpich"]  # the ABI check knows which MPI started the process
    assert str(e.value).startswith("HPC_LAUNCHER=mpi4py: mpi4py sees 1 rank(s) but mpich "
                                   "started 2.\n")
    assert "export MPI4PY_LIBMPI=" in str(e.value) and "unset HPC_LAUNCHER" in str(e.value)


def test_hpc_launcher_mpi4py_unusable_names_the_launcher(monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    from hpc.bootstrap import master

    monkeypatch.setattr(master, "mpi4py_world", lambda launcher="": None)
    env = {"HPC_LAUNCHER": "mpi4py", "OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2",
           "OMPI_COMM_WORLD_LOCAL_RANK": "0", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}
    with pytest.raises(MasterAddressError, match="cannot be imported or would load another "
                       "MPI library than openmpi's"):
        master.from_mpi4py(env)
    with pytest.raises(MasterAddressError, match=r"cannot be imported\.\nHINT: pip install"):
        master.from_mpi4py({"HPC_LAUNCHER": "mpi4py"})
