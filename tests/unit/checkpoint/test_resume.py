"""hpc.save_checkpoint / hpc.restore_checkpoint / hpc.ResumableSampler / hpc.AgreedStop in
one process (no process group; the 2-rank behaviour is tested with real processes in
tests/integration/test_docs_examples.py and test_preemption.py)."""

from __future__ import annotations

import argparse
import logging
import random
import re
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
np = pytest.importorskip("numpy")

from torch import nn  # noqa: E402
from torch.utils.data import DistributedSampler, TensorDataset  # noqa: E402

import hpc  # noqa: E402
from hpc.checkpoint.files import list_checkpoints, load_checkpoint, save_atomic  # noqa: E402
from hpc.errors import CheckpointError  # noqa: E402
from hpc.preempt.guard import PreemptGuard  # noqa: E402


def objects(seed: int = 0) -> dict:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, 3, gamma=0.5)
    return dict(model=model, optimizer=opt, scheduler=sched)


def train(states: dict, steps: int) -> None:
    model, opt, sched = states["model"], states["optimizer"], states["scheduler"]
    for _ in range(steps):
        loss = model(torch.randn(5, 4)).square().mean()  # dropout + data: both RNG
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()


def test_round_trip_is_bitwise_exact_and_keeps_the_newest_n(tmp_path: Path) -> None:
    a = objects()
    train(a, 4)
    for step in (4, 5, 6, 7):
        hpc.save_checkpoint(tmp_path, step, **a, epoch=1, batch=step, keep=2,
                            extra={"best": 0.5})
    assert [p.name for p in list_checkpoints(tmp_path)] == ["ckpt-00000006.pt",
                                                            "ckpt-00000007.pt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "ckpt-00000006.pt", "ckpt-00000006.pt.sha256", "ckpt-00000007.pt",
        "ckpt-00000007.pt.sha256"]  # no temp files, sidecars pruned too
    random.random(), np.random.rand()
    train(a, 3)  # the uninterrupted continuation, from the RNG state at save time...
    b = objects(seed=1)  # ...and a fresh process state restored from the file
    torch.manual_seed(99)
    restored = hpc.restore_checkpoint(tmp_path, **b)
    assert restored is not None and restored.step == 7 and restored.payload["best"] == 0.5
    assert (restored.epoch, restored.batch, restored.world_size) == (1, 7, 1)
    assert b["scheduler"].last_epoch == 4 and b["optimizer"].param_groups[0]["lr"] == 0.05
    train(b, 3)
    for x, y in zip(a["model"].state_dict().values(), b["model"].state_dict().values()):
        assert torch.equal(x, y)


def test_no_checkpoint_is_a_fresh_start(tmp_path: Path) -> None:
    assert hpc.restore_checkpoint(tmp_path / "none", **objects()) is None


