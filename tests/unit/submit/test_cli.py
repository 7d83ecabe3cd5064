"""hpc.submit.cli: the ``hpc submit`` command line, without submitting."""

from __future__ import annotations

import argparse
import dataclasses
import sys

import pytest

from hpc.errors import SubmitError
from hpc.submit.cli import _build, _options, main, split_target
from hpc.submit.options import SubmitOptions
from tests.helpers.paths import ROOT
from tests.helpers.processes import run_group


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


def test_cli_rejects_unknown_options_listing_valid_ones() -> None:
    proc = run_group([sys.executable, "-m", "hpc", "submit", "--nodez", "2"], timeout=60,
                     cwd=ROOT)
    assert proc.returncode == 2
    assert "--nodez -> --nodes?" in proc.stderr and "--gpus-per-node" in proc.stderr


def test_cli_modules_import_neither_torch_nor_submitit() -> None:
    code = ("import sys, hpc.cli.main; hpc.cli.main.build_parser();"
            "import hpc.submit, hpc.submit.cli, hpc.submit.watch;"
            "print(sorted(m for m in ('torch', 'submitit') if m in sys.modules))")
    out = run_group([sys.executable, "-c", code], timeout=60, cwd=ROOT).stdout.strip()
    assert out == "[]"


def test_main_takes_argv_and_returns_the_exit_status(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--nodes", "1", "--", "train.py"]) == 2  # refused before anything is submitted
    assert "unknown target 'train.py'" in capsys.readouterr().err


def test_executor_does_not_import_the_cli() -> None:
    code = "import sys, hpc.submit.executor; print('hpc.submit.cli' in sys.modules)"
    out = run_group([sys.executable, "-c", code], timeout=60, cwd=ROOT).stdout.strip()
    assert out == "False"


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    _build(parser)
    return parser.parse_args(list(argv))


def test_every_option_field_has_a_flag_with_its_default() -> None:
    parser = argparse.ArgumentParser()
    _build(parser)
    dests = {a.dest: a for a in parser._actions}
    for f in dataclasses.fields(SubmitOptions):
        assert f.name in dests, f"SubmitOptions.{f.name} has no hpc submit flag"
        assert dests[f.name].option_strings[0] == f.metadata["flags"][0]
    # the defaults of the flags are the defaults of the fields (the name is derived)
    assert _options(_parse(), "pretrain") == SubmitOptions(name="hpc-pretrain")


def test_flags_become_the_fields_they_name() -> None:
    args = _parse("-N", "2", "-G", "2", "-t", "1:30:00", "--env", "A=b", "--env", "C=d",
                  "--signal-delay", "90", "--max-requeues", "0", "-J", "x", "--", "-m", "m")
    assert _options(args, "module:m") == SubmitOptions(
        nodes=2, gpus_per_node=2, time_min=90, env={"A": "b", "C": "d"}, signal_delay_s=90,
        max_requeues=0, name="x")
    assert _options(_parse(), "module:pkg.train").name == "hpc-train"
    assert _options(_parse(), "function:pkg.jobs:main").name == "hpc-jobs"


def test_env_flag_must_be_key_value() -> None:
    with pytest.raises(SubmitError, match="HINT: e.g. --env OMP_NUM_THREADS=4"):
        _options(_parse("--env", "A"), "pretrain")
