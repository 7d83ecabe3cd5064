"""What a submitit job runs: a user's module that ends with the agreed requeue exit."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("submitit")  # in the test extra; a skip fails under HPC_CI (conftest)

from hpc.errors import SubmitError  # noqa: E402
from hpc.preempt.requeue import EXIT_REQUEUED  # noqa: E402
from hpc.submit.payload import ModuleJob  # noqa: E402


def _module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, code: str) -> str:
    (tmp_path / f"{name}.py").write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "argv", list(sys.argv))  # ModuleJob sets it
    return name


def test_module_that_was_requeued_exits_75_without_an_error(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """AgreedStop.requeue_and_exit: the job is requeued, every rank exits 75. A
    SubmitError here made submitit log 'Submitted job triggered an exception' and a
    traceback; SystemExit does not (submitit catches Exception), and writes no result,
    so the requeued job runs the call again."""
    name = _module(tmp_path, monkeypatch, "requeued_target",
                   f"import sys\nsys.exit({EXIT_REQUEUED})\n")
    with pytest.raises(SystemExit) as e:
        ModuleJob(name, ["--out", "x"])()
    assert e.value.code == EXIT_REQUEUED and not isinstance(e.value, Exception)


def test_module_that_failed_is_a_submit_error_naming_its_status(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    name = _module(tmp_path, monkeypatch, "failed_target", "import sys\nsys.exit(3)\n")
    with pytest.raises(SubmitError, match=r"`python -m failed_target` exited with status 3"):
        ModuleJob(name)()
    assert ModuleJob(_module(tmp_path, monkeypatch, "done_target", "x = 1\n"))() == 0
