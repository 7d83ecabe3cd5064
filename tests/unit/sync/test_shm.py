"""The shared-memory lane's pieces without a second process: slot layout, the combine
arithmetic, creating and mapping real files in /dev/shm, and when the lane applies."""

from __future__ import annotations

import os
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from hpc.errors import HPCError
from hpc.sync import _shm, grads
from hpc.sync._plan import Bucket, make_plan


def _lane(ws: int, half: int = 4096) -> _shm.ShmLane:
    regions = [torch.zeros(_shm.ALIGN + 2 * half, dtype=torch.uint8) for _ in range(ws)]
    return _shm.ShmLane(regions, 0, half)


def test_slots_are_aligned_and_alternate_halves() -> None:
    assert _shm.ShmLane.offsets([4, 100, 64, 1]) == [0, 64, 192, 256]
    lane = _lane(2)
    lane.begin_step()
    a = lane.slot(0, 64, 4, torch.float32)
    lane.begin_step()
    b = lane.slot(0, 64, 4, torch.float32)
    assert a.data_ptr() - b.data_ptr() in (4096, -4096)  # the other half
    assert a.data_ptr() % 4 == 0 and a.dtype == torch.float32 and a.numel() == 4


def test_mean_sums_in_rank_order_and_broadcast_copies_the_owner_with_positive_zeros(
        ) -> None:
    """A mean keeps the rank-order sum's bits (-0.0 + -0.0 is -0.0); a broadcast is the
    owner's slot with -0.0 made +0.0, DDP's sum with the other ranks' zeros: its owner
    packs it without that pass (ShmLane.signs_zeros)."""
    lane = _lane(3)
    lane.begin_step()
    values = [torch.tensor([1e8, 1.0, -0.0]), torch.tensor([-1e8, 1.0, -0.0]),
              torch.tensor([1.0, 2.0, -0.0])]
    for r, v in enumerate(values):
        lane.slot(r, 0, 3, torch.float32).copy_(v)
    out = torch.empty(3)
    lane.combine("mean", -1, 0, out)
    expected = (values[0] + values[1]) + values[2]
    assert torch.equal(out, expected) and str(out[2].item()) == "-0.0"
    lane.combine("broadcast", 2, 0, out)
    assert torch.equal(out, values[2]) and str(out[2].item()) == "0.0"
    assert _shm.ShmLane.signs_zeros


class _Arena:
    def take(self, device: torch.device, dtype: torch.dtype, numel: int,
             capacity: int) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype, device=device)


def _exchange_in_threads(ws: int, plan_of: Callable[[], list[Bucket]],
                         monkeypatch: pytest.MonkeyPatch
                         ) -> tuple[list[list[Bucket]], list[list[torch.Tensor]],
                                    list[dict[int, int]]]:
    """Run one step of a ``ws``-rank lane, one thread per rank, the barrier a threading
    one. Returns per rank: its plan, what each rank packed, and the bytes of every other
    rank's region it viewed (``slot()`` is how the lane reads a region)."""
    barrier = threading.Barrier(ws, timeout=30)

    class Done:
        def __init__(self, t: torch.Tensor) -> None:
            self.t = t

        def wait(self) -> torch.Tensor:
            barrier.wait()
            return self.t

    monkeypatch.setattr(_shm, "start_max", lambda t, group, *a, **kw: Done(t))
    half = 1 << 16
    regions = [torch.zeros(_shm.ALIGN + 2 * half, dtype=torch.uint8) for _ in range(ws)]
    read: list[dict[int, int]] = [{} for _ in range(ws)]
    real_slot = _shm.ShmLane.slot

    def counted(self: _shm.ShmLane, rank: int, offset: int, numel: int,
                dtype: torch.dtype) -> torch.Tensor:
        if rank != self.rank:
            read[self.rank][rank] = read[self.rank].get(rank, 0) + numel * dtype.itemsize
        return real_slot(self, rank, offset, numel, dtype)

    monkeypatch.setattr(_shm.ShmLane, "slot", counted)
    plans = [plan_of() for _ in range(ws)]
    packed: list[list[torch.Tensor]] = [[] for _ in range(ws)]
    errors: list[BaseException] = []

    def rank_main(r: int) -> None:
        try:
            lane = _shm.ShmLane(regions, r, half)
            lane.place(plans[r])
            gen = torch.Generator().manual_seed(r)
            for b in plans[r]:
                v = (torch.randn(b.numel, generator=gen) * 1e3).to(b.key[1])
                v[::7] = -0.0
                packed[r].append(v)
                if b.flat is not None:
                    b.flat.copy_(v)
            lane.exchange(plans[r], _Arena(), None)
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(ws)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    return plans, packed, read


