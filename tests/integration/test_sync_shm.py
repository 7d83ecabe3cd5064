"""sync_gradients' shared-memory exchange with real ranks, and when it cannot be used.

By default ranks that share a host (``hpc run``) exchange CPU gradients through
``/dev/shm`` (``shared_memory=1`` in the scripts' RESULT lines); ``HPC_SYNC_SHM=0`` or
``shm=False`` keeps the process group. The cases where it cannot be used are made real
with mount namespaces (root): a rank with a ``/dev/shm`` of its own, as in a
per-rank container, and a ``/dev/shm`` too small for the gradients (a container's
64 KiB default is the common one). Both must fall back to the process group with the
same, bitwise-exact results, and ``shm=True`` must fail on every rank, saying why.
"""

from __future__ import annotations

import os
import shutil
import sys
import textwrap
from pathlib import Path

import pytest

from tests.helpers.paths import ROOT, script
from tests.helpers.processes import clean_env, hpc_run, run_group

SYNC = script("sync_grads_vs_ddp.py")


#: Two ranks, mixed-dtype models (body of one dtype, a head of a smaller itemsize with
#: an odd element count): the default sync_gradients (the lane) against shm=False, bit
#: for bit, on every rank; each step one rank leaves the head without gradients, so the
#: head is an owner's broadcast and the body a mean.
MIXED = textwrap.dedent("""
    import sys
    import torch
    import torch.distributed as dist
    from torch import nn
    import hpc

    info = hpc.init_torch(backend="gloo", seed=0)
    torch.set_num_threads(1)
    pairs = [(torch.float32, torch.bfloat16), (torch.float64, torch.float32)]
    for body, head in pairs:
        lane = nn.Sequential(nn.Linear(16, 16).to(body), nn.Linear(16, 3).to(head))
        tcp = nn.Sequential(nn.Linear(16, 16).to(body), nn.Linear(16, 3).to(head))
        for step in range(3):
            gen = torch.Generator().manual_seed(100 * step + info.rank)
            for i, (a, b) in enumerate(zip(lane.parameters(), tcp.parameters())):
                if i >= 2 and info.rank == step % 2:
                    a.grad = b.grad = None
                    continue
                g = torch.randn(a.shape, generator=gen).to(a.dtype)
                a.grad, b.grad = g.clone(), g.clone()
            hpc.sync_gradients(lane)
            hpc.sync_gradients(tcp, shm=False)
            for a, b in zip(lane.parameters(), tcp.parameters()):
                bits = a.grad.view(torch.uint8).reshape(-1)
                if not torch.equal(bits, b.grad.view(torch.uint8).reshape(-1)):
                    print(f"RESULT FAIL {body}+{head} step {step}: lane != shm=False",
                          flush=True)
                    sys.exit(1)
                seen = [torch.empty_like(bits) for _ in range(info.world_size)]
                dist.all_gather(seen, bits)
                if not all(torch.equal(x, bits) for x in seen):
                    print(f"RESULT FAIL {body}+{head} step {step}: ranks differ",
                          flush=True)
                    sys.exit(1)
        used = hpc.sync.grads._CACHE[lane][1].stats["shared_memory"]
        print(f"RESULT ok rank={info.rank} {body}+{head} shared_memory={used}", flush=True)
""")


