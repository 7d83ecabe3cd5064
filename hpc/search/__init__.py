"""Search and tune: the stages that read a pretrain run (``hpc search``, ``hpc tune``).

* :mod:`hpc.search.search` — the distributed search for the best sub-network
  (exhaustive or evolutionary, :mod:`hpc.search.evolution`), with
  :mod:`hpc.search.report` (``search.json``, the Pareto plot);
* :mod:`hpc.search.tune` — the winner exported (:mod:`hpc.search.export`) and fine-tuned
  with DDP;
* :mod:`hpc.search.trained` — a pretrain run loaded back (its config, data, supernet);
* :mod:`hpc.search.config` — :class:`SearchConfig`, :class:`TuneConfig`;
* :mod:`hpc.search.search_cli`, :mod:`hpc.search.tune_cli` — the commands.

Reads :mod:`hpc.pretrain`'s runs; :mod:`hpc.pretrain` never imports this room.
Served lazily: importing :mod:`hpc.search` does not import torch.
"""

from __future__ import annotations

from hpc._lazy import lazy_attributes

__all__ = ["SearchConfig", "TuneConfig", "search", "tune"]

_LAZY = {"search": "hpc.search.search", "tune": "hpc.search.tune",
         "SearchConfig": "hpc.search.config", "TuneConfig": "hpc.search.config"}

__getattr__, __dir__ = lazy_attributes(__name__, _LAZY, __all__)
