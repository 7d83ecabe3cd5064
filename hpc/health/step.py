"""While training runs: stragglers, silent corruption and injected faults, per step.

:class:`StepHealth` is what a training loop's step boundary calls (every rank, every
step, the same step number): :class:`hpc.AgreedStop` calls it from ``stop(step)`` and
``hpc pretrain`` from its step. At each boundary it

1. splits the step into compute and wait (:class:`~hpc.health.straggler.StepClock`),
2. applies this rank's ``HPC_FAULT`` (:mod:`hpc.health.fault`),
3. every ``HPC_SDC_EVERY`` steps compares the replicated state across ranks
   (:mod:`hpc.health.divergence`; needs the model, optional optimizer),

and on window steps (``HPC_STRAGGLER_EVERY``) hands the caller this rank's row
(:meth:`row`), which the caller carries in its own collective and gives back as the
table of every rank's rows (:meth:`receive`): the straggler verdicts
(:func:`~hpc.health.straggler.judge`), one log line on the global master per new
verdict, and ``stragglers.json`` in the run directory.

The split needs the watchdog's collective tracker (``HPC_WATCHDOG=1``, the default);
without it straggler detection is off.
"""

from __future__ import annotations

import json
import logging
import math
import os
import socket
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional

from hpc import ledger
from hpc.health.fault import Injector
from hpc.health.straggler import (
    Baselines,
    Finding,
    Rules,
    StepClock,
    judge,
    probe_shifts,
    ranks_text,
    slow_links,
)
from hpc.watchdog import tracker

__all__ = ["StepHealth", "probe_links", "PROBE_BYTES"]

logger = logging.getLogger(__name__)

#: Windows in a row without a verdict after which it is cleared (one window of weaker
#: evidence between two verdicts is the same episode).
CLEAR_AFTER = 2

#: Windows one episode of a verdict must name the same ranks before their hosts get a
#: strike in the bad-node ledger (:mod:`hpc.ledger`; by the master, at most once per host
#: in a run, and never in a job on one host: its ranks measured against each other
#: cannot tell the host's fault from the load beside them).
STRIKE_AFTER = 3

#: Bytes each host's first rank sends to two others when the link probe runs.
PROBE_BYTES = 64 << 10


