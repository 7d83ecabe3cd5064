"""NCCL check on one GPU: every sync collective through a real NCCL process group.

At world size 1 ``sync_model``, ``sync_gradients`` and the pretrain's step reducer return
at once, so a one-GPU run never builds an NCCL communicator that carries them. This
script patches that "world of one" shortcut (``active_world`` reports 1, the reducer
believes in two ranks) and then, on ``hpc.init_torch()``'s one-rank group
(``cpu:gloo,cuda:nccl``) and on a plain ``nccl`` group:

1. ``sync_model`` of a model with CUDA float32/float16/bfloat16 parameters, a large
   tensor (sent in place), CPU, int64 and bool buffers, broadcast and mean;
2. ``GradSync.sync()`` and ``GradSync.backward()`` (plain and channels_last convs, one
   CPU parameter): gradients equal those of a plain backward, layouts kept;
3. host syncs per step, counted with ``torch.cuda.set_sync_debug_mode("warn")``: the
   mixed group must need fewer than plain nccl (its usage mask stays on the host);
4. the overlap arena's memory against the gradient bytes (must stay under 1.5x);
5. the step reducer's fused all_reduce of BatchNorm statistics;
6. two identical short ``hpc pretrain`` runs: their final weights' digests must match;
7. where NCCL >= 2.30: two ranks on one GPU (``NCCL_MULTI_RANK_GPU_ENABLE=1``, which
   also turns off the pre-flight's shared-GPU refusal).

Prints one ``CHECK name: PASS|FAIL|SKIP detail`` line per check and exits 0 when none
failed, 1 when one did, 3 when CUDA is unavailable (it is a GPU check: it fails rather
than pass without one). ``--cpu-dry-run`` runs checks 1, 2, 4 and 5 on gloo and the
CPU, to test the script itself on a machine without a GPU.

    python bench/nccl_check.py            # on a GPU node, from the repository root
"""

from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
EXIT_NO_CUDA = 3
RESULTS: list[tuple[str, str, str]] = []


def check(name: str, fn: Callable[[], str]) -> None:
    """Run one check; record PASS with its detail, or FAIL with the error."""
    start = time.monotonic()
    try:
        detail = fn()
        verdict = "SKIP" if detail.startswith("SKIP") else "PASS"
    except Exception as e:  # noqa: BLE001 - every failure is reported, then the next check
        verdict, detail = "FAIL", f"{type(e).__name__}: {e}"
    RESULTS.append((name, verdict, detail))
    print(f"CHECK {name}: {verdict} {detail} ({time.monotonic() - start:.1f}s)", flush=True)


def patch_world_of_one() -> None:
    """Make the sync modules issue their collectives at world size 1."""
    from hpc.sync import _collective, grads, model

    for mod in (_collective, grads, model):
        mod.active_world = lambda group=None: 1  # type: ignore[assignment]


def _mixed_model(torch: Any, dev: Any) -> Any:
    nn = torch.nn
    m = nn.Module()
    m.big = nn.Parameter(torch.randn(512, 1024, device=dev))          # 2 MiB: in place
    m.small = nn.Parameter(torch.randn(33, device=dev))
    m.f16 = nn.Parameter(torch.randn(17, device=dev, dtype=torch.float16))
    m.bf16 = nn.Parameter(torch.randn(9, device=dev, dtype=torch.bfloat16))
    m.register_buffer("on_cpu", torch.randn(5))                       # a CPU buffer
    m.register_buffer("count", torch.tensor(7, device=dev))           # int64
    m.register_buffer("flag", torch.tensor([True, False], device=dev))
    return m


def check_sync_model(torch: Any, dev: Any, group: Any) -> str:
    import hpc

    m = _mixed_model(torch, dev)
    before = {k: v.detach().clone() for k, v in m.state_dict().items()}
    hpc.sync_model(m, group=group)
    hpc.sync_model(m, reduce_parameters=True, reduce_buffers=True, group=group)
    for k, v in m.state_dict().items():
        if not torch.equal(v, before[k]):
            raise AssertionError(f"{k} changed: a world of one must keep every value")
        if v.device != before[k].device:
            raise AssertionError(f"{k} moved from {before[k].device} to {v.device}")
    return f"{len(before)} tensors (cuda f32/f16/bf16, cpu, int64, bool) unchanged"


def _conv_model(torch: Any, dev: Any, cpu_param: bool) -> Any:
    nn = torch.nn
    m = nn.Sequential(nn.Conv2d(3, 16, 3), nn.ReLU(), nn.Conv2d(16, 8, 3), nn.Flatten(),
                      nn.Linear(8 * 8 * 8, 10)).to(dev)
    m = m.to(memory_format=torch.channels_last)
    if cpu_param:
        m.register_parameter("cpu_scale", nn.Parameter(torch.ones(1)))
    return m


def _loss(torch: Any, m: Any, x: Any) -> Any:
    out = m(x).square().mean()
    scale = getattr(m, "cpu_scale", None)
    return out * scale.to(out.device).squeeze() if scale is not None else out


