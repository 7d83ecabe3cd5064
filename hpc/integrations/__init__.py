"""Adapters to the training frameworks users already run (docs/integrations.md).

* :mod:`hpc.integrations.lightning` — a Lightning ``ClusterEnvironment`` on
  :func:`hpc.detect` and :func:`hpc.init_torch`, and a Trainer callback for hpc's agreed
  stop and requeue.

Each module imports its framework; importing :mod:`hpc.integrations` imports none.
"""