class StepHealth:
    """This rank's per-step health checks (see the module's docstring).

    Args:
        rank, world: This rank and the world size (the default group).
        model, optimizer: The replicated state the corruption check digests (None: no
            check); ``model`` may be set later (the attribute ``model``).
        run_dir: Where the global master writes ``stragglers.json`` (default
            ``HPC_LOG_DIR``; None: no file).
        environ: Where the ``HPC_*`` settings are read (default ``os.environ``).
    """

    def __init__(self, rank: int, world: int, *, model: Any = None, optimizer: Any = None,
                 run_dir: Optional[os.PathLike[str] | str] = None,
                 environ: Optional[Any] = None, rules: Rules = Rules()) -> None:
        from hpc import envvars

        env = os.environ if environ is None else environ
        self.rank, self.world, self.rules = rank, world, rules
        self.model, self.optimizer = model, optimizer
        self.every = envvars.value("HPC_STRAGGLER_EVERY", env)
        self.stragglers = bool(envvars.value("HPC_STRAGGLER", env)) and world > 1 \
            and tracker.waited() is not None
        self.sdc = envvars.value("HPC_SDC", env)
        self.sdc_every = envvars.value("HPC_SDC_EVERY", env) if self.sdc != "off" else 0
        self.injector = Injector.from_env(rank, env)
        if self.stragglers:
            tracker.start_stall_meter()  # a frozen rank's stop is not its wait
        self.clock = StepClock(tracker.waited)
        self.baselines = Baselines()
        self.window_start: Optional[int] = None
        self._active: dict[tuple[int, ...], int] = {}  # named ranks -> windows without
        self._named: dict[tuple[int, ...], int] = {}  # named ranks -> windows with
        self._struck: set[str] = set()  # hosts this run gave a straggler strike
        self.findings: list[dict[str, Any]] = []
        self.hosts: Optional[list[str]] = None
        self._probed: Optional[list[Finding]] = None
        self._suspects: set[int] = set()
        self.host = socket.gethostname()
        log_dir = run_dir if run_dir is not None else envvars.value("HPC_LOG_DIR", env)
        self.path = Path(log_dir) / "stragglers.json" if log_dir else None
        self.corrupt: Optional[Any] = None  #: the last :class:`Mismatch` (HPC_SDC=warn)

    # -- at every step boundary ------------------------------------------------------

    def boundary(self, step: int) -> None:
        """Step ``step`` is done on this rank (before the caller's stop collective)."""
        compute = self.clock.mark()
        if self.window_start is None:
            self.window_start = step
        if self.injector:
            params = self.model.named_parameters() if self.model is not None else None
            self.injector.at_step(step, compute, params)
        if self.sdc_every and self.model is not None and self.world > 1 \
                and step % self.sdc_every == 0:
            t0 = time.perf_counter()
            self.check_replicas(step)
            self.clock.shift(time.perf_counter() - t0)

    def skip(self) -> None:
        """The time until the next boundary is not a training step (validation, a
        checkpoint): left out of the split."""
        self.clock.skip()

    # -- straggler windows -------------------------------------------------------------

    def due(self, step: int, agreed_every: int = 1) -> bool:
        """Whether the caller's collective at ``step`` carries the rows: the first step of
        each window of ``every`` steps at which the caller agrees (it agrees on multiples
        of ``agreed_every``). A pure function of ``step``, so a resumed run carries them at
        the same steps as an uninterrupted one (the carrying collective's length, and
        with it the rounding of what else it sums, is the same at every step)."""
        if not self.stragglers or step % agreed_every:
            return False
        return step // self.every > (step - agreed_every) // self.every

    def row(self) -> list[float]:
        """This rank's :data:`~hpc.health.straggler.FIELDS` for the window now ending."""
        return self.clock.window(self.rules.trim)

    def receive(self, step: int, table: list[list[float]]) -> list[Finding]:
        """Every rank's row (rank order, the same on every rank): the window's verdicts."""
        t0 = time.perf_counter()
        start, self.window_start = self.window_start, step + 1
        if self.hosts is None:
            from hpc.sync.agree import gather_objects

            self.hosts = gather_objects(self.host)
        if any(row[3] == 0 for row in table):  # a rank's first window: nothing to compare
            self.clock.shift(time.perf_counter() - t0)
            return []
        found = judge(table, self.baselines, self.rules, self.hosts, self._suspects)
        if self.rank == 0 and logger.isEnabledFor(logging.DEBUG):
            logger.debug("straggler window %s-%d (compute, wait, wall ms; steps): %s", start,
                         step, "; ".join(f"{1e3 * r[0]:.1f} {1e3 * r[1]:.1f} {1e3 * r[2]:.1f} "
                                         f"{r[3]:.0f}" for r in table))
        self.baselines.add(table, self.rules.baseline)
        verdicts = []
        for f in found:
            if f.kind != "link":
                verdicts.append(f)
            elif self._probed is None:  # once per episode of the suspicion
                self._probed = self._probe(f)
        if not any(f.kind == "link" for f in found):
            self._probed = None
        verdicts += self._probed or []
        self._report(verdicts, start if start is not None else step, step)
        self.clock.shift(time.perf_counter() - t0)
        return verdicts

    def _probe(self, suspicion: Finding) -> list[Finding]:
        """The job slowed while no rank computes slower: time each host's link."""
        assert self.hosts is not None
        hosts = list(dict.fromkeys(self.hosts))
        if len(hosts) < 2:
            return []
        first: dict[str, int] = {}
        for r, h in enumerate(self.hosts):
            first.setdefault(h, r)
        roots = [first[h] for h in hosts]
        shifts = probe_shifts(len(hosts))
        seconds = probe_links(roots, shifts)
        if self.rank == 0:
            logger.debug("straggler: the job slowed %.1fx while waiting; link probe, %d KiB "
                         "from each host to the next and the one before: %s",
                         suspicion.factor, PROBE_BYTES >> 10, "; ".join(
                             f"{hosts[i]} -> {hosts[(i + s) % len(hosts)]} {1e3 * t:.1f} ms"
                             for s, row in zip(shifts, seconds) for i, t in enumerate(row)))
        out = []
        for i, direction, factor, reference in slow_links(seconds, shifts, self.rules):
            out.append(Finding("link", tuple(r for r, h in enumerate(self.hosts)
                                             if h == hosts[i]), factor, reference,
                               suspicion.others_waited, direction))
        return out

    def _report(self, verdicts: list[Finding], start: int, end: int) -> None:
        """Log and record each new verdict once (per set of ranks, whichever rule named
        them); a verdict is cleared after :data:`CLEAR_AFTER` windows without it."""
        changed = False
        for f in verdicts:
            if f.ranks not in self._active:
                changed = True
                self.findings.append({"steps": [start, end], "hosts": self._hosts_of(f.ranks),
                                      "time": time.time(), **f.as_dict()})
                if self.rank == 0:
                    logger.warning("%s", self.describe(f, start, end))
            self._active[f.ranks] = 0
            self._named[f.ranks] = self._named.get(f.ranks, 0) + 1
            if self._named[f.ranks] == STRIKE_AFTER and self.rank == 0:
                self._strike(f, start, end)
        named = {f.ranks for f in verdicts}
        for ranks in [r for r in self._active if r not in named]:
            self._active[ranks] += 1
            if self._active[ranks] >= CLEAR_AFTER:
                del self._active[ranks]
                self._named.pop(ranks, None)
                if self.rank == 0:
                    logger.info("straggler cleared: %s (%s) by step %d",
                                ", ".join(self._hosts_of(ranks)), ranks_text(ranks), end)
        if changed:
            self._write()

    def _strike(self, f: Finding, start: int, end: int) -> None:
        """A persisting verdict's strike: its hosts not struck in this run yet, in a job of
        several hosts (on one, the ranks were only measured against each other)."""
        hosts = [h for h in self._hosts_of(f.ranks) if h not in self._struck]
        if hosts and len(set(self.hosts or ())) > 1:
            ledger.strike(hosts, self.describe(f, start, end), "straggler")
            self._struck.update(hosts)

    def _hosts_of(self, ranks: tuple[int, ...]) -> list[str]:
        hosts = self.hosts or []
        return list(dict.fromkeys(hosts[r] for r in ranks if r < len(hosts)))

    def describe(self, f: Finding, start: int, end: int) -> str:
        """The verdict's log line."""
        where = f"{', '.join(self._hosts_of(f.ranks))} ({ranks_text(f.ranks)})"
        waited = "" if math.isnan(f.others_waited) else \
            f"; others waited {100 * f.others_waited:.0f} % of the step"
        if f.kind == "relative":
            return (f"straggler: {where} {f.factor:.1f}x the median compute time "
                    f"({1e3 * f.reference_s:.1f} ms) over steps {start}-{end}{waited}")
        if f.kind == "individual":
            return (f"straggler: {where} {f.factor:.1f}x its own earlier compute time "
                    f"({1e3 * f.reference_s:.1f} ms) over steps {start}-{end}{waited}")
        return (f"straggler: {where}: slow link ({f.note}), {PROBE_BYTES >> 10} KiB took "
                f"{f.factor:.0f}x the other hosts' median ({1e3 * f.reference_s:.1f} ms) "
                f"after steps {start}-{end}{waited}")

    def _write(self) -> None:
        if self.rank != 0 or self.path is None:
            return
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps({"findings": self.findings}, indent=1) + "\n")
            os.replace(tmp, self.path)
        except OSError as e:
            logger.warning("could not write %s: %s", self.path, e)

    # -- silent corruption -------------------------------------------------------------

    def check_replicas(self, step: int) -> None:
        """Compare the replicated state across ranks now (collective); on a mismatch
        raise :class:`~hpc.errors.SilentCorruptionError` on every rank
        (``HPC_SDC=stop``) or warn once per step (``HPC_SDC=warn``)."""
        from hpc.errors import SilentCorruptionError
        from hpc.health import divergence

        named = divergence.named_state(self.model, self.optimizer)
        found = divergence.check(step, named, self.host)
        if found is None:
            if self.rank == 0:
                logger.debug("replicas agree at step %d (%d tensors)", step, len(named))
            return
        if self.corrupt is None and self.rank == 0 and not found.tied:  # once per job
            ledger.strike(found.hosts, found.message().splitlines()[0], "sdc")
        self.corrupt = found
        if self.sdc == "stop":
            raise SilentCorruptionError(found.message())
        if self.rank == 0:
            logger.warning("%s", found.message().splitlines()[0])


