"""PretrainConfig.deterministic: cuDNN's switches, and the CLI flag that clears it."""

from __future__ import annotations

import argparse

import pytest

torch = pytest.importorskip("torch")

from hpc.pretrain import cli
from hpc.pretrain.config import PretrainConfig
from hpc.pretrain.resume import set_determinism


@pytest.fixture()
def cudnn_flags():
    saved = torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark
    yield
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = saved


def test_deterministic_by_default_sets_cudnn(cudnn_flags: None) -> None:
    torch.backends.cudnn.benchmark = True
    assert PretrainConfig().deterministic is True
    set_determinism(PretrainConfig().deterministic)
    assert torch.backends.cudnn.deterministic is True
    assert torch.backends.cudnn.benchmark is False


def test_no_deterministic_frees_cudnn(cudnn_flags: None) -> None:
    torch.backends.cudnn.benchmark = True
    set_determinism(False)
    assert torch.backends.cudnn.deterministic is False
    assert torch.backends.cudnn.benchmark is True  # the script's choice stays


def test_cli_flag() -> None:
    p = argparse.ArgumentParser()
    cli.add_flags(p)
    assert cli.config_from_args(p.parse_args([])).deterministic is True
    assert cli.config_from_args(p.parse_args(["--no-deterministic"])).deterministic is False