#: ``opening.py MODE``: one default sync_gradients of a small model, so the lane opens.
#: MODE ``kill``: rank 1 SIGKILLs itself where it starts mapping the regions (every
#: rank's region exists then); ``fail``: every mapping fails on rank 1 (as mmap does
#: without memory); ``ok``: nothing injected. Every rank first prints its pid and the
#: job label its region's name carries.
OPENING = textwrap.dedent("""
    import os
    import signal
    import sys
    import torch
    from torch import nn
    import hpc
    from hpc.sync import _shm_region

    mode = sys.argv[1]
    info = hpc.init_torch(backend="gloo", seed=0)
    torch.set_num_threads(1)
    label = getattr(_shm_region, "job_label", lambda environ: "?")(os.environ)
    print(f"OWNER rank={info.rank} pid={os.getpid()} job={label}", flush=True)
    if info.rank == 1 and mode == "kill":
        def killed(*args, **kwargs):
            os.kill(os.getpid(), signal.SIGKILL)
        _shm_region._map_all = killed
    if info.rank == 1 and mode == "fail":
        def failing(*args, **kwargs):
            raise RuntimeError("injected: cannot map the region")
        torch.from_file = failing
    net = nn.Linear(256, 256)
    net(torch.randn(4, 256)).sum().backward()
    hpc.sync_gradients(net)
    used = hpc.sync.grads._CACHE[net][1].stats["shared_memory"]
    print(f"RESULT ok rank={info.rank} shared_memory={used}", flush=True)
""")


def _in_own_dev_shm(script: Path, *modes: str) -> str:
    """Run ``hpc run --nproc 2 -- python script MODE`` for each mode, in order, in a
    mount namespace with a /dev/shm of its own; after each job print ``EXIT <code>`` and
    ``LEFT <what /dev/shm holds>``. Returns the output."""
    steps = " ".join(f'timeout 60 "$@" {m}; echo "EXIT $?"; echo "LEFT" $(ls /dev/shm);'
                     for m in modes)
    argv = ["unshare", "-m", "sh", "-c",
            f"mount -t tmpfs -o size=64m tmpfs /dev/shm || exit 97; {steps}", "sh",
            sys.executable, "-m", "hpc", "run", "--nproc", "2", "--",
            sys.executable, str(script)]
    proc = run_group(argv, timeout=170, env=clean_env(), cwd=ROOT)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    return out


def _marked(out: str, mark: str) -> list[str]:
    """What follows ``mark`` on each line that has it (after ``hpc run``'s prefix)."""
    return [line.split(mark, 1)[1].strip() for line in out.splitlines()
            if line.removeprefix("[rank 0] ").removeprefix("[rank 1] ").startswith(mark)]


def _lines(out: str, nproc: int = 2) -> list[str]:
    lines = [line for line in out.splitlines() if "RESULT" in line]
    assert len(lines) == nproc, out
    return lines


def _needs_mounts() -> None:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare(1) to give ranks their own /dev/shm")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("env,used", [({}, "1"), ({"HPC_SYNC_SHM": "0"}, "0")])
def test_same_host_ranks_use_shared_memory_unless_turned_off(env: dict[str, str],
                                                            used: str) -> None:
    proc = hpc_run(2, [SYNC, "--expect", "bitwise", "--users", "--api", "backward"],
                   timeout=100, env=clean_env(**env))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert all("bitwise_vs_ddp=True" in line and f"shared_memory={used}" in line
               for line in _lines(out)), out


@pytest.mark.timeout(150)
@pytest.mark.parametrize("args", [[], ["--users", "--api", "backward"]],
                         ids=["sync", "backward-users"])
def test_four_ranks_reduce_scatter_through_shared_memory(args: list[str]) -> None:
    """From four ranks on the means are reduce-scattered (each rank sums one slice):
    every rank must still hold the same bits, within the documented tolerance of DDP
    (whose gloo ring sums three or more terms in another order)."""
    proc = hpc_run(4, [SYNC, "--expect", "close", *args], timeout=130)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert all("RESULT ok" in line and "shared_memory=1" in line
               for line in _lines(out, 4)), out


@pytest.mark.timeout(120)
def test_mixed_dtypes_through_shared_memory_equal_the_process_group(tmp_path: Path) -> None:
    """A half of mixed itemsizes must keep every slot aligned: the first default sync
    of fp32 + an odd-sized bf16 head died with "storage_offset() must be divisible by 4
    to view Byte as Float"."""
    path = tmp_path / "mixed.py"
    path.write_text(MIXED)
    proc = hpc_run(2, [str(path)], timeout=100)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    lines = _lines(out, 4)
    assert all("RESULT ok" in line and "shared_memory=1" in line for line in lines), out


