"""Every script in docs/examples/ runs under ``hpc run --nproc 2`` and prints what the
docs say it prints (the pages include these files with ``literalinclude``)."""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.helpers.paths import ROOT
from tests.helpers.processes import clean_env, hpc_run, kill_group, timeout_scale
from tests.helpers.step_hooks import killing, signalling, slowed

pytestmark = pytest.mark.background  # see setup.cfg

EXAMPLES = sorted((ROOT / "docs" / "examples").glob("*.py"))

#: What varies from run to run in an example's output, and what stands in for it.
_VARYING = [(re.compile(r"\b\d\d:\d\d:\d\d\b"), "<time>"),
            (re.compile(r"pid \d+"), "pid <pid>"),
            (re.compile(r"master 127\.0\.0\.1:\d+"), "master 127.0.0.1:<port>"),
            # The bits of trained weights follow the CPU's vector units (AVX-512 or AVX2
            # sums round differently): the checks compare a run's digests with each other.
            (re.compile(r"\b(final|digest) [0-9a-f]{12,16}\b"), r"\1 <digest>"),
            (re.compile(r"\bchecksum -?\d+\.\d+"), "checksum <sum>"),
            (re.compile(r"\b\d{8}-\d{6}-[0-9a-f]{6}\b"), "<run id>"),  # hpc.run_id
            (re.compile(r"\d+\.\d [KMG]iB free, fsync \d+\.\d+ s"), "<free> free, fsync <s>")]

#: Lines that come and go with the host's load, not with the example: hpc's straggler
#: monitor names a rank the host starves (seen in CI, a rank 6.7x its own earlier steps).
_LOADED = re.compile(r" (INFO|WARNING) hpc\.health\.step: straggler")


def documented_runs(page: str, command: str) -> list[list[str]]:
    """The lines docs/``page`` shows under each ``$ COMMAND`` prompt of its console blocks."""
    runs: list[list[str]] = []
    block = False
    for line in (ROOT / "docs" / page).read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            block = line.strip() == "```console"
            continue
        if not block:
            continue
        if line.startswith("$ "):
            if line == f"$ {command}":
                runs.append([])
            else:
                block = False  # another command: its lines are not this example's
            continue
        if runs:
            runs[-1].append(line)
    assert runs, f"docs/{page} shows no run of `{command}`"
    return runs


def normalized(lines: list[str], subs: dict[str, str]) -> list[str]:
    """``lines`` with run-dependent parts replaced (``subs`` first: regular expressions of
    the run's paths or values -> the docs' words), :data:`_LOADED` lines left out, sorted:
    the ranks' lines interleave differently each run."""
    out = []
    for line in lines:
        if _LOADED.search(line):
            continue
        for real, shown in subs.items():
            line = re.sub(real, shown, line)
        for pattern, shown in _VARYING:
            line = pattern.sub(shown, line)
        out.append(line)
    return sorted(out)


def assert_output_as_documented(page: str, command: str, real: list[list[str]],
                                subs: dict[str, str]) -> None:
    """Each run of ``command`` shown on ``page`` printed exactly the real run's lines."""
    shown = documented_runs(page, command)
    assert len(shown) == len(real), (len(shown), len(real))
    for doc, got in zip(shown, real):
        assert normalized(doc, subs) == normalized(got, subs), (
            f"docs/{page} shows for `{command}`:\n" + "\n".join(doc)
            + "\nthe example printed:\n" + "\n".join(got))


def _lines(*texts: str) -> list[str]:
    return [line for text in texts for line in text.splitlines() if line.strip()]


def check_train_minimal(proc: subprocess.CompletedProcess[str], tmp: Path) -> None:
    synced = re.findall(r"rank (\d): init (\w+) -> synced (\w+)", proc.stdout)
    assert sorted(r for r, _, _ in synced) == ["0", "1"], proc.stdout
    inits = {r: i for r, i, _ in synced}
    assert inits["0"] != inits["1"], "the example should start from different weights"
    assert len({s for _, _, s in synced}) == 1, "sync_model left ranks different"
    finals = re.findall(r"rank (\d): final (\w+)", proc.stdout)
    assert len(finals) == 2 and len({d for _, d in finals}) == 1, proc.stdout
    # Logging on local masters only: one node, so each epoch is logged once, by rank 0.
    epochs = [line for line in proc.stderr.splitlines() if "INFO train_minimal: epoch" in line]
    assert len(epochs) == 3 and all(line.startswith("[rank 0]") for line in epochs), epochs
    # init_torch's own line, logged before setup_logging ran, is replayed (issue 30)
    inits = [line for line in proc.stderr.splitlines()
             if "INFO hpc.bootstrap.distributed: initialised hpc-run rank" in line]
    assert len(inits) == 1 and inits[0].startswith("[rank 0]"), proc.stderr
    # IO on the global master only.
    assert (tmp / "model.pt").is_file()
    assert proc.stderr.count("INFO train_minimal: saved") == 1
    assert_output_as_documented(
        "script.md", "hpc run --nproc 2 -- python docs/examples/train_minimal.py --out "
        "runs/minimal", [_lines(proc.stdout, proc.stderr)], {re.escape(str(tmp)): "runs/minimal"})


