"""hpc.run_id: created once per run, read back by every later attempt, new when asked."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

import hpc
from hpc.errors import HPCError
from hpc.track import runid


@pytest.fixture(autouse=True)
def _fresh(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runid, "_current", None)


def test_the_first_call_creates_the_id_and_later_calls_read_it(tmp_path: Path) -> None:
    first = hpc.run_id(tmp_path / "run")
    assert re.fullmatch(r"\d{8}-\d{6}-[0-9a-f]{6}", first)
    assert (tmp_path / "run" / "run_id").read_text().strip() == first
    runid._current = None  # a requeued attempt: a new process, the same directory
    assert hpc.run_id(tmp_path / "run") == first
    assert hpc.run_id() == first  # settled: no directory needed


def test_new_replaces_the_id_and_another_directory_is_another_run(tmp_path: Path) -> None:
    first = hpc.run_id(tmp_path / "a")
    again = hpc.run_id(tmp_path / "a", new=True)
    assert again != first and (tmp_path / "a" / "run_id").read_text().strip() == again
    assert hpc.run_id(tmp_path / "b") not in (first, again)


def test_a_checkpoints_id_wins_over_the_directorys(tmp_path: Path) -> None:
    hpc.run_id(tmp_path)
    assert runid.establish(tmp_path, known="20260101-000000-abcdef") == \
        "20260101-000000-abcdef"
    assert (tmp_path / "run_id").read_text().strip() == "20260101-000000-abcdef"


def test_no_directory_before_any_id_is_settled_says_what_to_do() -> None:
    with pytest.raises(HPCError, match=r"HINT: call hpc.run_id\(DIR\)"):
        hpc.run_id()


def test_a_damaged_id_file_is_refused_with_its_content(tmp_path: Path) -> None:
    (tmp_path / "run_id").write_text("not an id!\n")
    with pytest.raises(HPCError, match="(?s)'not an id!'.*HINT: delete the file"):
        hpc.run_id(tmp_path)
    assert (tmp_path / "run_id").read_text() == "not an id!\n"  # nothing overwritten


def test_importing_hpc_track_imports_no_tracker_and_no_torch() -> None:
    import subprocess

    code = ("import sys, hpc, hpc.track.tracker, hpc.track.runid, hpc.track.sinks; "
            "print(sorted(m for m in ('torch', 'wandb', 'mlflow', 'tensorboard') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    assert out.strip() == "[]"


def test_a_checkpoint_carries_the_id_to_a_moved_directory(tmp_path: Path) -> None:
    """The docs' own-script pattern: the id is stored by save_checkpoint and adopted by
    open_trackers(restored=...) even where the directory holds another id."""
    import shutil

    import torch

    model = torch.nn.Linear(2, 2)
    rid = hpc.run_id(tmp_path / "run")
    hpc.save_checkpoint(tmp_path / "run" / "ckpt", 5, model=model)
    shutil.copytree(tmp_path / "run" / "ckpt", tmp_path / "moved" / "ckpt")
    runid._current = None  # a new process
    restored = hpc.restore_checkpoint(tmp_path / "moved" / "ckpt", model=model)
    assert restored is not None and restored.run_id == rid
    trackers = hpc.open_trackers(tmp_path / "moved", restored=restored, tensorboard=False)
    assert trackers.run_id == rid == (tmp_path / "moved" / "run_id").read_text().strip()
