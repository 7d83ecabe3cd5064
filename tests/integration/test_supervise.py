"""``hpc supervise`` in ``slurm/pretrain.sbatch`` on the 4-node cluster: a host that fails is
left out and the step runs again inside the allocation; a program error ends the job.

Every job runs the tiny pretrain (4 ranks: 2 nodes x 2 tasks, :mod:`tests.helpers.tiny_pretrain`)
with ``--no-kill``; faults come from ``HPC_FAULT`` (both ranks of node2 SIGKILL themselves
at step 7, after the checkpoint of step 6: the node "crashes", no rank writes a mark):

* 3 nodes, 1 spare (``HPC_SPARE_NODES=1``): the supervisor names node2 alone, relaunches
  on node1,node3 from step 6, the job COMPLETES in its first allocation, bitwise equal to
  the uninterrupted reference, node2 struck once in the bad-node ledger;
* 2 nodes, no spare (``HPC_SUPERVISE=1``): the job is requeued with the crashed host (the
  second of its first run) in its ``ExcNodeList``; its second run lands on two other
  nodes and completes, bitwise equal;
* rank 2 SIGKILLed at its second step in every attempt (a step hook: the fault follows the
  rank to the spare), before any checkpoint: the no-progress limit ends the job after two
  attempts, though a spare and budget are left;
* node2 silenced once checkpoint 6 is written, its link cut (``ip link set hpcv-node2
  down``) or the whole node crashed (``bin/hpc-testcluster crash node2``), while every
  rank holds at step 7 until the fault is in place (a step hook): the supervisor finds
  node2 silent on slurmd's port, relaunches on node1,node3 and the job completes
  bitwise equal;
* ``HPC_FAULT=2:5:exc`` and a real bug (a shape error): the job ends non-zero within
  seconds, no restart, the rank and its exception named, no strike;
* the other launchers and paths, node2's ranks crashing at step 7: ``torchrun.sbatch``,
  ``mpirun.sbatch`` (Open MPI), ``hpc submit --spare-nodes 1``, ``--array 2`` (each task
  on its own spare), and 2 nodes without a spare under ``HPC_SUPERVISE_ELASTIC=1`` (goes
  on on node1 alone).

Run under the shared lock: ``flock /tmp/hpc-heavy.lock pytest tests/integration/test_supervise.py``
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import pytest

from hpc.ledger import Ledger
from hpc.submit import watch as jobwatch
from tests.helpers.paths import ROOT
from tests.helpers.requires import require
from tests.helpers.slurm import (
    require_four,
    sbatch_nowait,
    sbatch_wait,
    slurm_env,
    until,
    wait_for_file,
)
from tests.helpers.step_hooks import buggy, holding, killing, killing_first_run, slowed
from tests.helpers.tiny_pretrain import (
    ENV,
    TINY_ARGS,
    assert_each_step_once,
    assert_same_final_weights,
    train_steps,
)

pytestmark = pytest.mark.slurm
pytest.importorskip("torch")
pytest.importorskip("sklearn")

TEMPLATE = str(ROOT / "slurm" / "pretrain.sbatch")
#: node2's ranks (2-3 of 4, two per node) crash after step 7, past the checkpoint of step 6.
CRASH_NODE2 = "2:7:kill,3:7:kill"
#: Within this many seconds of a crash the relaunched ranks have resumed (the issue's 30 s).
RESUMED_WITHIN_S = 30
_STAMP = re.compile(r"^(?:\d+: )?(\d\d:\d\d:\d\d) ")


@pytest.fixture(scope="module", autouse=True)
def four_nodes() -> None:
    require_four()


def _stamp(line: str) -> datetime:
    m = _STAMP.match(line)
    assert m, line
    return datetime.strptime(m[1], "%H:%M:%S")


def _fault_to_resume_s(text: str) -> float:
    """Seconds (1 s resolution) from the first injected SIGKILL to the first rank's
    "resumed from" line after it."""
    lines = text.splitlines()
    fault = next(i for i, x in enumerate(lines) if "HPC_FAULT" in x and "SIGKILL to" in x)
    resumed = next(x for x in lines[fault:] if "INFO hpc.pretrain.resume: resumed from" in x)
    return (_stamp(resumed) - _stamp(lines[fault])).total_seconds()


def _hostnames(nodelist: str) -> list[str]:
    return subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True,
                          text=True, timeout=20, check=True).stdout.split()


def _runs(job_id: object) -> list[str]:
    """The job's runs in sacct, once sacct too has its end (it lags squeue a little)."""
    jobwatch.wait(str(job_id), timeout=60)
    return [r.word for r in jobwatch.history(str(job_id))]


