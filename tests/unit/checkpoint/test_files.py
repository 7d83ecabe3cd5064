"""Checkpoint files: atomic save, keep-last-K, verified load, fallback, RNG round trip."""

from __future__ import annotations

import logging
import os
import random
import select
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
np = pytest.importorskip("numpy")

from hpc.checkpoint.files import (  # noqa: E402
    capture_rng,
    checkpoint_path,
    list_checkpoints,
    load_checkpoint,
    load_latest,
    prune,
    restore_rng,
    save_atomic,
)
from hpc.errors import CheckpointError  # noqa: E402
from hpc.pretrain.runlog import MetricsWriter, read_metrics  # noqa: E402
from tests.helpers.paths import ROOT  # noqa: E402


def payload(step: int) -> dict:
    return {"step": step, "model": {"w": torch.full((4,), float(step))}, "rng": [capture_rng()]}


def write(directory: Path, *steps: int) -> list[Path]:
    return [save_atomic(payload(s), checkpoint_path(directory, s)) for s in steps]


def test_save_is_atomic_and_leaves_a_checksum(tmp_path: Path) -> None:
    (path,) = write(tmp_path, 7)
    assert path.name == "ckpt-00000007.pt"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-00000007.pt",
                                                          "ckpt-00000007.pt.sha256"]
    assert (tmp_path / "ckpt-00000007.pt.sha256").read_text().endswith("  ckpt-00000007.pt\n")
    assert torch.equal(load_checkpoint(path)["model"]["w"], torch.full((4,), 7.0))


def test_failed_save_keeps_the_old_file_and_no_temp(tmp_path: Path) -> None:
    (path,) = write(tmp_path, 3)
    before = path.read_bytes()
    with pytest.raises(Exception):
        save_atomic({"step": 3, "bad": lambda: 0}, path)  # lambdas do not pickle
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-00000003.pt",
                                                          "ckpt-00000003.pt.sha256"]


def test_save_refuses_what_weights_only_cannot_load_and_writes_nothing(
        tmp_path: Path) -> None:
    """The file layer itself checks (hpc pretrain and hpc search save through it)."""
    write(tmp_path, 1)
    bad = {"step": 2, "records": [{"val_acc": np.float32(0.5)}]}
    with pytest.raises(CheckpointError, match=r"(?s)\['records'\]\[0\]\['val_acc'\] is a "
                       r"numpy.float32.*HINT: .*float\(x\)"):
        save_atomic(bad, checkpoint_path(tmp_path, 2))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-00000001.pt",
                                                          "ckpt-00000001.pt.sha256"]


def test_save_refuses_a_plain_int_weights_only_cannot_read(tmp_path: Path) -> None:
    """The rule is the loader's own, not a list of types: an int of more than 255
    bytes pickles with an opcode the weights_only unpickler does not know."""
    with pytest.raises(CheckpointError, match="weights_only"):
        save_atomic({"step": 1, "seed": 2 ** 3000}, checkpoint_path(tmp_path, 1))
    assert not list(tmp_path.iterdir())


