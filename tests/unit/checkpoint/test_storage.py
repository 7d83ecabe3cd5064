"""The storage pre-flight in one process (no process group: ``world()`` is ``(0, 1)``), on
real directories: a usable one, a tmpfs nearly full of bytes or of inodes (root mounts
it), a path the master cannot create. Each check must answer within 5 s."""

from __future__ import annotations

import logging
import re
import socket
import time
from collections.abc import Callable
from pathlib import Path

import pytest

pytest.importorskip("torch")

from hpc.checkpoint import storage  # noqa: E402
from hpc.checkpoint.storage import preflight, preflight_once  # noqa: E402
from hpc.errors import CheckpointError  # noqa: E402
from hpc.sync.agree import world  # noqa: E402
from tests.helpers.tmpfs import nearly_full_tmpfs  # noqa: E402

MiB = 1 << 20
BUDGET_S = 5.0


def timed(fn, *args):
    """``fn(*args)`` and the seconds it took, asserting it stays within the budget; an
    exception is returned, not raised."""
    start = time.perf_counter()
    try:
        out = fn(*args)
    except CheckpointError as e:
        out = e
    took = time.perf_counter() - start
    assert took < BUDGET_S, f"{fn.__name__} took {took:.2f} s"
    return out


def test_a_usable_directory_passes_and_is_left_as_it_was(tmp_path: Path) -> None:
    assert world() == (0, 1)
    ckpt = tmp_path / "new" / "ckpt"  # created by the master
    report = timed(preflight, ckpt, MiB)
    assert report.path == str(ckpt) and report.need_bytes == MiB
    assert report.fsync_s > 0 and report.free_bytes > 2 * MiB
    assert report.hosts == (socket.gethostname(),)
    assert ckpt.is_dir() and list(ckpt.iterdir()) == []  # the token file is gone


def test_a_relative_path_is_reported_absolute(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert timed(preflight, "ckpt", 1).path == str(tmp_path / "ckpt")


def test_a_nearly_full_filesystem_is_refused_naming_path_free_and_needed(
        tmp_path: Path) -> None:
    with nearly_full_tmpfs(tmp_path / "fs", size_mib=8, fill_mib=6) as fs:
        err = timed(preflight, fs / "ckpt", 4 * MiB)
    assert isinstance(err, CheckpointError), err
    msg = str(err)
    assert msg.startswith(f"checkpoint directory {fs / 'ckpt'} has too little room: "
                          f"{socket.gethostname()}: "), msg
    assert re.search(r": (1\.9|2\.0) MiB free, needs 8\.0 MiB\.\n", msg), msg
    assert msg.endswith("A save needs 8.0 MiB (2 x the 4.0 MiB checkpoint: the new file is "
                        "written beside the previous one before the rename) and 16 free "
                        "inodes.\nHINT: free space or files there, keep fewer checkpoints, "
                        "or use a larger filesystem."), msg


def test_a_filesystem_out_of_inodes_is_refused(tmp_path: Path) -> None:
    with nearly_full_tmpfs(tmp_path / "fs", fill_mib=0, inodes=20, files=6) as fs:
        err = timed(preflight, fs / "ckpt", 1024)
    assert isinstance(err, CheckpointError), err
    assert re.search(rf"{socket.gethostname()}: \d+ inodes free, needs 16\.", str(err)), err


def test_a_directory_the_master_cannot_create_is_refused(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("not a directory")
    err = timed(preflight, tmp_path / "file" / "ckpt", 1)
    assert isinstance(err, CheckpointError), err
    msg = str(err)
    assert msg.startswith(f"checkpoint directory {tmp_path / 'file' / 'ckpt'}: the global "
                          f"master (rank 0 on {socket.gethostname()}) cannot create or "
                          "write a file there: [Errno 20] Not a directory"), msg
    assert "\nHINT: pass a directory you own, with free space, on a filesystem" in msg


def test_a_full_filesystem_is_refused_and_left_without_a_token(tmp_path: Path) -> None:
    with nearly_full_tmpfs(tmp_path / "fs", size_mib=1, fill_mib=1) as fs:
        (fs / "ckpt").mkdir()
        err = timed(preflight, fs / "ckpt", 1)
        left = list((fs / "ckpt").iterdir())
    assert isinstance(err, CheckpointError), err
    assert "cannot create or write a file there: [Errno 28] No space left on device." \
        in str(err), err
    assert left == []


def test_preflight_once_checks_each_directory_once(tmp_path: Path) -> None:
    sized: list[str] = []

    def size(name: str) -> Callable[[], int]:
        return lambda: sized.append(name) or 1

    first = timed(preflight_once, tmp_path / "a", size("a"))
    assert first is not None and first.path == str(tmp_path / "a")
    assert preflight_once(tmp_path / "a", size("a again")) is None
    assert preflight_once(f"{tmp_path}/a/", size("a/")) is None  # the same directory
    assert preflight_once(tmp_path / "b", size("b")) is not None
    assert sized == ["a", "b"]  # the size is taken only for a check that runs


def test_a_failed_check_is_not_cached(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    with pytest.raises(CheckpointError):
        preflight_once(tmp_path / "file" / "ckpt", lambda: 1)
    with pytest.raises(CheckpointError):
        preflight_once(tmp_path / "file" / "ckpt", lambda: 1)


def test_a_slow_fsync_warns_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                 caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(storage, "FSYNC_WARN_S", -1.0)  # every fsync is "slow"
    with caplog.at_level(logging.INFO, logger="hpc.checkpoint.storage"):
        report = preflight(tmp_path, 1)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and f"one fsync in {tmp_path} took" in warnings[0], warnings
    assert "\nHINT: save less often" in warnings[0]
    infos = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert infos == [f"storage pre-flight: {tmp_path} is one directory on 1 host(s), "
                     f"{storage._size(report.free_bytes)} free, fsync {report.fsync_s:.4f} s"]
