"""The ``hpc`` subcommand table and the one entry shape of every command."""

from __future__ import annotations

import importlib
import inspect
from typing import Any

import pytest

from hpc.cli import main as cli_main

MODULES = {"run": "hpc.cli.run", "env": "hpc.cli.env", "demo": "hpc.cli.demo",
           "pretrain": "hpc.pretrain.cli", "check": "hpc.check.cli"}  # submit: in hpc.submit.cli


def test_table_lists_run_first_and_the_parser_has_every_entry() -> None:
    assert next(iter(cli_main.SUBCOMMANDS)) == "run"
    parser = cli_main.build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    assert list(sub.choices) == list(cli_main.SUBCOMMANDS)


@pytest.mark.parametrize("command", sorted(MODULES))
def test_every_command_has_main_argv_and_a_private_handler(command: str) -> None:
    module = importlib.import_module(MODULES[command])
    params = inspect.signature(module.main).parameters
    assert list(params) == ["argv"] and params["argv"].default is None
    assert callable(module._run) and "_run" not in module.__all__


def _capture_launch(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    import hpc.launch

    calls: list[Any] = []

    def fake_run(cmd: list[str], nproc: int, *, prefix: bool, port: Any) -> int:
        calls.append((cmd, nproc, prefix, port))
        return 7

    monkeypatch.setattr(hpc.launch, "run", fake_run)
    return calls


def test_module_main_parses_and_runs_as_the_hpc_subcommand(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from hpc.cli import run as cli_run

    calls = _capture_launch(monkeypatch)
    argv = ["-n", "3", "--no-prefix", "--", "echo", "x"]
    assert cli_run.main(argv) == cli_main.main(["run", *argv]) == 7
    assert calls[0] == calls[1] == (["echo", "x"], 3, False, None)


def test_run_refuses_bad_input_with_status_2(capsys: pytest.CaptureFixture[str]) -> None:
    from hpc.cli import run as cli_run

    assert cli_run.main(["-n", "0", "--", "true"]) == 2
    assert capsys.readouterr().err.startswith("hpc run: --nproc must be >= 1, got 0")


def test_module_main_reports_usage_as_hpc_subcommand(
        capsys: pytest.CaptureFixture[str]) -> None:
    from hpc.cli import demo

    errors = []
    for entry in (demo.main, lambda argv: cli_main.main(["demo", *argv])):
        with pytest.raises(SystemExit) as e:
            entry(["--backend"])
        assert e.value.code == 2
        errors.append(capsys.readouterr().err)
    assert errors[0] == errors[1]
    assert errors[0].startswith("usage: hpc demo [-h] [--backend BACKEND]")


_INCONSISTENT = {"RANK": "3", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": "29500"}


def _hpc_env(extra: dict[str, str]) -> Any:
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "OMPI_", "PMI"))}
    return subprocess.run([sys.executable, "-m", "hpc", "env"], env={**env, **extra},
                          capture_output=True, text=True, timeout=60)


def test_a_torch_hpc_error_is_its_message_in_one_line_and_status_1() -> None:
    """Under srun --kill-on-bad-exit a traceback written line by line lost its last line
    (CI, stop 35): the message comes alone, first, so it is what reaches the log."""
    proc = _hpc_env(_INCONSISTENT)
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.startswith("hpc env: "), proc.stderr
    assert "Traceback" not in proc.stderr and "RANK" in proc.stderr and "HINT" in proc.stderr


def test_hpc_traceback_shows_the_traceback_after_the_message() -> None:
    proc = _hpc_env({**_INCONSISTENT, "HPC_TRACEBACK": "1"})
    assert proc.returncode == 1
    assert proc.stderr.startswith("hpc env: ") and "Traceback (most recent call last)" in proc.stderr