def check_train_supernet(proc: subprocess.CompletedProcess[str], tmp: Path) -> None:
    rows = re.findall(r"rank (\d): last step blocks with grad (\[[\d, ]*\]) checksum (\S+)",
                      proc.stdout)
    assert sorted(r for r, _, _ in rows) == ["0", "1"], proc.stdout
    assert len({(used, total) for _, used, total in rows}) == 1, "ranks diverged"
    # The blocks with a gradient are exactly those some rank drew in the last step (the
    # example's rule): a block no rank used keeps grad=None, not a zero gradient.
    drawn = sorted({random.Random(f"0/{rank}/19").randrange(3) for rank in (0, 1)})
    assert rows[0][1] == str(drawn), (rows, drawn)
    assert_output_as_documented("script.md", "hpc run --nproc 2 -- python "
                                "docs/examples/train_supernet.py",
                                [_lines(proc.stdout, proc.stderr)], {})


DONE = re.compile(r"rank (\d): done step (\d+) digest (\w+)")


def _done(text: str) -> tuple[int, str]:
    """(step, digest) every rank printed at the end; asserts they agree."""
    rows = DONE.findall(text)
    assert sorted(r for r, _, _ in rows) == ["0", "1"], text
    assert len({(s, d) for _, s, d in rows}) == 1, f"ranks ended differently: {rows}"
    return int(rows[0][1]), rows[0][2]


def check_train_preemptible(proc: subprocess.CompletedProcess[str], tmp: Path) -> None:
    """``proc`` ran uninterrupted (the reference). Then: USR2 to rank 1 only, mid-run ->
    both ranks stop at the same step with a checkpoint, exit 0 (not a Slurm job); the
    rerun resumes from it and ends with the reference's digest, bitwise."""
    ref_step, ref_digest = _done(proc.stdout)
    assert ref_step == 256 and "resumed from" not in proc.stderr
    out = tmp / "interrupted"
    argv = [sys.executable, "-m", "hpc", "run", "--nproc", "2", "--",
            str(ROOT / "docs" / "examples" / "train_preemptible.py"), "--out", str(out)]
    run = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           env=clean_env(**slowed(0.02)), cwd=ROOT, start_new_session=True)
    lines, pids = [], {}
    try:
        assert run.stdout is not None
        for line in run.stdout:
            lines.append(line)
            if m := re.search(r"rank (\d): pid (\d+)", line):
                pids[m.group(1)] = int(m.group(2))
            if "epoch 1/4 step 64" in line:  # training under way: signal one rank only
                os.kill(pids["1"], signal.SIGUSR2)
                break
        lines += run.stdout.readlines()
        run.wait(timeout=60 * timeout_scale())
    finally:
        if run.poll() is None:
            kill_group(run)
    text = "".join(lines)
    assert run.returncode == 0, text
    stops = re.findall(r"rank (\d): stopped at step (\d+)", text)
    assert sorted(r for r, _ in stops) == ["0", "1"], text
    assert len({s for _, s in stops}) == 1, f"ranks stopped at different steps: {stops}"
    step = int(stops[0][1])
    assert 64 <= step < 256 and "done step" not in text, text
    assert (out / "checkpoints" / f"ckpt-{step:08d}.pt").is_file()
    assert "Not a Slurm job, nothing to requeue: rerun the same command to resume." in text
    resumed = hpc_run(2, argv[7:], timeout=120)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert f"resumed from {out}/checkpoints/ckpt-{step:08d}.pt: step {step} done" in \
        resumed.stderr, resumed.stderr
    assert _done(resumed.stdout) == (ref_step, ref_digest), "resume is not bitwise exact"
    # preemptible.md's session: the same lines, the stop step (the signal's timing) aside.
    def stop_subs(at: int) -> dict[str, str]:  # the stop step, not "epoch 1/4 step 64:"
        return {rf"\bstep {at}\b(?!:)": "step <stop>", f"ckpt-{at:08d}": "ckpt-<stop>",
                f"batch {at % 64} of epoch {at // 64} ": "batch <b> of epoch <e> "}

    shown = documented_runs("preemptible.md", "hpc run --nproc 2 -- python "
                            "docs/examples/train_preemptible.py --out runs/mine")
    doc_step = int(re.findall(r"stopped at step (\d+)", "\n".join(shown[0]))[0])
    subs = {re.escape(str(out)): "runs/mine", **stop_subs(step)}
    doc_subs = stop_subs(doc_step)
    real = [_lines(text), _lines(resumed.stdout, resumed.stderr)]
    # The docs' run stopped in the second epoch (64 steps each); so must this one, for
    # its lines to be the same ones.
    assert 64 <= step < 128 and 64 <= doc_step < 128, (step, doc_step)
    for doc, got in zip(shown, real):
        assert normalized(doc, doc_subs) == normalized(got, subs), (
            "docs/preemptible.md shows:\n" + "\n".join(doc) + "\nthe example printed:\n"
            + "\n".join(got))
    assert len(shown) == len(real)
    page = (ROOT / "docs" / "preemptible.md").read_text(encoding="utf-8")
    # The page's own digest (its run's CPU: the bits follow the vector units) is the one
    # its sentence about the uninterrupted run names; this run's resume matched its own
    # uninterrupted run above.
    doc_digest = re.findall(r"digest (\w+)", "\n".join(shown[-1]))[-1]
    assert f"The uninterrupted run prints the same `digest {doc_digest}`" in page


