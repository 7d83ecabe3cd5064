"""Sharded checkpoints with real ranks under ``hpc run``: saved on 4 ranks, each rank
writes about a quarter; loaded bitwise on 2 and on 3; converted to one ``torch.save``
file by a plain python that never imports hpc; an FSDP2 model saved on 2 ranks loads
into a plain model (and into FSDP2) on 3.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.processes import hpc_run, run_group

pytestmark = pytest.mark.background  # see setup.cfg

SCRIPT = "tests/integration/scripts/sharded_ckpt.py"
STEP = 3
#: torch.save's framing around each item in a shard file, in bytes (measured: ~1.6 KiB).
FRAMING = 2048


def loaded(out: str) -> list[int]:
    """The ranks that printed a bitwise load."""
    return sorted(int(r) for r in re.findall(
        rf"rank (\d+): loaded step {STEP} bitwise \(saved by \d+ ranks, whose buffers "
        r"differed\)", out))


def save(tmp: Path, nproc: int, *extra: str) -> dict[str, Any]:
    res = hpc_run(nproc, ["python", SCRIPT, "save", "--out", str(tmp), "--step",
                          str(STEP), *extra], timeout=150)
    assert res.returncode == 0, res.stdout + res.stderr
    found = re.search(r"BYTES (\{.*\})", res.stdout)
    assert found, res.stdout
    return json.loads(found.group(1))


@pytest.fixture(scope="module")
def four(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """A checkpoint of 4 ranks (BatchNorm and 6 layers of 512: 18 MiB of state in 59
    items) and the bytes each rank wrote."""
    out = tmp_path_factory.mktemp("four")
    return out, save(out, 4)


@pytest.mark.timeout(200)
def test_each_of_4_ranks_writes_about_a_quarter(four: tuple[Path, dict[str, Any]]) -> None:
    """Tensors of 1 MiB or more (the 512 x 512 weights and their Adam moments) are
    written in 4 slices, one per rank; DCP's planner gives each smaller (whole) tensor
    to the rank with the fewest bytes so far: a greedy assignment, so no rank exceeds
    the mean by more than its last whole item, plus torch.save's framing of its pieces.
    Rank 0 also writes ``.metadata`` and ``hpc-meta.pt`` (the ranks' RNG states)."""
    out, sizes = four
    total, shards, written = sizes["tensor_bytes"], sizes["shards"], sizes["written"]
    pieces = sizes["items"] + 3 * sizes["split"]
    print(f"bytes written per rank: {written} of {total} tensor bytes "
          f"(rank 0: {written[0] / total:.1%}); {sizes['split']} of {sizes['items']} "
          "tensors in slices")
    assert sizes["split"] >= 18
    assert all(s > 0 for s in shards), shards
    assert sum(shards) <= total + FRAMING * pieces  # each item once
    bound = total / 4 + sizes["largest"] + FRAMING * pieces
    assert shards[0] <= bound, (shards, bound)
    meta = (out / f"ckpt-{STEP:08d}.dcp" / ".metadata").stat().st_size + \
        (out / f"ckpt-{STEP:08d}.dcp" / "hpc-meta.pt").stat().st_size
    assert written[0] == shards[0] + meta
    assert written[0] / total <= 1 / 4 + sizes["largest"] / total + 0.01


@pytest.mark.timeout(200)
@pytest.mark.parametrize("nproc", [2, 3])
def test_a_4_rank_checkpoint_loads_bitwise_on_fewer_ranks(
        four: tuple[Path, dict[str, Any]], nproc: int) -> None:
    out, _ = four
    res = hpc_run(nproc, ["python", SCRIPT, "load", "--out", str(out), "--step", str(STEP)],
                  timeout=150)
    assert res.returncode == 0, res.stdout + res.stderr
    assert loaded(res.stdout) == list(range(nproc)), res.stdout
    assert "saved by 4 ranks" in res.stdout


#: Run by a plain interpreter (-I: no PYTHONPATH, no cwd on sys.path): torch only.
CONVERT = """
import sys, torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
ckpt, out, ref = sys.argv[1:4]
dcp_to_torch_save(ckpt, out)
got = torch.load(out, weights_only=True)
want = torch.load(ref, weights_only=True)
assert set(got) == {"model", "optim"}, sorted(got)
assert got["model"].keys() == want["model"].keys()
assert all(torch.equal(got["model"][k], v) for k, v in want["model"].items())
moments = {f"state.{k}.{n}": t for k, s in want["optim"]["state"].items()
           for n, t in s.items()}
assert got["optim"].keys() == moments.keys(), sorted(got["optim"])[:4]
assert all(torch.equal(got["optim"][k], v) for k, v in moments.items())
assert not [m for m in sys.modules if m == "hpc" or m.startswith("hpc.")]
print("converted", len(got["model"]), "weights and", len(got["optim"]), "optimizer tensors")
"""


@pytest.mark.timeout(120)
def test_a_plain_python_converts_it_to_one_file(four: tuple[Path, dict[str, Any]]) -> None:
    out, _ = four
    res = run_group([sys.executable, "-I", "-c", CONVERT, str(out / f"ckpt-{STEP:08d}.dcp"),
                     str(out / "converted.pt"), str(out / "reference.pt")],
                    timeout=90, cwd="/")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "converted 17 weights and 42 optimizer tensors" in res.stdout, res.stdout


@pytest.mark.timeout(300)
def test_an_fsdp2_checkpoint_of_2_ranks_loads_on_3(tmp_path: Path) -> None:
    sizes = save(tmp_path, 2, "--fsdp")
    assert len(sizes["shards"]) == 2 and all(s > 0 for s in sizes["shards"])
    for extra in ([], ["--fsdp"]):  # into a plain model, and into FSDP2 over 3 ranks
        res = hpc_run(3, ["python", SCRIPT, "load", "--out", str(tmp_path), "--step",
                          str(STEP), *extra], timeout=150)
        assert res.returncode == 0, res.stdout + res.stderr
        assert loaded(res.stdout) == [0, 1, 2], res.stdout
        assert "saved by 2 ranks" in res.stdout

