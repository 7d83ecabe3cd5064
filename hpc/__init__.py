"""torch-hpc: one PyTorch training script under torchrun, Slurm and MPI.

Re-exports only; importing ``hpc`` has no side effects and does not import torch.
"""

from __future__ import annotations

from hpc._lazy import lazy_attributes
from hpc.environments import DistInfo, detect, parse_local_rank
from hpc.errors import (
    CheckpointError,
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
    "HPCError", "LaunchEnvironmentError", "InconsistentEnvironmentError",
    "MasterAddressError", "RendezvousError", "ModelMismatchError", "CheckpointError",
    "SubmitError",
]

# Names served lazily so that `import hpc` (and `hpc run`) never imports torch.
_LAZY = {
    "init_torch": "hpc.distributed", "teardown": "hpc.distributed",
    "export_env": "hpc.distributed", "info": "hpc.distributed", "device": "hpc.distributed",
    "is_dist": "hpc.distributed", "get_rank": "hpc.distributed",
    "get_local_rank": "hpc.distributed", "get_world_size": "hpc.distributed",
    "get_local_world_size": "hpc.distributed", "get_node_rank": "hpc.distributed",
    "is_master": "hpc.distributed", "is_local_master": "hpc.distributed",
    "master_only": "hpc.distributed", "barrier": "hpc.distributed",
    "seed_everything": "hpc.distributed", "setup_logging": "hpc.log",
    "sync_model": "hpc.sync", "sync_gradients": "hpc.gradsync", "GradSync": "hpc.gradsync",
}

__getattr__, __dir__ = lazy_attributes(__name__, _LAZY, __all__)