@pytest.mark.parametrize("ws", [2, 3, 4, 8])
def test_a_mean_reads_each_byte_about_twice_at_any_world_size(
        ws: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Summing every rank's whole slot made a rank read ws slots of every mean (at 32
    ranks of a 100M-parameter fp32 model, ~12.8 GB per rank per step). A rank must read
    about twice a mean's bytes from the others at any world size, and every rank still
    gets the rank-order sum (the bits of the direct sum) and the owner's broadcast."""
    cpu = torch.device("cpu")

    def plan() -> list[Bucket]:
        out = [Bucket("mean", -1, (cpu, torch.float32)), Bucket("mean", -1, (cpu,
               torch.bfloat16)), Bucket("broadcast", 1, (cpu, torch.float32))]
        for b, n in zip(out, (10_001, 4_099, 333)):
            b.add(0, n)
        return out

    plans, packed, read = _exchange_in_threads(ws, plan, monkeypatch)
    for r in range(ws):
        for i, b in enumerate(plans[r]):
            if b.kind == "broadcast":
                expected = packed[1][i] + 0.0  # read out with -0.0 made +0.0
            else:
                expected = packed[0][i] + packed[1][i]
                for q in range(2, ws):
                    expected = expected + packed[q][i]
            assert torch.equal(b.flat.view(torch.uint8), expected.view(torch.uint8)), (r, i)
    lane = _shm.ShmLane([torch.zeros(64 * 3, dtype=torch.uint8)] * ws, 0, 64)
    assert lane.barriers(plans[0]) == (2 if ws >= _shm.SCATTER_FROM else 1)  # stats
    assert lane.barriers(plans[0][2:]) == 1  # broadcasts only: one barrier
    means = 10_001 * 4 + 4_099 * 2
    for r in range(ws):
        peers = sum(read[r].values()) - (333 * 4 if r != 1 else 0)
        assert peers <= 2 * means + 64 * ws * 2, (r, peers, means, read[r])


#: Mixed itemsizes whose byte total is not a multiple of the largest: an fp32 body with
#: a bf16 head of odd element count, an fp64 body with an fp32 head.
MIXED = [(torch.float32, torch.bfloat16), (torch.float64, torch.float32)]


@pytest.mark.parametrize("body,head", MIXED, ids=["fp32+bf16", "fp64+fp32"])
def test_halves_sized_by_half_bytes_keep_every_slot_aligned(body: torch.dtype,
                                                           head: torch.dtype) -> None:
    """The lane as GradSync builds it: the half from half_bytes(), slots from place(),
    over both halves (the first step uses the second one)."""
    shapes = [((16, 16), body), ((16,), body), ((3, 16), head), ((3,), head)]
    numels = [torch.Size(s).numel() for s, _ in shapes]
    itemsizes = [d.itemsize for _, d in shapes]
    keys = [(torch.device("cpu"), d) for _, d in shapes]
    half = _shm.half_bytes(numels, itemsizes)
    lane = _shm.ShmLane([torch.zeros(_shm.ALIGN + 2 * half, dtype=torch.uint8)
                         for _ in range(2)], 0, half)
    users = torch.ones(2, len(shapes), dtype=torch.int32)
    for _ in range(2):
        plan = make_plan(users, numels, keys, itemsizes, range(len(shapes)), 1 << 20, 0)
        lane.place(plan)  # raised "storage_offset() must be divisible by 4 (or 8)"
        for b in plan:
            assert b.flat is not None and b.flat.dtype == b.key[1]
            assert b.flat.data_ptr() % _shm.ALIGN == 0
            assert b.slot + b.numel * b.key[1].itemsize <= half
    with pytest.raises(ValueError, match="not a multiple of 64"):
        _shm.ShmLane(lane.regions, 0, half + 2)


@pytest.fixture
def token() -> Iterator[int]:
    tok = int(uuid.uuid4().int % (1 << 52))
    yield tok
    for p in Path(_shm.SHM_DIR).glob(f"hpc-grads-*-{tok:014x}-*"):
        p.unlink()


@pytest.mark.skipif(not os.path.isdir(_shm.SHM_DIR), reason="no /dev/shm on this system")
def test_regions_are_reserved_stamped_and_locked_before_they_are_named(token: int) -> None:
    paths = [os.path.join(_shm.SHM_DIR, _shm.region_name("t", token, r, 1000 + r))
             for r in range(2)]
    size = _shm.ALIGN + 2 * 4096
    fds, mine = [], []
    for r, path in enumerate(paths):
        fd, region, why = _shm._create(path, size, _shm._stamp(token, r))
        assert why is None and fd is not None and region is not None
        assert os.path.getsize(path) == size
        fds.append(fd)
        mine.append(region)
    try:
        assert not set(_shm.sweep()) & {os.path.basename(p) for p in paths}  # locked
        _, _, why = _shm._create(paths[0], size, _shm._stamp(token, 0))
        assert "cannot name" in (why or "") and "File exists" in (why or "")
        regions, why = _shm._map_all(_shm.SHM_DIR, token, 0, 2, mine[0])
        assert why is None and len(regions) == 2 and regions[0] is mine[0]
        regions[1][100] = 7  # a write through one mapping is seen through another
        assert mine[1][100] == 7
        _, why = _shm._map_all(_shm.SHM_DIR, token + 1, 0, 2, mine[0])
        assert "rank 1's" in (why or "") and "not visible here" in (why or "")
        mine[1][:_shm.STAMP_BYTES].view(torch.int64).copy_(_shm._stamp(token, 5))
        _, why = _shm._map_all(_shm.SHM_DIR, token, 0, 2, mine[0])
        assert "holds another stamp" in (why or "")
        os.unlink(paths[1])
        _, why = _shm._map_all(_shm.SHM_DIR, token, 0, 2, mine[0])
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
    monkeypatch.delenv(_shm.ENV, raising=False)
    assert _shm.lane_wanted(None, cpu, False, None) is True
    assert _shm.lane_wanted(False, cpu, False, None) is None  # decided: nothing asked
    monkeypatch.setenv(_shm.ENV, "0")
    assert _shm.lane_wanted(None, cpu, False, None) is False
    assert _shm.lane_wanted(True, cpu, False, None) is True  # the option wins
    assert _shm.lane_wanted(None, [], False, None) is None
    meta = [torch.nn.Parameter(torch.zeros(2, device="meta"))]
    assert _shm.lane_wanted(None, meta, False, None) is None


