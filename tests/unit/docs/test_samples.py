"""Sample output on the docs pages agrees with the code and the README's figures.

The quickstart's pretrain lines come from a real run of the README's main command;
they must show the default number of epochs and the accuracy the README states (which
``tests/integration/test_pretrain.py`` checks against a fresh run).
"""

from __future__ import annotations

import re

from hpc.pretrain.config import PretrainConfig
from tests.helpers.paths import ROOT

QUICKSTART = (ROOT / "docs" / "quickstart.md").read_text()
README = (ROOT / "README.md").read_text()


def test_quickstart_run_shows_the_default_epochs() -> None:
    epochs = {int(m) for m in re.findall(r"epoch \d+/(\d+) step", QUICKSTART)}
    assert epochs == {PretrainConfig().epochs}, epochs


def test_quickstart_accuracy_is_the_readmes() -> None:
    final = re.search(r"pretrain completed at step (\d+): val acc best ([\d.]+) mean ([\d.]+)",
                      QUICKSTART)
    claim = re.search(r"best sub-network ([\d.]+) %, mean ([\d.]+) %", README)
    assert final and claim
    assert round(float(final.group(2)) * 100, 1) == float(claim.group(1))
    assert round(float(final.group(3)) * 100, 1) == float(claim.group(2))


def test_quickstart_lines_carry_one_rank_prefix() -> None:
    lines = [x for x in QUICKSTART.splitlines() if "hpc.pretrain.loop" in x]
    assert lines and all(x.startswith("[rank 0] ") and "[rank 0/" not in x for x in lines)
