"""hpc.checkpoint.sharded in one process (DCP's ``no_dist``; DDP's wrapper on a real
one-rank gloo group): a bitwise round trip, the manifest's checks, the stale temporary
directories, keep-N. Several ranks and other world sizes: tests/integration/test_sharded.py.
"""

from __future__ import annotations

import json
import os
import re
import socket
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
np = pytest.importorskip("numpy")

from torch import nn  # noqa: E402

from hpc.checkpoint.files import capture_rng  # noqa: E402
from hpc.checkpoint.sharded import (  # noqa: E402
    list_sharded, load_sharded, save_sharded, sharded_path, verify_sharded)
from hpc.checkpoint.shardfiles import MANIFEST, META, remove_stale_dirs  # noqa: E402
from hpc.errors import CheckpointError  # noqa: E402


class Tied(nn.Module):
    """An embedding whose weight the output layer shares, BatchNorm between them."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(12, 8)
        self.norm = nn.BatchNorm1d(8)
        self.out = nn.Linear(8, 12, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(self.emb(x)))


def objects(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = Tied()
    return model, torch.optim.Adam(model.parameters(), lr=1e-2, weight_decay=0.1)


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: int, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        model(torch.randint(0, 12, (6,), generator=g)).square().mean().backward()
        opt.step()
        opt.zero_grad()


def assert_same(a: tuple[nn.Module, torch.optim.Optimizer],
                b: tuple[nn.Module, torch.optim.Optimizer]) -> None:
    """Weights, buffers, optimizer state and param_groups bitwise equal."""
    sa, sb = a[0].state_dict(), b[0].state_dict()
    assert list(sa) == list(sb)
    for key in sa:
        assert torch.equal(sa[key], sb[key]), key
    oa, ob = a[1].state_dict(), b[1].state_dict()
    assert oa["param_groups"] == ob["param_groups"]
    assert oa["state"].keys() == ob["state"].keys()
    for i, state in oa["state"].items():
        for key, value in state.items():
            assert torch.equal(value, ob["state"][i][key]), (i, key)


def test_a_round_trip_is_bitwise_and_the_continuation_too(tmp_path: Path) -> None:
    a = objects(0)
    train(*a, 4)
    meta = {"format": 1, "step": 4, "epoch": 1, "batch": 2, "world_size": 1,
            "best": 0.5, "rng": [capture_rng()]}
    path = save_sharded(tmp_path, 4, model=a[0], optimizer=a[1], meta=meta, keep=3)
    assert path == sharded_path(tmp_path, 4) == tmp_path / "ckpt-00000004.dcp"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-00000004.dcp"]  # no temps
    assert sorted(p.name for p in path.iterdir()) == [
        ".metadata", "__0_0.distcp", MANIFEST, META]
    verify_sharded(path)
    b = objects(1)
    got = load_sharded(path, model=b[0], optimizer=b[1])
    assert got.keys() == meta.keys() and got["best"] == 0.5 and got["batch"] == 2
    assert torch.equal(got["rng"][0]["torch"], meta["rng"][0]["torch"])
    assert_same(a, b)
    assert b[0].out.weight is b[0].emb.weight  # still tied
    train(*a, 3, seed=1)
    train(*b, 3, seed=1)
    assert_same(a, b)


def test_the_manifest_records_every_file(tmp_path: Path) -> None:
    model, opt = objects(0)
    train(model, opt, 1)
    path = save_sharded(tmp_path, 1, model=model, optimizer=opt, meta={}, keep=0)
    manifest = json.loads((path / MANIFEST).read_text())
    assert manifest["format"] == 1 and manifest["step"] == 1
    assert manifest["world_size"] == 1
    assert sorted(manifest["files"]) == [".metadata", "__0_0.distcp", META]
    for name, entry in manifest["files"].items():
        assert entry["size"] == (path / name).stat().st_size


@pytest.fixture()
def saved(tmp_path: Path) -> Path:
    model, opt = objects(0)
    train(model, opt, 2)
    return save_sharded(tmp_path, 2, model=model, optimizer=opt, meta={"step": 2}, keep=0)


def truncate(path: Path) -> None:
    shard = path / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-100])


def flip(path: Path) -> None:
    shard = path / "__0_0.distcp"
    raw = bytearray(shard.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    shard.write_bytes(bytes(raw))


@pytest.mark.parametrize("damage, says", [
    (truncate, r"__0_0\.distcp has \d+ bytes, hpc-manifest\.json records \d+"),
    (flip, r"__0_0\.distcp has SHA-256 \w+\.\.\., hpc-manifest\.json records \w+\.\.\."),
    (lambda p: (p / MANIFEST).unlink(), r"hpc-manifest\.json is missing"),
    (lambda p: (p / ".metadata").unlink(), r"\.metadata is missing \(\d+ bytes in "),
    (lambda p: (p / META).unlink(), r"hpc-meta\.pt is missing"),
    (lambda p: (p / MANIFEST).write_text("{"), r"hpc-manifest\.json does not parse"),
])
def test_verify_names_the_missing_short_or_corrupt_file(saved: Path, damage, says: str
                                                        ) -> None:
    damage(saved)
    with pytest.raises(CheckpointError) as e:
        verify_sharded(saved)
    text = str(e.value)
    assert re.search(says, text), text
    assert text.startswith(f"sharded checkpoint {saved} is incomplete or corrupt: ")
    assert "HINT: delete it to resume from the previous checkpoint." in text
    model, opt = objects(1)
    before = [t.clone() for t in model.state_dict().values()]
    with pytest.raises(CheckpointError, match=says):  # refused before anything is read
        load_sharded(saved, model=model, optimizer=opt)
    assert all(torch.equal(x, y) for x, y in zip(before, model.state_dict().values()))


def test_verify_refuses_a_directory_that_is_not_there(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="does not exist or is not a directory"):
        verify_sharded(tmp_path / "ckpt-00000001.dcp")


def test_a_meta_value_weights_only_refuses_is_named_and_nothing_stays(tmp_path: Path
                                                                     ) -> None:
    model, opt = objects(0)
    save_sharded(tmp_path, 1, model=model, optimizer=opt, meta={}, keep=1)
    with pytest.raises(CheckpointError, match=r"\['best'\] is a numpy\.float64"):
        save_sharded(tmp_path, 2, model=model, optimizer=opt,
                     meta={"best": np.float64(0.5)}, keep=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-00000001.dcp"]


def test_a_temp_dir_of_a_dead_process_goes_at_the_next_save(tmp_path: Path) -> None:
    host, model = socket.gethostname(), nn.Linear(3, 2)
    dead = tmp_path / f".ckpt-00000005.dcp.tmp-{host}-{2**22 + 7}"  # no such pid
    alive = tmp_path / f".ckpt-00000005.dcp.tmp-{host}-1"  # init: alive, another's
    elsewhere = tmp_path / ".ckpt-00000005.dcp.tmp-node9-123"  # can't be asked: fresh
    old = tmp_path / ".ckpt-00000004.dcp.del-node9-123"  # ...or untouched for long
    other = tmp_path / ".ckpt-00000005.dcp.tmp-notes"  # not a save's name
    for d in (dead, alive, elsewhere, old, other):
        d.mkdir()
        (d / "__0_0.distcp").write_bytes(b"x" * 10)
    past = time.time() - 3600
    os.utime(old / "__0_0.distcp", (past, past))
    os.utime(old, (past, past))
    save_sharded(tmp_path, 6, model=model, meta={}, keep=0)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [alive.name, elsewhere.name, other.name, "ckpt-00000006.dcp"])
    assert remove_stale_dirs(tmp_path) == []


def test_keep_prunes_to_the_newest_and_zero_keeps_all(tmp_path: Path) -> None:
    model, opt = objects(0)
    for step in (1, 2, 3, 4):
        train(model, opt, 1)
        save_sharded(tmp_path / "two", step, model=model, optimizer=opt, meta={}, keep=2)
        save_sharded(tmp_path / "all", step, model=model, optimizer=opt, meta={}, keep=0)
    assert [p.name for p in list_sharded(tmp_path / "two")] == [
        "ckpt-00000003.dcp", "ckpt-00000004.dcp"]
    assert sorted(p.name for p in (tmp_path / "two").iterdir()) == [
        "ckpt-00000003.dcp", "ckpt-00000004.dcp"]  # nothing hidden left either
    assert len(list_sharded(tmp_path / "all")) == 4
    with pytest.raises(ValueError, match="keep=-1 is negative"):
        save_sharded(tmp_path, 5, model=model, meta={}, keep=-1)


def test_the_same_step_saved_again_replaces_it(tmp_path: Path) -> None:
    a = objects(0)
    save_sharded(tmp_path, 3, model=a[0], optimizer=a[1], meta={"n": 1}, keep=2)
    train(*a, 1)
    path = save_sharded(tmp_path, 3, model=a[0], optimizer=a[1], meta={"n": 2}, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-00000003.dcp"]
    b = objects(1)
    assert load_sharded(path, model=b[0], optimizer=b[1]) == {"n": 2}
    assert_same(a, b)


def test_a_save_before_the_first_step_leaves_the_optimizer_fresh(tmp_path: Path) -> None:
    """DCP's get_state_dict initializes an empty optimizer by a step at lr=0, which
    Adam's bias correction would count: the save undoes it, the load restores a fresh
    optimizer with the saved param_groups."""
    a = objects(0)
    a[1].param_groups[0]["lr"] = 0.5
    path = save_sharded(tmp_path, 0, model=a[0], optimizer=a[1], meta={}, keep=1)
    assert not a[1].state
    b = objects(1)
    train(*b, 1)  # b has state; loading the fresh checkpoint empties it
    load_sharded(path, model=b[0], optimizer=b[1])
    assert not b[1].state and b[1].param_groups[0]["lr"] == 0.5
    train(*a, 2)
    train(*b, 2)
    assert_same(a, b)


def test_a_model_without_optimizer_and_the_mismatches(tmp_path: Path) -> None:
    a = objects(0)
    path = save_sharded(tmp_path, 1, model=a[0], meta={}, keep=1)
    b = objects(1)
    load_sharded(path, model=b[0])
    assert all(torch.equal(x, y) for x, y in zip(a[0].state_dict().values(),
                                                b[0].state_dict().values()))
    with pytest.raises(CheckpointError, match=r"holds no optimizer state\.\nHINT: pass "
                                              r"optimizer= to save_sharded too"):
        load_sharded(path, model=b[0], optimizer=b[1])
    other = nn.Sequential(nn.Linear(8, 8))
    with pytest.raises(CheckpointError) as e:
        load_sharded(path, model=other)
    text = str(e.value)
    assert "does not fit the given model: missing ['0.bias', '0.weight']" in text
    assert "unexpected ['emb.weight', 'norm.bias'," in text and "HINT: build the" in text


@pytest.mark.parametrize("wrap", ["ddp", "compile(ddp)", "ddp(compile)"])
def test_ddp_and_compile_wrappers_save_the_plain_modules_keys(
        tmp_path: Path, one_rank: None, wrap: str) -> None:
    a = objects(0)
    train(*a, 2)
    ddp = nn.parallel.DistributedDataParallel
    wrapped = {"ddp": lambda m: ddp(m), "compile(ddp)": lambda m: torch.compile(ddp(m)),
               "ddp(compile)": lambda m: ddp(torch.compile(m))}[wrap](a[0])
    path = save_sharded(tmp_path, 2, model=wrapped, optimizer=a[1], meta={}, keep=1)
    from torch.distributed.checkpoint import FileSystemReader

    keys = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    assert sorted(k for k in keys if k.startswith("model.")) == [
        "model.emb.weight", "model.norm.bias", "model.norm.num_batches_tracked",
        "model.norm.running_mean", "model.norm.running_var", "model.norm.weight",
        "model.out.weight"]
    b = objects(1)
    load_sharded(path, model=b[0], optimizer=b[1])  # a plain model loads it
    assert_same(a, b)


def test_a_failed_shard_write_raises_and_keeps_the_older_checkpoint(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed.checkpoint as dcp

    model, opt = objects(0)
    train(model, opt, 1)
    save_sharded(tmp_path, 1, model=model, optimizer=opt, meta={}, keep=1)

    def full(*args: object, **kwargs: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(dcp, "save", full)
    with pytest.raises(CheckpointError) as e:
        save_sharded(tmp_path, 2, model=model, optimizer=opt, meta={}, keep=1)
    text = str(e.value)
    assert text.startswith(f"rank 0 could not write its shard of sharded checkpoint "
                           f"{tmp_path / 'ckpt-00000002.dcp'}: OSError: [Errno 28] No "
                           "space left on device.\n"), text
    assert "HINT: check free space and permissions" in text
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-00000001.dcp"]
    verify_sharded(tmp_path / "ckpt-00000001.dcp")


def test_rank_0_must_see_every_file_a_rank_wrote(tmp_path: Path) -> None:
    """A rank whose shard rank 0 cannot see wrote to another directory (its node's)."""
    from hpc.checkpoint.shardfiles import put_in_place

    tmp = tmp_path / ".ckpt-00000001.dcp.tmp-x-1"
    tmp.mkdir()
    for name in (".metadata", META, "__0_0.distcp"):
        (tmp / name).write_bytes(b"x")
    shards = [{"__0_0.distcp": (1, "0" * 64)}, {"__1_0.distcp": (5, "0" * 64)}]
    with pytest.raises(CheckpointError) as e:
        put_in_place(tmp, tmp_path / "ckpt-00000001.dcp", 1, shards, {"__0_0.distcp"})
    assert str(e.value).startswith("rank 0 does not see __1_0.distcp of rank 1 in ")
    assert "HINT: put the checkpoint directory on a filesystem every node mounts." in \
        str(e.value)
    assert not (tmp_path / "ckpt-00000001.dcp").exists()
