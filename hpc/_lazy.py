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

from hpc.errors import HPCError

__all__ = ["lazy_attributes", "resolve_callable"]


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


def resolve_callable(spec: str, *, label: str, example: str, where: str,
                     error: type[HPCError] = HPCError) -> Callable[..., Any]:
    """``pkg.mod:func`` (or ``pkg.mod:Class.method``) -> that callable, imported now.

    The one reader of ``module:function`` references (``hpc submit pkg.mod:func``,
    ``HPC_STEP_HOOK``); the callers say how their messages name the reference.

    Args:
        spec: The reference.
        label: How messages name it, e.g. ``HPC_STEP_HOOK='x:y'``.
        example: A well-formed reference for the HINT.
        where: Where the module must be importable, for the HINT.
        error: The :class:`~hpc.errors.HPCError` subclass to raise.

    Raises:
        HPCError: (``error``) not ``module:function``, the module does not import or
            has no such attribute, or the attribute is not callable.
    """
    module, sep, attr = spec.partition(":")
    if not (sep and module and attr):
        raise error(f"{label} is not module:function.\nHINT: write it as {example}.")
    try:
        obj: Any = importlib.import_module(module)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as e:
        raise error(f"{label} cannot be loaded: {type(e).__name__}: {e}.\n"
                    f"HINT: put the module on PYTHONPATH {where}.") from e
    if not callable(obj):
        raise error(f"{label} is a {type(obj).__name__}, not a function.\n"
                    "HINT: point at a function.")
    return obj
