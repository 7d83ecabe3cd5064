"""hpc search / hpc tune, the pure parts: evolution, export, settings, CLI parsing."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from hpc.pretrain.evaluate import recalibrate_bn  # noqa: E402
from hpc.pretrain.space import CANDIDATES, Supernet  # noqa: E402
from hpc.search.config import SearchConfig, TuneConfig  # noqa: E402
from hpc.search.evolution import (  # noqa: E402
    enumerate_archs,
    pareto_front,
    propose,
    rank_key,
    space_size,
)
from hpc.search.export import SubNet, count_params, extract, load_model, save_model  # noqa: E402


def _propose(net: Supernet, generation: int, parents=(), seen=(), feasible=lambda a: True,
             n: int = 8) -> list[tuple[int, ...]]:
    return propose(n, generation, seed=3, choices=net.choices(), sample=net.sample,
                   parents=list(parents), seen=set(seen), feasible=feasible,
                   mutation_prob=0.25)


#: ``_propose(Supernet(width=4), 0)``, torch 2.13's CPU generator.
FIRST_PROPOSALS = [(1, 0, 1, 1), (0, 1, 3, 3), (1, 3, 3, 2), (1, 0, 0, 3), (2, 0, 0, 1),
                   (1, 2, 3, 3), (0, 0, 3, 3), (2, 1, 2, 2)]


def test_proposals_are_a_pure_function_of_seed_generation_and_history() -> None:
    net = Supernet(width=4)
    first = _propose(net, 0)
    # Pinned: any process, any PYTHONHASHSEED (the next test runs other hash seeds).
    assert first == FIRST_PROPOSALS
    assert len(first) == len(set(first)) == 8
    assert _propose(net, 1) != first  # the generation seeds the draws
    parents = first[:3]
    children = _propose(net, 1, parents=parents, seen=first)
    assert children == _propose(net, 1, parents=parents, seen=first)
    assert not set(children) & set(first)  # never re-proposes what was evaluated
    # mutations/crossovers stay close to their parents: most choices are inherited
    inherited = sum(any(c[i] == p[i] for p in parents) for c in children for i in range(4))
    assert inherited >= 0.7 * len(children) * 4


#: ``_propose(Supernet(width=4), 0)`` in a fresh process.
_PROBE = """
from hpc.pretrain.space import Supernet
from hpc.search.evolution import propose
net = Supernet(width=4)
print(propose(8, 0, seed=3, choices=net.choices(), sample=net.sample, parents=[], seen=set(),
              feasible=lambda a: True, mutation_prob=0.25))