def check_gradsync(torch: Any, dev: Any, group: Any, cpu_param: bool) -> str:
    from hpc.sync.grads import GradSync

    torch.manual_seed(0)
    m = _conv_model(torch, dev, cpu_param)
    x = torch.randn(4, 3, 12, 12, device=dev).to(memory_format=torch.channels_last)
    _loss(torch, m, x).backward()
    expected = {n: p.grad.clone() for n, p in m.named_parameters()}
    gs = GradSync(m, group=group)
    for mode in ("sync", "backward"):
        for _ in range(2):  # the second step reuses the arena's buffers
            m.zero_grad(set_to_none=True)
            if mode == "sync":
                _loss(torch, m, x).backward()
                gs.sync()
            else:
                gs.backward(_loss(torch, m, x))
            for n, p in m.named_parameters():
                if not torch.equal(p.grad, expected[n]):
                    raise AssertionError(f"{mode}: gradient of {n} differs")
                if p.grad.device != p.device:
                    raise AssertionError(f"{mode}: {n}.grad on {p.grad.device}")
                if p.dim() == 4 and not p.grad.is_contiguous(
                        memory_format=torch.channels_last):
                    raise AssertionError(f"{mode}: {n}.grad lost channels_last")
    gs.close()
    return (f"sync() and backward() x2, {len(expected)} grads exact, channels_last kept"
            + (", CPU parameter staged" if cpu_param else "") + f"; stats {gs.stats}")


def count_host_syncs(torch: Any, dev: Any, group: Any) -> int:
    """Synchronizing CUDA calls of one steady-state GradSync.backward() step."""
    from hpc.sync.grads import GradSync

    torch.manual_seed(0)
    m = _conv_model(torch, dev, cpu_param=False)
    x = torch.randn(4, 3, 12, 12, device=dev).to(memory_format=torch.channels_last)
    gs = GradSync(m, group=group)
    for _ in range(2):
        m.zero_grad(set_to_none=True)
        gs.backward(_loss(torch, m, x))
    loss = _loss(torch, m, x)
    m.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            gs.backward(loss)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    gs.close()
    return sum("synchroniz" in str(w.message).lower() for w in caught)


def check_host_syncs(torch: Any, dev: Any, nccl_group: Any) -> str:
    mixed = count_host_syncs(torch, dev, None)
    plain = count_host_syncs(torch, dev, nccl_group)
    if mixed >= plain:
        raise AssertionError(f"cpu:gloo,cuda:nccl {mixed} host syncs per step, plain "
                             f"nccl {plain}: the usage mask should stay on the host")
    return f"per GradSync.backward step: cpu:gloo,cuda:nccl {mixed}, plain nccl {plain}"


def check_overlap_memory(torch: Any, dev: Any, group: Any) -> str:
    """Memory GradSync.backward() holds at steady state against the gradient bytes."""
    from hpc.sync.grads import GradSync

    nn = torch.nn
    cuda = dev.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated(dev)
    m = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(6)]).to(dev)  # 24 MiB, 12 buckets
    grad_bytes = sum(p.numel() * p.element_size() for p in m.parameters())
    gs = GradSync(m, group=group)
    x = torch.randn(8, 1024, device=dev)
    for _ in range(3):
        m.zero_grad(set_to_none=True)
        gs.backward(m(x).square().mean())
    arena = sum(b.numel() * b.element_size() for bufs in gs._arena._pool.values()
                for b in bufs)
    detail = f"arena {arena / 2**20:.1f} MiB for {grad_bytes / 2**20:.1f} MiB of grads"
    ratio = arena / grad_bytes
    if cuda:
        torch.cuda.synchronize()
        held = torch.cuda.memory_allocated(dev) - base - grad_bytes  # params = grads
        ratio = held / grad_bytes
        detail += (f"; CUDA memory held beyond the parameters {held / 2**20:.1f} MiB = "
                   f"{ratio:.2f}x the gradient bytes")
    gs.close()
    if ratio > 1.5:
        raise AssertionError(detail + " (over 1.5x)")
    return detail


def check_reducer(torch: Any, dev: Any) -> str:
    from hpc.pretrain.reduce import StepReducer

    nn = torch.nn
    m = nn.Sequential(nn.Conv2d(1, 8, 3), nn.BatchNorm2d(8), nn.Conv2d(8, 8, 3),
                      nn.BatchNorm2d(8)).to(dev)
    m(torch.randn(4, 1, 9, 9, device=dev))
    before = {k: v.clone() for k, v in m.state_dict().items()}
    reducer = StepReducer(m, dev, ranks=2)
    reducer.world = 2  # the one-rank all_reduce is the identity: buffers halve
    stats = reducer(torch.tensor(6.0, device=dev), torch.tensor(3, device=dev), 8, False)
    if (stats.loss, stats.acc, stats.samples, stats.stop) != (0.75, 0.375, 8, False):
        raise AssertionError(f"step stats {stats}")
    for k, v in m.state_dict().items():
        if "running" in k and not torch.equal(v, before[k] / 2):
            raise AssertionError(f"{k} is not the mean")
    return f"{len(reducer.buffers)} BN buffers and 4 step values in one all_reduce"


