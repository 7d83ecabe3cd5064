"""``hpc supervise``: run the job's step, and restart it inside the allocation when a host
fails — without that host.

Runs in the batch shell (``slurm/*.sbatch``), never in a rank. Each attempt is one
``srun --kill-on-bad-exit=1 --nodelist=HOSTS`` of the command (of torchrun, or one
mpirun: :mod:`hpc.supervise.launch`) on ``nodes`` hosts of the allocation; the others
are spares (``--spare-nodes``, ``HPC_SPARE_NODES``). While it runs, the supervisor
watches the step's hosts in Slurm (``sinfo``) and on slurmd's port
(:class:`hpc.supervise.hosts.Reachability`): a host that goes DOWN, stops responding or
stops answering ends the attempt at once (the step is cancelled, the ranks cannot
finish it). After a failure it gathers the evidence (srun's exit lines, the ranks'
failure marks in the attempt's ``HPC_ERROR_DIR``, the hosts' states), classifies it
(:mod:`hpc.supervise.verdict`), decides (:mod:`hpc.supervise.plan`) and logs ONE line
with the evidence and the decision. A relaunch resumes from the newest checkpoint the
ranks reported (``HPC_PROGRESS_FILE``): the command must resume by itself, as ``hpc
pretrain`` does from its run directory and a script with :func:`hpc.restore_checkpoint`.

``HPC_FAULT`` (:mod:`hpc.health.fault`) reaches the first attempt of the job's first run
only: an injected crash is one crash, not one per attempt or requeue.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from hpc.supervise import plan as plans
from hpc.supervise.hosts import (
    UNREACHABLE_S,
    Reachability,
    addresses,
    allocation,
    node_states,
    run,
    slurmd_port,
    tasks_per_node,
)
from hpc.supervise.launch import mpirun_argv, mpirun_env, srun_argv
from hpc.checkpoint.progress import read_progress
from hpc.supervise.verdict import UNREACHABLE, Evidence, Mark, Verdict, classify, gone
from hpc.watchdog import marks
from hpc.watchdog.launchlog import ExitParser

__all__ = ["Options", "supervise", "SETTLE_S", "KILLED_SETTLE_S", "POLL_S", "CANCEL_S"]

logger = logging.getLogger(__name__)

#: Once a rank failed, seconds srun gets to end the step before it is cancelled (a host
#: that stopped answering keeps srun waiting for its tasks): time for the ranks' marks
#: and the watchdog's report, which tell whose fault it was.
SETTLE_S = 8.0
#: The same once srun saw a task die of a signal: its line is the evidence already, and
#: the survivors only wait in a collective (srun's SIGTERM stops them at a step boundary
#: they never reach; SIGKILL follows after Slurm's KillWait, 30 s by default).
KILLED_SETTLE_S = 2.0
#: Seconds between two looks at the step's hosts in Slurm.
POLL_S = 1.0
#: Seconds scancel, then srun, get to end a cancelled step.
CANCEL_S = 2.0


@dataclass(frozen=True)
class Options:
    """What ``hpc supervise`` was asked (see :mod:`hpc.supervise.cli`)."""

    command: tuple[str, ...]
    spare_nodes: int = 0
    max_restarts: int = 3
    elastic: bool = False
    srun_args: tuple[str, ...] = ()
    #: Workers per host under torchrun (``slurm/torchrun.sbatch``); 0: one task per rank.
    torchrun: int = 0
    #: The mpirun and its options (``slurm/mpirun.sbatch``); empty: srun.
    mpirun: tuple[str, ...] = ()


def say(message: str) -> None:
    """One decision line, on the job's output (stderr, whole, flushed), with the time of
    day the ranks' lines carry (``20:16:44 hpc supervise: ...``)."""
    os.write(2, f"{time.strftime('%H:%M:%S')} hpc supervise: {message}\n".encode(
        errors="replace"))


