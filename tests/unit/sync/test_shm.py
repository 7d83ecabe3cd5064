"""The shared-memory lane's exchange without a second process: the slot layout, the
combine arithmetic, and a step of several ranks run as threads."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
import torch

from hpc.sync import _shm
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
