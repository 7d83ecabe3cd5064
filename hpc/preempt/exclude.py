"""A requeued job's ``ExcNodeList``: the hosts its next run must not get.

After ``scontrol requeue`` (:func:`hpc.preempt.requeue.requeue_job`), while the requeued
job is pending again (the only state in which Slurm changes it), the failed hosts and
those of the bad-node ledger (:mod:`hpc.ledger`: two live strikes) are added to the job's
``ExcNodeList``, never so many that the partition could not hold the job any more (it
would pend for ever, ``BadConstraints``). Every ``scontrol``/``sinfo`` here runs with
SIGTERM blocked: it runs while Slurm sends the job's batch step SIGTERM for the requeue.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
from collections.abc import Sequence
from typing import Optional

__all__ = ["exclude_bad_nodes", "excluded_hosts", "placeable"]

logger = logging.getLogger(__name__)


def exclude_bad_nodes(job_id: str, hosts: Sequence[str] = (),
                      nodes: Optional[int] = None) -> Optional[str]:
    """Add ``hosts`` and the bad-node ledger's hosts (:meth:`hpc.ledger.Ledger.excluded`)
    to the ``ExcNodeList`` of ``job_id``, a requeued job that is pending again (``scontrol
    update``; Slurm refuses it for a running job). The job's own exclusions stay. No
    more hosts are excluded than leave the job's partition ``nodes`` nodes (default
    ``SLURM_JOB_NUM_NODES``; ``scontrol`` shows 1 for a job still completing its requeue).

    Returns:
        What was done (``excluding node3 (bad-node ledger: ...)``), or None: nothing to
        exclude, or scontrol refused (a warning says why; the requeue stands).
    """
    from hpc.ledger import STRIKES, Ledger

    try:
        ledger = list(Ledger().excluded())
    except Exception as e:  # noqa: BLE001 - a broken ledger must not fail the requeue
        logger.warning("bad-node ledger unreadable, requeued job %s excludes no host: %s",
                       job_id, e)
        ledger = []
    bad = list(dict.fromkeys([*hosts, *ledger]))
    if not bad:
        return None
    left_in = ""
    try:
        shown = _shielded(["scontrol", "show", "job", "-o", job_id], 60).stdout
        fields = dict(w.split("=", 1) for w in shown.split() if "=" in w)
        current = fields.get("ExcNodeList", "(null)")
        before = excluded_hosts(current)
        need = nodes or int(os.environ.get("SLURM_JOB_NUM_NODES") or 0)
        partition = fields.get("Partition", "")
        bad, kept = placeable(bad, before, _partition_nodes(partition.split(",")[0]), need)
        left_in = (f"not excluding {', '.join(kept)}: partition {partition or '?'} would "
                   f"keep too few nodes for this {need}-node job (it would pend for ever)"
                   if kept else "")
        if not bad:
            return left_in or None
        merged = ",".join(before + [h for h in bad if h not in before])
        proc = _shielded(["scontrol", "update", f"JobId={job_id}", f"ExcNodeList={merged}"],
                         60)
    except (OSError, subprocess.TimeoutExpired) as e:
        proc = subprocess.CompletedProcess([], 1, "", f"{type(e).__name__}: {e}")
    if proc.returncode != 0:
        logger.warning("could not exclude %s from requeued job %s: `scontrol update "
                       "ExcNodeList` said %s", ", ".join(bad), job_id,
                       (proc.stderr or proc.stdout).strip() or proc.returncode)
        return None
    failed = [h for h in hosts if h in bad]
    why = [f"{', '.join(failed)} failed in this job"] if failed else []
    if [h for h in ledger if h in bad]:
        why.append(f"{', '.join(h for h in ledger if h in bad)}: bad-node ledger, {STRIKES} "
                   "live strikes; hpc nodes --clear HOST allows one again")
    return "; ".join(filter(None, [f"excluding {', '.join(bad)} ({'; '.join(why)})",
                                   left_in]))


def excluded_hosts(field: str) -> list[str]:
    """The hosts of an ``ExcNodeList`` as ``scontrol show job`` prints it: ``node[1-2],gpu7``
    is three hosts (a range read as one name kept every host of it in the count of the
    partition's nodes left, and the requeued job excluded too many to ever run);
    ``(null)`` or empty: none."""
    from hpc.environments import expand_hostnames

    field = field.strip()
    return [] if field in ("", "(null)") else expand_hostnames(field)


def _shielded(argv: Sequence[str], timeout: float) -> subprocess.CompletedProcess[str]:
    """``argv``'s output, run with SIGTERM blocked (the mask is inherited through exec).

    These calls run right after ``scontrol requeue``, while Slurm sends the job's batch
    step SIGTERM: a ``sinfo`` started then died of it, said nothing, and the requeued job
    excluded every failed host, too many to ever run again."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        return subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def _partition_nodes(partition: str) -> list[str]:
    """The nodes of ``partition`` (``sinfo -N``), empty when sinfo cannot say."""
    try:
        out = _shielded(["sinfo", "-h", "-N", "-p", partition, "-o", "%N"], 30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    return list(dict.fromkeys(out.split()))


def placeable(bad: Sequence[str], before: Sequence[str], nodes: Sequence[str], need: int
              ) -> tuple[list[str], list[str]]:
    """(hosts to exclude, hosts left in): as many of ``bad``, in order, as leave ``need``
    of the partition's ``nodes`` that ``before`` (the job's exclusions, expanded) does
    not already exclude; a requeued job that excludes too many would pend for ever
    (``BadConstraints``). Pure; no ``nodes`` (sinfo could not say) or no ``need``: all."""
    if not nodes or need < 1:
        return list(bad), []
    left = [n for n in nodes if n not in set(before)]
    out, kept = [], []
    for h in bad:
        if h in left and len(left) - 1 < need:
            kept.append(h)
            continue
        out.append(h)
        left = [n for n in left if n != h]
    return out, kept
