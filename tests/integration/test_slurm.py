"""The launchers of issue 3 on the real 2-node test cluster (``bin/hpc-testcluster up``).

Each test starts real jobs on node1 and node2 (2 tasks each, gloo on CPU torch) and
asserts on what the ranks printed and on what accounting recorded:

* the three sbatch templates (``sbatch --wait``), mpirun.sbatch with Open MPI and MPICH;
* ``srun -N2 -n4`` from the login host, ``salloc`` + ``mpirun``/``mpiexec`` (the MPI
  variables win over ``SLURM_PROCID`` of the launcher's own step), with and without
  mpi4py, and an mpi4py program direct-launched by ``srun --mpi=pmix`` / ``--mpi=pmi2``;
* python in the batch script without srun (one process, a HINT, no hang), a dying rank
  (the job ends non-zero within 60 s) and two concurrent steps (distinct master ports);
* the launch environment of each combination, captured and read back through ``detect``.
  ``HPC_WRITE_ENV_FIXTURES=DIR`` also writes the captures there, in the format of
  ``tests/fixtures/env/`` (that is how the committed dumps were made).

Run (2 shared cores: one heavy run at a time)::

    flock -o /tmp/hpc-heavy.lock /work/venv/bin/python -m pytest -m slurm tests/integration/test_slurm.py

Every job gets ``--time=3`` and a unique name; whatever still runs under that name is
cancelled when its test ends, so a failure leaves nothing in the queue.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from hpc.environments import detect
from hpc.environments.base import derive_port
from tests.helpers.demo import DEMO, check_demo
from tests.helpers.envdumps import parse_dump, parse_header
from tests.helpers.mpi import launcher, no_mpi4py
from tests.helpers.paths import ROOT, script
from tests.helpers.requires import require
from tests.helpers.slurm import run, sbatch, slurm_env

pytestmark = [pytest.mark.slurm, pytest.mark.usefixtures("cluster")]

PY = sys.executable
NODES = ["node1", "node2"]
MPI_EXE = {"openmpi": ["mpirun.openmpi", "-np", "4"], "mpich": ["mpiexec.mpich", "-n", "4"]}
STATE_DIR = os.environ.get("HPC_TESTCLUSTER_DIR", "/var/tmp/hpc-testcluster")


def step_port(job_id: int, step: int) -> int:
    """The documented srun-step port: 15000 + (job * 64 + step) % 17000."""
    return 15000 + (job_id * 64 + step) % 17000


def env_for(kind: str, tmp: Path, *, with_mpi4py: bool = True) -> dict[str, str]:
    """slurm_env() plus what ranks of ``kind`` need: MPICH's libmpi for mpi4py, or no mpi4py."""
    env = slurm_env()
    if not with_mpi4py:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [no_mpi4py(tmp), env.get("PYTHONPATH")]))
    elif kind == "mpich":  # the mpi4py wheel loads Open MPI unless pointed at MPICH
        _, mpich = launcher("mpich", tmp, 4, with_mpi4py=True)
        env.update(MPI4PY_LIBMPI=mpich["MPI4PY_LIBMPI"], LD_LIBRARY_PATH=mpich["LD_LIBRARY_PATH"])
    return env


def accounted(*select: str) -> dict[str, tuple[str, str]]:
    """``{JobID: (State, ExitCode)}`` of one job and its steps from sacct, once final.

    ``select`` is ``-j ID`` or ``--name=NAME``; slurmdbd may lag a second behind.
    """
    deadline = time.monotonic() + 20
    while True:
        out = subprocess.run(["sacct", "-n", "-P", "-S", "now-1hours",
                              "-o", "JobID,State,ExitCode", *select],
                             check=False, capture_output=True, text=True, timeout=20).stdout
        rows = {r[0]: (r[1], r[2]) for r in (line.split("|") for line in out.splitlines()
                                             if line.strip())}
        if (sum("." not in k for k in rows) == 1
                and not {s for s, _ in rows.values()} & {"PENDING", "RUNNING", "COMPLETING"}):
            return rows
        assert time.monotonic() < deadline, f"sacct {select}: {out!r}"
        time.sleep(0.5)


def completed(*select: str) -> int:
    """Assert that sacct has the job and every step COMPLETED 0:0; return the job id."""
    rows = accounted(*select)
    assert all(v == ("COMPLETED", "0:0") for v in rows.values()), rows
    return int(next(k for k in rows if "." not in k))


