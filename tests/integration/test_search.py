"""``hpc search`` and ``hpc tune`` with real ranks (gloo over loopback).

One tiny pretrain run (2 ranks, 1 epoch, width 16) serves the whole module. Searches
use a budget of 24 (evolution, 3 generations of 8) unless a test needs exhaustive mode.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import LAUNCHER_VARS
from tests.helpers.paths import ROOT
from tests.helpers.processes import clean_env

pytestmark = pytest.mark.background  # see setup.cfg

torch = pytest.importorskip("torch")
pytest.importorskip("sklearn")

SEARCH = ["--budget", "24", "--population", "8", "--recal-samples", "128",
          "--latency-repeats", "3", "--no-progress"]
SAME = ("arch", "val_acc", "val_loss", "params", "generation")


def _env() -> dict[str, str]:
    # Module-scoped fixtures run before conftest's per-test clearing: filter here too.
    return {k: v for k, v in clean_env().items() if not LAUNCHER_VARS.match(k)}


def hpc(nproc: int, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """``hpc run --nproc N -- hpc ARGS`` as a real subprocess."""
    argv = [sys.executable, "-m", "hpc", "run", "--nproc", str(nproc), "--", "hpc", *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout,
                          env=_env(), cwd=ROOT, check=False)


def ok(proc: subprocess.CompletedProcess[str]) -> subprocess.CompletedProcess[str]:
    assert proc.returncode == 0, f"rc={proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc


def load(out: Path, name: str = "search.json") -> dict[str, Any]:
    return json.loads((out / name).read_text())


def scores(found: dict[str, Any]) -> list[tuple[Any, ...]]:
    return [tuple(tuple(r[k]) if k == "arch" else r[k] for k in SAME)
            for r in found["evaluated"]]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("pretrain") / "run"
    ok(hpc(2, "pretrain", "--epochs", "1", "--batch-size", "64", "--width", "16",
           "--val-archs", "1", "--recal-samples", "64", "--no-progress", "--out", str(out),
           timeout=100))
    return out


@pytest.fixture(scope="module")
def searched(run_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    """The same search on 1, 2 and 3 ranks."""
    outs = {}
    for n in (1, 2, 3):
        outs[n] = tmp_path_factory.mktemp(f"search{n}")
        ok(hpc(n, "search", "--run", str(run_dir), *SEARCH, "--out", str(outs[n])))
    return outs


@pytest.mark.timeout(300)
def test_same_best_and_scores_on_1_2_3_ranks(searched: dict[int, Path]) -> None:
    found = {n: load(out) for n, out in searched.items()}
    one = found[1]
    assert one["mode"] == "evolution" and one["evaluations"] == 24 == len(one["evaluated"])
    assert one["generations"] == 3 and one["status"] == "completed"
    assert len({tuple(r["arch"]) for r in one["evaluated"]}) == 24  # no re-evaluation
    for n in (2, 3):
        assert found[n]["world_size"] == n
        assert scores(found[n]) == scores(one), f"{n} ranks scored differently"
        best = {k: v for k, v in found[n]["best"].items() if k != "latency_ms"}
        assert best == {k: v for k, v in one["best"].items() if k != "latency_ms"}
    best = one["best"]
    assert best["val_acc"] == max(r["val_acc"] for r in one["evaluated"])
    assert set(best) == {"arch", "arch_name", "val_acc", "val_loss", "params", "latency_ms"}
    assert best["latency_ms"] > 0 and (searched[1] / "pareto.png").stat().st_size > 10_000
    assert one["pareto"]["params"] and one["pareto"]["latency_ms"]


@pytest.mark.timeout(300)
def test_stop_mid_search_and_resume_equals_uninterrupted(run_dir: Path, tmp_path: Path,
                                                         searched: dict[int, Path]) -> None:
    out = tmp_path / "resumed"
    first = ok(hpc(2, "search", "--run", str(run_dir), *SEARCH, "--out", str(out),
                   "--max-generations", "1"))
    stopped = load(out)
    assert stopped["status"] == "stopped" and stopped["evaluations"] == 8, first.stderr
    second = ok(hpc(2, "search", "--run", str(run_dir), *SEARCH, "--out", str(out)))
    assert "resuming the search" in second.stderr and "after generation 1" in second.stderr
    resumed = load(out)
    assert resumed["status"] == "completed"
    assert scores(resumed) == scores(load(searched[2]))
    changed = hpc(2, "search", "--run", str(run_dir), *SEARCH, "--out", str(out),
                  "--seed", "5")
    assert changed.returncode == 1 and "other settings" in changed.stderr
    assert "HINT" in changed.stderr


@pytest.mark.timeout(300)
def test_constraints_are_never_violated(run_dir: Path, tmp_path: Path) -> None:
    from hpc.search.evolution import enumerate_archs
    from hpc.search.export import SubNet, count_params

    limit = 8000
    archs = enumerate_archs([4] * 4)
    sizes = {a: count_params(SubNet(a, width=16)) for a in archs}
    allowed = {a for a, p in sizes.items() if p <= limit}
    assert 10 < len(allowed) < len(archs)
    out = tmp_path / "small"
    ok(hpc(2, "search", "--run", str(run_dir), *SEARCH, "--budget", "256",
           "--population", "32", "--max-params", str(limit), "--out", str(out)))
    found = load(out)
    assert found["mode"] == "exhaustive"
    # exactly the feasible sub-networks, with their exact sizes
    assert {tuple(r["arch"]) for r in found["evaluated"]} == allowed
    assert all(r["params"] == sizes[tuple(r["arch"])] for r in found["evaluated"])
    latencies = sorted(r["latency_ms"] for r in found["evaluated"])
    cap = latencies[len(latencies) // 2]
    out = tmp_path / "fast"
    ok(hpc(2, "search", "--run", str(run_dir), *SEARCH, "--budget", "12",
           "--max-latency-ms", f"{cap:.6f}", "--max-params", str(2 * limit), "--out",
           str(out)))
    fast = load(out)
    assert fast["evaluations"] == 12
    assert all(r["latency_ms"] <= cap and r["params"] <= 2 * limit
               for r in fast["evaluated"])
    none = hpc(1, "search", "--run", str(run_dir), *SEARCH, "--max-params", "10",
               "--out", str(tmp_path / "none"))
    assert none.returncode == 1 and "no sub-network satisfies" in none.stderr


@pytest.mark.timeout(300)
def test_tune_exports_the_winner_and_resumes_exactly(searched: dict[int, Path],
                                                     tmp_path: Path) -> None:
    from hpc.search.export import load_model
    from hpc.search.trained import load_run

    search_dir = str(searched[2])
    whole = tmp_path / "whole"
    ok(hpc(2, "tune", "--search", search_dir, "--epochs", "1", "--out", str(whole)))
    result = load(whole, "tune.json")
    best = load(searched[2])["best"]
    # before fine-tuning the export scores exactly what the search measured
    assert result["val_acc_before"] == best["val_acc"]
    assert result["arch"] == best["arch"] and result["params"] == best["params"]
    assert result["status"] == "completed" and result["world_size"] == 2
    assert {"tune.json", "metrics.csv", "metrics.png", "model.pt"} <= {
        p.name for p in whole.iterdir()}
    import csv
    with open(whole / "metrics.csv", newline="") as f:
        elapsed = [float(r["elapsed_s"]) for r in csv.DictReader(f) if r["split"] == "train"]
    assert elapsed and elapsed == sorted(elapsed) and elapsed[0] > 0  # as pretrain's rows
    # model.pt loads without the supernet and scores what tune.json says
    net = load_model(whole / "model.pt")
    data = load_run(str(Path(load(searched[2])["pretrain"]["run"]))).data
    with torch.no_grad():
        acc = (net(data.x_val).argmax(1) == data.y_val).double().mean().item()
    assert acc == pytest.approx(result["val_acc"], abs=1e-12)
    # stop after step 5, resume: the same model bitwise
    parts = tmp_path / "parts"
    ok(hpc(2, "tune", "--search", search_dir, "--epochs", "1", "--out", str(parts),
           "--max-steps", "5"))
    assert load(parts, "tune.json")["status"] == "stopped"
    ok(hpc(2, "tune", "--search", search_dir, "--epochs", "1", "--out", str(parts)))
    a = torch.load(whole / "model.pt", weights_only=True)["state_dict"]
    b = torch.load(parts / "model.pt", weights_only=True)["state_dict"]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
