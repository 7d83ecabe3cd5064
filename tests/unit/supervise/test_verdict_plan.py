"""The supervisor's pure rules: whose fault a failed attempt was, and what comes next."""

from __future__ import annotations

from hpc.supervise import plan
from hpc.supervise.verdict import APPLICATION, INFRASTRUCTURE, Evidence, Mark, classify
from hpc.watchdog.failure import srun_exits

HOSTS = ("node1", "node1", "node2", "node2", "node3", "node3")


def _lines(*lines: str) -> list:
    return srun_exits(lines)


def test_ranks_killed_without_a_mark_blame_their_host_not_the_cancelled_ones() -> None:
    e = Evidence(137, _lines("srun: error: node3: tasks 4-5: Killed",
                             "srun: launch/slurm: _step_signal: Terminating StepId=3.0",
                             "srun: error: node1: tasks 0-1: Killed"), hosts=HOSTS)
    v = classify(e)
    assert (v.kind, v.culprits) == (INFRASTRUCTURE, ("node3",)), v


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
