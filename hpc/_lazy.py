"""Lazy re-exports (PEP 562): a package serves names whose modules load on first use.

``hpc`` and ``hpc.pretrain`` re-export functions that need torch; serving them lazily
keeps ``import hpc`` (and ``hpc --help``) free of torch. In the package::

    __all__ = ["init_torch", ...]
    __getattr__, __dir__ = lazy_attributes(__name__, {"init_torch": "hpc.bootstrap.distributed"},
                                           __all__)
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

__all__ = ["lazy_attributes"]


def lazy_attributes(package: str, modules: Mapping[str, str], public: Sequence[str],
                    ) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The module ``__getattr__`` and ``__dir__`` of ``package``.

    Args:
        package: The package's ``__name__``.
        modules: Lazily served name -> the module defining it.
        public: The package's ``__all__``, which ``dir()`` lists.

    Returns:
        ``(__getattr__, __dir__)``: ``__getattr__`` imports a name's module on first
        access and stores the value in the package, so later lookups do not come back.
    """

    def __getattr__(name: str) -> Any:
        module = modules.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted(public)

    return __getattr__, __dir__