@pytest.mark.timeout(120)
def test_rank_with_its_own_dev_shm_falls_back_or_fails_clearly() -> None:
    _needs_mounts()
    wrap = script("own_dev_shm.sh")
    proc = hpc_run(2, [wrap, sys.executable, SYNC, "--expect", "bitwise"], timeout=100)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert all("bitwise_vs_ddp=True" in line and "shared_memory=0" in line
               for line in _lines(out)), out
    proc = hpc_run(2, [wrap, sys.executable, SYNC, "--shm", "on"], timeout=100)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "RESULT ok" not in out, out
    # A /dev/shm of its own makes the rank a node of its own (hpc.sync._nodes.node_key):
    # two nodes of one rank each, nothing to share inside a node.
    assert "shm=True, but the shared-memory exchange across 2 nodes cannot be opened: " \
           "one rank per node" in out, out
    assert "or pass shm=None" in out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("shm", ["auto", "on"])
def test_full_dev_shm_falls_back_or_fails_clearly(shm: str) -> None:
    """posix_fallocate reserves the region, so a full tmpfs is an error now, not a
    SIGBUS when a page is first touched."""
    _needs_mounts()
    argv = ["unshare", "-m", "sh", "-c",
            'mount -t tmpfs -o size=64k tmpfs /dev/shm && exec "$@"', "sh",
            sys.executable, "-m", "hpc", "run", "--nproc", "2", "--",
            sys.executable, SYNC, "--expect", "bitwise", "--shm", shm]
    proc = run_group(argv, timeout=100, env=clean_env(), cwd=ROOT)
    out = proc.stdout + proc.stderr
    if shm == "auto":
        assert proc.returncode == 0, out
        assert all("bitwise_vs_ddp=True" in line and "shared_memory=0" in line
                   for line in _lines(out)), out
        return
    assert proc.returncode != 0 and "RESULT ok" not in out, out
    assert "cannot reserve" in out and "No space left on device" in out, out


@pytest.mark.timeout(180)
def test_rank_killed_while_the_lane_opens_leaves_no_region_past_the_next_open(
        tmp_path: Path) -> None:
    """A rank SIGKILLed while mapping left every rank's region in /dev/shm (resident
    memory) after the job. A dead owner's region must carry the job and its pid in its
    name and be gone once any later lane opens on the host; that open still works."""
    _needs_mounts()
    path = tmp_path / "opening.py"
    path.write_text(OPENING)
    out = _in_own_dev_shm(path, "kill", "ok")
    codes, left = _marked(out, "EXIT"), _marked(out, "LEFT")
    assert codes[0] != "0" and codes[1] == "0", out
    assert left[1] == "", f"regions left after the next open: {left[1]}\n{out}"
    owners = _marked(out, "OWNER")
    rank1 = next(o for o in owners[:2] if o.startswith("rank=1"))
    pid, job = rank1.split()[1].removeprefix("pid="), rank1.split()[2].removeprefix("job=")
    assert any(name.startswith(f"hpc-grads-{job}-") and name.endswith(f"-1-{pid}")
               for name in left[0].split()), f"{left[0]!r} vs job {job} pid {pid}\n{out}"
    second = out[out.index("EXIT"):]
    assert all("shared_memory=1" in line for line in _lines(second)), out


@pytest.mark.timeout(180)
def test_a_rank_that_cannot_map_makes_every_rank_fall_back(tmp_path: Path) -> None:
    """An exception while mapping skipped the unlink and left the peer waiting in the
    next collective: it must be an answer every rank hears (fall back to the group),
    with nothing left in /dev/shm."""
    _needs_mounts()
    path = tmp_path / "opening.py"
    path.write_text(OPENING)
    out = _in_own_dev_shm(path, "fail")
    assert _marked(out, "EXIT") == ["0"], out
    assert _marked(out, "LEFT") == [""], out
    assert all("shared_memory=0" in line for line in _lines(out)), out
