"""torch-hpc: one PyTorch training script under torchrun, Slurm and MPI.

Re-exports only; importing ``hpc`` has no side effects and does not import torch.
"""

from __future__ import annotations

from hpc._lazy import lazy_attributes
from hpc.environments import DistInfo, detect, parse_local_rank
from hpc.errors import (
    CheckpointError,
    CollectiveError,
    HPCError,
    InconsistentEnvironmentError,
    LaunchEnvironmentError,
    MasterAddressError,
    ModelMismatchError,
    RendezvousError,
    SubmitError,
)

__version__ = "0.1.0"

__all__ = [
    "DistInfo", "detect", "parse_local_rank",
    "init_torch", "teardown", "export_env", "info", "device", "is_dist", "get_rank",
    "get_local_rank", "get_world_size", "get_local_world_size", "get_node_rank",
    "is_master", "is_local_master", "master_only", "barrier", "seed_everything",
    "setup_logging", "sync_model", "sync_gradients", "GradSync",
    "save_checkpoint", "restore_checkpoint", "wait_for_checkpoint", "Restored", "ResumableSampler", "AgreedStop",
    "PreemptGuard", "run_id", "open_trackers",
    "HPCError", "LaunchEnvironmentError", "InconsistentEnvironmentError",
    "MasterAddressError", "RendezvousError", "ModelMismatchError", "CheckpointError",
    "SubmitError", "CollectiveError",
]

# Names served lazily so that `import hpc` (and `hpc run`) never imports torch.
_LAZY = {
    "init_torch": "hpc.bootstrap.distributed", "teardown": "hpc.bootstrap.distributed",
    "export_env": "hpc.bootstrap.distributed", "seed_everything": "hpc.bootstrap.distributed",
    # who this process is (hpc.roles: recorded by init_torch, or detected before it)
    "info": "hpc.roles", "device": "hpc.roles", "is_dist": "hpc.roles", "get_rank": "hpc.roles",
    "get_local_rank": "hpc.roles", "get_world_size": "hpc.roles",
    "get_local_world_size": "hpc.roles", "get_node_rank": "hpc.roles", "is_master": "hpc.roles",
    "is_local_master": "hpc.roles", "master_only": "hpc.roles", "barrier": "hpc.roles",
    "setup_logging": "hpc.log",
    "sync_model": "hpc.sync.model", "sync_gradients": "hpc.sync.grads", "GradSync": "hpc.sync.grads",
    # checkpoint, resume and the agreed stop for any script (docs/preemptible.md)
    "save_checkpoint": "hpc.checkpoint.resume", "restore_checkpoint": "hpc.checkpoint.resume",
    "wait_for_checkpoint": "hpc.checkpoint.asyncsave",
    "Restored": "hpc.checkpoint.resume", "ResumableSampler": "hpc.checkpoint.sampler",
    "AgreedStop": "hpc.preempt.stop", "PreemptGuard": "hpc.preempt.guard",
    # one id per training run, for trackers (docs/tracking.md)
    "run_id": "hpc.track.runid", "open_trackers": "hpc.track.tracker",
}

__getattr__, __dir__ = lazy_attributes(__name__, _LAZY, __all__)
