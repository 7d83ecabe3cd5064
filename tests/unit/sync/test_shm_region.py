"""The shared-memory lane's regions without a second process: creating and mapping
real files in /dev/shm, when the lane applies, opening it, and sweeping what dead ranks
left."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from hpc.errors import HPCError
from hpc.sync import _shm_region, grads
from hpc.sync._shm import ALIGN
from hpc.sync._shm_region import SHM_DIR


@pytest.fixture
def token() -> Iterator[int]:
    tok = int(uuid.uuid4().int % (1 << 52))
    yield tok
    for p in Path(SHM_DIR).glob(f"hpc-grads-*-{tok:014x}-*"):
        p.unlink()


@pytest.mark.skipif(not os.path.isdir(SHM_DIR), reason="no /dev/shm on this system")
def test_regions_are_reserved_stamped_and_locked_before_they_are_named(token: int) -> None:
    paths = [os.path.join(SHM_DIR, _shm_region.region_name("t", token, r, 1000 + r))
             for r in range(2)]
    size = ALIGN + 2 * 4096
    fds, mine = [], []
    for r, path in enumerate(paths):
        fd, region, why = _shm_region._create(path, size, _shm_region._stamp(token, r))
        assert why is None and fd is not None and region is not None
        assert os.path.getsize(path) == size
        fds.append(fd)
        mine.append(region)
    try:
        assert not set(_shm_region.sweep()) & {os.path.basename(p) for p in paths}  # locked
        _, _, why = _shm_region._create(paths[0], size, _shm_region._stamp(token, 0))
        assert "cannot name" in (why or "") and "File exists" in (why or "")
        regions, why = _shm_region._map_all(SHM_DIR, token, 0, 2, mine[0])
        assert why is None and len(regions) == 2 and regions[0] is mine[0]
        regions[1][100] = 7  # a write through one mapping is seen through another
        assert mine[1][100] == 7
        _, why = _shm_region._map_all(SHM_DIR, token + 1, 0, 2, mine[0])
        assert "rank 1's" in (why or "") and "not visible here" in (why or "")
        stamp = mine[1][:_shm_region.STAMP_BYTES].view(torch.int64)
        stamp.copy_(_shm_region._stamp(token, 5))
        _, why = _shm_region._map_all(SHM_DIR, token, 0, 2, mine[0])
        assert "holds another stamp" in (why or "")
        os.unlink(paths[1])
        _, why = _shm_region._map_all(SHM_DIR, token, 0, 2, mine[0])
        assert "rank 1's /dev/shm/hpc-grads-" in (why or "") and "not visible" in (why or "")
    finally:
        for fd in fds:
            os.close(fd)


@pytest.fixture
def world() -> Iterator[None]:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_when_the_lane_applies(world: None, monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = [torch.nn.Parameter(torch.zeros(2))]
    monkeypatch.delenv(_shm_region.ENV, raising=False)
    assert _shm_region.lane_wanted(None, cpu, False, None) is True
    # decided: nothing asked
    assert _shm_region.lane_wanted(False, cpu, False, None) is None
    monkeypatch.setenv(_shm_region.ENV, "0")
    assert _shm_region.lane_wanted(None, cpu, False, None) is False
    assert _shm_region.lane_wanted(True, cpu, False, None) is True  # the option wins
    assert _shm_region.lane_wanted(None, [], False, None) is None
    meta = [torch.nn.Parameter(torch.zeros(2, device="meta"))]
    assert _shm_region.lane_wanted(None, meta, False, None) is None


def test_required_but_impossible_is_an_error(world: None) -> None:
    with pytest.raises(HPCError, match=r"(?s)shm=True, but .*\nHINT: pass shm=None"):
        _shm_region.open_lane(4096, None, None, required=True)
    assert _shm_region.open_lane(4096, None, None) is None


def test_shm_false_sends_no_lane_agreement(world: None, monkeypatch: pytest.MonkeyPatch
                                           ) -> None:
    """sync_gradients(list of parameters) builds a GradSync per call with shm=False;
    asking the ranks whether they want a lane cost one collective per step. The
    environment's HPC_SYNC_SHM=0 may differ between ranks, so it is still agreed on, once
    per GradSync."""
    asked: list[list[int]] = []

    def recording_max(values: list[int], group: object = None) -> list[int]:
        asked.append(list(values))
        return list(values)

    monkeypatch.setattr(_shm_region, "max_ints", recording_max)
    monkeypatch.setattr(grads, "active_world", lambda group=None: 1)  # sync on 1 rank
    net = torch.nn.Linear(3, 2)
    for _ in range(3):
        net(torch.randn(4, 3)).sum().backward()
        grads.sync_gradients(list(net.parameters()))
        grads.GradSync(net, shm=False).sync()
    assert asked == []
    monkeypatch.setenv(_shm_region.ENV, "0")
    for _ in range(3):
        grads.sync_gradients(net)
    assert len(asked) == 1


def _regions_of(token: int) -> list[str]:
    return sorted(p.name for p in Path(SHM_DIR).glob(f"hpc-grads-*{token:014x}*"))


@pytest.fixture
def opened(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The tokens of the lanes this test opens (read from the agreement)."""
    tokens: list[int] = []
    real = _shm_region._agree

    def agree(want: bool, group: object) -> tuple[bool, int]:
        everyone, token = real(want, group)
        tokens.append(token)
        return everyone, token

    monkeypatch.setattr(_shm_region, "_agree", agree)
    return tokens


