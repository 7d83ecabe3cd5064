"""The supervisor's pure rules: whose fault a failed attempt was, and what comes next."""

from __future__ import annotations

from hpc.supervise import plan
from hpc.supervise.verdict import APPLICATION, INFRASTRUCTURE, Evidence, Mark, classify
from hpc.watchdog.launchlog import srun_exits

HOSTS = ("node1", "node1", "node2", "node2", "node3", "node3")


def _lines(*lines: str) -> list:
    return srun_exits(lines)


def test_ranks_killed_without_a_mark_blame_their_host_not_the_cancelled_ones() -> None:
    e = Evidence(137, _lines("srun: error: node3: tasks 4-5: Killed",
                             "srun: launch/slurm: _step_signal: Terminating StepId=3.0",
                             "srun: error: node1: tasks 0-1: Killed"), hosts=HOSTS)
    v = classify(e)
    assert (v.kind, v.culprits) == (INFRASTRUCTURE, ("node3",)), v


def test_an_out_of_memory_kill_is_the_programs_and_strikes_no_host() -> None:
    """srun's line for a task the OOM killer ended (the step's cgroup limit or the node's
    RAM; Slurm 22.05's words): the program needs more memory wherever it runs. Read as
    a task killed by a signal, it excluded node3, struck it and burnt a spare."""
    e = Evidence(137, _lines("srun: error: node3: task 4: Out Of Memory",
                             "srun: launch/slurm: _step_signal: Terminating StepId=3.0",
                             "srun: error: node1: tasks 0-1: Killed"), hosts=HOSTS)
    v = classify(e)
    assert (v.kind, v.culprits) == (APPLICATION, ()), v
    assert "node3: rank 4 Out Of Memory" in v.evidence and not v.restartable


def test_a_python_exception_is_the_programs_even_when_peers_then_lost_it() -> None:
    marks = {2: Mark(10.0, "InjectedFault: rank 2 at step 50", "node2"),
             0: Mark(10.5, "RuntimeError: Connection closed by peer [10.0.0.2]:123", "node1")}
    e = Evidence(1, _lines("srun: error: node2: task 2: Exited with exit code 1"),
                 marks, HOSTS, addresses={"node2": "10.0.0.2"})
    v = classify(e)
    assert v.kind == APPLICATION and "InjectedFault" in v.evidence


def test_a_lost_peer_names_the_host_by_its_address() -> None:
    marks = {0: Mark(10.0, "RuntimeError: Connection closed by peer [10.0.0.3]:99", "node1")}
    v = classify(Evidence(1, (), marks, HOSTS, addresses={"node3": "10.0.0.3"}))
    assert (v.kind, v.culprits) == (INFRASTRUCTURE, ("node3",))


def test_a_host_down_in_slurm_wins_and_completed_or_requeued_are_not_failures() -> None:
    v = classify(Evidence(-9, (), {}, HOSTS, {"node2": "down*", "node1": "allocated"}))
    assert (v.kind, v.culprits) == (INFRASTRUCTURE, ("node2",))
    assert classify(Evidence(0)).kind == "completed"
    assert classify(Evidence(75)).kind == "requeued"


def test_stuck_ranks_on_one_host_blame_it_on_several_hosts_the_program() -> None:
    one = {4: Mark(1.0, "all_reduce #9 timed out: rank 4 never entered it", "node3")}
    assert classify(Evidence(1, (), one, HOSTS)).culprits == ("node3",)
    two = {**one, 0: Mark(1.0, "all_reduce #9 timed out: rank 0 never entered it", "node1")}
    assert classify(Evidence(1, (), two, HOSTS)).kind == APPLICATION


def _infra(host: str) -> object:
    return classify(Evidence(137, _lines(f"srun: error: {host}: tasks 4-5: Killed"),
                             hosts=HOSTS))


