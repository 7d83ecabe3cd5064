"""``python -m hpc.submit ARGS`` is ``hpc submit ARGS``."""

import sys

from hpc.submit.cli import main

sys.exit(main())
