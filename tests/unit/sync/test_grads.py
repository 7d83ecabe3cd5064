"""sync_gradients' per-module GradSync cache: keyed by every keyword option."""

from __future__ import annotations

import inspect
from typing import Any, ClassVar

import pytest
import torch

from hpc.sync import grads


class _FakeGradSync:
    """Records how it was built and how often it synced (no collectives)."""

    built: ClassVar[list[_FakeGradSync]] = []

    def __init__(self, module_or_params: Any, **options: Any) -> None:
        self.target = module_or_params
        self.options = options
        self.syncs = 0
        _FakeGradSync.built.append(self)

    def sync(self, users: Any = None) -> None:
        self.syncs += 1
        self.users = users


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> type[_FakeGradSync]:
    """A pretend world of two ranks whose GradSync objects are recorded."""
    monkeypatch.setattr(grads, "active_world", lambda group=None: 2)
    monkeypatch.setattr(grads, "GradSync", _FakeGradSync)
    monkeypatch.setattr(_FakeGradSync, "built", [])
    return _FakeGradSync


def _keyword_options() -> dict[str, inspect.Parameter]:
    sig = inspect.signature(grads.sync_gradients)
    return {n: p for n, p in sig.parameters.items() if p.kind is p.KEYWORD_ONLY}


def _other_value(default: Any) -> Any:
    if isinstance(default, bool):
        return not default
    if isinstance(default, int):
        return default + 1
    return object()


def test_same_options_reuse_the_cached_gradsync(fake: type[_FakeGradSync]) -> None:
    net = torch.nn.Linear(2, 2)
    for _ in range(3):
        grads.sync_gradients(net)
    assert len(fake.built) == 1 and fake.built[0].syncs == 3
    grads.sync_gradients(net, match_ddp=True)
    grads.sync_gradients(net, match_ddp=True)
    assert len(fake.built) == 2 and fake.built[1].syncs == 2
    assert fake.built[1].options["match_ddp"] is True


@pytest.mark.parametrize("name", [n for n in _keyword_options() if n != "group"])
def test_every_option_is_part_of_the_cache_key(name: str,
                                               fake: type[_FakeGradSync]) -> None:
    """A call with any other option value builds (and forwards it to) a new GradSync."""
    net = torch.nn.Linear(2, 2)
    grads.sync_gradients(net)
    value = _other_value(_keyword_options()[name].default)
    grads.sync_gradients(net, **{name: value})
    assert len(fake.built) == 2, name
    assert fake.built[1].options[name] is value


def test_every_option_reaches_gradsync() -> None:
    """sync_gradients forwards its keywords to GradSync, which must accept them all."""
    sig = inspect.signature(grads.GradSync.__init__)
    accepted = {n for n, p in sig.parameters.items() if p.kind is p.KEYWORD_ONLY}
    assert set(_keyword_options()) <= accepted


def test_users_reach_the_cached_gradsync_without_rebuilding_it(
        fake: type[_FakeGradSync]) -> None:
    net = torch.nn.Linear(2, 2)
    rows = [list(net.parameters()), []]
    grads.sync_gradients(net)
    grads.sync_gradients(net, rows)
    assert len(fake.built) == 1 and fake.built[0].users is rows


def test_a_group_or_a_parameter_list_is_never_cached(fake: type[_FakeGradSync]) -> None:
    net = torch.nn.Linear(2, 2)
    group = object()
    grads.sync_gradients(net, group=group)
    grads.sync_gradients(net, group=group)
    grads.sync_gradients(list(net.parameters()))
    grads.sync_gradients(list(net.parameters()))
    assert len(fake.built) == 4
    assert fake.built[0].options["group"] is group
    assert net not in grads._CACHE