def check_layout(output: str, launcher_name: str) -> list[re.Match[str]]:
    """check_demo for 4 ranks, plus: 2 per node on node1/node2, block order, master on
    rank 0's host."""
    rows = check_demo(output, 4, launcher_name)
    by_rank = {int(m[1]): m for m in rows}
    assert [by_rank[r][7] for r in range(4)] == ["node1", "node1", "node2", "node2"], output
    assert [(int(m[3]), int(m[4]), int(m[5]), int(m[6])) for _, m in sorted(by_rank.items())] \
        == [(0, 2, 0, 2), (1, 2, 0, 2), (0, 2, 1, 2), (1, 2, 1, 2)], output
    assert rows[0][9].rsplit(":", 1)[0] == "node1", "master is not rank 0's host"
    return rows


def master_port(rows: list[re.Match[str]]) -> int:
    return int(rows[0][9].rsplit(":", 1)[1])


# --- sbatch templates ------------------------------------------------------------------

TEMPLATES = {
    "pretrain": ("pretrain.sbatch", "slurm", None),
    "torchrun": ("torchrun.sbatch", "torchrun", None),
    "mpirun-openmpi": ("mpirun.sbatch", "openmpi", "mpirun.openmpi"),
    "mpirun-mpich": ("mpirun.sbatch", "mpich", "mpiexec.mpich"),
}


@pytest.mark.timeout(150)
@pytest.mark.parametrize("case", list(TEMPLATES))
def test_template_runs_demo(case: str, job: str, tmp_path: Path) -> None:
    template, launcher_name, mpirun = TEMPLATES[case]
    env = env_for(launcher_name, tmp_path)
    if mpirun:
        env["HPC_MPIRUN"] = require(mpirun, "MPI launcher")
    job_id, code, out = sbatch([str(ROOT / "slurm" / template), *DEMO], job, tmp_path, env)
    assert code == 0, out
    rows = check_layout(out, launcher_name)
    assert completed("-j", str(job_id)) == job_id
    if case == "pretrain":
        assert master_port(rows) == step_port(job_id, 0)
    if case == "torchrun":  # the template's rendezvous, and the agents' store as master
        assert f"rendezvous node1:{step_port(job_id, 63)}" in out


@pytest.mark.timeout(150)
@pytest.mark.parametrize("template", ["pretrain.sbatch", "torchrun.sbatch"])
def test_template_leading_python_is_hpc_python(template: str, job: str,
                                               tmp_path: Path) -> None:
    """`sbatch slurm/X.sbatch python -m hpc demo` as the headers advertise, with another
    `python` first on PATH: HPC_PYTHON runs it. Also: no c10d "hostname of the client
    socket" warning (bin/hpc-testcluster's /etc/hosts maps the IPv4-mapped addresses)."""
    shim = tmp_path / "bin"
    shim.mkdir()
    (shim / "python").write_text("#!/bin/sh\necho 'the python on PATH ran' >&2; exit 7\n")
    (shim / "python").chmod(0o755)
    env = slurm_env(HPC_PYTHON=PY)
    env["PATH"] = f"{shim}{os.pathsep}{env['PATH']}"
    _, code, out = sbatch([str(ROOT / "slurm" / template), "python", "-m", "hpc",
                           "demo"], job, tmp_path, env)
    assert code == 0 and "the python on PATH ran" not in out, out
    check_layout(out, "slurm" if template == "pretrain.sbatch" else "torchrun")
    assert "hostname of the client socket cannot be retrieved" not in out, out


# --- srun, salloc + MPI, srun direct MPI launch ----------------------------------------

INIT_ON_GPU_NODE = ("import hpc; info = hpc.init_torch(); "
                    "print('device', hpc.device(), 'warnings', len(info.warnings), flush=True)")


@pytest.mark.timeout(120)
def test_cpu_torch_with_granted_gpus_is_refused(job: str, tmp_path: Path) -> None:
    """Issue 30: `srun -N1 -n1 --gpus-per-node=2` with the CPU torch trained on the CPU
    without a word (device cpu, no warning); now refused, HPC_ALLOW_CPU=1 accepts it."""
    env = slurm_env()
    del env["HPC_ALLOW_CPU"]  # slurm_env() accepts the fake GPUs for the other tests
    argv = ["srun", "-N1", "-n1", "--gpus-per-node=2", PY, "-c", INIT_ON_GPU_NODE]
    proc = run(argv, job, tmp_path, env)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "device cpu" not in out, out
    import torch

    assert f"torch {torch.__version__} is a CPU-only build" in out, out
    assert "SLURM_GPUS_ON_NODE=2" in out and "CUDA_VISIBLE_DEVICES=0,1" in out, out
    assert "HINT: install torch's CUDA build" in out and "HPC_ALLOW_CPU=1" in out, out
    proc = run(argv, job, tmp_path, dict(env, HPC_ALLOW_CPU="1"))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "device cpu warnings 1" in proc.stdout, out
    assert out.count("training on the CPU, as HPC_ALLOW_CPU=1 asks") == 1, out

