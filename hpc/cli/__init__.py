"""The ``hpc`` command: :mod:`hpc.cli.main` holds the subcommand table.

* :mod:`hpc.cli.main` — the table, the parser and ``main``;
* :mod:`hpc.cli.run` — ``hpc run`` (engine: :mod:`hpc.launch`);
* :mod:`hpc.cli.env` — ``hpc env``;
* :mod:`hpc.cli.demo` — ``hpc demo``.

Feature packages keep their own command line (``hpc.pretrain.cli``, ``hpc.submit.cli``).
"""
