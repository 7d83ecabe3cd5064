"""hpc.bootstrap.gpubind: the shared-GPU message (pure) and the claims in a real (in-process) store."""

from __future__ import annotations

import pytest

from hpc.bootstrap.gpubind import GpuClaim, find_shared, publish, shared_gpu_error
from hpc.errors import LaunchEnvironmentError

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")


def claim(rank: int, uuid: str = "GPU-aaaa", host: str = "gpu01",
          visible: str | None = "0") -> GpuClaim:
    return GpuClaim(rank=rank, local_rank=rank % 4, host=host, index=0, uuid=uuid,
                    name="NVIDIA H200", visible=visible)


def test_message_names_ranks_gpu_and_fix() -> None:
    err = shared_gpu_error([claim(1), claim(0, visible=None)])
    assert isinstance(err, LaunchEnvironmentError)
    first, cause, hint = str(err).splitlines()
    assert first == (
        "ranks 0 and 1 would share one GPU under nccl: NVIDIA H200 (GPU-aaaa) on gpu01 "
        "(rank 0: local rank 0, cuda:0, CUDA_VISIBLE_DEVICES=None; "
        "rank 1: local rank 1, cuda:0, CUDA_VISIBLE_DEVICES=0).")
    assert cause.startswith("NCCL needs a GPU of its own for every rank")
    assert hint.startswith("HINT: ") and "--gpus-per-task=1" in hint
    assert "--ntasks-per-node" in hint and "backend='gloo'" in hint


def test_message_lists_three_and_caps_many() -> None:
    assert str(shared_gpu_error([claim(r) for r in (2, 0, 1)])).startswith(
        "ranks 0, 1 and 2 would share")
    many = str(shared_gpu_error([claim(r) for r in range(20)])).splitlines()[0]
    assert many.startswith("ranks 0, 1, 2,") and ", 15 and ... would share" in many
    assert "rank 16:" not in many


def test_store_flags_only_a_gpu_claimed_twice() -> None:
    store = dist.HashStore()
    publish(store, claim(0, uuid="GPU-a"))
    publish(store, claim(1, uuid="GPU-b"))
    publish(store, claim(4, uuid="GPU-a", host="gpu02"))  # same id, other host: fine
    assert find_shared(store) is None
    publish(store, claim(2, uuid="GPU-b"))
    publish(store, claim(3, uuid="GPU-b"))
    err = find_shared(store)
    assert err is not None
    assert str(err).startswith("ranks 1, 2 and 3 would share one GPU under nccl: "
                               "NVIDIA H200 (GPU-b) on gpu01 (")


class _Props:
    def __init__(self, uuid: object, name: str = "NVIDIA H200") -> None:
        self.uuid, self.name = uuid, name
        self.pci_domain_id, self.pci_bus_id, self.pci_device_id = 0, 0x1B, 0


class _RawUuid:  # a _CUuuid without __str__
    bytes = list(range(16))


@pytest.mark.parametrize("uuid,ident", [
    ("8a3c1f2e-0000-1111-2222-333344445555", "8a3c1f2e-0000-1111-2222-333344445555"),
    (_RawUuid(), bytes(range(16)).hex()),
    ("", "pci-0:27:0"),
])
def test_local_claim_identity(monkeypatch: pytest.MonkeyPatch, uuid: object,
                              ident: str) -> None:
    from hpc.bootstrap import gpubind

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: _Props(uuid))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    got = gpubind.local_claim(rank=5, local_rank=1, index=0)
    assert got is not None
    assert (got.uuid, got.name, got.visible, got.rank, got.local_rank, got.index) == (
        ident, "NVIDIA H200", "3", 5, 1, 0)


def test_local_claim_none_when_cuda_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    from hpc.bootstrap import gpubind

    def broken(i: int) -> None:
        raise RuntimeError("CUDA driver initialization failed")

    monkeypatch.setattr(torch.cuda, "get_device_properties", broken)
    assert gpubind.local_claim(0, 0, 0) is None