def test_corrupt_or_truncated_newest_falls_back_to_the_previous(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    a = objects()
    for step in (1, 2, 3):
        hpc.save_checkpoint(tmp_path, step, **a, keep=3)
    newest, middle = tmp_path / "ckpt-00000003.pt", tmp_path / "ckpt-00000002.pt"
    newest.write_bytes(newest.read_bytes()[:100])  # truncated
    data = bytearray(middle.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte: the checksum catches it
    middle.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING):
        restored = hpc.restore_checkpoint(tmp_path, **objects(seed=1))
    assert restored is not None and restored.step == 1
    assert "skipping checkpoint ckpt-00000003.pt" in caplog.text
    assert "skipping checkpoint ckpt-00000002.pt" in caplog.text and "SHA-256" in caplog.text
    assert [p.name for p in list_checkpoints(tmp_path)] == ["ckpt-00000001.pt"]  # set aside
    (tmp_path / "ckpt-00000001.pt").write_bytes(b"junk")
    with pytest.raises(CheckpointError, match="none of the 1 checkpoints"):
        hpc.restore_checkpoint(tmp_path, **objects())


def test_keep_after_a_fallback_drops_the_skipped_file_not_the_good_one(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A corrupt ckpt-200 was skipped and the run resumed from ckpt-100: the next saves
    must not count ckpt-200 as one of the newest `keep` (it would push out ckpt-100,
    the one file that loads, and stay for ever)."""
    a = objects()
    for step in (100, 200):
        hpc.save_checkpoint(tmp_path, step, **a, keep=2)
    bad = tmp_path / "ckpt-00000200.pt"
    bad.write_bytes(bad.read_bytes()[:100])
    truncated = bad.read_bytes()
    with caplog.at_level(logging.WARNING):
        restored = hpc.restore_checkpoint(tmp_path, **objects(seed=1))
    assert restored is not None and restored.step == 100
    hpc.save_checkpoint(tmp_path, 110, **a, keep=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["ckpt-00000100.pt",
                                                            "ckpt-00000110.pt"]
    # set aside, not deleted: kept for a look under a name no listing matches
    assert (tmp_path / "ckpt-00000200.pt.unloadable").read_bytes() == truncated
    assert (tmp_path / "ckpt-00000200.pt.sha256.unloadable").is_file()
    assert "set aside as ckpt-00000200.pt.unloadable" in caplog.text
    restored = hpc.restore_checkpoint(tmp_path, **objects(seed=1))
    assert restored is not None and restored.step == 110


def test_nothing_is_set_aside_when_no_checkpoint_loads(tmp_path: Path) -> None:
    """Then the resume fails and the files stay: renaming them all would turn the next
    attempt into a silent fresh start over the run's history."""
    a = objects()
    for step in (1, 2):
        hpc.save_checkpoint(tmp_path, step, **a)
    for path in list_checkpoints(tmp_path):
        path.write_bytes(b"junk")
    with pytest.raises(CheckpointError, match="none of the 2 checkpoints"):
        hpc.restore_checkpoint(tmp_path, **objects())
    assert len(list_checkpoints(tmp_path)) == 2
    assert not list(tmp_path.glob("*.unloadable"))


def _good_and_corrupt(directory: Path, payload: dict) -> None:
    for step in (100, 200):
        save_atomic({**payload, "step": step}, directory / f"ckpt-{step:08d}.pt")
    bad = directory / "ckpt-00000200.pt"
    bad.write_bytes(bad.read_bytes()[:100])


def test_hpc_pretrain_and_tune_set_a_skipped_checkpoint_aside(tmp_path: Path) -> None:
    from hpc.pretrain.config import PretrainConfig
    from hpc.pretrain.resume import _choose

    _good_and_corrupt(tmp_path / "checkpoints", {"model": {}})
    path, error, payload = _choose(PretrainConfig(out=str(tmp_path)), tmp_path)
    assert error is None and payload is not None and payload["step"] == 100
    assert [p.name for p in list_checkpoints(tmp_path / "checkpoints")] == [
        "ckpt-00000100.pt"]


def test_a_reader_of_another_run_leaves_its_files_alone(tmp_path: Path) -> None:
    """hpc search reads a pretrain run's newest loadable checkpoint, it does not own
    that directory: nothing there is renamed."""
    from hpc.checkpoint.files import load_latest

    _good_and_corrupt(tmp_path, {"model": {}})
    path, payload = load_latest(tmp_path)
    assert payload["step"] == 100
    assert len(list_checkpoints(tmp_path)) == 2


def test_hpc_search_sets_a_skipped_checkpoint_aside(tmp_path: Path) -> None:
    from hpc.search.config import SearchConfig
    from hpc.search.search import _exactness, _resume_payload

    cfg = SearchConfig(run=str(tmp_path / "run"), out=str(tmp_path / "search"))
    _good_and_corrupt(cfg.out_dir / "checkpoints", {"settings": _exactness(cfg)})
    payload = _resume_payload(cfg)
    assert payload is not None and payload["step"] == 100
    assert [p.name for p in list_checkpoints(cfg.out_dir / "checkpoints")] == [
        "ckpt-00000100.pt"]


def _written_by(tmp_path: Path, world: int, batch: int = 0) -> dict:
    a = objects()
    path = hpc.save_checkpoint(tmp_path, 5, **a, epoch=2, batch=batch)
    payload = load_checkpoint(path)
    payload.update(world_size=world, rng=payload["rng"] * world)
    save_atomic(payload, path)  # as if `world` ranks had written it
    return a


def test_a_different_world_size_is_refused_unless_allowed(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    a = _written_by(tmp_path, 4, batch=6)
    b = objects(seed=1)
    with pytest.raises(CheckpointError) as err:
        hpc.restore_checkpoint(tmp_path, **b)
    text = str(err.value)
    assert "written by 4 ranks but this run has 1" in text
    assert "HINT: relaunch with 4 ranks, or pass allow_world_change=True" in text
    assert not torch.equal(b["model"][0].weight, a["model"][0].weight)  # nothing loaded
    with caplog.at_level(logging.WARNING):
        restored = hpc.restore_checkpoint(tmp_path, **b, allow_world_change=True)
    assert restored is not None and restored.batch == 24  # same sample count: 6 x 4 / 1
    assert torch.equal(b["model"][0].weight, a["model"][0].weight)
    assert "world size changed 4 -> 1" in caplog.text and "NOT exactly" in caplog.text


def data(n: int = 64) -> TensorDataset:
    return TensorDataset(torch.arange(n))


def test_resumable_sampler_skips_the_done_batches_once() -> None:
    plain = DistributedSampler(data(), num_replicas=2, rank=1, seed=3)
    ours = hpc.ResumableSampler(data(), batch_size=4, num_replicas=2, rank=1, seed=3)
    for epoch in (0, 1):
        plain.set_epoch(epoch)
        ours.set_epoch(epoch)
        assert list(ours) == list(plain)  # the same order and shard as DistributedSampler
    ours.resume_at(1, 3)
    ours.set_epoch(1)  # the loop's own set_epoch keeps the resumed epoch's skip
    assert ours.start_batch == 3 and len(ours) == 32 - 12
    assert list(ours) == list(plain)[12:]
    assert ours.start_batch == 0 and list(ours) == list(plain)  # once only
    ours.resume_at(1, 3)
    ours.set_epoch(2)  # another epoch: whole
    plain.set_epoch(2)
    assert list(ours) == list(plain)


def test_restore_positions_the_sampler(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    a = objects()
    sampler = hpc.ResumableSampler(data(), batch_size=4, num_replicas=1, rank=0)
    hpc.save_checkpoint(tmp_path, 9, **a, sampler=sampler, epoch=1, batch=5)
    other = hpc.ResumableSampler(data(), batch_size=4, num_replicas=1, rank=0)
    with caplog.at_level(logging.INFO, logger="hpc.checkpoint.resume"):
        restored = hpc.restore_checkpoint(tmp_path, **objects(), sampler=other)
    assert restored is not None and (other.epoch, other.start_batch) == (1, 5)
    # where the run goes on, in the words of the sampler's errors (epoch/batch as saved)
    assert f"resumed from {tmp_path}/ckpt-00000009.pt: step 9 done; next: batch 5 of " \
        "epoch 1 (both counted from 0)" in caplog.text
    wrong = hpc.ResumableSampler(data(), batch_size=8, num_replicas=1, rank=0)
    with pytest.raises(CheckpointError, match="batch_size=4 but the sampler has batch_size=8"):
        hpc.restore_checkpoint(tmp_path, **objects(), sampler=wrong)
    plain = DistributedSampler(data(), num_replicas=1, rank=0)
    with pytest.raises(CheckpointError, match="(?s)after batch 5 of epoch 1.*HINT: use "
                       "hpc.ResumableSampler"):
        hpc.restore_checkpoint(tmp_path, **objects(), sampler=plain)


def test_save_refuses_reserved_extra_keys(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="reserved"):
        hpc.save_checkpoint(tmp_path, 1, **objects(), extra={"model": 1})
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("value, kind, hint", [
    (np.mean([0.9, 0.95]), "numpy.float64", "float(x)"),
    (Path("/data/run"), "pathlib.PosixPath", "str(path)"),
    (argparse.Namespace(lr=0.1), "argparse.Namespace", "vars(ns)"),
], ids=["numpy-scalar", "path", "namespace"])
def test_save_refuses_extra_that_no_resume_could_load(tmp_path: Path, value: object,
                                                      kind: str, hint: str) -> None:
    """Such a file saves fine but weights_only=True refuses it at every resume; with
    keep=1 the prune then removes the last checkpoint that did load."""
    a = objects()
    hpc.save_checkpoint(tmp_path, 1, **a, keep=1)
    with pytest.raises(CheckpointError) as err:
        hpc.save_checkpoint(tmp_path, 2, **a, keep=1, extra={"best_acc": value})
    text = str(err.value)
    assert re.search(rf"\['best_acc'\] is an? {kind}", text) and "weights_only" in text
    assert "HINT:" in text and hint in text.split("HINT:")[1]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "ckpt-00000001.pt", "ckpt-00000001.pt.sha256"]  # not written, nothing pruned
    restored = hpc.restore_checkpoint(tmp_path, **objects())
    assert restored is not None and restored.step == 1


def test_save_names_the_refused_value_inside_the_optimizer_state(tmp_path: Path) -> None:
    """An lr taken from numpy (np.linspace, a config read with np.float64) ends up in
    the optimizer's param_groups: the package's own state is checked too."""
    a = objects()
    a["optimizer"] = torch.optim.SGD(a["model"].parameters(), lr=np.float64(0.1))
    a["scheduler"] = torch.optim.lr_scheduler.StepLR(a["optimizer"], 3)
    where = r"\['optimizer'\]\['param_groups'\]\[0\]\['lr'\]"
    with pytest.raises(CheckpointError, match=where + " is a numpy.float64"):
        hpc.save_checkpoint(tmp_path, 1, **a)
    assert not list(tmp_path.iterdir())


def test_a_failed_write_is_a_clear_error(tmp_path: Path) -> None:
    """Found by the storage pre-flight of the first save, before anything is written."""
    (tmp_path / "file").write_text("")
    with pytest.raises(CheckpointError, match="(?s)the global master .* cannot create or "
                                              "write a file there.*HINT"):
        hpc.save_checkpoint(tmp_path / "file" / "sub", 1, **objects())


def test_agreed_stop_checks_only_on_due_steps_and_exits_0_outside_slurm() -> None:
    guard = PreemptGuard("USR2")  # not installed: request() by hand
    stop = hpc.AgreedStop(guard, every=3)
    assert not stop(1) and not stop(3) and stop.exit_code(3) == 0  # nothing requested
    guard.request()
    assert stop.requested and not stop(4) and not stop(5)  # not due: no agreement yet
    assert stop(6) and stop.stopped and stop.step == 6 and stop(7)
    assert stop.exit_code(6, "ckpt") == 0  # "not-slurm": rerun to resume
    with pytest.raises(SystemExit) as exit_:
        stop.requeue_and_exit(6, "ckpt")
    assert exit_.value.code == 0
    with pytest.raises(ValueError, match="every=0"):
        hpc.AgreedStop(guard, every=0)


def test_agreed_stop_in_a_slurm_job_without_requeue_budget_exits_1(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    monkeypatch.setenv("HPC_MAX_REQUEUES", "0")
    guard = PreemptGuard("TERM")
    guard.request()
    stop = hpc.AgreedStop(guard)
    assert stop(1) and stop.exit_code(1) == 1
    monkeypatch.delenv("SLURM_JOB_ID")


def test_a_mid_epoch_save_with_a_plain_sampler_warns_once_at_save_time(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """restore_checkpoint refuses such a file; say so when it is written, not at resume."""
    from hpc.checkpoint import resume

    getattr(resume, "_WARNED", set()).clear()  # once per process: forget earlier tests
    plain = DistributedSampler(data(), num_replicas=1, rank=0)
    a = objects()
    with caplog.at_level(logging.WARNING):
        hpc.save_checkpoint(tmp_path, 2, **a, sampler=plain, epoch=1, batch=0)
        assert "ResumableSampler" not in caplog.text  # an epoch end resumes fine
        hpc.save_checkpoint(tmp_path, 3, **a, sampler=plain, epoch=1, batch=1)
        hpc.save_checkpoint(tmp_path, 4, **a, sampler=plain, epoch=1, batch=2)
    warned = [r for r in caplog.records if "ResumableSampler" in r.getMessage()]
    assert len(warned) == 1, caplog.text
    text = warned[0].getMessage()
    assert "after batch 1 of epoch 1" in text and "DistributedSampler" in text
    assert "restore_checkpoint will refuse" in text and "HINT: use hpc.ResumableSampler" in text
    caplog.clear()
    ours = hpc.ResumableSampler(data(), batch_size=4, num_replicas=1, rank=0)
    with caplog.at_level(logging.WARNING):
        hpc.save_checkpoint(tmp_path, 5, **a, sampler=ours, epoch=1, batch=3)
    assert "ResumableSampler" not in caplog.text


def test_a_compiled_model_saves_plain_keys_and_loads_either_way(tmp_path: Path) -> None:
    """torch.compile wraps the model in an OptimizedModule whose keys carry `_orig_mod.`:
    a checkpoint of the compiled model must load into the plain one, and back."""
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))
    compiled = torch.compile(plain)   # no call: nothing is compiled, only wrapped
    assert any(k.startswith("_orig_mod.") for k in compiled.state_dict())
    hpc.save_checkpoint(tmp_path / "a", 1, model=compiled)
    payload = load_checkpoint(list_checkpoints(tmp_path / "a")[-1])
    assert not any(k.startswith("_orig_mod.") for k in payload["model"]), list(payload["model"])
    fresh = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))
    hpc.restore_checkpoint(tmp_path / "a", model=fresh)
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(),
                                                 plain.state_dict().values()))
    again = torch.compile(nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3)))
    hpc.restore_checkpoint(tmp_path / "a", model=again)   # into a compiled one
    assert torch.equal(again._orig_mod[0].weight, plain[0].weight)