FRAMEWORK_DONE = re.compile(r"rank (\d): .*; done step (\d+)(?: digest (\w+))? run ([\w-]+)")


def _framework_runs(script: str, tmp: Path) -> tuple[str, subprocess.CompletedProcess[str]]:
    """``script`` stopped by a USR2 to rank 1 at its 30th step, then run again: the
    stopped run's output and the resumed run."""
    out = tmp / "interrupted"
    argv = [str(ROOT / "docs" / "examples" / script), "--out", str(out)]
    stopped = hpc_run(2, argv, timeout=150, env=clean_env(**signalling(1, 30)))
    text = stopped.stdout + stopped.stderr
    assert stopped.returncode == 0, text
    assert "stopped at step 30 on SIGUSR2" in text and "Not a Slurm job" in text, text
    resumed = hpc_run(2, argv, timeout=150)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    return text, resumed


def _framework_done(text: str) -> tuple[str, str, str]:
    """(step, digest, run id) both ranks printed at the end; asserts they agree."""
    rows = FRAMEWORK_DONE.findall(text)
    assert sorted(r for r, *_ in rows) == ["0", "1"], text
    assert len({tuple(r[1:]) for r in rows}) == 1, f"ranks ended differently: {rows}"
    return rows[0][1], rows[0][2], rows[0][3]


def check_framework_resume(proc: subprocess.CompletedProcess[str], tmp: Path,
                           script: str) -> None:
    """``proc`` ran uninterrupted. Stopped at step 30 and resumed, the run ends at the same
    step (with the same digest where the example prints one) under one run id."""
    step, digest, ref_id = _framework_done(proc.stdout)
    assert step == "96", proc.stdout
    stopped, resumed = _framework_runs(script, tmp)
    assert "done step" not in stopped, stopped
    end_step, end_digest, rid = _framework_done(resumed.stdout)
    assert (end_step, end_digest) == (step, digest), "resume is not where the reference ended"
    assert rid != ref_id and (tmp / "interrupted" / "run_id").read_text().strip() == rid


def check_train_lightning(proc: subprocess.CompletedProcess[str], tmp: Path) -> None:
    """Also: one TensorBoard version with one point per step, and a rerun of the finished
    run restores its last checkpoint and trains nothing more (a helper's finding: the
    first version retrained from the stop's checkpoint and logged 57 steps twice)."""
    from tests.helpers.trackers import duplicates, tensorboard_steps

    check_framework_resume(proc, tmp, "train_lightning.py")
    assert "layout 2 ranks, 1 nodes, global_rank 1 local_rank 1 node_rank 0" in proc.stdout
    out = tmp / "interrupted"
    rid = (out / "run_id").read_text().strip()
    assert [p.name for p in (out / "tensorboard").iterdir()] == [rid]
    steps = tensorboard_steps(out / "tensorboard" / rid, "train/loss")
    assert sorted(steps) == list(range(96)), duplicates(steps)
    again = hpc_run(2, [str(ROOT / "docs" / "examples" / "train_lightning.py"), "--out",
                        str(out)], timeout=150)
    assert again.returncode == 0 and _framework_done(again.stdout)[::2] == ("96", rid), \
        again.stdout + again.stderr
    assert f"checkpoint at {out}/checkpoints/hpc-00000096.ckpt" in again.stderr, again.stderr
    assert sorted(tensorboard_steps(out / "tensorboard" / rid, "train/loss")) == steps
    check_lightning_crash(tmp)


