"""The replicated-state digest (:mod:`hpc.health.divergence`) and fault injection's bit flip."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from hpc.errors import InjectedFault  # noqa: E402
from hpc.health import divergence  # noqa: E402
from hpc.health.fault import Fault, Injector, flip_bit  # noqa: E402


def _model_and_adam() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(5, 4)).sum().backward()
    opt.step()
    return model, opt


def test_named_state_holds_parameters_and_optimizer_state_not_buffers() -> None:
    model, opt = _model_and_adam()
    names = [n for n, _ in divergence.named_state(model, opt)]
    assert names[:4] == ["0.weight", "0.bias", "1.weight", "1.bias"]
    assert "optimizer[0.weight].exp_avg" in names and "optimizer[1.bias].step" in names
    assert not any("running" in n for n in names)


def test_one_flipped_bit_changes_that_tensors_digest_only() -> None:
    model, opt = _model_and_adam()
    named = divergence.named_state(model, opt)
    before = divergence.tensor_digests(named)
    assert flip_bit(model.named_parameters()) == "0.weight[0] bit 12"
    after = divergence.tensor_digests(named)
    assert [i for i, (a, b) in enumerate(zip(before, after)) if a != b] == [0]
    assert divergence.combined(before) != divergence.combined(after)
    flip_bit(model.named_parameters())  # flipped back: the same bytes, the same digest
    assert divergence.tensor_digests(named) == before


def test_bf16_and_empty_tensors_digest() -> None:
    named = [("a", torch.ones(3, dtype=torch.bfloat16)), ("b", torch.empty(0)),
             ("c", torch.tensor(1.5))]
    assert len(set(divergence.tensor_digests(named))) == 3
    assert flip_bit(named) == "a[0] bit 4"  # bf16: the bit within its low byte


def test_majority_names_the_odd_one_out() -> None:
    assert divergence.majority([7, 7, 9, 7]) == (7, [2])
    assert divergence.majority([7, 9]) == (7, [1])  # a tie: the lowest index's side


def test_mismatch_message_names_rank_host_step_and_tensor() -> None:
    m = divergence.Mismatch(120, (3,), ("node2",), ("0.weight", "optimizer[0.weight].exp_avg"),
                            False)
    first, cause, hint = m.message().splitlines()
    assert "after step 120" in first and "rank 3 on node2" in first
    assert "0.weight, optimizer[0.weight].exp_avg" in first
    assert hint.startswith("HINT:") and "HPC_SDC=warn" in hint


def test_injector_applies_only_its_ranks_faults_once() -> None:
    inj = Injector([Fault(1, 5, "exc"), Fault(0, 5, "exc")], rank=1)
    inj.at_step(4, 0.01)
    with pytest.raises(InjectedFault, match="HPC_FAULT 1:5:exc"):
        inj.at_step(5, 0.01)
    inj.at_step(5, 0.01)  # not again
    assert not Injector([Fault(0, 5, "exc")], rank=1)


def test_slow_sleeps_its_factor_of_the_steps_own_compute(monkeypatch) -> None:
    slept: list[float] = []
    monkeypatch.setattr("hpc.health.fault.time.sleep", slept.append)
    inj = Injector([Fault(0, 2, "slow", 3.0)], rank=0)
    inj.at_step(1, 0.010)
    inj.at_step(2, 0.010)
    inj.at_step(3, 0.030)  # 0.010 of its own + the 0.020 slept at step 2
    assert slept == pytest.approx([0.020, 0.020])