def test_a_spare_replaces_the_culprit_then_requeue_or_elastic_when_none_is_left() -> None:
    s = plan.State(("node1", "node2", "node3", "node4"), 3)
    d = plan.decide(s, _infra("node3"), progressed=True, step=20)
    assert (d.action, d.hosts) == (plan.RELAUNCH, ("node1", "node2", "node4"))
    d2 = plan.decide(d.state, _infra("node4"), progressed=True, step=40)
    assert d2.action == plan.REQUEUE and d2.state.excluded == ("node3", "node4")
    s_el = plan.State(("node1", "node2", "node3", "node4"), 3, elastic=True,
                      excluded=("node3",))
    d3 = plan.decide(s_el, _infra("node4"), progressed=True, step=40)
    assert (d3.action, d3.hosts) == (plan.RELAUNCH, ("node1", "node2"))


def test_no_progress_costs_double_and_two_in_a_row_end_the_job() -> None:
    s = plan.State(tuple(f"node{i}" for i in range(1, 9)), 2, max_restarts=9)
    d = plan.decide(s, _infra("node1"), progressed=False, step=None)
    assert d.action == plan.RELAUNCH and d.state.spent == 2
    d2 = plan.decide(d.state, _infra("node3"), progressed=False, step=None)
    assert d2.action == plan.END and "no-progress" in d2.why


def test_an_application_failure_is_never_restarted() -> None:
    v = classify(Evidence(1, _lines("srun: error: node1: task 0: Exited with exit code 1")))
    d = plan.decide(plan.State(("node1", "node2"), 1), v, progressed=True, step=5)
    assert v.kind == APPLICATION and d.action == plan.END


#: The marks of a real run (the 4-node cluster, HPC_FAULT=2:7:kill,3:7:kill): node2's ranks
#: SIGKILLed themselves; rank 1's watchdog reported them and marked them with its report,
#: rank 0 repeated it in its own mark. Classified "application" before the report's
#: named ranks were told from the ranks that wrote it.
_REPORT = ("all_reduce #53 failed (reported by rank 1): rank 2 (node2, pid 21320) never "
           "entered it; rank 3 (node2, pid 21321) never entered it.")
_KILLED_NODE2 = {
    2: Mark(100.0, _REPORT, "node2"), 3: Mark(100.1, _REPORT, "node2"),
    1: Mark(103.0, _REPORT, "node1"),
    0: Mark(103.1, f"all_reduce #53 failed on rank 0 (node1, pid 21317); rank 1 reported: "
            f"{_REPORT}", "node1")}


def test_a_crash_reported_by_the_watchdog_blames_the_crashed_host() -> None:
    e = Evidence(-9, _lines("srun: error: node2: tasks 2-3: Killed",
                            "srun: launch/slurm: _step_signal: Terminating StepId=9.0",
                            "srun: error: node1: tasks 0-1: Killed"),
                 _KILLED_NODE2, ("node1", "node2"))
    v = classify(e)
    assert (v.kind, v.culprits) == (INFRASTRUCTURE, ("node2",)), v
    assert "ranks 2-3 Killed by a signal" in v.evidence


def test_the_watchdog_report_alone_blames_the_named_host_not_the_waiters() -> None:
    e = Evidence(1, _lines("srun: error: node1: tasks 0-1: Exited with exit code 1"),
                 _KILLED_NODE2, ("node1", "node2"))
    v = classify(e)
    assert (v.kind, v.culprits) == (INFRASTRUCTURE, ("node2",)), v
    assert "ranks 2-3 never entered" in v.evidence


def test_an_exception_names_its_first_line_the_fact() -> None:
    marks = {2: Mark(1.0, "InjectedFault: HPC_FAULT 2:5:exc: injected on rank 2.\n"
                     "HPC_FAULT asked for it.\nHINT: unset HPC_FAULT", "node2")}
    v = classify(Evidence(1, _lines("srun: error: node2: task 2: Exited with exit code 1"),
                          marks, ("node1", "node2")))
    assert v.kind == APPLICATION
    assert v.evidence == "rank 2 on node2: InjectedFault: HPC_FAULT 2:5:exc: injected on rank 2."


