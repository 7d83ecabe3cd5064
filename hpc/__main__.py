"""``python -m hpc`` is the ``hpc`` command."""

import sys

from hpc.cli import main

sys.exit(main())
