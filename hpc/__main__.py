"""``python -m hpc`` is the ``hpc`` command."""

import sys

from hpc.cli.main import main

sys.exit(main())