@pytest.mark.skipif(not os.path.isdir(SHM_DIR), reason="no /dev/shm on this system")
def test_an_error_in_a_collective_while_opening_leaves_no_region(
        world: None, opened: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    """A peer dying while the lane opens makes gloo raise in the next collective; the
    region must still be unlinked (it was kept: tmpfs is resident memory)."""
    calls = []

    def all_true(ok: bool, group: object = None) -> bool:
        calls.append(ok)
        if len(calls) == 2:  # "every rank mapped every region"
            raise RuntimeError("Connection closed by peer")
        return ok

    monkeypatch.setattr(_shm_region, "all_true", all_true)
    with pytest.raises(RuntimeError, match="closed by peer"):
        _shm_region.open_lane(4096, None, True)
    assert _regions_of(opened[0]) == []


@pytest.mark.skipif(not os.path.isdir(SHM_DIR), reason="no /dev/shm on this system")
def test_a_mapping_error_is_an_answer_not_an_exception(
        world: None, opened: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    """An exception while mapping skipped the unlink and the collectives the peers wait
    in; it must become the reason every rank falls back (or raises with shm=True)."""
    def failing(*args: object, **kwargs: object) -> torch.Tensor:
        raise RuntimeError("mmap: Cannot allocate memory")

    monkeypatch.setattr(torch, "from_file", failing)
    assert _shm_region.open_lane(4096, None, True) is None
    with pytest.raises(HPCError, match="Cannot allocate memory"):
        _shm_region.open_lane(4096, None, True, required=True)
    assert [_regions_of(t) for t in opened] == [[], []]


def test_sweep_removes_regions_whose_owner_is_gone(tmp_path: Path) -> None:
    """A region's owner holds a lock on it until it unlinks it; one nobody holds was left
    by a dead process (SIGKILL, the OOM killer) and goes at the next open. A pid in the
    name would not tell: pids are reused, and ranks in containers sharing /dev/shm
    (``--ipc=host``) each see their own pid namespace."""
    import fcntl

    token = 0x1234567890ABCD
    names = [_shm_region.region_name("4242", token, r, 1000 + r) for r in range(3)]
    for name in names:
        (tmp_path / name).write_bytes(b"x")
    (tmp_path / "hpc-grads-1234567890abcd-0").write_bytes(b"x")  # another version's name
    (tmp_path / "unrelated").write_bytes(b"x")
    alive = os.open(tmp_path / names[1], os.O_RDONLY)
    try:
        fcntl.flock(alive, fcntl.LOCK_EX)  # rank 1's owner is still opening its lane
        assert sorted(_shm_region.sweep(str(tmp_path))) == [names[0], names[2]]
    finally:
        os.close(alive)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [names[1], "hpc-grads-1234567890abcd-0", "unrelated"])
    assert names[0] == "hpc-grads-4242-1234567890abcd-0-1000"
    assert _shm_region.job_label({"SLURM_JOB_ID": "77", "HPC_RUN_ID": "x"}) == "77"
    assert _shm_region.job_label({"HPC_RUN_ID": "ab-c/1"}) == "ab_c_1"
    assert _shm_region.job_label({}) == "0"
