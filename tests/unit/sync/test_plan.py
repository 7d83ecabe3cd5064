"""Pure parts of the sync: bucket planning, the arena, the mismatch message."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import hpc.sync
from hpc.sync import model
from hpc.sync._collective import (
    BUCKET_KINDS,
    _digest,
    agreement_vector,
    all_agree,
    mismatch_message,
    signature,
)
from hpc.sync._plan import Arena, make_plan
from hpc.sync.model import _Bucket, _buckets, _pack, _unpack
from tests.helpers.paths import ROOT

F32 = (torch.device("cpu"), torch.float32)
F64 = (torch.device("cpu"), torch.float64)


def _plan(users: list[list[int]], numels: list[int], rank: int = 0, bucket: int = 1 << 20,
          keys: list | None = None, layout=None):
    n = len(numels)
    keys = keys or [F32] * n
    sizes = [8 if k == F64 else 4 for k in keys]
    return make_plan(torch.tensor(users), numels, keys, sizes, range(n), bucket, rank,
                     layout)


def test_plan_classifies_by_number_of_users() -> None:
    users = [[1, 1, 0, 0, 1],
             [0, 1, 1, 0, 0]]
    plan = _plan(users, [10, 20, 30, 40, 50])
    kinds = sorted((b.kind, b.owner, tuple(b.idx)) for b in plan)
    assert kinds == [("broadcast", 0, (0, 4)), ("broadcast", 1, (2,)), ("mean", -1, (1,))]
    assert 3 not in {i for b in plan for i in b.idx}  # nobody used it: not sent


def test_plan_pending_counts_only_local_work() -> None:
    users = [[1, 1, 0], [0, 1, 1]]
    by_idx = {tuple(b.idx): b for b in _plan(users, [4, 4, 4], rank=0)}
    assert by_idx[(0,)].pending == 1       # rank 0 owns it
    assert by_idx[(1,)].pending == 1       # shared: rank 0 packs its part
    assert by_idx[(2,)].pending == 0       # rank 1's broadcast: rank 0 only receives


def test_plan_splits_buckets_and_dtypes() -> None:
    users = [[1] * 4, [1] * 4]
    plan = _plan(users, [100, 100, 100, 100], bucket=800, keys=[F32, F32, F64, F32])
    assert sorted(tuple(b.idx) for b in plan) == [(0, 1), (2,), (3,)]
    for b in plan:
        assert b.offsets == [sum([100] * k) for k in range(len(b.idx))]


def test_plan_is_identical_on_every_rank_except_pending() -> None:
    users = [[1, 0, 1, 1], [0, 1, 1, 0], [1, 1, 0, 1]]
    plans = [_plan(users, [3, 5, 7, 9], rank=r) for r in range(3)]
    shapes = [[(b.kind, b.owner, b.idx, b.numel) for b in p] for p in plans]
    assert shapes[0] == shapes[1] == shapes[2]


def test_plan_match_ddp_sends_whole_layout_buckets_with_three_users() -> None:
    users = [[1, 1, 0, 1], [1, 0, 0, 1], [1, 0, 0, 0]]
    plan = _plan(users, [2, 2, 2, 2], layout=[[2, 3], [0, 1]])
    exact = [b for b in plan if b.exact]
    assert [b.idx for b in exact] == [[0, 1]]  # param 0 has 3 users
    rest = sorted(tuple(b.idx) for b in plan if not b.exact)
    assert rest == [(3,)]                     # two users: any layout is exact


def test_arena_reuses_a_buffer_only_when_its_views_are_gone() -> None:
    arena = Arena()
    a = arena.take(torch.device("cpu"), torch.float32, 10, 16)
    grad = a[2:4]
    arena.end_step()
    b = arena.take(torch.device("cpu"), torch.float32, 10, 16)
    assert b.data_ptr() != a.data_ptr()       # a still referenced through `grad`
    old = {a.data_ptr(), b.data_ptr()}
    del a, grad, b
    arena.end_step()
    c = arena.take(torch.device("cpu"), torch.float32, 12, 16)
    d = arena.take(torch.device("cpu"), torch.float32, 12, 16)
    assert c.data_ptr() != d.data_ptr()       # never the same buffer twice in a step
    # ...and both are the old buffers, which the arena still holds (so no fresh
    # allocation could land at their addresses): reuse turned off fails here.
    assert {c.data_ptr(), d.data_ptr()} == old
    arena.end_step()
    e = arena.take(torch.device("cpu"), torch.float32, 20, 16)  # larger than both: new
    assert e.data_ptr() not in old


def test_mismatch_message_names_first_difference_and_ranks() -> None:
    a = signature([("w", torch.zeros(2, 3)), ("b", torch.zeros(3))])
    b = signature([("w", torch.zeros(2, 3)), ("b", torch.zeros(4))])
    c = signature([("w", torch.zeros(2, 3))])
    msg = mismatch_message([a, a, b, c], "sync_model")
    assert "first difference at tensor #1" in msg
    assert "rank 0: 'b' shape (3,) float32 (2 tensors in all)" in msg
    assert "rank 2: 'b' shape (4,) float32" in msg
    assert "rank 3: nothing (1 tensors in all)" in msg
    assert "ranks [1] agree with rank 0" in msg
    assert "HINT:" in msg


def _max_reduce(vectors: list[list[int]]) -> list[int]:
    """What ``all_reduce(MAX)`` returns on every rank."""
    return [max(col) for col in zip(*vectors)]


def test_agreement_check_detects_any_differing_rank() -> None:
    a = signature([("w", torch.zeros(2, 3)), ("b", torch.zeros(3))])
    b = signature([("w", torch.zeros(2, 3)), ("b", torch.zeros(4))])
    c = signature([("w", torch.zeros(2, 3))])
    vec = {k: agreement_vector(_digest(s), len(s)) for k, s in (("a", a), ("b", b), ("c", c))}
    assert all(d >= 0 for v in vec.values() for d in v[::2])  # negation cannot overflow
    assert all_agree(_max_reduce([vec["a"]] * 4))
    for odd in ("b", "c"):
        for pos in range(4):
            ranks = [vec["a"]] * 4
            ranks[pos] = vec[odd]
            assert not all_agree(_max_reduce(ranks)), (odd, pos)
    assert not all_agree(_max_reduce([vec["a"], vec["b"], vec["c"]]))


@pytest.mark.parametrize("foreach", [True, False])
def test_bucket_pack_and_copy_out_round_trip(foreach: bool,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """sync_model's packing: mixed dtypes, a non-contiguous tensor, a 0-d bool."""
    if not foreach:  # torch without _foreach_copy_: the per-tensor fallback
        monkeypatch.delattr(torch, "_foreach_copy_", raising=False)
    src = [torch.randn(3, 4), torch.randn(5).half(), torch.randn(2, 3).t(),
           torch.tensor(True), torch.tensor(7)]
    numel = sum(t.numel() for t in src)
    flat = torch.empty(numel)
    _pack(_Bucket("broadcast", torch.device("cpu"), torch.float32, src, numel), flat)
    dst = [torch.zeros_like(t) for t in src]
    _unpack(_Bucket("broadcast", torch.device("cpu"), torch.float32, dst, numel), flat)
    assert [d.dtype for d in dst] == [s.dtype for s in src]
    assert all(torch.equal(d, s) for d, s in zip(dst, src))


