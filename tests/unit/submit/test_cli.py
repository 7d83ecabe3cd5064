"""hpc.submit.cli: the ``hpc submit`` command line, without submitting."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from hpc.errors import SubmitError
from hpc.submit.cli import main, parse_time, split_target
from tests.helpers import ROOT


@pytest.mark.parametrize("cmd, expected", [
    ([], ("pretrain", [])),
    (["--", "--epochs", "2"], ("pretrain", ["--epochs", "2"])),
    (["pretrain", "--epochs", "2"], ("pretrain", ["--epochs", "2"])),
    (["--", "-m", "pkg.mod", "a"], ("module:pkg.mod", ["a"])),
    (["pkg.mod:main", "a", "b"], ("function:pkg.mod:main", ["a", "b"])),
])
def test_split_target(cmd: list, expected: tuple) -> None:
    assert split_target(cmd) == expected


def test_split_target_rejects_the_unknown_listing_forms() -> None:
    with pytest.raises(SubmitError, match="pkg.mod:func"):
        split_target(["train.py"])


@pytest.mark.parametrize("text, minutes", [("90", 90), ("1:30", 2), ("1:30:00", 90),
                                           ("1-12:00", 2160), ("2-0", 2880)])
def test_parse_time(text: str, minutes: int) -> None:
    assert parse_time(text) == minutes


def test_parse_time_rejects_garbage() -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        parse_time("soon")


def test_cli_rejects_unknown_options_listing_valid_ones() -> None:
    proc = subprocess.run([sys.executable, "-m", "hpc", "submit", "--nodez", "2"],
                          check=False, capture_output=True, text=True, timeout=60,
                          cwd=ROOT)
    assert proc.returncode == 2
    assert "--nodez -> --nodes?" in proc.stderr and "--gpus-per-node" in proc.stderr


def test_cli_modules_import_neither_torch_nor_submitit() -> None:
    code = ("import sys, hpc.cli.main; hpc.cli.main.build_parser();"
            "import hpc.submit, hpc.submit.cli, hpc.submit.watch;"
            "print(sorted(m for m in ('torch', 'submitit') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True,
                         text=True, timeout=60, cwd=ROOT).stdout.strip()
    assert out == "[]"


def test_main_takes_argv_and_returns_the_exit_status(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--nodes", "1", "--", "train.py"]) == 2  # refused before anything is submitted
    assert "unknown target 'train.py'" in capsys.readouterr().err


def test_executor_does_not_import_the_cli() -> None:
    code = "import sys, hpc.submit.executor; print('hpc.submit.cli' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True,
                         text=True, timeout=60, cwd=ROOT).stdout.strip()
    assert out == "False"