def _assert_recovered(job_id: object, out: Path, reference: Path, host: str,
                      text: str, what: str) -> None:
    """One allocation, ``host`` alone struck, every step once, bitwise the reference, and
    the relaunched ranks resumed within :data:`RESUMED_WITHIN_S` of the injected crash."""
    assert _runs(job_id) == ["COMPLETED"]  # one allocation
    assert [s.host for s in Ledger().strikes()] == [host]  # the culprit, no healthy node
    assert_each_step_once(out)
    assert_same_final_weights(out, reference)
    took = _fault_to_resume_s(text)
    print(f"{what}: crash on {host} to resumed: {took:.0f} s", file=sys.stderr)
    assert took <= RESUMED_WITHIN_S, text[-4000:]


def _crash_node2_with_a_spare(template: str, per_node: int, out: Path, tmp_path: Path,
                              **variables: str) -> tuple[int, str]:
    """``slurm/TEMPLATE`` on 3 nodes of partition four, 1 spare, the tiny pretrain slowed
    to 0.6 s a step, ranks 2-3 SIGKILLing themselves at step 7; (job id, its output) once
    it ended with status 0."""
    env = slurm_env(**ENV, **slowed(0.6), **variables, HPC_SPARE_NODES="1",
                    HPC_FAULT=CRASH_NODE2)
    job_id, rc, text = sbatch_wait(["-p", "four", "-N3", f"--ntasks-per-node={per_node}",
                                    "--no-kill", str(ROOT / "slurm" / template), *TINY_ARGS,
                                    "--out", str(out)], tmp_path, timeout=240, env=env)
    assert rc == 0, text[-4000:]
    return job_id, text


def _decisions(text: str) -> list[str]:
    return [x for x in text.splitlines() if re.match(r"\d\d:\d\d:\d\d hpc supervise: attempt", x)]


