"""Backend strings and the device_id version gate (pure)."""

from __future__ import annotations

import pytest

from hpc.bootstrap.backend import (
    DEFAULT_GPU_BACKEND,
    device_id_supported,
    parse_backend,
    uses_cuda,
)


@pytest.mark.parametrize("text, expected", [
    ("nccl", {"cuda": "nccl"}),
    ("gloo", {"cpu": "gloo", "cuda": "gloo"}),
    ("NCCL", {"cuda": "nccl"}),
    ("cpu:gloo,cuda:nccl", {"cpu": "gloo", "cuda": "nccl"}),
    ("cuda:nccl, cpu:gloo", {"cpu": "gloo", "cuda": "nccl"}),
    ("cpu:gloo", {"cpu": "gloo"}),
    ("mybackend", {"cpu": "mybackend", "cuda": "mybackend"}),
])
def test_parse_backend(text: str, expected: dict[str, str]) -> None:
    assert parse_backend(text) == expected


@pytest.mark.parametrize("bad", ["cpu:", "cuda:nccl,gloo", ":nccl"])
def test_parse_backend_refuses_a_malformed_list(bad: str) -> None:
    with pytest.raises(ValueError, match="(?s)DEVICE:BACKEND.*HINT"):
        parse_backend(bad)


def test_uses_cuda_reads_the_mixed_string_as_gpu() -> None:
    assert uses_cuda(None) and uses_cuda("nccl") and uses_cuda(DEFAULT_GPU_BACKEND)
    assert uses_cuda("cuda:nccl,cpu:gloo")
    assert not uses_cuda("gloo") and not uses_cuda("cpu:gloo") and not uses_cuda("mpi")


@pytest.mark.parametrize("version, ok", [
    ("2.1.0", False), ("2.1.2+cu121", False), ("2.2.2", False),   # no device_id yet
    ("2.3.0", True), ("2.4.1+cu124", True), ("2.5.1", True),
    ("2.6.0", False), ("2.6.0+cu126", False), ("2.7.0", False),   # #153960 hangs
    ("2.7.0a0+git1234", False),
    ("2.7.1", True), ("2.8.0", True), ("2.13.0+cpu", True), ("3.0", True),
])
def test_device_id_gate(version: str, ok: bool) -> None:
    assert device_id_supported(version) is ok


def test_device_id_gate_refuses_garbage() -> None:
    with pytest.raises(ValueError, match="not a torch version"):
        device_id_supported("unknown")
