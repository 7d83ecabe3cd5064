"""``hpc supervise`` against the issue's fault matrix on the 4-node test cluster.

One ``slurm/pretrain.sbatch`` job per fault: ``-p four -N4 --ntasks-per-node=2 --no-kill``
with ``HPC_SPARE_NODES=1`` (6 ranks on node1-3, node4 the spare), the tiny pretrain for 3
epochs (21 steps, a checkpoint every 3, each step slowed to 0.6 s so the faults land
mid-run), and one more job without a fault: the reference. Faults, each node of the step
at least twice, mixed kinds, all past checkpoint 6:

- ``hpc_fault``: ``HPC_FAULT`` makes both ranks of the node SIGKILL themselves at step 7;
- ``sigkill``: both ranks SIGKILLed from outside (``kill -9`` of the node's rank processes);
- ``link``: the node's link cut (``ip link set hpcv-nodeX down``), up again after the resume;
- ``crash``: every process of the node SIGKILLed, slurmd included (``bin/hpc-testcluster
  crash``), revived after the resume.

node1 holds the batch shell (the supervisor itself): it gets only the rank faults; a
node1 that loses its link or slurmd takes the job's batch step with it, which no
supervisor inside the job can survive (Slurm requeues such a job, ``--requeue``).

Per fault it prints: the job's runs in sacct (one ``COMPLETED``: its first allocation),
the excluded host (it must be the one the fault hit), the ledger's strikes, the seconds from
the fault to the relaunched ranks' ``resumed from`` line (polled every 0.1 s; for
``hpc_fault`` from the ranks' own ``SIGKILL to rank`` line) and whether the final weights,
optimizer state and validation accuracies are bitwise those of the reference. Exits 1 when
any run misses one of them.

    flock /tmp/hpc-heavy.lock python bench/fault_matrix.py [--only 0,3]

Needs root (ip, kill) and ``bin/hpc-testcluster up``.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.helpers: the driver

from hpc.submit import watch as jobwatch  # noqa: E402
from tests.helpers.paths import ROOT  # noqa: E402
from tests.helpers.slurm import slurm_env  # noqa: E402
from tests.helpers.step_hooks import slowed  # noqa: E402
from tests.helpers.tiny_pretrain import ENV, TINY_ARGS  # noqa: E402

MATRIX = [("node1", "hpc_fault"), ("node2", "link"), ("node3", "crash"), ("node1", "sigkill"),
          ("node2", "crash"), ("node3", "hpc_fault"), ("node2", "sigkill"), ("node3", "link")]
ARGS = [*TINY_ARGS[:1], "3", *TINY_ARGS[2:]]  # 3 epochs: 21 steps of 6 ranks
assert TINY_ARGS[:2] == ["--epochs", "2"]
TESTCLUSTER = str(ROOT / "bin" / "hpc-testcluster")


def _poll(check: Callable[[], object], what: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout:g} s")
        time.sleep(0.1)


def _ranks_of(node: str) -> list[int]:
    pids = subprocess.run(["ip", "netns", "pids", f"hpc-{node}"], capture_output=True,
                          text=True, timeout=20).stdout.split()
    out = []
    for pid in pids:
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        # the ranks: python -m hpc pretrain (not the supervisor, not srun's own command line)
        if Path(cmd[0].decode()).name.startswith("python") and b"pretrain" in cmd \
                and b"supervise" not in cmd:
            out.append(int(pid))
    return out


def _inject(node: str, kind: str) -> Callable[[], None]:
    """Inject the fault now; returns what undoes it once the job went on (or nothing)."""
    if kind == "sigkill":
        pids = _ranks_of(node)
        assert len(pids) == 2, f"{node}: rank processes {pids}"
        subprocess.run(["kill", "-9", *map(str, pids)], check=True, timeout=20)
        return lambda: None
    if kind == "link":
        subprocess.run(["ip", "link", "set", f"hpcv-{node}", "down"], check=True, timeout=20)
        return lambda: subprocess.run(["ip", "link", "set", f"hpcv-{node}", "up"], check=True,
                                      timeout=20)
    if kind == "crash":
        subprocess.run([TESTCLUSTER, "crash", node], check=True, timeout=60,
                       stdout=subprocess.DEVNULL)
        return lambda: subprocess.run([TESTCLUSTER, "revive", node], check=True, timeout=120,
                                      stdout=subprocess.DEVNULL)
    raise ValueError(kind)


def _final(run_dir: Path) -> dict:
    import torch

    newest = sorted((run_dir / "checkpoints").glob("ckpt-*.pt"))[-1]
    return torch.load(newest, map_location="cpu", weights_only=True)


def _bitwise(a: dict, b: dict) -> bool:
    import torch

    if a["step"] != b["step"] or a["model"].keys() != b["model"].keys():
        return False
    if not all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"]):
        return False
    for k, state in a["optimizer"]["state"].items():
        if not all(torch.equal(v, b["optimizer"]["state"][k][n]) for n, v in state.items()):
            return False
    return a["val_acc"] == b["val_acc"]


def run_job(work: Path, node: str | None, kind: str | None) -> dict:
    """One supervised job, with the fault ``kind`` on ``node`` (None: the reference)."""
    state = work / "state"
    state.mkdir(parents=True)
    extra = {**ENV, **slowed(0.6), "HPC_SPARE_NODES": "1", "HPC_STATE_DIR": str(state)}
    if kind == "hpc_fault":
        first = 2 * (int(node[-1]) - 1)
        extra["HPC_FAULT"] = f"{first}:7:kill,{first + 1}:7:kill"
    out = work / "run"
    proc = subprocess.run(["sbatch", "--parsable", "-p", "four", "-N4", "--ntasks-per-node=2",
                           "--no-kill", str(ROOT / "slurm" / "pretrain.sbatch"), *ARGS,
                           "--out", str(out)], cwd=work, env=slurm_env(**extra),
                          capture_output=True, text=True, timeout=30, check=True)
    job = proc.stdout.strip().split(";")[0]
    log = work / f"hpc-srun-{job}.out"
    text = lambda: log.read_text(errors="replace") if log.exists() else ""  # noqa: E731
    took = None
    try:
        if kind is not None:
            if kind == "hpc_fault":
                _poll(lambda: "SIGKILL to rank" in text(), "the injected SIGKILL", 180)
                undo = lambda: None  # noqa: E731
            else:
                _poll((out / "checkpoints" / "ckpt-00000006.pt").exists, "checkpoint 6", 180)
                undo = _inject(node, kind)
            at = time.monotonic()
            try:
                _poll(lambda: "resumed from" in text(), "the relaunch's resume", 120)
                took = time.monotonic() - at
            finally:
                undo()
        last = jobwatch.wait(job, timeout=240)
    except BaseException:
        subprocess.run(["scancel", job], check=False, timeout=20)
        raise
    from hpc.ledger import Ledger

    os.environ["HPC_STATE_DIR"] = str(state)
    decisions = [x for x in text().splitlines() if " hpc supervise: attempt " in x]
    excluded = re.findall(r"\((\S+) excluded\)", "\n".join(decisions))
    return dict(job=job, word=last.word, runs=[r.word for r in jobwatch.history(job)],
                decisions=decisions, excluded=excluded, took=took, out=out,
                strikes=[s.host for s in Ledger().strikes()])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", default="", help="comma-separated indices into the matrix")
    args = p.parse_args()
    chosen = [int(i) for i in args.only.split(",") if i] or list(range(len(MATRIX)))
    failed = 0
    with tempfile.TemporaryDirectory(prefix="fault-matrix-", dir="/var/tmp") as tmp:
        ref = run_job(Path(tmp) / "reference", None, None)
        assert ref["word"] == "COMPLETED" and not ref["decisions"], ref
        reference = _final(ref["out"])
        print(f"reference: job {ref['job']} {ref['runs']}, step {reference['step']}",
              flush=True)
        times = []
        for i in chosen:
            node, kind = MATRIX[i]
            r = run_job(Path(tmp) / f"fault{i}", node, kind)
            same = r["word"] == "COMPLETED" and _bitwise(_final(r["out"]), reference)
            ok = (r["runs"] == ["COMPLETED"] and r["excluded"] == [node] and same
                  and r["strikes"] == [node] and r["took"] is not None and r["took"] <= 30)
            failed += not ok
            if r["took"] is not None:
                times.append(r["took"])
            took = f"{r['took']:.1f} s" if r["took"] is not None else "-"
            print(f"{i}: {node} {kind:9s} job {r['job']}: sacct {','.join(r['runs'])}; "
                  f"excluded {','.join(r['excluded']) or '-'}; strikes "
                  f"{','.join(r['strikes']) or '-'}; fault to resumed {took}; bitwise "
                  f"{'yes' if same else 'NO'}{'' if ok else '  <-- FAILED'}", flush=True)
            for d in r["decisions"]:
                print(f"    {d}", flush=True)
        if times:
            print(f"fault to resumed: median {statistics.median(times):.1f} s, "
                  f"max {max(times):.1f} s over {len(times)} faults; {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