@pytest.mark.timeout(300)
def test_a_crashed_node_is_replaced_by_the_spare_and_the_run_ends_bitwise(
        tiny_reference: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    # 0.6 s a step: the relaunch runs ~10 s, past the supervisor's settle time (the empty
    # faulthandler files of healthy ranks once counted as marks, and cancelled a healthy
    # step 8 s after its ranks started)
    env = slurm_env(**ENV, **slowed(0.6), HPC_SPARE_NODES="1")
    # the fault through sbatch's --export (as docs/resilience.md shows): srun reads
    # SLURM_EXPORT_ENV, and once gave the relaunch the fault back (one rank: a comma would
    # end the value there)
    job_id, rc, text = sbatch_wait(["-p", "four", "-N3", "--ntasks-per-node=2", "--no-kill",
                                    "--export=ALL,HPC_FAULT=2:7:kill", TEMPLATE, *TINY_ARGS,
                                    "--out", str(out)], tmp_path, timeout=240, env=env)
    assert rc == 0, text[-4000:]
    assert " hpc supervise: 2 of 3 hosts, 2 tasks each; spares node3" in text, text[-4000:]
    decisions = _decisions(text)
    assert len(decisions) == 1 and text.count("cancelling it") == 1, text[-4000:]
    assert text.count("SIGKILL to rank 2") == 1, text[-4000:]
    assert re.search(r"attempt 0 failed: node2: rank 2 .* -> infrastructure \(node2 "
                     r"excluded\); relaunching on node1,node3 from step 6 ", decisions[0]), \
        decisions
    _assert_recovered(job_id, out, tiny_reference, "node2", text, "srun")


@pytest.mark.timeout(360)
def test_without_a_spare_the_job_is_requeued_without_the_crashed_node(
        tiny_reference: Path, tmp_path: Path, cancel_after: list[str]) -> None:
    out = tmp_path / "run"
    env = slurm_env(**ENV, HPC_SUPERVISE="1", HPC_FAULT=CRASH_NODE2)
    job_id = sbatch_nowait(["-p", "four", "-N2", "--ntasks-per-node=2", "--no-kill",
                            TEMPLATE, *TINY_ARGS, "--out", str(out)], tmp_path, env,
                           cancel_after)
    last = jobwatch.wait(job_id, timeout=300)
    text = (tmp_path / f"hpc-srun-{job_id}.out").read_text()
    assert last.word == "COMPLETED", text[-4000:]
    runs = [_hostnames(x) for x in
            re.findall(rf"^hpc: job {job_id} on (\S+):", text, re.MULTILINE)]
    assert len(runs) == 2, text[-4000:]
    crashed = runs[0][1]  # ranks 2-3: the first run's second host
    decisions = _decisions(text)
    assert len(decisions) == 1, text[-4000:]
    assert re.search(rf"attempt 0 failed: {crashed}: ranks 2-3 .* -> infrastructure; 1 healthy "
                     r"hosts left of the 2 the step needs and no spare: requeueing without "
                     rf"{crashed}", decisions[0]), decisions
    assert crashed not in runs[1], runs
    assert _runs(job_id) == ["REQUEUED", "COMPLETED"]
    assert_each_step_once(out)
    assert_same_final_weights(out, tiny_reference)


#: (variables, the rank's first words of its failure in the log, the decision's regex)
APPLICATION_ERRORS = {
    "injected": ({"HPC_FAULT": "2:5:exc"}, "HPC_FAULT 2:5:exc: an exception",
                 r"attempt 0 failed: rank 2 on node2: .*InjectedFault.* -> application "
                 r"failure: no restart"),
    "shape_bug": (buggy(rank=2, at=5), "mat1 and mat2 shapes cannot be multiplied",
                  r"attempt 0 failed: rank 2 on node2: RuntimeError: mat1 and mat2 shapes "
                  r"cannot be multiplied.* -> application failure: no restart"),
}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("error", list(APPLICATION_ERRORS))
def test_an_application_error_ends_the_job_at_once_without_a_restart(
        error: str, tmp_path: Path, cancel_after: list[str]) -> None:
    variables, said, decided = APPLICATION_ERRORS[error]
    out = tmp_path / "run"
    env = slurm_env(**ENV, **variables, HPC_SPARE_NODES="1")
    job_id = sbatch_nowait(["-p", "four", "-N3", "--ntasks-per-node=2", "--no-kill",
                            TEMPLATE, *TINY_ARGS, "--out", str(out)], tmp_path, env,
                           cancel_after)
    log = tmp_path / f"hpc-srun-{job_id}.out"
    until("the rank's error", lambda: log.exists() and said in log.read_text(), job_id,
          timeout=150)
    raised = time.monotonic()
    last = jobwatch.wait(job_id, timeout=60)
    ended = time.monotonic() - raised
    text = log.read_text()
    assert last.word == "FAILED", text[-4000:]
    decisions = _decisions(text)
    assert len(decisions) == 1, text[-4000:]
    assert re.search(decided, decisions[0]), decisions
    assert "relaunching" not in text and "requeue" not in decisions[0]
    assert Ledger().strikes() == []  # a program's error is not a bad node
    print(f"{error}: exception to job end: {ended:.1f} s", file=sys.stderr)
    assert ended <= 10, text[-4000:]


@pytest.mark.timeout(240)
def test_attempts_that_never_reach_a_checkpoint_hit_the_no_progress_limit(
        tmp_path: Path) -> None:
    out = tmp_path / "run"
    env = slurm_env(**ENV, **killing(rank=2, at=2), HPC_SPARE_NODES="2",
                    HPC_MAX_RESTARTS="9")
    job_id, rc, text = sbatch_wait(["-p", "four", "-N4", "--ntasks-per-node=2", "--no-kill",
                                    TEMPLATE, *TINY_ARGS, "--out", str(out)], tmp_path,
                                   timeout=200, env=env)
    assert rc != 0, text[-4000:]
    decisions = _decisions(text)
    assert len(decisions) == 2, text[-4000:]
    assert re.search(r"attempt 0 failed: node2: rank 2 .* -> infrastructure \(node2 excluded\); "
                     r"relaunching on node1,node3 from the start \(no checkpoint\) \(budget 2 "
                     r"of 9 spent\)", decisions[0]), decisions
    assert re.search(r"attempt 1 failed: node3: rank 2 .* -> infrastructure; 2 attempts in a "
                     r"row wrote no new checkpoint \(no-progress limit\)", decisions[1]), decisions
    assert _runs(job_id) == ["FAILED"]
    assert not (out / "checkpoints").exists() or not list((out / "checkpoints").glob("*.pt"))


def _link(node: str, state: str) -> None:
    subprocess.run(["ip", "link", "set", f"hpcv-{node}", state], check=True, timeout=20)


def _testcluster(*args: str) -> None:
    subprocess.run([str(ROOT / "bin" / "hpc-testcluster"), *args], check=True, timeout=120)


#: node2 silenced once checkpoint 6 is written: (fault, undo, the decision's evidence).
#: ``link``: its link cut from the host; its ranks live on but nothing reaches them, and
#: Slurm would notice only after ``SlurmdTimeout`` (300 s). ``crash``: slurmd, slurmstepd
#: and the ranks of node2 SIGKILLed at once (a power loss: the address answers, nothing
#: listens; ``bin/hpc-testcluster crash``), revived afterwards.
SILENCED = {
    "link": (lambda: _link("node2", "down"), lambda: _link("node2", "up"),
             r"no answer on slurmd's port \(node unreachable\)"),
    "crash": (lambda: _testcluster("crash", "node2"), lambda: _testcluster("revive", "node2"),
              r"(no answer on slurmd's port \(node unreachable\)|ranks? [\d-]+ Killed by a "
              r"signal, no failure mark)"),
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("fault", list(SILENCED))
def test_a_silenced_node_is_found_and_the_step_goes_on_without_it(
        fault: str, tiny_reference: Path, tmp_path: Path, cancel_after: list[str]) -> None:
    """The supervisor finds node2 silent on slurmd's port, relaunches on node1,node3
    (``srun --overlap``: a cut-off step still holds node1's CPUs) and the job completes
    bitwise equal.

    Every rank of the first attempt holds at step 7 until the fault is in place (the
    file ``released``): on a slow host the 16 steps left after checkpoint 6 once ended
    the job before the test had crashed node2. The relaunch resumes at step 7 and does
    not hold (its 7th step is step 13, and the file exists)."""
    require("ip", "iproute2")
    inject, undo, evidence = SILENCED[fault]
    out = tmp_path / "run"
    released = tmp_path / "fault-in-place"
    env = slurm_env(**ENV, **holding(7, released, seconds=0.6), HPC_SPARE_NODES="1")
    job_id = sbatch_nowait(["-p", "four", "-N3", "--ntasks-per-node=2", "--no-kill",
                            TEMPLATE, *TINY_ARGS, "--out", str(out)], tmp_path, env,
                           cancel_after)
    log = tmp_path / f"hpc-srun-{job_id}.out"
    try:
        wait_for_file(out / "checkpoints" / "ckpt-00000006.pt", job_id, timeout=150)
        inject()
        released.touch()
        at = time.monotonic()
        until("the relaunch's resume", lambda: "resumed from" in log.read_text(), job_id,
              timeout=90)
        resumed = time.monotonic() - at
    finally:
        released.touch()
        undo()
    last = jobwatch.wait(job_id, timeout=120)
    text = log.read_text()
    assert last.word == "COMPLETED", text[-4000:]
    decisions = _decisions(text)
    assert len(decisions) == 1, text[-4000:]
    assert re.search(rf"attempt 0 failed: node2: {evidence} -> infrastructure \(node2 "
                     r"excluded\); relaunching on node1,node3 from step \d+ ", decisions[0]), \
        decisions
    assert [s.host for s in Ledger().strikes()] == ["node2"]
    assert_each_step_once(out)
    assert_same_final_weights(out, tiny_reference)
    print(f"{fault} to resumed: {resumed:.1f} s; {decisions[0]}", file=sys.stderr)
    assert resumed <= RESUMED_WITHIN_S, text[-4000:]


@pytest.mark.timeout(300)
def test_torchrun_template_replaces_the_crashed_host_and_moves_the_rendezvous(
        tiny_reference: Path, tmp_path: Path) -> None:
    """``slurm/torchrun.sbatch`` under ``HPC_SPARE_NODES=1``: one torchrun per host. The c10d
    rendezvous gives ranks 2-3 to either host, so the crashed host is read from the log;
    when it is node1, the relaunch's rendezvous moves to node2 (the new first host)."""
    out = tmp_path / "run"
    job_id, text = _crash_node2_with_a_spare("torchrun.sbatch", 1, out, tmp_path,
                                             HPC_NPROC_PER_NODE="2")
    assert " hpc supervise: 2 of 3 hosts, torchrun with 2 workers each; spares node3" in text
    crashed = re.search(r"\[rank 2/4 (\S+)\] WARNING hpc.health.fault: HPC_FAULT", text)
    assert crashed, text[-4000:]
    host = crashed[1]
    healthy = "node2" if host == "node1" else "node1"
    decisions = _decisions(text)
    assert len(decisions) == 1, text[-4000:]
    assert re.search(rf"attempt 0 failed: {host}: rank [23] Killed by a signal, no failure "
                     rf"mark -> infrastructure \({host} excluded\); relaunching on "
                     rf"{healthy},node3 from step 6 ", decisions[0]), decisions
    _assert_recovered(job_id, out, tiny_reference, host, text, "torchrun")


@pytest.mark.timeout(300)
def test_hpc_submit_spare_nodes_replaces_the_crashed_host(tiny_reference: Path,
                                                          tmp_path: Path) -> None:
    """``hpc submit --spare-nodes 1``: submitit's batch script runs the supervisor, which runs
    the tasks on 2 of the 3 nodes; node2 crashes, the spare takes its place."""
    pytest.importorskip("submitit")
    from hpc.pretrain import PretrainConfig
    from hpc.submit import submit
    from tests.helpers.tiny_pretrain import TINY

    out = tmp_path / "run"
    job = submit(PretrainConfig(**TINY, out=str(out)), log_dir=str(tmp_path / "logs"),
                 env={**ENV, **slowed(0.6), "HPC_FAULT": CRASH_NODE2}, nodes=2,
                 spare_nodes=1, tasks_per_node=2, gpus_per_node=0, partition="four",
                 time_min=5)
    try:
        result = job.result(timeout=240)
    finally:
        job.cancel()
    text = "\n".join(p.read_text() for p in sorted((tmp_path / "logs" / job.job_id).glob(
        "*_0_log.*")))
    assert result is not None
    decisions = _decisions(text)
    assert " hpc supervise: 2 of 3 hosts, 2 tasks each; spares node3" in text, text[-4000:]
    assert len(decisions) == 1, text[-4000:]
    assert re.search(r"attempt 0 failed: node2: ranks 2-3 .* -> infrastructure \(node2 "
                     r"excluded\); relaunching on node1,node3 from step 6 ", decisions[0]), \
        decisions
    assert _runs(job.job_id) == ["COMPLETED"]
    assert [s.host for s in Ledger().strikes()] == ["node2"]
    assert_each_step_once(out)
    assert_same_final_weights(out, tiny_reference)




@pytest.mark.timeout(300)
def test_elastic_without_a_spare_goes_on_on_fewer_hosts(tmp_path: Path) -> None:
    """2 nodes, no spare, ``HPC_SUPERVISE_ELASTIC=1`` and ``hpc pretrain --elastic``: node2
    crashes at step 7 and the step goes on on node1 alone (2 ranks) from step 6, in the
    first allocation, the world-size change logged by the resume."""
    out = tmp_path / "run"
    env = slurm_env(**ENV, HPC_SUPERVISE="1", HPC_SUPERVISE_ELASTIC="1", HPC_FAULT=CRASH_NODE2)
    job_id, rc, text = sbatch_wait(["-p", "four", "-N2", "--ntasks-per-node=2", "--no-kill",
                                    TEMPLATE, *TINY_ARGS, "--elastic", "--out", str(out)],
                                   tmp_path, timeout=240, env=env)
    assert rc == 0, text[-4000:]
    decisions = _decisions(text)
    assert len(decisions) == 1, text[-4000:]
    assert re.search(r"attempt 0 failed: node2: ranks? [23-]+ .* -> infrastructure \(node2 "
                     r"excluded\); relaunching on node1 from step 6 ", decisions[0]), decisions
    assert _runs(job_id) == ["COMPLETED"]
    assert [s.host for s in Ledger().strikes()] == ["node2"]
    assert "world size changed 4 -> 2" in text, text[-4000:]
    steps = sorted(int(x) for x in re.findall(r"pretrain completed at step (\d+)", text))
    assert len(steps) == 1 and steps[0] > 6, text[-4000:]


@pytest.mark.timeout(300)
def test_mpirun_template_replaces_the_crashed_host(tiny_reference: Path,
                                                   tmp_path: Path) -> None:
    """``slurm/mpirun.sbatch`` (Open MPI) under ``HPC_SPARE_NODES=1``: the supervisor runs
    ``mpirun -np 4 --host node1:2,node2:2``; node2's ranks SIGKILL themselves at step 7,
    mpirun names rank 2 on node2, and the next mpirun runs on node1:2,node3:2."""
    mpirun = require("mpirun.openmpi", "Open MPI")
    out = tmp_path / "run"
    job_id, text = _crash_node2_with_a_spare("mpirun.sbatch", 2, out, tmp_path,
                                             HPC_MPIRUN=mpirun)
    assert " hpc supervise: 2 of 3 hosts, 2 ranks by mpirun.openmpi each; spares node3" in text
    decisions = _decisions(text)
    assert len(decisions) == 1, text[-4000:]
    assert re.search(r"attempt 0 failed: node2: rank [23] Killed by a signal, no failure "
                     r"mark -> infrastructure \(node2 excluded\); relaunching on node1,node3 "
                     r"from step 6 ", decisions[0]), decisions
    _assert_recovered(job_id, out, tiny_reference, "node2", text, "mpirun")


@pytest.mark.timeout(300)
def test_array_tasks_each_replace_their_own_crashed_host(tmp_path: Path) -> None:
    """``hpc submit --array 2 -N1 --spare-nodes 1`` on the 4 nodes: each task runs 2 ranks on
    one node with one spare; both ranks of each task SIGKILL themselves at step 7, and each
    task relaunches on its own spare, in its own first allocation."""
    pytest.importorskip("submitit")
    envs = [f"--env={k}={v}" for k, v in
            {**ENV, **slowed(0.6), "HPC_FAULT": "0:7:kill,1:7:kill"}.items()]
    cmd = [sys.executable, "-m", "hpc", "submit", "--array", "2", "-N", "1", "--spare-nodes",
           "1", "-G", "0", "--tasks-per-node", "2", "-p", "four", "--time", "5",
           "--log-dir", str(tmp_path / "logs"), *envs, "--", *TINY_ARGS,
           "--out", str(tmp_path / "sweep" / "{task}")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=slurm_env(),
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    ids = [line.split()[2].rstrip(":") for line in proc.stdout.splitlines()
           if line.startswith("submitted job ")]
    try:
        assert len(ids) == 2 and "+ 1 spare node(s) under hpc supervise" in proc.stdout, \
            proc.stdout
        last = [jobwatch.wait(i, timeout=240) for i in ids]
        texts = {i: "\n".join(p.read_text() for p in sorted(
            (tmp_path / "logs").glob(f"{i}/*_0_log.err"))) for i in ids}
        assert [r.word for r in last] == ["COMPLETED", "COMPLETED"], texts
        crashed = []
        for i in ids:
            assert _runs(i) == ["COMPLETED"], i
            decisions = _decisions(texts[i])
            assert len(decisions) == 1, texts[i][-3000:]
            m = re.search(r"attempt 0 failed: (node\d): ranks 0-1 .* -> infrastructure "
                          r"\((node\d) excluded\); relaunching on (node\d) from step 6 ",
                          decisions[0])
            assert m and m[1] == m[2] != m[3], decisions
            crashed.append(m[1])
        assert len(set(crashed)) == 2, crashed  # two tasks, two hosts, each its own
        assert sorted(s.host for s in Ledger().strikes()) == sorted(crashed)
        for task in ("0", "1"):  # 2 ranks: 2 epochs of 1437 // 64 steps, each once
            assert train_steps(tmp_path / "sweep" / task) == list(range(1, 45))
    finally:
        for job_id in ids:
            subprocess.run(["scancel", job_id], check=False, timeout=20)


@pytest.mark.timeout(360)
def test_a_requeue_excludes_no_more_hosts_than_leave_room_for_the_job(
        tiny_reference: Path, tmp_path: Path, cancel_after: list[str]) -> None:
    """3 of the 4 nodes, 1 spare; rank 2 SIGKILLed at its 7th step in every attempt of the
    first run: node2 fails, the spare node3 takes over and fails too. Excluding both would
    leave partition four 2 nodes for a 3-node job, pending for ever (BadConstraints):
    the requeue excludes node2 only, says why not node3, and the second run completes."""
    out = tmp_path / "run"
    env = slurm_env(**ENV, **killing_first_run(rank=2, at=7), HPC_SPARE_NODES="1")
    job_id = sbatch_nowait(["-p", "four", "-N3", "--ntasks-per-node=2", "--no-kill",
                            TEMPLATE, *TINY_ARGS, "--out", str(out)], tmp_path, env,
                           cancel_after)
    last = jobwatch.wait(job_id, timeout=300)
    text = (tmp_path / f"hpc-srun-{job_id}.out").read_text()
    assert last.word == "COMPLETED", text[-4000:]
    decisions = _decisions(text)
    assert len(decisions) == 2, text[-4000:]
    first = re.search(r"attempt 0 failed: (node\d): .*\(\1 excluded\); relaunching on "
                      r"node\d,(node\d) ", decisions[0])
    assert first, decisions
    failed, spare = first[1], first[2]
    assert f"no spare: requeueing without {failed},{spare}" in decisions[1], decisions
    assert re.search(rf"requeued job \d+; excluding {failed} \({failed} failed in this job\); "
                     rf"not excluding {spare}: partition four would keep too few nodes for "
                     r"this 3-node job", text), text[-4000:]
    assert _runs(job_id) == ["REQUEUED", "COMPLETED"]
    assert_each_step_once(out)
    assert_same_final_weights(out, tiny_reference)
