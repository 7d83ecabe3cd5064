"""A sync's own CPU copies run on this rank's share of the host (internal).

A script that calls ``init_process_group`` itself and is started without
``OMP_NUM_THREADS`` (``srun python``, ``mpirun``, ``mp.spawn``; ``torchrun`` sets it to
1) runs every rank with one torch thread per core of the host. A copy large enough for
torch's intra-op pool then wakes the pool, whose threads keep spinning after it
(OpenMP's active wait), on the cores the other ranks of the host need for their part of
the same exchange. Measured: ``sync_model`` of a ResNet-50-shaped model, two ranks on
two cores, a plain ``torchrun`` script, medians of 5 runs: 0.97x a flat broadcast with
one thread per rank, 0.73x with two (0.90 and 0.92x in two runs with
``OMP_WAIT_POLICY=PASSIVE``: the spinning is what costs), 0.88x with the cap.
:func:`share_of_host` caps torch's threads, for the span of a sync's copies, at what
:func:`hpc.init_torch` gives each rank (:func:`hpc.bootstrap.threads.rank_share`), and
restores the caller's count after it,
and says once per process (a warning) that the ranks are oversubscribed: their own
compute suffers more than any sync (DDP on the benchmark supernet, two ranks on two
cores: 14.7 steps/s with one thread per rank, 1.25-1.72 with two).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from hpc.bootstrap.threads import rank_share

__all__ = ["share_of_host", "oversubscribed"]

logger = logging.getLogger(__name__)

_WARNED: list[bool] = []


@contextmanager
def share_of_host(local_ranks: int) -> Iterator[None]:
    """At most this rank's share of the host's CPUs for torch while inside, when
    ``local_ranks`` ranks run on this host; nothing changes where the count already
    fits (``hpc.init_torch``'s ranks, ``torchrun``'s, a single rank per host)."""
    threads = torch.get_num_threads()
    share = rank_share(local_ranks)
    if local_ranks < 2 or threads <= share:
        yield
        return
    if not _WARNED:
        _WARNED.append(True)
        logger.warning("%s", oversubscribed(local_ranks, threads, share))
    torch.set_num_threads(share)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def oversubscribed(local_ranks: int, threads: int, share: int) -> str:
    """The warning for ``local_ranks`` ranks of ``threads`` torch threads each where
    each should use ``share`` CPUs (pure)."""
    return (f"sync: {local_ranks} ranks run on this host, each with {threads} torch "
            f"threads, where each has {share} CPU(s) to itself.\nThe ranks compete for "
            "the cores (training steps ran 9x slower so on a 2-core test host); torch "
            "starts a thread per core unless OMP_NUM_THREADS or torch.set_num_threads "
            f"says otherwise. The sync's own copies now run on {share} thread(s).\n"
            f"HINT: export OMP_NUM_THREADS={share} (CPUs per host / ranks per host) "
            "before starting the ranks, or call hpc.init_torch(), which sets it.")