def test_model_and_grads_buckets_share_one_kind_vocabulary(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """sync_model's buckets and GradSync's plan use the same BucketKind words."""
    monkeypatch.setattr(model, "comm_device", lambda group, device=None: device)
    assert BUCKET_KINDS == ("broadcast", "mean")
    plan = _plan([[1, 1], [0, 1]], [4, 4])
    packed = _buckets([(torch.zeros(4), "broadcast"), (torch.zeros(4), "mean"),
                      (torch.zeros(2, dtype=torch.bool), "mean")],
                     None, 1 << 20, 1 << 20)
    assert {b.kind for b in plan} == {b.kind for b in packed} == set(BUCKET_KINDS)


#: Run in a fresh interpreter: torch first, then every module of hpc.sync imported for
#: the first time under a mode that records each torch call with the hpc module whose
#: code made it. Prints one line: ``MISSING <names>`` or ``CALLS <module:function ...>``.
_IMPORT_PROBE = """
import importlib, pkgutil, sys
import torch
from torch.overrides import TorchFunctionMode

names = sorted(f"hpc.sync.{m.name}" for m in pkgutil.iter_modules(
    [sys.argv[1]]))
already = [n for n in ["hpc.sync", *names] if n in sys.modules]
assert not already, already
calls = []

class Record(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        frame = sys._getframe(1)
        while frame and not frame.f_globals.get("__name__", "").startswith("hpc."):
            frame = frame.f_back
        where = frame.f_globals["__name__"] if frame else "?"
        calls.append(f"{where}:{getattr(func, '__name__', repr(func))}")
        return func(*args, **(kwargs or {}))

with Record():
    for name in names:
        importlib.import_module(name)
missing = [n for n in names if n not in sys.modules]
print("MISSING" if missing else "CALLS", *(missing or calls))
"""


def test_importing_the_sync_modules_allocates_no_tensor() -> None:
    """Each hpc.sync module, imported fresh in a new interpreter, calls no torch function
    at import (a module-level tensor would be created before init_torch picked the
    device, and on every import of hpc.sync). In this process the modules are imported
    already, so re-importing some of them here could not see the others' module code."""
    proc = subprocess.run([sys.executable, "-c", _IMPORT_PROBE, hpc.sync.__path__[0]],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["CALLS"], proc.stdout
