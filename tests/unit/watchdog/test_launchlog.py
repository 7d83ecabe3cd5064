"""The parser of what srun, slurmstepd, torchrun and mpirun print when ranks fail."""

from __future__ import annotations

from hpc.watchdog.launchlog import (
    ExitParser,
    SrunExit,
    cancellations,
    compact_ranks,
    srun_exits,
)


def test_srun_lines_in_order_and_those_after_its_own_cancellation() -> None:
    lines = ["0: RuntimeError: boom",
             "srun: error: node2: tasks 2-3,5: Killed",
             "srun: error: node1: task 0: Exited with exit code 1",
             "srun: launch/slurm: _step_signal: Terminating StepId=26.0",
             "srun: error: node1: task 1: Terminated"]
    assert srun_exits(lines) == [SrunExit("node2", (2, 3, 5), "Killed"),
                                 SrunExit("node1", (0,), "Exited with exit code 1"),
                                 SrunExit("node1", (1,), "Terminated", after_cancel=True)]
    assert [e.by_signal for e in srun_exits(lines)] == [True, False, True]


def test_torchruns_root_cause_and_open_mpis_signal_line_name_the_killed_rank() -> None:
    lines = ["1: Root Cause (first observed failure):",
             "1: [0]:",
             "1:   time      : 2024-05-01_10:00:00",
             "1:   host      : node2.cluster",
             "1:   rank      : 3 (local_rank: 1)",
             "1:   exitcode  : -9 (pid: 42)",
             "mpirun noticed that process rank 2 with PID 0 on node node4 exited on signal 15 "
             "(Terminated)."]
    assert srun_exits(lines) == [SrunExit("node2", (3,), "Killed"),
                                 SrunExit("node4", (2,), "Terminated")]


def test_compact_ranks_is_sruns_form() -> None:
    assert compact_ranks([0, 1, 2, 5]) == "0-2,5"
    assert compact_ranks([3]) == "3"
    assert compact_ranks([1, 3, 4, 5, 7, 8]) == "1,3-5,7-8"
    assert compact_ranks([]) == ""


def test_cancellations_keep_only_the_banners_with_a_reason() -> None:
    lines = ["slurmstepd: error: *** JOB 12 ON node1 CANCELLED AT 2024-05-01T10:00:00 "
             "DUE TO TIME LIMIT ***",
             "slurmstepd: error: *** STEP 12.0 ON node1 CANCELLED AT 2024-05-01T10:00:00 ***",
             "srun: error: node1: task 0: Killed"]
    assert cancellations(lines) == ["cancelled DUE TO TIME LIMIT"]


def test_the_parser_fed_line_by_line_finds_what_the_whole_output_gives() -> None:
    """``hpc supervise`` feeds each line once as srun prints it and reads the exits every
    poll (it re-parsed every line of the attempt each second: 1.5 s a poll at 1M lines);
    a torchrun summary split across polls still gives its rank."""
    lines = ["1: Root Cause (first observed failure):", "1:   host      : node2.cluster",
             "0: noise " * 3, "1:   rank      : 3 (local_rank: 1)",
             "srun: error: node1: task 0: Exited with exit code 1",
             "srun: launch/slurm: _step_signal: Terminating StepId=26.0",
             "1:   exitcode  : -9 (pid: 42)", "srun: error: node1: task 1: Terminated"]
    parser, seen = ExitParser(), []
    for line in lines:
        parser.feed(line)
        seen.append(len(parser.exits))
    assert parser.exits == srun_exits(lines)
    assert parser.exits[1] == SrunExit("node2", (3,), "Killed", after_cancel=True)
    assert seen == [0, 0, 0, 0, 1, 1, 2, 3]
