"""hpc.submit.options: SubmitOptions validation and the extra sbatch options."""

from __future__ import annotations

import shutil

import pytest

from hpc.errors import SubmitError
from hpc.submit import SubmitOptions, parse_sbatch


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


@pytest.mark.skipif(shutil.which("sbatch") is None, reason="no sbatch")
def test_sbatch_extras_are_validated_against_sbatch_help() -> None:
    assert parse_sbatch(["mail_type=END", "exclusive"]) == {"mail-type": "END",
                                                           "exclusive": True}
    with pytest.raises(SubmitError, match=r"(?s)did you mean account.*valid sbatch options"):
        parse_sbatch({"acount": "x"})
    with pytest.raises(SubmitError, match="HINT: use --time instead"):
        parse_sbatch(["time=5"])
