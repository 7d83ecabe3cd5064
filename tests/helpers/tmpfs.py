"""A small tmpfs, nearly full, mounted on a test's directory (root only): a real
filesystem short of space or inodes, seen by every process of this machine."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest


@contextmanager
def nearly_full_tmpfs(where: Path, *, size_mib: int = 8, fill_mib: int = 6,
                      inodes: int = 0, files: int = 0) -> Iterator[Path]:
    """Mount a ``size_mib`` MiB tmpfs (``nr_inodes=inodes`` when given) on ``where``,
    fill it with one ``fill_mib`` MiB file and ``files`` empty ones, yield ``where``,
    unmount it whatever happened. Skips (fails under ``HPC_CI=1``) when not root."""
    if os.geteuid() != 0:
        pytest.skip("needs root to mount a small tmpfs (mount -t tmpfs -o size=...)")
    where.mkdir(parents=True, exist_ok=True)
    opts = f"size={size_mib}m" + (f",nr_inodes={inodes}" if inodes else "")
    subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "hpc-test-full", str(where)],
                   check=True, capture_output=True, text=True, timeout=20)
    try:
        if fill_mib:
            (where / "fill").write_bytes(b"\xff" * (fill_mib << 20))
        for i in range(files):
            (where / f"empty-{i}").touch()
        yield where
    finally:
        subprocess.run(["umount", str(where)], check=True, capture_output=True, timeout=20)