def test_a_rank_that_raised_before_the_watchdog_named_it_is_the_programs() -> None:
    """The real marks of HPC_FAULT=2:5:exc: rank 2's own exception first, then rank 1's
    report that rank 2 never entered the next all_reduce."""
    report = "all_reduce #38 failed (reported by rank 1): rank 2 (node2, pid 22640) never entered it."
    marks = {2: Mark(13.3, "hpc.errors.InjectedFault: HPC_FAULT 2:5:exc: an exception "
                     "injected on rank 2 at step 5.\nHINT: unset HPC_FAULT", "node2"),
             1: Mark(16.8, f"hpc.errors.CollectiveError: {report}", "node1"),
             3: Mark(16.8, f"hpc.errors.CollectiveError: all_reduce #38 failed on rank 3 "
                     f"(node2, pid 22641); rank 1 reported: {report}", "node2")}
    e = Evidence(-9, _lines("srun: error: node2: task 2: Exited with exit code 1",
                            "srun: launch/slurm: _step_signal: Terminating StepId=13.0",
                            "srun: error: node1: tasks 0-1: Killed"), marks, ("node1", "node2"))
    v = classify(e)
    assert v.kind == APPLICATION and v.culprits == (), v
    assert v.evidence.startswith("rank 2 on node2: hpc.errors.InjectedFault: HPC_FAULT 2:5:exc")


def test_a_host_silent_on_slurmds_port_for_6_s_is_unreachable_one_that_answers_again_not() -> None:
    from hpc.supervise.hosts import Reachability

    now, up = [0.0], {"10.0.0.1": True, "10.0.0.2": False}
    r = Reachability({"node1": "10.0.0.1", "node2": "10.0.0.2"}, 6818,
                     answers=lambda a, p: up[a], clock=lambda: now[0])
    seen = []
    for t in range(0, 9):
        now[0] = float(t)
        seen.append(r.unreachable())
    assert seen[:6] == [[]] * 6 and seen[6:] == [["node2"]] * 3  # silent since t=0
    up["10.0.0.2"] = True
    now[0] = 9.0
    assert r.unreachable() == ["node2"]  # probes every 2 s: the last at t=8
    now[0] = 10.0
    assert r.unreachable() == []  # it answered the next one
    v = classify(Evidence(-9, (), {}, ("node1", "node2"), {"node2": "unreachable"}))
    assert (v.kind, v.culprits) == (INFRASTRUCTURE, ("node2",))
    assert v.evidence == "node2: no answer on slurmd's port (node unreachable)"


def _torchrun_summary(label: str, root: tuple[str, int, str], other: tuple[str, int, str]) -> list:
    """torchrun's ChildFailedError summary as a labelled srun task prints it (the format of
    torch 2.13's, copied from a real run: rank 1 SIGKILLed itself, the agent then ended
    rank 0 with SIGTERM)."""
    def entry(i: int, e: tuple[str, int, str]) -> list:
        host, rank, code = e
        return [f"[{i}]:", "  time      : 2026-12-05_02:08:03", f"  host      : {host}",
                f"  rank      : {rank} (local_rank: {rank % 2})",
                f"  exitcode  : {code} (pid: 3420)  (SIGKILL)", "  error_file: <N/A>",
                "  traceback : Signal 9 (SIGKILL) received by PID 3420"]
    text = ["torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ", "=" * 54,
            "/tmp/k.py FAILED", "-" * 54, "Failures:", *entry(1, other), "-" * 54,
            "Root Cause (first observed failure):", *entry(0, root), "=" * 54]
    return [f"{label}: {x}" for x in text]


def test_torchruns_summary_gives_the_killed_worker_not_the_ones_its_agent_ended() -> None:
    lines = [*_torchrun_summary("1", ("node2.cluster", 3, "-9"), ("node2.cluster", 2, "-15")),
             "srun: error: node2: task 1: Exited with exit code 1",
             "srun: launch/slurm: _step_signal: Terminating StepId=3.0",
             *_torchrun_summary("0", ("node1", 0, "-15"), ("node1", 1, "-15"))]
    exits = srun_exits(lines)
    assert [(x.host, x.ranks, x.what, x.after_cancel) for x in exits] == [
        ("node2", (3,), "Killed", False),
        ("node2", (1,), "Exited with exit code 1", False),
        ("node1", (0,), "Terminated", True)]
    v = classify(Evidence(1, exits, hosts=("node1", "node1", "node2", "node2")))
    assert (v.kind, v.culprits) == (INFRASTRUCTURE, ("node2",)), v
    assert "rank 3 Killed by a signal" in v.evidence


