"""Asynchronous checkpoints in one process: the same file as a synchronous save, a real
writer process killed or short of disk, staging short of memory, orphans removed."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
np = pytest.importorskip("numpy")

import hpc  # noqa: E402
from hpc.checkpoint import asyncsave  # noqa: E402
from hpc.checkpoint.files import list_checkpoints, load_checkpoint  # noqa: E402
from hpc.checkpoint.staging import OWN_FILE_BYTES, Stage, remove_orphans  # noqa: E402
from hpc.errors import CheckpointError  # noqa: E402
from tests.helpers.tmpfs import nearly_full_tmpfs  # noqa: E402

pytestmark = pytest.mark.timeout(120)


class Net(torch.nn.Module):
    """Large and small tensors, tied weights, BatchNorm's int64 counter, a bf16 buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.big = torch.nn.Linear(512, 1024)  # 2 MiB weight: a file of its own
        self.bn = torch.nn.BatchNorm1d(1024)
        self.head = torch.nn.Linear(1024, 10)
        self.tied = self.head  # the same parameters under two names
        self.register_buffer("lowp", torch.arange(100, dtype=torch.bfloat16))
        self.register_buffer("flags", torch.tensor([True, False, True]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.bn(self.big(x)))


def trained(steps: int = 2, seed: int = 0) -> tuple[Net, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = Net()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    for _ in range(steps):
        model(torch.randn(8, 512)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


@pytest.fixture(autouse=True)
def _end_writer() -> object:
    yield
    if asyncsave._WRITER is not None:  # each test starts without a writer
        asyncsave._WRITER.close()
    asyncsave._WRITER, asyncsave._IN_FLIGHT = None, None


def test_an_asynchronous_file_is_byte_for_byte_the_synchronous_one(tmp_path: Path) -> None:
    model, opt = trained()
    assert model.big.weight.numel() * 4 >= OWN_FILE_BYTES
    extra = {"best": 0.5, "names": ["a", "b"], "nested": {"t": torch.ones(3)}}
    sync = hpc.save_checkpoint(tmp_path / "sync", 2, model=model, optimizer=opt, extra=extra)
    path = hpc.save_checkpoint(tmp_path / "async", 2, model=model, optimizer=opt,
                               extra=extra, blocking=False)
    hpc.wait_for_checkpoint()
    assert path.read_bytes() == sync.read_bytes()
    loaded = load_checkpoint(path)  # checksum verified, weights_only
    assert loaded["model"]["tied.weight"] is not None
    assert (loaded["model"]["tied.weight"].untyped_storage().data_ptr()
            == loaded["model"]["head.weight"].untyped_storage().data_ptr())


def test_the_loop_may_change_the_state_as_soon_as_the_save_returns(tmp_path: Path) -> None:
    """Staged, not referenced: weights changed right after the call are not in the file,
    and the buffers reused by the next save hold that save's values."""
    model, opt = trained()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    hpc.save_checkpoint(tmp_path, 1, model=model, optimizer=opt, blocking=False)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    after = {k: v.clone() for k, v in model.state_dict().items()}
    hpc.save_checkpoint(tmp_path, 2, model=model, optimizer=opt, blocking=False, keep=0)
    hpc.wait_for_checkpoint()
    first, second = (load_checkpoint(p)["model"] for p in list_checkpoints(tmp_path))
    assert all(torch.equal(first[k], before[k]) for k in before)
    assert all(torch.equal(second[k], after[k]) for k in after)
    assert not all(torch.equal(first[k], second[k]) for k in before)


def test_a_killed_writer_is_an_error_at_the_wait_and_the_next_save_works(
        tmp_path: Path) -> None:
    """SIGKILL the writer while it writes a 64 MiB state: the wait names the signal, no
    partial checkpoint is left in place, the older one is intact, a new writer saves."""
    model, opt = trained()
    hpc.save_checkpoint(tmp_path, 1, model=model, optimizer=opt)
    state = {"w": torch.randn(16, 1 << 20)}
    hpc.save_checkpoint(tmp_path, 2, model=model, extra=state, blocking=False)
    writer = asyncsave._WRITER
    assert writer is not None and writer.proc is not None
    time.sleep(0.3)  # started, writing
    os.kill(writer.proc.pid, signal.SIGKILL)
    with pytest.raises(CheckpointError, match=r"writer \(pid \d+\) ended with signal 9 "
                                              r"while writing .*ckpt-00000002\.pt"):
        hpc.wait_for_checkpoint()
    assert [p.name for p in list_checkpoints(tmp_path)] == ["ckpt-00000001.pt"]
    load_checkpoint(tmp_path / "ckpt-00000001.pt")
    hpc.save_checkpoint(tmp_path, 3, model=model, optimizer=opt, blocking=False)
    hpc.wait_for_checkpoint()
    assert load_checkpoint(tmp_path / "ckpt-00000003.pt")["step"] == 3
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]


def test_a_full_disk_is_raised_by_the_next_save_and_nothing_is_lost(tmp_path: Path) -> None:
    """ENOSPC in the writer: the next save raises it before saving; the checkpoint that
    fitted stays, no temporary file is left."""
    model, opt = trained()
    with nearly_full_tmpfs(tmp_path / "small", size_mib=24, fill_mib=8) as small:
        hpc.save_checkpoint(small, 1, model=model, optimizer=opt, blocking=False)
        hpc.save_checkpoint(small, 2, model=model, optimizer=opt, blocking=False,
                            extra={"more": torch.zeros(4 << 20)})
        # torch.save says "unexpected pos" for ENOSPC: the message adds the sizes
        with pytest.raises(CheckpointError, match=r"could not write checkpoint .*"
                           r"ckpt-00000002\.pt: .* \(its tensors: 22\.\d MiB; "
                           r"9\.\d MiB free there\)"):
            hpc.save_checkpoint(small, 3, model=model, optimizer=opt, blocking=False)
        assert [p.name for p in list_checkpoints(small)] == ["ckpt-00000001.pt"]
        assert not [p for p in small.iterdir() if ".tmp-" in p.name]


def test_a_value_the_loader_refuses_is_named_at_the_wait(tmp_path: Path) -> None:
    model, _ = trained(steps=0)
    hpc.save_checkpoint(tmp_path, 1, model=model, extra={"acc": np.float64(0.5)},
                        blocking=False)
    with pytest.raises(CheckpointError, match=r"\['acc'\] is a numpy\.float64"):
        hpc.wait_for_checkpoint()
    assert list_checkpoints(tmp_path) == []


def test_a_containers_64_mib_shm_stages_a_small_state_and_not_a_large_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """A 64 MiB tmpfs as HPC_STAGE_DIR (docker's default /dev/shm) keeps an eighth free:
    a 4 MiB state is staged; a 60 MiB one is written synchronously (both saves), with
    one warning saying why."""
    model, _ = trained(steps=0)
    small, large = {"w": torch.randn(1 << 20)}, {"w": torch.randn(15 << 20)}
    with nearly_full_tmpfs(tmp_path / "stage", size_mib=64, fill_mib=0) as stage:
        monkeypatch.setenv("HPC_STAGE_DIR", str(stage))
        with caplog.at_level(logging.DEBUG, logger="hpc.checkpoint.asyncsave"):
            hpc.save_checkpoint(tmp_path / "ck", 1, model=model, extra=small, blocking=False)
            hpc.wait_for_checkpoint()
            assert not [r for r in caplog.records if r.levelno == logging.WARNING]
            asyncsave._WRITER.close()  # its buffers would stay in the small tmpfs
            asyncsave._WRITER = None
            for step in (2, 3):
                hpc.save_checkpoint(tmp_path / "ck", step, model=model, extra=large,
                                    blocking=False)
            hpc.wait_for_checkpoint()
    warned = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1, caplog.text
    assert f"{stage} lacks" in warned[0].getMessage()
    assert "HINT: point HPC_STAGE_DIR" in warned[0].getMessage()
    assert [torch.equal(load_checkpoint(p)["w"], w["w"]) for p, w in zip(
        list_checkpoints(tmp_path / "ck"), (small, large, large))] == [True] * 3


def test_a_schedulers_shared_lists_stay_shared_byte_for_byte(tmp_path: Path) -> None:
    """SequentialLR's state holds its schedulers' states and lists met twice: pickle
    writes such an object once, so the staged copy must keep them one object."""
    model, opt = trained()
    first = torch.optim.lr_scheduler.LinearLR(opt, total_iters=2)
    then = torch.optim.lr_scheduler.StepLR(opt, step_size=2)
    sched = torch.optim.lr_scheduler.SequentialLR(opt, [first, then], milestones=[2])
    sched.step()
    sync = hpc.save_checkpoint(tmp_path / "sync", 1, model=model, optimizer=opt,
                               scheduler=sched)
    path = hpc.save_checkpoint(tmp_path / "async", 1, model=model, optimizer=opt,
                               scheduler=sched, blocking=False)
    hpc.wait_for_checkpoint()
    assert path.read_bytes() == sync.read_bytes()


def test_a_failed_last_save_ends_the_process_with_status_1(tmp_path: Path) -> None:
    """No wait_for_checkpoint before the end: the exit waits, and a failed save makes the
    exit status 1 (a requeue loop must not count the job a success)."""
    script = (
        "import numpy as np, torch, hpc\n"
        "m = torch.nn.Linear(2, 2)\n"
        f"hpc.save_checkpoint({str(tmp_path)!r}, 1, model=m, extra={{'x': np.float64(1)}},"
        " blocking=False)\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 1, proc.stderr
    assert "the last asynchronous checkpoint failed (exit status 1)" in proc.stderr
    assert "['x'] is a numpy.float64" in proc.stderr
    assert list_checkpoints(tmp_path) == []


def test_a_stage_left_by_a_dead_process_is_removed(tmp_path: Path) -> None:
    dead = os.fork()
    if dead == 0:
        os._exit(0)
    os.waitpid(dead, 0)
    (tmp_path / f"hpc-stage-{dead}-1").mkdir()
    (tmp_path / f"hpc-stage-{dead}-1" / "t1").write_bytes(b"x")
    (tmp_path / f"hpc-stage-{os.getppid()}-1").mkdir()  # alive: kept
    stage = Stage(tmp_path)
    try:
        assert not (tmp_path / f"hpc-stage-{dead}-1").exists()
        assert (tmp_path / f"hpc-stage-{os.getppid()}-1").exists()
        assert remove_orphans(tmp_path) == []
    finally:
        stage.close()
    assert not stage.dir.exists()
