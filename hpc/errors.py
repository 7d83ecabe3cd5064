"""Typed errors raised by torch-hpc.

Every message follows the house format: the fact with its values, the cause, then a
``HINT:`` line with the concrete fix.
"""

from __future__ import annotations

__all__ = [
    "EXIT_REQUEUED",
    "HPCError",
    "LaunchEnvironmentError",
    "InconsistentEnvironmentError",
    "MasterAddressError",
    "RendezvousError",
    "ModelMismatchError",
    "CheckpointError",
    "PreemptError",
    "SubmitError",
    "CollectiveError",
    "SilentCorruptionError",
    "InjectedFault",
]

#: Exit status of every rank after a successful requeue (sysexits' EX_TEMPFAIL): not a
#: failure. Here, below every room, because the preemption code sets it and the failure
#: marks (watchdog) and templates' reports must not count it.
EXIT_REQUEUED = 75


class HPCError(RuntimeError):
    """Base class of every error torch-hpc raises on purpose."""


class LaunchEnvironmentError(HPCError, ValueError):
    """The launch environment's variables are missing, malformed or out of range."""


class InconsistentEnvironmentError(LaunchEnvironmentError):
    """Two launchers' variables describe different process layouts."""


class MasterAddressError(HPCError):
    """No master address/port can be derived for this launch."""


class RendezvousError(HPCError, TimeoutError):
    """The pre-flight could not bring every rank together in time."""


class ModelMismatchError(HPCError):
    """Ranks hold models whose parameter lists differ."""


class CheckpointError(HPCError):
    """A checkpoint is missing, truncated or corrupt."""


class PreemptError(HPCError, ValueError):
    """A preemption setting is malformed (signal, requeue budget, step hook), under any launcher."""


class SubmitError(HPCError):
    """Submitting, following or requeueing a Slurm job failed, or the job itself failed."""


class CollectiveError(HPCError):
    """A collective timed out or failed after init; the message names the stuck rank(s)."""


class SilentCorruptionError(HPCError):
    """The replicated state (parameters, optimizer state) of some rank differs from the
    majority's; the message names the rank(s), host(s), step and tensor(s)."""


class InjectedFault(HPCError):
    """Raised on purpose by ``HPC_FAULT=rank:step:exc`` (an application error)."""