def check_lightning_crash(tmp: Path) -> None:
    """Rank 1 SIGKILLed at its 50th step: the rerun resumes from step 40's periodic
    checkpoint and runs 41-50 again; TensorBoard shows each step once, the rerun's point
    where both attempts logged one (HPCPreemption opens the writer with ``purge_step``)."""
    from tests.helpers.trackers import duplicates, tensorboard_steps, tensorboard_values

    out = tmp / "crashed"
    argv = [str(ROOT / "docs" / "examples" / "train_lightning.py"), "--out", str(out)]
    crashed = hpc_run(2, argv, timeout=150, env=clean_env(**killing(1, 50)))
    assert crashed.returncode != 0 and "done step" not in crashed.stdout, crashed.stderr
    rid = (out / "run_id").read_text().strip()
    tb = out / "tensorboard" / rid
    before = tensorboard_values(tb, "train/loss")
    assert max(before) >= 45, sorted(before)  # logged past the checkpoint it resumes from
    assert sorted(p.name for p in (out / "checkpoints").iterdir())[-1] == "hpc-00000040.ckpt"
    resumed = hpc_run(2, argv, timeout=150)
    assert resumed.returncode == 0 and _framework_done(resumed.stdout)[::2] == ("96", rid), \
        resumed.stdout + resumed.stderr
    assert f"checkpoint at {out}/checkpoints/hpc-00000040.ckpt" in resumed.stderr, \
        resumed.stderr
    steps = tensorboard_steps(tb, "train/loss")
    assert sorted(steps) == list(range(96)), duplicates(steps)
    after = tensorboard_values(tb, "train/loss")
    assert all(after[s] == before[s] for s in range(40)), "a point before the resume changed"


#: Expected output of each example; a new example needs an entry here.
CHECKS: dict[str, tuple[list[str], Callable[[subprocess.CompletedProcess[str], Path], None]]] = {
    "train_minimal.py": (["--out", "{tmp}"], check_train_minimal),
    "train_supernet.py": ([], check_train_supernet),
    "train_preemptible.py": (["--out", "{tmp}/reference"], check_train_preemptible),
    "train_lightning.py": (["--out", "{tmp}/reference"], check_train_lightning),
    "train_fabric.py": (["--out", "{tmp}/reference"],
                        lambda p, t: check_framework_resume(p, t, "train_fabric.py")),
    "train_accelerate.py": (["--out", "{tmp}/reference"],
                            lambda p, t: check_framework_resume(p, t, "train_accelerate.py")),
}


def test_every_example_has_a_check() -> None:
    assert EXAMPLES, "docs/examples/ is empty"
    assert sorted(p.name for p in EXAMPLES) == sorted(CHECKS)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_runs_under_hpc_run(path: Path, tmp_path: Path) -> None:
    args, check = CHECKS[path.name]
    argv = [str(path), *(a.format(tmp=tmp_path) for a in args)]
    proc = hpc_run(2, argv, timeout=150)
    assert proc.returncode == 0, f"{path.name} failed:\n{proc.stdout}\n{proc.stderr}"
    assert "Traceback" not in proc.stderr, proc.stderr
    check(proc, tmp_path)


@pytest.mark.slurm
@pytest.mark.timeout(150)
def test_minimal_example_on_two_nodes_shows_the_start_up_lines(job: str, tmp_path: Path
                                                               ) -> None:
    """Issue 30: the example calls setup_logging after init_torch, as the docs do; the
    pre-flight's network line and init's own line (troubleshooting.md tells users to
    read them) were dropped. Now each node's local master shows them, before epoch 0."""
    from tests.helpers.slurm import run, slurm_env

    proc = run(["srun", "-N2", "--ntasks-per-node=1", sys.executable,
                str(ROOT / "docs" / "examples" / "train_minimal.py"), "--epochs", "1"],
               job, tmp_path, slurm_env())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stderr.splitlines()

    def first(text: str, host: str) -> int:
        found = [i for i, line in enumerate(lines) if text in line and f" {host}]" in line]
        assert found, f"no {text!r} line of {host}:\n{proc.stderr}"
        return found[0]

    for rank, host in enumerate(("node1", "node2")):
        net = first("INFO hpc.bootstrap.interfaces: network: master node1 ", host)
        assert "is reachable over" in lines[net], lines[net]
        init = first(f"INFO hpc.bootstrap.distributed: initialised slurm rank {rank}/2", host)
        assert net < init < first("INFO train_minimal: epoch 0", host), proc.stderr