def names(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


# the real save_atomic writing a real 8 MiB checkpoint through a torch.save that stalls
# half-way, so the SIGKILL lands mid-write every time
SLOW_WRITER = """
import io, sys, time, torch
from hpc.checkpoint.files import checkpoint_path, save_atomic
real_save = torch.save
def half_then_stall(obj, f):
    buf = io.BytesIO()
    real_save(obj, buf)
    f.write(buf.getvalue()[: len(buf.getvalue()) // 2])
    f.flush()
    print("writing", flush=True)
    time.sleep(120)
torch.save = half_then_stall
save_atomic({"step": 2, "w": torch.zeros(1 << 21)}, checkpoint_path(sys.argv[1], 2))
"""


def test_a_sigkill_mid_write_leaves_a_temp_file_the_next_save_removes(
        tmp_path: Path) -> None:
    """The end of a preemption's grace time: SIGKILL, no handler runs, the temporary
    file stays at the size written so far."""
    write(tmp_path, 1)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    child = subprocess.Popen([sys.executable, "-c", SLOW_WRITER, str(tmp_path)],
                             stdout=subprocess.PIPE, text=True, env=env)
    try:
        ready, _, _ = select.select([child.stdout], [], [], 120)
        assert ready and child.stdout.readline().strip() == "writing"
        child.send_signal(signal.SIGKILL)
        assert child.wait(timeout=30) == -signal.SIGKILL
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(timeout=30)
        child.stdout.close()
    (left,) = tmp_path.glob(".ckpt-00000002.pt.tmp-*")
    assert left.stat().st_size >= 4 << 20  # half of the 8 MiB tensor, at least
    write(tmp_path, 3)
    assert names(tmp_path) == ["ckpt-00000001.pt", "ckpt-00000001.pt.sha256",
                               "ckpt-00000003.pt", "ckpt-00000003.pt.sha256"]


def test_stale_temp_files_go_and_live_ones_stay(tmp_path: Path) -> None:
    """Owner gone on this host, or older than a few minutes (a writer on another node
    cannot be asked); a live writer's fresh file and files not ours stay."""
    host, live = socket.gethostname(), os.getppid()
    old = time.time() - 3600
    files = {
        f".ckpt-00000003.pt.tmp-othernode-{live}": old,  # another node, old: gone
        f".ckpt-00000004.pt.tmp-othernode-{live}": None,  # another node, fresh: stays
        ".ckpt-00000005.pt.sha256.tmp-4242": old,  # the old name (pid only), old: gone
        f".ckpt-00000006.pt.tmp-{host}-{live}": None,  # this host, writer alive: stays
        f".ckpt-00000006.pt.tmp-{host}-{live}x": old,  # not a temp name: stays
        ".notes.txt.tmp-4242": old,  # someone else's temporary file: stays
    }
    for name, mtime in files.items():
        (tmp_path / name).write_bytes(b"x" * 100)
        if mtime:
            os.utime(tmp_path / name, (mtime, mtime))
    write(tmp_path, 7)
    assert names(tmp_path) == sorted([
        f".ckpt-00000004.pt.tmp-othernode-{live}", f".ckpt-00000006.pt.tmp-{host}-{live}",
        f".ckpt-00000006.pt.tmp-{host}-{live}x", ".notes.txt.tmp-4242",
        "ckpt-00000007.pt", "ckpt-00000007.pt.sha256"])


def test_prune_keeps_the_newest(tmp_path: Path) -> None:
    write(tmp_path, 1, 2, 10, 3)
    removed = prune(tmp_path, 2)
    assert [p.name for p in removed] == ["ckpt-00000001.pt", "ckpt-00000002.pt"]
    assert [p.name for p in list_checkpoints(tmp_path)] == ["ckpt-00000003.pt",
                                                            "ckpt-00000010.pt"]
    assert not list(tmp_path.glob("ckpt-00000001*"))


@pytest.mark.parametrize("sidecar", [True, False], ids=["checksum", "no-checksum"])
def test_truncated_newest_falls_back_with_a_warning(tmp_path: Path, sidecar: bool,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    _, newest = write(tmp_path, 1, 2)
    newest.write_bytes(newest.read_bytes()[:100])
    if not sidecar:  # then torch.load itself must notice
        newest.with_name(newest.name + ".sha256").unlink()
    with caplog.at_level(logging.WARNING):
        path, data = load_latest(tmp_path)
    assert path.name == "ckpt-00000001.pt" and data["step"] == 1
    assert "skipping checkpoint ckpt-00000002.pt" in caplog.text


def test_flipped_byte_fails_the_checksum(tmp_path: Path) -> None:
    (path,) = write(tmp_path, 5)
    raw = bytearray(path.read_bytes())
    raw[-30] ^= 0xFF
    path.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match="SHA-256"):
        load_checkpoint(path)


def test_no_loadable_checkpoint_is_an_error_with_a_hint(tmp_path: Path) -> None:
    (path,) = write(tmp_path, 1)
    path.write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="HINT: start over"):
        load_latest(tmp_path)
    assert load_latest(tmp_path / "missing") is None


