"""Asynchronous checkpoints in one process: the same file as a synchronous save, a real
writer process killed or short of disk, staging short of memory, orphans removed."""

from __future__ import annotations

import logging
import os
import signal
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
    asyncsave._at_exit()  # each test starts without a writer
    asyncsave._IN_FLIGHT = None


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


def test_no_room_to_stage_saves_synchronously_with_one_warning(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """A 72 MiB tmpfs as HPC_STAGE_DIR cannot hold a 32 MiB state with the 64 MiB
    margin: both saves are written (synchronously), one warning says why."""
    model, _ = trained(steps=0)
    state = {"w": torch.randn(8 << 20)}
    with nearly_full_tmpfs(tmp_path / "stage", size_mib=72, fill_mib=0) as stage:
        monkeypatch.setenv("HPC_STAGE_DIR", str(stage))
        with caplog.at_level(logging.DEBUG, logger="hpc.checkpoint.asyncsave"):
            for step in (1, 2):
                hpc.save_checkpoint(tmp_path / "ck", step, model=model, extra=state,
                                    blocking=False)
            hpc.wait_for_checkpoint()
    warned = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1, caplog.text
    assert f"{stage} lacks" in warned[0].getMessage()
    assert "HINT: point HPC_STAGE_DIR" in warned[0].getMessage()
    assert [torch.equal(load_checkpoint(p)["w"], state["w"])
            for p in list_checkpoints(tmp_path / "ck")] == [True, True]


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
