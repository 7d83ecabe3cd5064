"""Faults a user injects on purpose: ``HPC_FAULT=rank:step:kind[,...]``.

A job that claims it recovers from a dead rank, names a slow one or catches a corrupted
one should be shown doing it on the user's own script. Each fault hits one rank (its
global rank) at the boundary of one step (after the step's work, where
:class:`hpc.AgreedStop` or ``hpc pretrain`` calls :meth:`hpc.health.step.StepHealth.boundary`):

=========  ==============================================================================
kind       what the rank does at step ``step``
=========  ==============================================================================
kill       SIGKILLs itself (the node "crashes": no traceback, no failure mark of its own)
hang       stops at its next world collective, never entering it (a frozen rank)
exit       ``sys.exit(1)`` (a failing exit status)
exc        raises :class:`~hpc.errors.InjectedFault` (an application error with a traceback)
slow:F     from this step on, sleeps ``F - 1`` times each step's compute time (a straggler)
bitflip    flips one bit of one parameter once (a silent data corruption)
=========  ==============================================================================

The value is parsed with every other ``HPC_*`` variable at init
(:data:`hpc.envvars.VARIABLES`), so a typo fails at start-up.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Optional

__all__ = ["Fault", "Injector", "flip_bit"]

logger = logging.getLogger(__name__)

#: The bit ``bitflip`` flips in the first element of the chosen tensor: bit 12 of a
#: float32 (a relative change of ~5e-4, small enough to train on unnoticed) and the
#: same bit of any other dtype's first bytes.
BIT = 12


@dataclass(frozen=True)
class Fault:
    """One ``rank:step:kind[:arg]`` of ``HPC_FAULT``."""

    rank: int
    step: int
    kind: str
    arg: Optional[float] = None

    def __str__(self) -> str:
        arg = "" if self.arg is None else f":{self.arg:g}"
        return f"{self.rank}:{self.step}:{self.kind}{arg}"


def flip_bit(params: Iterable[tuple[str, Any]], bit: int = BIT) -> Optional[str]:
    """Flip ``bit`` of the first element of the first non-empty floating parameter, in
    place; its name (``"fc.weight[0] bit 12"``), or None when there is none."""
    import torch

    for name, p in params:
        if p.numel() == 0 or not p.is_floating_point():
            continue
        with torch.no_grad():
            flat = p.detach().reshape(-1)[:1]
            raw = flat.view(torch.uint8) if p.element_size() < 4 else flat.view(torch.int32)
            width = raw.element_size() * 8
            raw[0] ^= 1 << (bit % width)
        return f"{name}[0] bit {bit % width}"
    return None


class Injector:
    """This rank's faults, applied at step boundaries.

    Args:
        faults: Every fault of the job (those of other ranks are ignored).
        rank: This rank's global rank.
    """

    def __init__(self, faults: Sequence[Fault], rank: int) -> None:
        self.faults = [f for f in faults if f.rank == rank]
        self.rank = rank
        self.slow: Optional[float] = None  #: the factor of an active ``slow``
        self._slept = 0.0

    @classmethod
    def from_env(cls, rank: int, environ: Optional[Any] = None) -> "Injector":
        from hpc import envvars

        parsed = envvars.value("HPC_FAULT", environ) or ()
        return cls([Fault(*t) for t in parsed], rank)

    def __bool__(self) -> bool:
        return bool(self.faults) or self.slow is not None

    def at_step(self, step: int, compute_s: Optional[float],
                params: Optional[Iterable[tuple[str, Any]]] = None) -> None:
        """Apply what is due at the boundary of ``step``: ``compute_s`` is this step's
        compute time (for ``slow``), ``params`` the named parameters (for ``bitflip``)."""
        for f in [f for f in self.faults if f.step == step]:
            self.faults.remove(f)
            self._apply(f, step, params)
        if self.slow is not None and compute_s:
            # compute_s holds the sleep of the step before (it counts as compute)
            own = max(0.0, compute_s - self._slept)
            self._slept = (self.slow - 1.0) * own
            time.sleep(self._slept)

    def _apply(self, f: Fault, step: int,
               params: Optional[Iterable[tuple[str, Any]]]) -> None:
        from hpc.errors import InjectedFault

        where = f"rank {self.rank} at step {step}"
        if f.kind == "slow":
            self.slow = f.arg
            logger.warning("HPC_FAULT %s: rank %d runs %gx slower from step %d on", f,
                           self.rank, f.arg, step)
        elif f.kind == "bitflip":
            flipped = flip_bit(params or ())
            logger.warning("HPC_FAULT %s: flipped %s on %s", f, flipped or "nothing (no "
                           "floating parameter known here)", where)
        elif f.kind == "kill":
            logger.warning("HPC_FAULT %s: SIGKILL to %s", f, where)
            _flush()
            os.kill(os.getpid(), signal.SIGKILL)
        elif f.kind == "exit":
            logger.warning("HPC_FAULT %s: exit 1 on %s", f, where)
            sys.exit(1)
        elif f.kind == "exc":
            raise InjectedFault(f"HPC_FAULT {f}: an exception injected on {where}.\n"
                                "HPC_FAULT asked for it (an application error).\n"
                                "HINT: unset HPC_FAULT to train without faults.")
        elif f.kind == "hang":
            from hpc.watchdog import tracker

            logger.warning("HPC_FAULT %s: %s hangs in its next collective", f, where)
            if not tracker.hang_next():  # no tracker: hang here, before the collective
                _flush()
                while True:
                    time.sleep(3600)


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    for h in logging.getLogger().handlers:
        try:
            h.flush()
        except (OSError, ValueError):
            pass