"""


@pytest.mark.timeout(120)
def test_proposals_do_not_depend_on_the_hash_seed() -> None:
    """Ranks are separate processes with their own PYTHONHASHSEED: they must agree."""
    from tests.helpers.paths import ROOT
    from tests.helpers.processes import clean_env, run_group

    for seed in ("1", "2"):
        proc = run_group([sys.executable, "-c", _PROBE], timeout=100, cwd=ROOT,
                         env=clean_env(PYTHONHASHSEED=seed, PYTHONPATH=str(ROOT)))
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.split("\n")[0] == str(FIRST_PROPOSALS), (seed, proc.stdout)


def test_proposals_respect_feasible_and_stop_when_the_space_runs_dry() -> None:
    net = Supernet(width=4)
    calls: list[tuple[int, ...]] = []

    def feasible(arch: tuple[int, ...]) -> bool:
        calls.append(arch)
        return arch[0] == 3  # 64 of the 256 sub-networks

    out = _propose(net, 0, feasible=feasible, n=16)
    assert len(out) == 16 and all(a[0] == 3 for a in out)
    assert len(calls) == len(set(calls))  # each new proposal is checked exactly once
    everything = enumerate_archs(net.choices())
    assert space_size(net.choices()) == len(everything) == 256 == len(set(everything))
    left = everything[:-2]
    assert sorted(_propose(net, 5, seen=left, n=10)) == sorted(everything[-2:])


def test_pareto_front_and_ranking() -> None:
    points = [(10, 0.5), (20, 0.9), (15, 0.4), (5, 0.5), (30, 0.9), (25, 0.95)]
    assert pareto_front(points) == [3, 1, 5]  # (5, .5) (20, .9) (25, .95)
    records = [{"arch": [1], "val_acc": 0.9, "val_loss": 0.3, "params": 50},
               {"arch": [0], "val_acc": 0.9, "val_loss": 0.3, "params": 40},
               {"arch": [2], "val_acc": 0.8, "val_loss": 0.1, "params": 10}]
    assert [r["arch"] for r in sorted(records, key=rank_key)] == [[0], [1], [2]]


NO_IDENTITY = ("sepconv3x3", "conv5x5", "conv3x3")


def _recalibrated(arch: tuple[int, ...], ops: tuple[str, ...] = CANDIDATES
                  ) -> tuple[Supernet, torch.Tensor]:
    torch.manual_seed(0)
    net = Supernet(width=8, ops=ops)
    x = torch.randn(64, 1, 8, 8)
    recalibrate_bn(net, arch, x, reduce=False)
    return net, torch.randn(16, 1, 8, 8)


@pytest.mark.parametrize("arch,ops", [((0, 1, 2, 3), CANDIDATES), ((3, 3, 3, 3), CANDIDATES),
                                      ((2, 0, 3, 1), CANDIDATES), ((0, 2, 1, 0), NO_IDENTITY)])
def test_export_reproduces_the_supernet_subnetwork_bitwise(arch: tuple[int, ...],
                                                          ops: tuple[str, ...],
                                                          tmp_path: Path) -> None:
    net, x = _recalibrated(arch, ops)
    sub = extract(net, arch)
    net.eval()
    sub.eval()
    with torch.no_grad():
        expected = net(x, arch)
        assert torch.equal(sub(x), expected)
    # exactly the chosen operations' parameters, nothing shared with the supernet
    used = sum(p.numel() for m in (net.stem, net.head) for p in m.parameters())
    used += sum(p.numel() for b, c in zip(net.blocks, arch) for p in b[c].parameters())
    assert count_params(sub) == used < count_params(net)
    assert not {p.data_ptr() for p in sub.parameters()} & {
        p.data_ptr() for p in net.parameters()}
    # model.pt rebuilds it without the supernet, bitwise
    save_model(sub, tmp_path / "model.pt", val_acc=0.5)
    loaded = load_model(tmp_path / "model.pt")
    assert loaded.arch == arch and not loaded.training and loaded.kwargs["ops"] == list(ops)
    with torch.no_grad():
        assert torch.equal(loaded(x), expected)
    payload = torch.load(tmp_path / "model.pt", weights_only=True)
    assert payload["val_acc"] == 0.5 and (tmp_path / "model.pt.sha256").is_file()


def test_export_train_mode_matches_too_and_bad_input_is_refused(tmp_path: Path) -> None:
    arch = (1, 2, 0, 3)
    net, x = _recalibrated(arch)
    sub = extract(net, arch)
    with torch.no_grad():
        assert torch.equal(sub(x), net(x, arch))  # train mode: batch statistics
    with pytest.raises(ValueError, match="HINT"):
        SubNet((0, 9, 1, 1))
    with pytest.raises(TypeError, match="subnet"):
        extract(torch.nn.Linear(2, 2), arch)
    torch.save({"x": torch.zeros(1)}, tmp_path / "other.pt")
    with pytest.raises(ValueError, match="not a model file"):
        load_model(tmp_path / "other.pt")


def test_settings_refuse_impossible_values(tmp_path: Path) -> None:
    cfg = SearchConfig(run=str(tmp_path), budget=0, max_params=0, mutation_prob=2.0)
    with pytest.raises(ValueError, match=r"budget=0.*mutation_prob=2.0.*max_params=0"
                                         r"(.|\n)*HINT"):
        cfg.validate()
    with pytest.raises(ValueError, match="no such directory"):
        SearchConfig(run=str(tmp_path / "nope")).validate()
    SearchConfig(run=str(tmp_path)).validate()
    assert SearchConfig(run=str(tmp_path)).out_dir == tmp_path / "search"
    with pytest.raises(ValueError, match="holds no search.json"):
        TuneConfig(search=str(tmp_path)).validate()
    with pytest.raises(ValueError, match=r"'\S*nope' \(no such directory; pass the --out"):
        TuneConfig(search=str(tmp_path / "nope")).validate()
    assert TuneConfig(search="s", from_scratch=True).out_dir == Path("s/scratch")


def test_cli_flags_derive_from_the_dataclasses() -> None:
    from hpc.cli.main import build_parser

    args = build_parser().parse_args(["search", "--run", "r", "--budget", "7",
                                      "--max-params", "1000", "--max-latency-ms", "0.5",
                                      "--no-resume", "--no-progress"])
    assert (args.run, args.budget, args.max_params, args.max_latency_ms, args.resume,
            args.progress, args.seed) == ("r", 7, 1000, 0.5, "never", False, 0)
    args = build_parser().parse_args(["tune", "--search", "s", "--epochs", "3",
                                      "--from-scratch"])
    assert (args.search, args.epochs, args.from_scratch, args.lr) == ("s", 3, True, 0.02)
    assert isinstance(args, argparse.Namespace) and callable(args.func)
