"""How :func:`hpc.bootstrap.distributed.teardown` closes the process group at exit.

Three endings, by what happened: a collective failed (the watchdog ends the process
with its exit code: destroying a broken group can block, and gloo aborts the
interpreter's shutdown), this process is failing (abort, not destroy: destroy flushes
pending NCCL work, which hangs when peers are gone; then the same grace as a clean run's),
or a clean run (destroy, then let gloo's worker threads finish before the interpreter
finalizes).
"""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import Any

logger = logging.getLogger(__name__)


def close_group() -> None:
    """End the watchdog and close the default process group (best effort, at exit)."""
    try:
        import gc

        import torch.distributed as dist

        from hpc.watchdog import marks
        from hpc.watchdog import monitor as watchdog

        dog = watchdog.stop()
        if dog is not None and dog.failure is not None:
            # A collective failed: the group's connections are broken; destroying it
            # can block, and gloo aborts the interpreter's shutdown (SIGABRT). End here.
            dog.finish()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(watchdog.EXIT_CODE)
        if dist.is_available() and dist.is_initialized() and marks.failed():
            _abort_group(dist)
            # The clean run's race below, on a failing rank: 2 of 194 runs of
            # test_health's bitflip cases ended a rank that raised with SIGABRT
            # ("terminate called without an active exception") instead of exit code 1.
            # No gc.collect() here: freeing a group whose worker waits on a cut link
            # joins that worker, and the rank would hang at exit.
            _let_workers_finish()
        elif dist.is_available() and dist.is_initialized():
            # Free unreferenced Work handles while the group still exists: a gloo Work
            # destroyed after its group, during interpreter shutdown, can abort the
            # process ("terminate called without an active exception").
            gc.collect()
            dist.destroy_process_group()
            gc.collect()
            _let_workers_finish()
    except Exception as e:  # pragma: no cover - best effort at exit
        logger.debug("teardown: %s", e)


#: Seconds teardown releases the GIL after destroying the group (see below).
WORKER_GRACE = 0.05


def _let_workers_finish() -> None:
    """Give gloo's worker threads the GIL before the interpreter finalizes.

    A gloo worker frees each Work after running it; when the Work holds the last
    reference to tensors Python created, freeing them takes the GIL. If the group
    outlives ``destroy_process_group`` (DDP's C++ reducer keeps it alive: its worker
    threads are still there at exit) and that free comes after finalization began,
    Python ends the worker with ``pthread_exit`` inside a C++ destructor:
    "terminate called without an active exception", SIGABRT or SIGSEGV after a clean
    run (seen in 5 of 90 runs of a DDP comparison). Sleeping releases the GIL so that
    pending frees run now; a group that was really destroyed joined its workers
    already and this costs the sleep only.
    """
    time.sleep(WORKER_GRACE)


def _abort_group(dist: Any) -> None:
    """Abort every process group without flushing their work (torch >= 2.2's private
    ``_abort_process_group``; destroy where it is missing)."""
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    logger.debug("teardown: failing, aborting the process group")
    if abort is None:  # pragma: no cover - older torch
        dist.destroy_process_group()
    else:
        abort()
