"""The ``hpc`` command: the subcommand table and the commands that belong to no room.

* :mod:`hpc.cli.main` — the table (:data:`~hpc.cli.main.SUBCOMMANDS`), the parser and
  ``main`` of the ``hpc`` console script;
* :mod:`hpc.cli.run` — ``hpc run`` (engine: :mod:`hpc.launch`);
* :mod:`hpc.cli.env` — ``hpc env``; :mod:`hpc.cli.demo` — ``hpc demo``;
* :mod:`hpc.cli.failures` — ``hpc first-failure``.

Rooms with a command keep it beside their code (``hpc.pretrain.cli``,
``hpc.search.search_cli``, ``hpc.search.tune_cli``, ``hpc.submit.cli``,
``hpc.check.cli``, ``hpc.supervise.cli``), built with :mod:`hpc._command`; the table
names them as text, so ``hpc --help`` imports no torch. Nothing imports this room: it is
the top floor of the house.
"""