def test_required_but_impossible_is_an_error(world: None) -> None:
    with pytest.raises(HPCError, match=r"(?s)shm=True, but .*\nHINT: pass shm=None"):
        _shm.open_lane(4096, None, None, required=True)
    assert _shm.open_lane(4096, None, None) is None


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

    monkeypatch.setattr(_shm, "max_ints", recording_max)
    monkeypatch.setattr(grads, "active_world", lambda group=None: 1)  # sync on 1 rank
    net = torch.nn.Linear(3, 2)
    for _ in range(3):
        net(torch.randn(4, 3)).sum().backward()
        grads.sync_gradients(list(net.parameters()))
        grads.GradSync(net, shm=False).sync()
    assert asked == []
    monkeypatch.setenv(_shm.ENV, "0")
    for _ in range(3):
        grads.sync_gradients(net)
    assert len(asked) == 1


def _regions_of(token: int) -> list[str]:
    return sorted(p.name for p in Path(_shm.SHM_DIR).glob(f"hpc-grads-*{token:014x}*"))


@pytest.fixture
def opened(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The tokens of the lanes this test opens (read from the agreement)."""
    tokens: list[int] = []
    real = _shm._agree

    def agree(want: bool, group: object) -> tuple[bool, int]:
        everyone, token = real(want, group)
        tokens.append(token)
        return everyone, token

    monkeypatch.setattr(_shm, "_agree", agree)
    return tokens


@pytest.mark.skipif(not os.path.isdir(_shm.SHM_DIR), reason="no /dev/shm on this system")
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

    monkeypatch.setattr(_shm, "all_true", all_true)
    with pytest.raises(RuntimeError, match="closed by peer"):
        _shm.open_lane(4096, None, True)
    assert _regions_of(opened[0]) == []


@pytest.mark.skipif(not os.path.isdir(_shm.SHM_DIR), reason="no /dev/shm on this system")
def test_a_mapping_error_is_an_answer_not_an_exception(
        world: None, opened: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    """An exception while mapping skipped the unlink and the collectives the peers wait
    in; it must become the reason every rank falls back (or raises with shm=True)."""
    def failing(*args: object, **kwargs: object) -> torch.Tensor:
        raise RuntimeError("mmap: Cannot allocate memory")

    monkeypatch.setattr(torch, "from_file", failing)
    assert _shm.open_lane(4096, None, True) is None
    with pytest.raises(HPCError, match="Cannot allocate memory"):
        _shm.open_lane(4096, None, True, required=True)
    assert [_regions_of(t) for t in opened] == [[], []]


def test_sweep_removes_regions_whose_owner_is_gone(tmp_path: Path) -> None:
    """A region's owner holds a lock on it until it unlinks it; one nobody holds was left
    by a dead process (SIGKILL, the OOM killer) and goes at the next open. A pid in the
    name would not tell: pids are reused, and ranks in containers sharing /dev/shm
    (``--ipc=host``) each see their own pid namespace."""
    import fcntl

    token = 0x1234567890ABCD
    names = [_shm.region_name("4242", token, r, 1000 + r) for r in range(3)]
    for name in names:
        (tmp_path / name).write_bytes(b"x")
    (tmp_path / "hpc-grads-1234567890abcd-0").write_bytes(b"x")  # another version's name
    (tmp_path / "unrelated").write_bytes(b"x")
    alive = os.open(tmp_path / names[1], os.O_RDONLY)
    try:
        fcntl.flock(alive, fcntl.LOCK_EX)  # rank 1's owner is still opening its lane
        assert sorted(_shm.sweep(str(tmp_path))) == [names[0], names[2]]
    finally:
        os.close(alive)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [names[1], "hpc-grads-1234567890abcd-0", "unrelated"])
    assert names[0] == "hpc-grads-4242-1234567890abcd-0-1000"
    assert _shm.job_label({"SLURM_JOB_ID": "77", "HPC_RUN_ID": "x"}) == "77"
    assert _shm.job_label({"HPC_RUN_ID": "ab-c/1"}) == "ab_c_1"
    assert _shm.job_label({}) == "0"
