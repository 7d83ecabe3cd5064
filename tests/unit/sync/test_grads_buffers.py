"""GradSync's buffers on a real one-rank gloo group, the world-of-one shortcut patched
so the collectives really run: arena sizing, gradient layout, CPU staging, fusion."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch import nn

from hpc.sync import _collective, _pack, grads
from hpc.sync._plan import Bucket
from hpc.sync.grads import GradSync, _Step

MiB = 1024 * 1024


@pytest.fixture()
def one_rank(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A gloo group of one rank in this process, with ``active_world`` reporting 1."""
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    monkeypatch.setattr(grads, "active_world", lambda group=None: 1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _mlp(width: int, depth: int) -> nn.Module:
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(depth)])


def test_overlap_arena_is_sized_by_the_overlap_bucket(one_rank: None) -> None:
    """Each arena buffer reserves the bucket actually planned, not the 25 MiB of sync()
    capped at all gradients (before the fix: 9 MiB per buffer, ~16x the gradient bytes
    in all; CPU never commits the untouched pages, CUDA does)."""
    model = _mlp(512, 6)  # 6 x 1 MiB weights + biases, float32: 12 buckets
    grad_bytes = sum(p.numel() * 4 for p in model.parameters())
    gs = GradSync(model, overlap_bucket_bytes=1 * MiB)
    counts = []
    for _ in range(3):
        model.zero_grad(set_to_none=True)
        gs.backward(model(torch.randn(4, 512)).square().mean())
        counts.append(sum(len(v) for v in gs._arena._pool.values()))
    sizes = [b.numel() * 4 for bufs in gs._arena._pool.values() for b in bufs]
    assert counts[0] == counts[-1] == 12, counts     # steady state: buffers reused
    assert max(sizes) <= 1 * MiB + 512 * 4, sizes    # one weight and its bias at most
    assert sum(sizes) == grad_bytes, (sum(sizes), grad_bytes)  # exactly the gradients
    gs.close()


def test_after_backward_arena_still_caps_at_bucket_bytes(one_rank: None) -> None:
    model = _mlp(512, 4)
    gs = GradSync(model, bucket_bytes=2 * MiB)
    model(torch.randn(4, 512)).sum().backward()
    gs.sync()
    sizes = [b.numel() * 4 for bufs in gs._arena._pool.values() for b in bufs]
    assert max(sizes) <= 2 * MiB + 2 * 512 * 4 and len(sizes) >= 2, sizes


