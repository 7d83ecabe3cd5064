"""hpc.submit.options: SubmitOptions, its validation and readers, extra sbatch options."""

from __future__ import annotations

import argparse
import dataclasses
import shutil
from pathlib import Path

import pytest

from hpc.errors import SubmitError
from hpc.submit import SubmitOptions, parse_sbatch
from hpc.submit.options import (
    _SET_ALWAYS,
    MANAGED,
    field_parameters,
    job_dir,
    marks_dir,
    parse_time,
)


def test_options_reject_unknown_keywords_listing_the_valid_ones() -> None:
    with pytest.raises(SubmitError, match=r"(?s)nodez.*nodez -> nodes\?.*valid options: nodes"):
        SubmitOptions.from_kwargs(nodez=2)


@pytest.mark.parametrize("kwargs, match", [
    ({"gpus_per_node": 2, "tasks_per_node": 4}, "one task per GPU"),
    ({"time_min": 1, "signal_delay_s": 60}, "signal_delay_s=60 >= time limit 60 s"),
    ({"nodes": 0}, "nodes=0"),
    ({"env": {"1X": "a"}}, "env names"),
    ({"signal": "KILL"}, "use one of"),
])
def test_options_validate(kwargs: dict, match: str) -> None:
    with pytest.raises(SubmitError, match=match):
        SubmitOptions(**kwargs).validate()


def test_tasks_per_node_defaults_to_one_per_gpu() -> None:
    assert SubmitOptions(gpus_per_node=4).ntasks_per_node == 4
    assert SubmitOptions().ntasks_per_node == 1
    assert SubmitOptions(tasks_per_node=3).ntasks_per_node == 3


def test_is_array_is_one_or_more_tasks() -> None:
    assert [SubmitOptions(array=n).is_array for n in (-1, 0, 1, 4)] == [False, False, True, True]


@pytest.mark.skipif(shutil.which("sbatch") is None, reason="no sbatch")
def test_sbatch_extras_are_validated_against_sbatch_help() -> None:
    assert parse_sbatch(["mail_type=END", "exclusive"]) == {"mail-type": "END",
                                                           "exclusive": True}
    with pytest.raises(SubmitError, match=r"(?s)did you mean account.*valid sbatch options"):
        parse_sbatch({"acount": "x"})
    with pytest.raises(SubmitError, match="HINT: use --time instead"):
        parse_sbatch(["time=5"])


@pytest.mark.parametrize("text, minutes", [("90", 90), ("1:30", 2), ("1:30:00", 90),
                                           ("1-12:00", 2160), ("2-0", 2880)])
def test_parse_time(text: str, minutes: int) -> None:
    assert parse_time(text) == minutes


def test_parse_time_rejects_garbage() -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        parse_time("soon")


def test_managed_sbatch_options_come_from_the_fields() -> None:
    from_fields: dict[str, list[str]] = {}
    for f in dataclasses.fields(SubmitOptions):
        for name in f.metadata["sbatch"]:
            from_fields.setdefault(name, []).append(f.metadata["flags"][0])
    assert set(MANAGED) == set(from_fields) | set(_SET_ALWAYS)
    for name, flags in from_fields.items():
        assert MANAGED[name] == " and ".join(flags)
    assert MANAGED["ntasks"] == "--nodes and --tasks-per-node"
    assert MANAGED["time"] == "--time" and MANAGED["output"] == "--log-dir"


def test_field_parameters_map_the_fields() -> None:
    assert field_parameters(SubmitOptions()) == {
        "nodes": 1, "tasks_per_node": 1, "cpus_per_task": 1, "timeout_min": 60,
        "name": "hpc", "slurm_signal_delay_s": 120, "slurm_max_num_timeout": 3,
        "slurm_python": None}
    params = field_parameters(SubmitOptions(gpus_per_node=2, partition="p"))
    assert (params["gpus_per_node"], params["tasks_per_node"]) == (2, 2)
    assert params["slurm_partition"] == "p"


def test_job_and_marks_dirs_are_real_directories_under_the_log_dir(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    logs = tmp_path.resolve() / "my logs"
    assert job_dir("my logs", "%j") == logs / "%j"
    assert marks_dir("my logs", "42", 1) == logs / "42" / "failures-1"