def _launcher_name(launcher: Sequence[str]) -> Optional[str]:
    """The mpirun (or mpiexec) word of the launcher's command line, None without one."""
    return next((w for w in launcher if re.match(r"mpi(run|exec)", Path(w).name)), None)


def _open_mpi(launcher: Sequence[str]) -> bool:
    """The launcher's mpirun is Open MPI's (``--version``), not MPICH's hydra."""
    name = _launcher_name(launcher)
    if name is None:
        return True
    said = run([name, "--version"], timeout=20)  # 4.x: "mpirun (OpenRTE) 4.1.4"
    return "Open MPI" in said or "OpenRTE" in said


def _marks(directory: Path) -> dict[int, Mark]:
    out = {}
    for rank in sorted(marks.marked(str(directory))):
        mark = marks.read_mark(str(directory), rank)
        if mark is not None:
            out[rank] = Mark(mark[0], mark[1], marks.origin(str(directory), rank)[0])
    return out


class Attempt:
    """One srun of the command on ``hosts``: started, watched, its evidence gathered."""

    def __init__(self, opts: Options, hosts: Sequence[str], per_node: int,
                 error_dir: Path, env: Mapping[str, str], port: int = 6818,
                 attempt: int = 0) -> None:
        self.hosts = list(hosts)
        self.error_dir = error_dir
        self.name = f"hpc-attempt-{uuid.uuid4().hex[:8]}"
        self.exits = ExitParser()  # fed by the reader thread, line by line
        self.lost: dict[str, str] = {}
        self.mpirun = bool(opts.mpirun)
        env = dict(env)
        if self.mpirun:
            self.argv = mpirun_argv(opts.mpirun, opts.command, self.hosts, per_node,
                                    open_mpi=_open_mpi(opts.mpirun))
            env.update(mpirun_env(self.hosts, env, attempt))
        else:
            self.argv = srun_argv(opts.command, self.hosts, per_node, self.name,
                                  srun_args=opts.srun_args, torchrun=opts.torchrun,
                                  attempt=attempt, environ=env)
        self.reach = Reachability(addresses(self.hosts), port)
        # a session of its own: cancelling an mpirun ends its daemons' srun too
        self.proc = subprocess.Popen(self.argv, stderr=subprocess.PIPE, text=True, env=env,
                                     errors="replace", start_new_session=True)
        self._reader = threading.Thread(target=self._pump, daemon=True)
        self._reader.start()

    def _pump(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.exits.feed(line.rstrip("\n"))  # no line kept: memory stays bounded
            sys.stderr.write(line)
            sys.stderr.flush()

    def _failing_since(self) -> Optional[tuple[float, float]]:
        """(when, how long srun gets to end the step) once a rank failed, else None."""
        exits = list(self.exits.exits)  # once per poll: what came since is parsed already
        if any(not x.after_cancel and x.by_signal
               for x in exits):
            return time.monotonic(), KILLED_SETTLE_S
        if exits or _marks(self.error_dir):  # a mark with a message, not an empty .fault
            return time.monotonic(), SETTLE_S
        return None

    def wait(self) -> int:
        """srun's exit status; ends the step when a host is lost or srun lingers."""
        failing: Optional[tuple[float, float]] = None
        while True:
            try:
                return self._finish(self.proc.wait(timeout=POLL_S))
            except subprocess.TimeoutExpired:
                pass
            states = node_states(self.hosts)
            lost = {h: s for h, s in states.items() if gone(s)}
            lost.update({h: UNREACHABLE for h in self.reach.unreachable() if h not in lost})
            if lost:
                self.lost = lost
                say("; ".join(f"{h} did not answer on slurmd's port for {UNREACHABLE_S:g} s"
                              if s == UNREACHABLE else f"{h} is {s} in Slurm"
                              for h, s in lost.items()) + ": ending the attempt")
                return self._finish(self.cancel())
            if failing is None:
                failing = self._failing_since()
            elif time.monotonic() - failing[0] > failing[1]:
                say(f"a rank failed and srun had not ended the step {failing[1]:g} s later: "
                    "cancelling it")
                return self._finish(self.cancel())

    def _finish(self, code: int) -> int:
        self._reader.join(timeout=5)
        return code

    def _step_ids(self, environ: Mapping[str, str]) -> list[str]:
        """The attempt's steps: by its job name; under mpirun every numbered step of the
        job (its daemons' srun has a name of mpirun's choosing; one attempt runs at a
        time)."""
        job = environ.get("SLURM_JOB_ID", "")
        out = run(["squeue", "-h", "-s", "-j", job, "-o", "%i %j"], timeout=10)
        steps = [(i, n.strip()) for i, _, n in (line.partition(" ") for line in out.splitlines())]
        if self.mpirun:
            return [i for i, _ in steps if i.rpartition(".")[2].isdigit()]
        return [i for i, n in steps if n == self.name]

    def cancel(self) -> int:
        """Cancel the step (``scancel --signal=KILL JOB.STEP``), then srun; -9.

        Neither is waited for long: with a host cut off, scancel blocked 10 s on the
        controller (which keeps trying that host) and srun waits for its tasks for ever;
        the request is in once scancel has sent it, and the next attempt shares the CPUs
        the cut-off step still holds (``--overlap``)."""
        for step in self._step_ids(os.environ):
            run(["scancel", "--signal=KILL", step], timeout=CANCEL_S)
        try:
            self.proc.wait(timeout=CANCEL_S)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except OSError:
                self.proc.kill()
            self.proc.wait()
        return -9

    def evidence(self, code: int) -> Evidence:
        states = node_states(self.hosts)
        states.update(self.lost)
        return Evidence(code, list(self.exits.exits), _marks(self.error_dir),
                        tuple(self.hosts), states, addresses(self.hosts))


def _attempt_env(base: Mapping[str, str], error_dir: Path, progress: Path,
                 attempt: int) -> dict[str, str]:
    from hpc.preempt.requeue import read_budget

    env = {**base, "HPC_ERROR_DIR": str(error_dir), "HPC_PROGRESS_FILE": str(progress),
           "HPC_ATTEMPT": str(attempt)}
    if attempt > 0 or read_budget(base).restarts > 0:
        env.pop("HPC_FAULT", None)  # an injected crash is one crash, requeues included
        # `sbatch --export=ALL,HPC_FAULT=...` leaves SLURM_EXPORT_ENV with the fault in it,
        # and srun (torchrun's, mpirun's too) reads it as its --export: every attempt's
        # ranks got the fault back. What it names is in this environment already.
        if "HPC_FAULT" in env.get("SLURM_EXPORT_ENV", ""):
            env["SLURM_EXPORT_ENV"] = "ALL"
    return env


def _restart_line(verdict: Verdict, decision: plans.Decision, step: Optional[int],
                  attempt: int) -> str:
    s = decision.state
    head = f"attempt {attempt} failed: {verdict.evidence} -> {verdict.kind}"
    if decision.action == plans.RELAUNCH:
        out = f" ({', '.join(verdict.culprits)} excluded)" if verdict.culprits else ""
        start = f"from step {step}" if step is not None else "from the start (no checkpoint)"
        return (f"{head}{out}; relaunching on {','.join(decision.hosts)} {start} (budget "
                f"{s.spent} of {s.max_restarts} spent)")
    return f"{head}; {decision.why}"


def _error_dir(env: Mapping[str, str]) -> Path:
    """Where the first attempt's ranks mark their failures: ``HPC_ERROR_DIR``, else what
    ``slurm/pretrain.sbatch`` gives it (``HPC_LOG_DIR/failures-<restart count>``, the log
    directory defaulting to ``hpc-logs/<job id>`` in the submit directory)."""
    if env.get("HPC_ERROR_DIR"):
        return Path(env["HPC_ERROR_DIR"])
    logs = env.get("HPC_LOG_DIR") or str(Path(env.get("SLURM_SUBMIT_DIR") or ".") / "hpc-logs"
                                         / env.get("SLURM_JOB_ID", "0"))
    return Path(logs) / f"failures-{env.get('SLURM_RESTART_COUNT') or 0}"


def supervise(opts: Options, environ: Optional[Mapping[str, str]] = None) -> int:
    """Run ``opts.command`` under supervision; the exit status the job should end with."""
    env = dict(os.environ if environ is None else environ)
    hosts = allocation(env)
    nodes = len(hosts) - opts.spare_nodes
    if not hosts or nodes < 1:
        say(f"cannot supervise: allocation {hosts or '(none)'} with {opts.spare_nodes} spare "
            "nodes leaves no host to run on.\nHINT: run inside an sbatch allocation of more "
            "nodes than --spare-nodes.")
        return 2
    base = _error_dir(env)
    progress = base.parent / "progress.json"
    state = plans.State(tuple(hosts), nodes, opts.max_restarts, opts.elastic)
    per_node, port = tasks_per_node(env), slurmd_port()
    each = (f"torchrun with {opts.torchrun} workers" if opts.torchrun
            else f"{per_node} ranks by {Path(_launcher_name(opts.mpirun) or 'mpirun').name}"
            if opts.mpirun
            else f"{per_node} tasks")
    say(f"{nodes} of {len(hosts)} hosts, {each} each"
        + (f"; spares {','.join(hosts[nodes:])}" if opts.spare_nodes else "")
        + f"; up to {opts.max_restarts} restarts")
    attempt, run_on = 0, state.hosts()
    previous_sigs = {s: signal.signal(s, lambda *_: None) for s in (signal.SIGTERM,
                                                                   signal.SIGUSR2)}
    try:
        while True:
            error_dir = base if attempt == 0 else base.with_name(f"{base.name}.{attempt}")
            error_dir.mkdir(parents=True, exist_ok=True)
            before = read_progress(progress)
            current = Attempt(opts, run_on, per_node, error_dir,
                              _attempt_env(env, error_dir, progress, attempt), port, attempt)
            code = current.wait()
            verdict = classify(current.evidence(code))
            if not verdict.restartable:
                if verdict.kind not in ("completed", "requeued"):
                    say(f"attempt {attempt} failed: {verdict.evidence} -> {verdict.kind} "
                        "failure: no restart")
                return code if code >= 0 else 1
            now = read_progress(progress)
            progressed = now is not None and (before is None or now.step > before.step)
            step = now.step if now else None
            decision = plans.decide(state, verdict, progressed, step)
            say(_restart_line(verdict, decision, step, attempt))
            if not decision.program:
                _strike(verdict, env)
            state = decision.state
            if decision.action == plans.RELAUNCH:
                attempt, run_on = attempt + 1, list(decision.hosts)
                continue
            if decision.action == plans.REQUEUE:
                return _requeue(state, env)
            return code if code > 0 else 1
    finally:
        for s, h in previous_sigs.items():
            signal.signal(s, h)


def _strike(verdict: Verdict, env: Mapping[str, str]) -> None:
    if verdict.culprits:
        from hpc import ledger

        ledger.strike(verdict.culprits, verdict.evidence, "supervise", env)


def _requeue(state: plans.State, env: Mapping[str, str]) -> int:
    """Requeue the job without the excluded hosts; 75 when it is requeued, else 1."""
    from hpc.preempt.requeue import read_budget, requeue_job

    job = env.get("SLURM_JOB_ID", "")
    budget = read_budget(env)
    if not budget.left:
        say(f"not requeueing: SLURM_RESTART_COUNT={budget.restarts} reached "
            f"HPC_MAX_REQUEUES={budget.max_requeues}")
        return 1
    done = requeue_job(job, env, hosts=state.excluded, nodes=len(state.allocation))
    if done.error is not None:
        say(f"`scontrol requeue {job}` failed: {done.error}")
        return 1
    say(f"requeued job {job}" + (f"; {done.excluding}" if done.excluding else ""))
    return 75