def test_under_torchrun_an_exception_with_an_agent_ended_peer_is_the_programs() -> None:
    lines = _torchrun_summary("1", ("node2", 2, "1"), ("node2", 3, "-15"))
    marks = {2: Mark(10.0, "ValueError: shapes (4,8) and (9,) do not match", "node2")}
    v = classify(Evidence(1, srun_exits(lines), marks, ("node1", "node1", "node2", "node2")))
    assert v.kind == APPLICATION and "ValueError" in v.evidence, v


def test_open_mpis_signal_line_blames_the_ranks_host() -> None:
    line = ("mpirun noticed that process rank 2 with PID 0 on node node2 exited on signal 9 "
            "(Killed).")
    exits = srun_exits([line])
    assert [(x.host, x.ranks, x.what) for x in exits] == [("node2", (2,), "Killed")]
    v = classify(Evidence(137, exits, hosts=("node1", "node1", "node2", "node2")))
    assert (v.kind, v.culprits) == (INFRASTRUCTURE, ("node2",)), v


def test_the_mpirun_attempt_gets_its_hosts_and_a_master_on_the_first() -> None:
    from hpc.supervise.launch import mpirun_argv, mpirun_env

    argv = mpirun_argv(["mpirun", "--mca", "btl", "tcp,self"], ["python", "t.py"],
                       ["node2", "node3"], 2, open_mpi=True)
    assert argv == ["mpirun", "--mca", "btl", "tcp,self", "-np", "4", "--host",
                    "node2:2,node3:2", "python", "t.py"]
    assert mpirun_argv(["mpiexec.mpich"], ["x"], ["a"], 1, open_mpi=False)[3] == "-hosts"
    env = mpirun_env(["node2", "node3"], {"SLURM_JOB_ID": "7"}, 1)
    assert env["MASTER_ADDR"] == "node2"
    assert env["MASTER_PORT"] != mpirun_env(["node2"], {"SLURM_JOB_ID": "7"}, 2)["MASTER_PORT"]


def test_a_relaunch_drops_hpc_fault_also_from_sbatchs_export_list(tmp_path) -> None:
    """``sbatch --export=ALL,HPC_FAULT=2:7:kill``: srun reads SLURM_EXPORT_ENV as its
    --export, which gave every attempt's ranks the fault back (a user's run showed it)."""
    from hpc.supervise.supervisor import _attempt_env

    base = {"HPC_FAULT": "2:7:kill", "SLURM_EXPORT_ENV": "ALL,HPC_FAULT=2:7:kill,A=1"}
    first = _attempt_env(base, tmp_path, tmp_path / "p.json", 0)
    assert first["HPC_FAULT"] == "2:7:kill" and first["SLURM_EXPORT_ENV"] == base[
        "SLURM_EXPORT_ENV"]
    later = _attempt_env(base, tmp_path, tmp_path / "p.json", 1)
    assert "HPC_FAULT" not in later and later["SLURM_EXPORT_ENV"] == "ALL"
    requeued = _attempt_env({**base, "SLURM_RESTART_COUNT": "1"}, tmp_path,
                            tmp_path / "p.json", 0)
    assert "HPC_FAULT" not in requeued and "HPC_FAULT" not in requeued["SLURM_EXPORT_ENV"]


def test_the_same_ranks_killed_at_the_same_step_on_another_host_are_the_programs() -> None:
    """A user's job: rank 2 SIGKILLed at step 12 on node2, then again on the spare node3
    after resuming from checkpoint 10 (the fault followed the rank)."""
    s = plan.State(("node1", "node2", "node3"), 2)

    def killed(host: str) -> object:
        return classify(Evidence(137, _lines(f"srun: error: {host}: task 2: Killed"),
                                 hosts=("node1", "node1", host, host)))

    d = plan.decide(s, killed("node2"), progressed=True, step=10)
    assert d.action == plan.RELAUNCH and not d.program
    d2 = plan.decide(d.state, killed("node3"), progressed=False, step=10)
    assert d2.action == plan.END and d2.program and "the program's" in d2.why, d2
    assert d2.state.excluded == ("node2",)  # node3 is not held against
    d3 = plan.decide(d.state, killed("node3"), progressed=True, step=15)
    assert d3.action == plan.REQUEUE and not d3.program  # progressed: another failure