WRITE_AFTER_INIT = """import pathlib, socket, sys
import hpc
info = hpc.init_torch()
if info.is_master:
    pathlib.Path(sys.argv[1], f"master-{socket.gethostname()}").touch()
"""


@pytest.mark.timeout(120)
def test_torchrun_per_srun_task_without_rendezvous_is_refused(job: str, tmp_path: Path
                                                              ) -> None:
    """Issue 30: `srun -N2 --ntasks-per-node=1 torchrun --nproc-per-node 2` (no --nnodes or
    rendezvous) made one world per node, a master on each; now every rank refuses at
    init, before the script writes anything."""
    script_path = tmp_path / "train.py"
    script_path.write_text(WRITE_AFTER_INIT)
    proc = run(["srun", "-N2", "--ntasks-per-node=1", "-c2", PY, "-m", "torch.distributed.run",
                "--nproc-per-node", "2", str(script_path), str(tmp_path)],
               job, tmp_path, slurm_env())
    out = proc.stdout + proc.stderr
    assert sorted(p.name for p in tmp_path.glob("master-*")) == [], out  # not two masters
    assert proc.returncode != 0, out
    fact = ("torchrun formed a world of 2 rank(s) on 1 node(s) (WORLD_SIZE=2, "
            "GROUP_WORLD_SIZE=1) inside a Slurm step of 2 tasks on 2 node(s)")
    assert out.count(fact) >= 4, out  # every rank of both worlds
    assert "--rdzv-endpoint $(hostname):29500" in out and "slurm/torchrun.sbatch" in out


@pytest.mark.timeout(120)
def test_srun_from_login_host(job: str, tmp_path: Path) -> None:
    proc = run(["srun", "-N2", "-n4", *DEMO], job, tmp_path, slurm_env())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = check_layout(proc.stdout, "slurm")
    job_id = completed(f"--name={job}")
    assert master_port(rows) == step_port(job_id, 0)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("with_mpi4py", [True, False], ids=["mpi4py", "no-mpi4py"])
