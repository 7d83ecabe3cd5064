"""``hpc check``'s parser, table, JSON and PNG from synthetic results (no torch.distributed)."""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import pytest

from hpc.check import cli, report
from hpc.check.runner import CheckOptions, Results, units_of
from hpc.check.verdict import Figure, Thresholds


@pytest.mark.parametrize("text,value", [("4096", 4096), ("512K", 512 << 10), ("4M", 4 << 20),
                                        ("1G", 1 << 30), ("2MiB", 2 << 20), ("1.5k", 1536)])
def test_parse_size(text: str, value: int) -> None:
    assert cli.parse_size(text) == value


@pytest.mark.parametrize("text", ["0", "-1M", "4X", ""])
def test_parse_size_refuses_bad_input_with_a_hint(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="HINT: e.g. 4096"):
        cli.parse_size(text)


def test_bad_threshold_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        cli.main(["--threshold", "2"])
    assert e.value.code == 2 and "not a fraction in (0, 1]" in capsys.readouterr().err


def test_defaults_follow_the_device() -> None:
    cpu, gpu = CheckOptions().resolved(False), CheckOptions().resolved(True)
    assert (cpu.size, cpu.gemm, cpu.copy) == (4 << 20, 1024, 64 << 20)
    assert (gpu.size, gpu.gemm, gpu.copy) == (64 << 20, 8192, 1 << 30)
    assert CheckOptions(size=123).resolved(True).size == 123


def test_units_are_nodes_across_hosts_else_ranks() -> None:
    rows = [{"rank": 0, "host": "a"}, {"rank": 1, "host": "a"}, {"rank": 2, "host": "b"}]
    assert units_of(rows) == ("node", ["a", "b"], [[0, 1], [2]])
    one = [{"rank": 0, "host": "a"}, {"rank": 1, "host": "a"}]
    assert units_of(one) == ("rank", ["rank 0 (a)", "rank 1 (a)"], [[0], [1]])


def results(slow: int | None = None) -> Results:
    hosts = ["node1", "node2", "node3", "node4"]
    rows = [{"rank": r, "host": h, "device": "cpu", "gemm": 20e9, "copy": 6e9, "gpus": 0,
             "torch_cuda": None, "gpu_name": None, "gpu_uuid": None}
            for r, h in enumerate(hosts)]
    pairs = {p: Figure(2, 4 << 20, 0.7 if slow in p else 0.008, 6e-4)
             for p in itertools.combinations(range(4), 2)}
    settings = {"world": 4, "backend": "gloo", "device": "cpu", "size": 4 << 20,
                "gemm": 1024, "copy": 64 << 20, "budget": 0.3,
                "thresholds": {"compute": 0.5, "bandwidth": 0.5, "latency": 0.25,
                               "min_busbw": 0.0}}
    return Results(rows, "node", hosts, [[0], [1], [2], [3]], pairs,
                   Figure(4, 4 << 20, 0.02, 1e-3), settings)


def test_report_healthy_and_flagged(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli._report(results(), tmp_path) is False
    out = capsys.readouterr().out
    assert "node1  node2      2      8.00      0.5243      0.5243       600.0" in out
    assert "all ranks" in out and out.rstrip().splitlines()[-1].startswith("VERDICT: OK: 4 nodes")
    assert cli._report(results(slow=2), tmp_path) is True
    last = capsys.readouterr().out.rstrip().splitlines()[-1]
    assert last.startswith("VERDICT: FLAGGED node3: slow node node3")
    data = json.loads((tmp_path / "hpc-check.json").read_text())
    assert data["findings"][0]["names"] == ["node3"] and len(data["pairs"]) == 6
    assert data["pairs"][0]["busbw"] == pytest.approx((4 << 20) / 0.008)


def test_a_flagged_node_gets_one_strike_in_the_ledger_a_healthy_run_none(
        tmp_path: Path) -> None:
    from hpc.ledger import Ledger

    cli._report(results(), tmp_path)
    assert Ledger().strikes() == []
    cli._report(results(slow=2), tmp_path)
    (strike,) = Ledger().strikes()
    assert (strike.host, strike.source) == ("node3", "check")
    assert strike.reason.startswith("slow node node3: busbw of all its 3 pairs")
    cli._report(results(slow=2), tmp_path)
    assert list(Ledger().excluded()) == ["node3"]  # two runs, two strikes


def test_png_is_written_or_skipped_with_a_note(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("matplotlib")
    note = report.write_png(results(slow=2), tmp_path / "m.png")
    assert note == f"pair matrix: {tmp_path / 'm.png'}"
    assert (tmp_path / "m.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails as if missing
    note = report.write_png(results(), tmp_path / "n.png")
    assert note.startswith("PNG skipped: matplotlib is not installed")
    assert not (tmp_path / "n.png").exists()


def test_latency_floor_and_serial_options(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu, gpu = CheckOptions().resolved(False), CheckOptions().resolved(True)
    assert (cpu.thresholds.latency_floor, gpu.thresholds.latency_floor) == (1e-3, 100e-6)
    off = CheckOptions(thresholds=Thresholds(latency_floor=0)).resolved(False)
    assert off.thresholds.latency_floor == 0
    seen: dict[str, object] = {}
    monkeypatch.setattr(cli, "_run", lambda args: seen.update(vars(args)) or 0)
    parser = argparse.ArgumentParser()
    cli.add_parser(parser.add_subparsers())
    args = parser.parse_args(["check", "--serial", "--latency-floor", "250"])
    assert args.serial is True and args.latency_floor == 250.0


def test_report_shows_the_pairs_timed_again(tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    res = results()
    first = Figure(2, 4 << 20, 0.016, 9.2e-4)
    res.remeasured = {(0, 2): (first, res.pairs[(0, 2)])}
    res.rows[0].update(CUDA_VISIBLE_DEVICES="0,1", ROCR_VISIBLE_DEVICES="0", gpus=2,
                       torch_cuda="12.4")
    res.rows[1:] = [dict(r, gpus=2) for r in res.rows[1:]]
    assert cli._report(res, tmp_path) is False
    out = capsys.readouterr().out
    assert "timed again alone, as the rounds flagged them" in out
    assert "node1  node3  busbw 0.2621 -> 0.5243 GB/s, latency 920.0 -> 600.0 us" in out
    assert "CUDA_VISIBLE_DEVICES=0,1 ROCR_VISIBLE_DEVICES=0" in out   # two variables, apart
    pair = json.loads((tmp_path / "hpc-check.json").read_text())["pairs"][1]
    assert (pair["a"], pair["b"]) == ("node1", "node3")
    assert pair["first"]["latency"] == 9.2e-4 and pair["alone"]["seconds"] == 0.008