def _digest(path: Path) -> str:
    import torch

    from hpc.checkpoint.files import load_latest

    found = load_latest(path / "checkpoints")
    if found is None:
        raise AssertionError(f"no checkpoint in {path}")
    h = hashlib.sha256()
    for name, t in sorted(found[1]["model"].items()):
        h.update(name.encode())
        h.update(t.cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def check_pretrain_digests() -> str:
    digests = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(2):
            out = Path(tmp) / f"run{i}"
            proc = subprocess.run(
                [sys.executable, "-m", "hpc", "pretrain", "--epochs", "2", "--out",
                 str(out), "--no-progress", "--val-every", "0", "--val-archs", "1"],
                check=False, capture_output=True, text=True, timeout=240, cwd=ROOT)
            if proc.returncode != 0:
                raise AssertionError(f"pretrain {i} rc={proc.returncode}: "
                                     f"{(proc.stdout + proc.stderr)[-2000:]}")
            digests.append(_digest(out))
    if digests[0] != digests[1]:
        raise AssertionError(f"two identical pretrains differ: {digests}")
    return f"two 2-epoch pretrains on the GPU, digest {digests[0]} both"


def check_two_ranks_one_gpu(torch: Any) -> str:
    version = torch.cuda.nccl.version()
    version = version if isinstance(version, tuple) else (version // 10000,
                                                          version // 100 % 100, 0)
    if tuple(version) < (2, 30, 0):
        return f"SKIP NCCL {'.'.join(map(str, version))} < 2.30"
    env = dict(os.environ, NCCL_MULTI_RANK_GPU_ENABLE="1", HPC_CONNECT_TIMEOUT="60")
    proc = subprocess.run(
        [sys.executable, "-m", "hpc", "run", "--nproc", "2", "--", sys.executable,
         __file__, "--two-ranks-worker"], check=False, capture_output=True, text=True, timeout=240,
        cwd=ROOT, env=env)
    out = proc.stdout + proc.stderr
    if proc.returncode != 0 or out.count("WORKER ok") != 2:
        raise AssertionError(f"rc={proc.returncode}: {out[-2000:]}")
    return "2 ranks on cuda:0: all_reduce, sync_model, GradSync.backward"


def two_ranks_worker() -> int:
    import torch
    import torch.distributed as dist

    import hpc
    from hpc.sync.grads import GradSync

    info = hpc.init_torch(seed=0)
    dev = hpc.device()
    t = torch.full((4,), float(info.rank + 1), device=dev)
    dist.all_reduce(t)
    assert t.tolist() == [3.0] * 4, t
    m = torch.nn.Linear(64, 8).to(dev)
    hpc.sync_model(m)
    gs = GradSync(m)
    gs.backward(m(torch.randn(4, 64, device=dev)).sum())
    torch.cuda.synchronize()
    print(f"WORKER ok rank={info.rank} backend={dist.get_backend()} device={dev}",
          flush=True)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu-dry-run", action="store_true",
                    help="test this script on gloo/CPU (checks 1, 2, 4, 5)")
    ap.add_argument("--two-ranks-worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    import torch

    if args.two_ranks_worker:
        return two_ranks_worker()
    if not args.cpu_dry_run and not torch.cuda.is_available():
        print("nccl_check: FAIL: no CUDA device (torch.cuda.is_available() is False; "
              f"torch {torch.__version__}, CUDA build {torch.version.cuda}).\n"
              "This check runs NCCL collectives on a GPU; without one it proves nothing.\n"
              "HINT: run it on a GPU node (srun --gpus=1 python bench/nccl_check.py), or "
              "pass --cpu-dry-run to test the script itself on gloo.", file=sys.stderr)
        return EXIT_NO_CUDA
    import torch.distributed as dist

    import hpc

    hpc.init_torch(backend="gloo" if args.cpu_dry_run else None)
    dev = hpc.device()
    patch_world_of_one()
    print(f"nccl_check: backend {dist.get_backend()}, device {dev}, torch "
          f"{torch.__version__}", flush=True)
    other = dist.new_group(backend="gloo" if args.cpu_dry_run else "nccl")
    check("sync_model mixed group", lambda: check_sync_model(torch, dev, None))
    check("sync_model plain group", lambda: check_sync_model(torch, dev, other))
    check("GradSync mixed group", lambda: check_gradsync(torch, dev, None, True))
    check("GradSync plain group + CPU param",
          lambda: check_gradsync(torch, dev, other, True))
    if not args.cpu_dry_run:
        check("host syncs", lambda: check_host_syncs(torch, dev, other))
    check("overlap memory", lambda: check_overlap_memory(torch, dev, None))
    check("step reducer", lambda: check_reducer(torch, dev))
    if not args.cpu_dry_run:
        check("pretrain digests", check_pretrain_digests)
        check("two ranks one GPU", lambda: check_two_ranks_one_gpu(torch))
    failed = [name for name, verdict, _ in RESULTS if verdict == "FAIL"]
    print(f"nccl_check: {len(RESULTS) - len(failed)}/{len(RESULTS)} passed or skipped"
          + (f"; FAILED: {', '.join(failed)}" if failed else ""), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