@pytest.mark.parametrize("overlap", [False, True])
def test_channels_last_gradients_keep_their_layout(one_rank: None, overlap: bool) -> None:
    """As DDP's bucket views: a channels_last weight gets a channels_last gradient."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 4, 3))
    model = model.to(memory_format=torch.channels_last)
    x = torch.randn(2, 3, 12, 12).to(memory_format=torch.channels_last)
    model(x).sum().backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    gs = GradSync(model)
    if overlap:
        gs.backward(model(x).sum())
    else:
        model(x).sum().backward()
        gs.sync()
    for n, p in model.named_parameters():
        assert p.grad.data_ptr() != 0 and p.grad.shape == p.shape
        if p.dim() == 4:
            assert p.grad.is_contiguous(memory_format=torch.channels_last), n
            assert not p.grad.is_contiguous(), n
        assert torch.equal(p.grad, expected[n]), n
    # the synced gradients are views of the arena's flat buffers, not copies
    flat = [b for bufs in gs._arena._pool.values() for b in bufs]
    base = {b.untyped_storage().data_ptr() for b in flat}
    assert {p.grad.untyped_storage().data_ptr() for p in model.parameters()} <= base
    gs.close()


def _step_with(gs: GradSync, flat: torch.Tensor, kind: str = "mean") -> _Step:
    b = Bucket(kind, 0 if kind == "broadcast" else -1, (flat.device, flat.dtype))
    st = _Step(torch.ones(len(gs.params), dtype=torch.uint8), torch.empty(0), None)
    for i, p in enumerate(gs.params):
        st.where[i] = (b, b.numel)
        b.add(i, p.numel())
        b.pending += 1
    b.flat = flat
    return st


def test_cpu_gradient_is_staged_onto_the_comm_device() -> None:
    """A CPU parameter whose collective runs on another device (CUDA under plain nccl;
    here the meta device stands in): packing copies then scales, where the old
    ``torch.mul(cpu_grad, s, out=other_device_view)`` raised."""
    model = nn.Linear(3, 2)
    model(torch.randn(4, 3)).sum().backward()
    gs = GradSync(model)
    st = _step_with(gs, torch.empty(8, device="meta"))
    with pytest.raises(RuntimeError, match="device"):
        torch.mul(model.weight.grad.reshape(-1), 0.5, out=st.where[0][0].flat[:6])
    for i in range(2):
        gs._pack(st, i, 0.5)
    assert st.packed == {0, 1} and st.where[0][0].pending == 0


@pytest.mark.parametrize("kind", ["mean", "broadcast"])
def test_fused_packing_equals_one_kernel_per_gradient(kind: str) -> None:
    """Small gradients are fused, a large one (FUSE_BELOW elements or more: one mul
    pass instead of copy-then-scale) is not; the bits are the same either way."""
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(7, 5), nn.Linear(5, 3), nn.Linear(3, 6000))
    model(torch.randn(4, 7)).sum().backward()
    model[1].bias.grad[0] = -0.0
    gs = GradSync(model)
    big = 4  # the last Linear's weight
    assert gs.params[big].numel() >= _pack.FUSE_BELOW > gs.params[0].numel()
    n = sum(p.numel() for p in gs.params)
    one, fused = _step_with(gs, torch.empty(n), kind), _step_with(gs, torch.empty(n), kind)
    for i in range(len(gs.params)):
        gs._pack(one, i, 1.0 / 3)
    gs._pack_many(fused, list(range(len(gs.params))), 1.0 / 3)
    bucket = fused.where[0][0]
    assert gs._layout.fusable(bucket, 0) == (kind == "mean")
    assert not gs._layout.fusable(bucket, big)
    a, b = one.where[0][0].flat, fused.where[0][0].flat
    assert torch.equal(a.view(torch.int32), b.view(torch.int32))  # bit for bit
    assert fused.packed == set(range(len(gs.params))) and fused.where[0][0].pending == 0


def test_broadcast_zeros_are_made_positive_by_the_packer_or_left_to_the_reader() -> None:
    """DDP's broadcast of a gradient is its sum with zeros: -0.0 arrives as +0.0. The
    process group's path packs it so (one more pass over the owner's bytes); the one-host
    lane's readers do it while copying out (ShmLane.signs_zeros), so its owner packs
    the plain product."""
    model = nn.Linear(3, 2)
    model(torch.randn(4, 3)).sum().backward()
    model.bias.grad[0] = -0.0
    gs = GradSync(model)
    for signed, expected in ((True, "0.0"), (False, "-0.0")):
        st = _step_with(gs, torch.empty(8), "broadcast")
        b, off = st.where[1]
        gs._layout.pack(b, off, 1, 0.5, signed)
        assert str(b.flat[off].item()) == expected


@pytest.mark.parametrize("backend, tensor, expected", [
    ("cpu:gloo,cuda:nccl", None, "cpu"),          # host agreement stays on the host
    ("cpu:gloo,cuda:nccl", "cpu", "cpu"),         # CPU tensors go through gloo
    ("cpu:gloo,cuda:nccl", "cuda:1", "cuda:1"),   # CUDA tensors through nccl
    ("nccl", "cpu", "cuda:3"),                    # plain nccl: CPU tensors are staged
    ("nccl", None, "cuda:3"),
    ("gloo", "cuda:1", "cuda:1"),
    ("mpi", "cuda:1", "cpu"),
])
def test_comm_device_reads_per_device_backends(monkeypatch: pytest.MonkeyPatch,
                                               backend: str, tensor: str,
                                               expected: str) -> None:
    monkeypatch.setattr(_collective, "_backend", lambda group: backend)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    dev = None if tensor is None else torch.device(tensor)
    assert _collective.comm_device(None, dev) == torch.device(expected)