# --------------------------------------------------------------------- MIG
_NEW = ["MIG-3b4f1a2c-1d2e-5f60-8a9b-0c1d2e3f4a5b", "MIG-9e8d7c6b-5a49-5382-9170-6f5e4d3c2b1a"]
_OLD = ["MIG-GPU-5f1a2b3c-4d5e-6f70-8192-a3b4c5d6e7f8/1/0",
        "MIG-GPU-5f1a2b3c-4d5e-6f70-8192-a3b4c5d6e7f8/2/0"]


def test_mig_devices_parses_both_uuid_forms() -> None:
    from hpc.bootstrap.gpubind import mig_devices

    assert mig_devices(",".join(_NEW)) == _NEW
    assert mig_devices(" , ".join(_OLD)) == _OLD
    assert mig_devices("0,1") == [] and mig_devices(None) == [] and mig_devices("") == []
    assert mig_devices(f"0,{_NEW[0]}") == []  # mixed: not a MIG list


def test_narrow_mig_gives_each_local_rank_its_instance() -> None:
    from hpc.bootstrap.gpubind import narrow_mig

    both = ",".join(_NEW)
    assert narrow_mig(both, 0, 2) == _NEW[0] and narrow_mig(both, 1, 2) == _NEW[1]
    assert narrow_mig(",".join(_OLD), 1, 2) == _OLD[1]
    assert narrow_mig(_NEW[0], 0, 1) is None        # already one instance per task
    assert narrow_mig(both, 2, 3) is None           # too few: the shared-GPU check names it
    assert narrow_mig(both, 0, 3) is None
    assert narrow_mig("0,1", 1, 2) is None          # whole GPUs: torch picks by index


def test_init_binds_the_local_ranks_mig_instance(monkeypatch) -> None:
    """_pick_device narrows CUDA_VISIBLE_DEVICES before CUDA is touched."""
    import torch

    from hpc.bootstrap import distributed
    from hpc.environments.base import DistInfo

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", ",".join(_NEW))
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # CPU host
    info = DistInfo(launcher="local", rank=1, local_rank=1, world_size=2,
                    local_world_size=2)
    assert distributed._pick_device(info, None) == ("gloo", torch.device("cpu"))
    import os

    assert os.environ["CUDA_VISIBLE_DEVICES"] == _NEW[1]


# --- choose_index and AMD's variables (issue 13) --------------------------------------


def test_choose_index_rules() -> None:
    from hpc.bootstrap.gpubind import choose_index

    assert choose_index(3, 4, 1, {}) == 0                  # one GPU per task
    assert choose_index(1, 2, 2, {}) == 1                  # the node's GPUs, shared
    assert choose_index(1, 2, 2, {"SLURM_GPUS_PER_TASK": "2"}) == 0  # its own 2 GPUs


def test_choose_index_gpus_per_task_never_gets_the_more_tasks_hint() -> None:
    """--gpus-per-task=2 with 4 tasks per node: each task sees its own 2 GPUs."""
    from hpc.bootstrap.gpubind import choose_index

    assert choose_index(3, 4, 2, {"SLURM_GPUS_PER_TASK": "2"}) == 0


def test_more_tasks_than_gpus_names_rocm_variables() -> None:
    from hpc.bootstrap.gpubind import choose_index
    from hpc.errors import LaunchEnvironmentError

    env = {"ROCR_VISIBLE_DEVICES": "0,1", "HIP_VISIBLE_DEVICES": "0,1"}
    with pytest.raises(LaunchEnvironmentError, match="has no GPU") as e:
        choose_index(2, 3, 2, env)
    assert "ROCR_VISIBLE_DEVICES=0,1 HIP_VISIBLE_DEVICES=0,1" in str(e.value)
    with pytest.raises(LaunchEnvironmentError, match=r"CUDA_VISIBLE_DEVICES=None\)"):
        choose_index(2, 3, 2, {})


def test_local_claim_under_rocm_shows_rocr(monkeypatch: pytest.MonkeyPatch) -> None:
    from hpc.bootstrap import gpubind

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: _Props("u-1"))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setenv("ROCR_VISIBLE_DEVICES", "2")
    got = gpubind.local_claim(rank=0, local_rank=0, index=0)
    assert got is not None and got.visible == "ROCR_VISIBLE_DEVICES=2"
    assert "ROCR_VISIBLE_DEVICES=2" in str(gpubind.shared_gpu_error([got, got]))