def probe_links(roots: list[int], shifts: Sequence[int],
                nbytes: int = PROBE_BYTES) -> list[list[float]]:
    """For each shift ``s`` and each host ``i`` (its first rank ``roots[i]``): the seconds
    ``nbytes`` take from host ``i`` to host ``i + s``, one transfer at a time (concurrent
    ones would queue the receivers' acknowledgements behind a slow sender's data),
    timed by the receiver (collective; the same table on every rank)."""
    import torch
    import torch.distributed as dist

    from hpc.sync.agree import comm_device

    rank = dist.get_rank()
    payload = torch.zeros(nbytes // 4, dtype=torch.float32, device=comm_device())
    n = len(roots)
    mine = [0.0] * (n * len(shifts))
    for k, shift in enumerate(shifts):
        for i in range(n):
            src, dst = roots[i], roots[(i + shift) % n]
            dist.barrier()
            if rank == src:
                dist.send(payload, dst)
            elif rank == dst:
                t0 = time.perf_counter()
                dist.recv(payload, src)
                mine[k * n + i] = time.perf_counter() - t0
    # Each transfer was timed by its receiver alone: the element-wise max of every
    # rank's row is the table (one all_reduce of 2 x hosts floats, not a gather of
    # every rank's row: at 8,192 ranks on 1,024 hosts that was 64 MiB on every rank).
    times = torch.tensor(mine, dtype=torch.float64, device=comm_device())
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    flat = times.tolist()
    return [flat[k * n:(k + 1) * n] for k in range(len(shifts))]