@pytest.mark.parametrize("kind", ["openmpi", "mpich"])
def test_salloc_mpi_launcher(kind: str, with_mpi4py: bool, job: str, tmp_path: Path) -> None:
    """mpirun/mpiexec start their daemons through srun: every rank inherits that step's
    SLURM_PROCID/SLURM_LOCALID (one per node), which must lose to the MPI variables."""
    exe = MPI_EXE[kind]
    require(exe[0], "MPI launcher")
    env = env_for(kind, tmp_path, with_mpi4py=with_mpi4py)
    proc = run(["salloc", "-N2", "-n4", *exe, *DEMO], job, tmp_path, env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = check_layout(proc.stdout, kind)
    job_id = completed(f"--name={job}")
    port = master_port(rows)
    # mpi4py: rank 0 broadcasts a port it found free (ephemeral range); without it
    # every rank derives the same one from the allocation.
    assert port >= 32768 if with_mpi4py else port == derive_port(job_id, "mpi"), port


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mpi", ["pmix", "pmi2"])
def test_srun_direct_mpi_launch(mpi: str, job: str, tmp_path: Path) -> None:
    """An mpi4py program started by srun itself: Open MPI through PMIx (only PMIX_RANK),
    MPICH through PMI2 (PMI_RANK/PMI_SIZE, no MPI_LOCALRANKID); read as Slurm tasks."""
    env = env_for("mpich" if mpi == "pmi2" else "openmpi", tmp_path)
    proc = run(["srun", f"--mpi={mpi}", "-N2", "-n4", PY, script("slurm_mpi_demo.py")],
               job, tmp_path, env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = check_layout(proc.stdout, "slurm")
    mpi_rows = re.findall(r"MPI comm_rank=(\d+) comm_size=(\d+) hpc_rank=(\d+) vars=(\S+)",
                          proc.stdout)
    assert sorted(int(r[0]) for r in mpi_rows) == [0, 1, 2, 3], proc.stdout
    assert all(r[0] == r[2] and r[1] == "4" for r in mpi_rows), "mpi4py and hpc disagree"
    assert {r[3] for r in mpi_rows} == {"PMIX_RANK" if mpi == "pmix" else "PMI_RANK"}
    job_id = completed(f"--name={job}")
    assert master_port(rows) == step_port(job_id, 0)


# --- misuse and failures ---------------------------------------------------------------


@pytest.mark.timeout(120)
def test_python_in_batch_script_without_srun(job: str, tmp_path: Path) -> None:
    start = time.monotonic()
    job_id, code, out = sbatch(["-N2", "--ntasks-per-node=2", "--wrap", shlex.join(DEMO)],
                               job, tmp_path, timeout=90)
    elapsed = time.monotonic() - start
    assert code == 0, out
    rows = check_demo(out, 1, "slurm")
    assert len(rows) == 1 and rows[0][7] == "node1"
    assert rows[0][9] == f"127.0.0.1:{derive_port(job_id, 4094)}"  # the batch step's slot
    warning = out[out.index("no srun step"):]
    assert "SLURM_NTASKS=4" in out and "HINT:" in warning and "srun" in warning, out
    assert elapsed < 60
    assert completed("-j", str(job_id)) == job_id


@pytest.mark.timeout(120)
def test_dying_rank_ends_job(job: str, tmp_path: Path) -> None:
    """Rank 3 exits 3 after init while 0-2 block in all_reduce: srun --kill-on-bad-exit."""
    env = slurm_env(FAIL_RANK="3")
    start = time.monotonic()
    job_id, code, out = sbatch([str(ROOT / "slurm" / "pretrain.sbatch"), PY,
                                script("launch_fail.py")], job, tmp_path, env, timeout=90)
    elapsed = time.monotonic() - start
    assert code != 0, out
    assert elapsed < 60, f"job {job_id} took {elapsed:.0f}s to end"
    assert "rank 3 failing on purpose" in out
    # srun's report names the first task to exit non-zero: rank 3 itself, or (with tasks
    # bound to one CPU each, task/affinity) its node2 peer whose gloo connection to
    # rank 3 closed while rank 3 was still tearing down; both happen within a second.
    assert re.search(r"node2: tasks? [0-9,-]*[23]: Exited with exit code [13]", out), out
    # ... while the template's closing line, from the failure marks, is rank 3 either way
    assert re.search(r"^hpc: first failure: rank 3 on node2 \(pid \d+\) at ", out,
                     re.MULTILINE), out
    assert "UNREACHABLE" not in out
    rows = accounted("-j", str(job_id))
    assert rows[str(job_id)][0] == "FAILED" and rows[f"{job_id}.0"][0] in ("FAILED", "CANCELLED")


# Two srun steps of one job at the same time, each one task per node. Steps get whole
# cores: the job asks for both cores of each node (2 tasks x 1 CPU) so that two --exact
# steps of one core per node fit side by side.
STEPS_SCRIPT = """#!/bin/bash
step() {{ srun --exact -N2 -n2 --ntasks-per-node=1 --cpus-per-task=1 --kill-on-bad-exit=1 \\
        {py} {script} {marks} "$@"; }}
step a b & A=$!
step b a & B=$!
wait $A; ra=$?
wait $B; rb=$?
echo "STEPS a=$ra b=$rb"
[ $ra -eq 0 ] && [ $rb -eq 0 ]
"""


@pytest.mark.timeout(120)
def test_concurrent_steps_get_distinct_ports(job: str, tmp_path: Path) -> None:
    marks = tmp_path / "marks"
    marks.mkdir()
    batch = tmp_path / "steps.sh"
    batch.write_text(STEPS_SCRIPT.format(py=PY, script=script("slurm_steps.py"), marks=marks))
    job_id, code, out = sbatch(["-N2", "--ntasks-per-node=2", "--cpus-per-task=1", str(batch)],
                               job, tmp_path)
    assert code == 0 and "STEPS a=0 b=0" in out, out
    rows = re.findall(r"STEP name=(\w) step=(\d+) rank=(\d) world=2 master=(\S+) sum=3 "
                      r"overlap=(\S+)", out)
    assert len(rows) == 4, out
    steps = {name: {(s, m) for n, s, _, m, _ in rows if n == name} for name in "ab"}
    assert all(len(v) == 1 for v in steps.values()), "ranks of one step disagree"
    (sa, ma), (sb, mb) = steps["a"].pop(), steps["b"].pop()
    assert {sa, sb} == {"0", "1"}
    assert ma != mb and ma.startswith("node1:") and mb.startswith("node1:")
    for step, master in ((sa, ma), (sb, mb)):
        assert master == f"node1:{step_port(job_id, int(step))}"
    assert sorted(o for *_, o in rows) == ["n/a", "n/a", "yes", "yes"]
    assert {f"{job_id}.0", f"{job_id}.1"} <= set(accounted("-j", str(job_id)))
    assert completed("-j", str(job_id)) == job_id


# --- launch environments -----------------------------------------------------------


def _capture(name: str, out: Path, port: int) -> tuple[list[str], str]:
    """(argv without job name/time limit, MPI kind for env_for) of capture ``name``."""
    dump = [PY, script("slurm_envdump.py"), str(out)]
    return {
        "mpirun_openmpi_salloc_env.txt": (
            ["salloc", "-N2", "-n4", *MPI_EXE["openmpi"], *dump, "mpi4py"], "openmpi"),
        "mpiexec_mpich_salloc_env.txt": (
            ["salloc", "-N2", "-n4", *MPI_EXE["mpich"], *dump, "mpi4py"], "mpich"),
        "srun_pmix_env.txt": (["srun", "--mpi=pmix", "-N2", "-n4", *dump, "mpi4py"], "openmpi"),
        "srun_pmi2_env.txt": (["srun", "--mpi=pmi2", "-N2", "-n4", *dump, "mpi4py"], "mpich"),
        "srun_gpus_per_task_env.txt": (
            ["srun", "-N2", "-n4", "--gpus-per-task=1", *dump, "SLURM_PROCID"], "slurm"),
        "srun_torchrun_env.txt": (
            ["srun", "-N2", "--ntasks-per-node=1", PY, "-m", "torch.distributed.run",
             "--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
             "--rdzv-endpoint", f"node1:{port}", "--rdzv-id", "envdump", *dump[1:], "RANK"],
            "torchrun"),
        "salloc_shell_env.txt": (["salloc", "-N2", "-n4", *dump, "label:salloc-shell"], "slurm"),
    }[name]


CAPTURES = {  # file: (launcher detect must report, world size)
    "mpirun_openmpi_salloc_env.txt": ("openmpi", 4),
    "mpiexec_mpich_salloc_env.txt": ("mpich", 4),
    "srun_pmix_env.txt": ("slurm", 4),
    "srun_pmi2_env.txt": ("slurm", 4),
    "srun_gpus_per_task_env.txt": ("slurm", 4),
    "srun_torchrun_env.txt": ("torchrun", 4),
    "salloc_shell_env.txt": ("slurm", 1),
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", list(CAPTURES))
def test_capture_launch_environment(name: str, job: str, tmp_path: Path) -> None:
    """Dump every task's launcher variables and read each block back through detect."""
    out = tmp_path / "dump"
    out.mkdir()
    argv, kind = _capture(name, out, 20000 + int(uuid.uuid4().int % 9000))
    proc = run(argv, job, tmp_path, env_for(kind, tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    files = sorted(out.glob("*.txt"), key=lambda p: int(p.stem.split("-")[-1])
                   if p.stem.startswith("task-") else 0)
    text = "".join(p.read_text(encoding="utf-8") for p in files)
    launcher_name, world = CAPTURES[name]
    blocks = parse_dump(text)
    assert len(blocks) == world, text
    for label, env in blocks:
        header = parse_header(label)
        info = detect(env)
        assert (info.launcher, info.world_size) == (launcher_name, world), label
        if world == 1:  # salloc's shell runs on the login host: one process, a HINT
            assert header.host not in NODES
            assert len(info.warnings) == 1 and "HINT" in info.warnings[0]
            continue
        assert info.rank == header.rank and header.host == NODES[header.rank // 2], label
        assert (info.local_rank, info.node_rank) == (header.rank % 2, header.rank // 2)
        assert info.warnings == (), label
    if name == "srun_gpus_per_task_env.txt":  # one fake GPU per task, by local rank
        assert [env["CUDA_VISIBLE_DEVICES"] for _, env in blocks] == ["0", "1", "0", "1"]
    target = os.environ.get("HPC_WRITE_ENV_FIXTURES")
    if target:
        for old, new in ((str(tmp_path), "/srv/slurm-lab"), (STATE_DIR, "/srv/slurm-lab/state")):
            text = text.replace(old, new)
        Path(target, name).write_text(text, encoding="utf-8")