def test_foreign_object_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "ckpt-00000001.pt"
    torch.save([1, 2], path)
    with pytest.raises(CheckpointError, match="not an hpc checkpoint"):
        load_checkpoint(path)


def test_rng_states_round_trip_through_weights_only(tmp_path: Path) -> None:
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    random.gauss(0, 1)  # leaves a cached gauss value in the python state
    np.random.standard_normal()
    path = save_atomic({"step": 0, "rng": capture_rng()}, tmp_path / "ckpt-00000000.pt")
    expected = (random.random(), float(np.random.rand()), torch.rand(3))
    random.seed(9)
    np.random.seed(9)
    torch.manual_seed(9)
    restore_rng(load_checkpoint(path)["rng"])
    got = (random.random(), float(np.random.rand()), torch.rand(3))
    assert got[:2] == expected[:2] and torch.equal(got[2], expected[2])


def test_metrics_resume_drops_rows_after_the_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "metrics.csv"
    w = MetricsWriter(path)
    w.add({"step": s, "split": "train", "loss": 1.0 / s} for s in range(1, 8))
    w.flush()
    w = MetricsWriter(path, resume_step=4)  # the run died after step 7, ckpt at 4
    w.add({"step": s, "split": "train", "loss": 0.0} for s in range(5, 9))
    w.flush()
    assert [int(r["step"]) for r in read_metrics(path)] == list(range(1, 9))
    MetricsWriter(tmp_path / "fresh.csv")
    assert read_metrics(tmp_path / "fresh.csv") == []


class _FakeCuda:
    """torch.cuda's RNG functions for a process that sees ``count`` GPUs, ``current``
    bound: each device's state is a distinct byte tensor."""

    def __init__(self, count: int, current: int) -> None:
        self.count, self.current = count, current
        self.states = {i: torch.full((8,), 10 + i, dtype=torch.uint8) for i in range(count)}

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        c = torch.cuda
        monkeypatch.setattr(c, "is_available", lambda: True)
        monkeypatch.setattr(c, "is_initialized", lambda: True)
        monkeypatch.setattr(c, "device_count", lambda: self.count)
        monkeypatch.setattr(c, "current_device", lambda: self.current)
        monkeypatch.setattr(c, "get_rng_state_all",
                            lambda: [self.states[i].clone() for i in range(self.count)])
        monkeypatch.setattr(c, "get_rng_state", lambda d="cuda": self.states[int(d)].clone())
        monkeypatch.setattr(c, "set_rng_state_all", lambda sts: self.states.update(
            {i: s.clone() for i, s in enumerate(sts)}))
        monkeypatch.setattr(c, "set_rng_state",
                            lambda s, d="cuda": self.states.__setitem__(int(d), s.clone()))


def test_cuda_rng_is_restored_when_the_visible_device_count_changed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Saved by rank 2 seeing the node's 4 GPUs (bound to cuda:2), resumed seeing one
    (--gpus-per-task=1): its own GPU's stream continues on cuda:0."""
    before = _FakeCuda(4, 2)
    before.install(monkeypatch)
    state = capture_rng()
    assert torch.equal(state["cuda_current"], before.states[2])
    after = _FakeCuda(1, 0)
    after.install(monkeypatch)
    restore_rng(state)
    assert torch.equal(after.states[0], before.states[2])


def test_cuda_rng_same_device_count_restores_every_device(
        monkeypatch: pytest.MonkeyPatch) -> None:
    before = _FakeCuda(2, 1)
    before.install(monkeypatch)
    state = capture_rng()
    after = _FakeCuda(2, 1)
    after.states = {i: torch.zeros(8, dtype=torch.uint8) for i in range(2)}
    after.install(monkeypatch)
    restore_rng(state)
    assert all(torch.equal(after.states[i], before.states[i]) for i in range(2))