def test_restore_takes_the_newest_complete_checkpoint_of_either_format(
        tmp_path: Path) -> None:
    """One file at step 4, sharded at 6 and 8; 8 loses a shard byte: the restore skips it
    (set aside) and resumes bitwise from 6, scheduler, RNG and all; a single file at 10
    is newer than every sharded one and wins."""
    a = objects()
    train(a, 4)
    hpc.save_checkpoint(tmp_path, 4, **a)
    train(a, 2)
    hpc.save_checkpoint(tmp_path, 6, **a, sharded=True)
    random.random(), np.random.rand()
    train(a, 3)  # the uninterrupted continuation from step 6
    hpc.save_checkpoint(tmp_path, 8, **a, sharded=True)
    shard = next((tmp_path / "ckpt-00000008.dcp").glob("__0_*.distcp"))
    raw = bytearray(shard.read_bytes())
    raw[len(raw) // 2] ^= 0x10
    shard.write_bytes(bytes(raw))
    b = objects(seed=1)
    restored = hpc.restore_checkpoint(tmp_path, **b)
    assert restored is not None and restored.path == str(tmp_path / "ckpt-00000006.dcp")
    assert (restored.step, restored.payload["step"]) == (6, 6)
    assert (tmp_path / "ckpt-00000008.dcp.unloadable").is_dir()
    train(b, 3)
    for x, y in zip(a["model"].state_dict().values(), b["model"].state_dict().values()):
        assert torch.equal(x, y)
    assert b["scheduler"].last_epoch == a["scheduler"].last_epoch
    hpc.save_checkpoint(tmp_path, 10, **a)
    assert hpc.restore_checkpoint(tmp_path, **objects(seed=2)).path.endswith("ckpt-00000010.pt")


def test_sharded_saves_are_synchronous() -> None:
    with pytest.raises(ValueError, match="sharded=True is synchronous only"):
        hpc.save_checkpoint("unused", 1, **objects(), sharded=True, blocking=False)
