"""``python -m hpc.submit ARGS`` is ``hpc submit ARGS``."""

import sys

from hpc.submit.cli import run

sys.exit(run())
