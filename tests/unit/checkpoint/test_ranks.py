"""What each rank keeps of its own (hpc.checkpoint.ranks): buffers that differ across
ranks and ``rank_extra`` saved per rank, given back per rank; the master's at another
world size. The pure parts in this process, the collective save and restore on a real
gloo group of 3 (and then 2) processes."""

from __future__ import annotations

import json
import logging
import multiprocessing
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

import hpc  # noqa: E402
from hpc.checkpoint.files import list_checkpoints, load_checkpoint  # noqa: E402
from hpc.checkpoint.ranks import (  # noqa: E402
    buffers_digest,
    buffers_of,
    model_state_for,
    rank_extra_for,
)

pytestmark = pytest.mark.timeout(90)


def bn_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.ReLU(), nn.Linear(4, 2))
    model[1].register_buffer("scratch", torch.zeros(2), persistent=False)
    return model


def test_buffers_are_the_state_dict_tensors_that_are_not_parameters() -> None:
    model = bn_model()
    assert sorted(buffers_of(model)) == ["1.num_batches_tracked", "1.running_mean",
                                         "1.running_var"]  # not the non-persistent one
    assert buffers_of(nn.Linear(2, 2)) == {}


def test_the_digest_tells_equal_buffers_from_different_ones() -> None:
    a, b = buffers_of(bn_model()), buffers_of(bn_model(seed=1))
    assert buffers_digest(a) == buffers_digest(b)  # fresh statistics: equal
    b["1.running_mean"][2] += 1e-7
    assert buffers_digest(a) != buffers_digest(b)
    c = {**a, "1.running_var": a["1.running_var"].double()}  # same values, other dtype
    assert buffers_digest(a) != buffers_digest(c)
    assert buffers_digest({}) == buffers_digest({})


def _payload(world: int) -> dict:
    model = bn_model()
    state = model.state_dict()
    own = [{k: torch.full_like(v, r) for k, v in buffers_of(model).items()}
           for r in range(world)]
    return {"model": state, "rank_buffers": own,
            "rank_extra": [{"losses": [float(r)]} for r in range(world)]}


def test_each_rank_loads_the_masters_weights_with_its_own_buffers() -> None:
    payload = _payload(3)
    state = model_state_for(payload, 2, same_world=True)
    assert torch.equal(state["0.weight"], payload["model"]["0.weight"])
    assert torch.equal(state["1.running_mean"], torch.full((4,), 2.0))
    assert int(state["1.num_batches_tracked"]) == 2
    assert rank_extra_for(payload, 2, same_world=True) == {"losses": [2.0]}
    no_buffers = {"model": payload["model"]}  # they agreed: the master's serve all
    assert model_state_for(no_buffers, 1, same_world=True) is payload["model"]
    assert rank_extra_for(no_buffers, 1, same_world=True) == {}


def test_at_another_world_size_every_rank_gets_the_masters_with_one_warning(
        caplog: pytest.LogCaptureFixture) -> None:
    payload = _payload(4)
    with caplog.at_level(logging.WARNING, "hpc.checkpoint.ranks"):
        state = model_state_for(payload, 0, same_world=False, path="ckpt-00000008.pt")
    assert state is payload["model"]
    assert [r.getMessage() for r in caplog.records] == [
        "checkpoint ckpt-00000008.pt holds 3 buffers per rank (e.g. BatchNorm running "
        "statistics) that differed across its 4 ranks; at world size 1 they do not map "
        "onto the ranks, so every rank starts from rank 0's."]
    assert rank_extra_for(payload, 0, same_world=False) == {}


# -- a real gloo group: each rank a process, results as JSON files -----------------------

def _rank_main(rank: int, world: int, tmp: str, phase: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store-{phase}",
                            rank=rank, world_size=world)
    try:
        ckpt = Path(tmp) / "ckpt"
        out: dict = {}
        if phase == "save":
            model = bn_model()
            hpc.save_checkpoint(ckpt, 1, model=model)  # fresh statistics: equal
            # ranks 0 and 1 see the same batch, rank 2 another
            model(torch.randn(8, 3, generator=torch.Generator().manual_seed(rank // 2)))
            hpc.save_checkpoint(ckpt, 2, model=model, rank_extra={"rank": rank})
            out["buffers"] = {k: v.tolist() for k, v in buffers_of(model).items()}
            fresh = bn_model(seed=5)
            restored = hpc.restore_checkpoint(ckpt, model=fresh)
            assert restored is not None
            out["restored"] = {k: v.tolist() for k, v in buffers_of(fresh).items()}
            out["weight_equal"] = torch.equal(fresh[0].weight, model[0].weight)
            out["rank_extra"] = restored.rank_extra
        else:  # another world size: every rank starts from rank 0's buffers
            fresh = bn_model(seed=5)
            restored = hpc.restore_checkpoint(ckpt, model=fresh, allow_world_change=True)
            assert restored is not None
            out["restored"] = {k: v.tolist() for k, v in buffers_of(fresh).items()}
            out["rank_extra"] = restored.rank_extra
        (Path(tmp) / f"{phase}-{rank}.json").write_text(json.dumps(out))
    finally:
        dist.destroy_process_group()


def _run_group(world: int, tmp: Path, phase: str) -> list[dict]:
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_rank_main, args=(r, world, str(tmp), phase))
             for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=60)
    for p in procs:
        if p.is_alive():
            p.kill()
    assert [p.exitcode for p in procs] == [0] * world, [p.exitcode for p in procs]
    return [json.loads((tmp / f"{phase}-{r}.json").read_text()) for r in range(world)]


def test_a_real_group_saves_differing_buffers_per_rank_and_gives_each_its_own(
        tmp_path: Path) -> None:
    saved = _run_group(3, tmp_path, "save")
    first, second = (load_checkpoint(p) for p in list_checkpoints(tmp_path / "ckpt"))
    # step 1: equal on every rank, saved once (in "model"); no rank_extra passed
    assert "rank_buffers" not in first and "rank_extra" not in first
    # step 2: ranks 0 and 1 agree but rank 2 differs, so all three are kept
    means = [b["1.running_mean"] for b in second["rank_buffers"]]
    assert len(means) == 3 and torch.equal(means[0], means[1])
    assert not torch.equal(means[0], means[2])
    assert second["rank_extra"] == [{"rank": 0}, {"rank": 1}, {"rank": 2}]
    for rank, out in enumerate(saved):
        assert out["restored"] == out["buffers"], f"rank {rank} did not get its own back"
        assert out["weight_equal"] and out["rank_extra"] == {"rank": rank}
    assert saved[2]["buffers"] != saved[0]["buffers"]
    resized = _run_group(2, tmp_path, "resize")
    assert [out["restored"] for out in resized] == [saved[0]["buffers"]] * 2
    assert [out["rank_extra"] for out in resized] == [{}, {}]


def test_buffers_equal_on_every_rank_are_saved_once(tmp_path: Path) -> None:
    """One process (no group): the master's buffers are every rank's, no per-rank copy."""
    model = bn_model()
    model(torch.randn(8, 3))
    hpc.save_checkpoint(tmp_path, 1, model=model, rank_extra={"losses": [0.5]})
    payload = load_checkpoint(list_checkpoints(tmp_path)[0])
    assert "rank_buffers" not in payload and payload["rank_extra"] == [{"losses": [0.5]}]
    restored = hpc.restore_checkpoint(tmp_path, model=bn_model(seed=3))
    assert restored is not None and restored.rank_extra == {"losses": [0.5]}
