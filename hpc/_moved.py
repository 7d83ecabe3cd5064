"""Old import paths of modules that moved, kept working for one release with a warning.

A module that moved leaves a two-line file at its old path::

    from hpc._moved import moved
    moved(__name__, "hpc.checkpoint.resume")

Importing the old path warns (:class:`DeprecationWarning`, pointing at the importing
line) and gives the new module itself (``sys.modules`` maps the old name to it), so
``isinstance`` checks, monkeypatching and module state stay shared. Run as a script
(``python -m hpc.submit.shield``), the old path runs the new module as ``__main__``.
The API reference skips these files (:data:`MARKER`).
"""

from __future__ import annotations

import importlib
import runpy
import sys
import warnings

__all__ = ["MARKER", "moved"]

#: Text that identifies a moved module's file (the docs build skips such modules).
MARKER = "from hpc._moved import moved"


def moved(old: str, new: str) -> None:
    """Make the module ``old`` (the caller's ``__name__``) an alias of ``new``."""
    if old == "__main__":
        warnings.warn(f"python -m of this module's old path is deprecated: use "
                      f"python -m {new}", DeprecationWarning, stacklevel=2)
        sys.argv[0] = new
        runpy.run_module(new, run_name="__main__", alter_sys=True)
        return
    message = (f"{old} moved to {new}; import it from there (the old path goes away in "
               "the next release)")
    importer = sys._getframe(2)  # past this function and the moved module's own code
    while importer.f_back is not None and _machinery(importer.f_code.co_filename):
        importer = importer.f_back
    where = importer.f_globals
    warnings.warn_explicit(message, DeprecationWarning, importer.f_code.co_filename,
                           importer.f_lineno, module=where.get("__name__", "?"),
                           registry=where.setdefault("__warningregistry__", {}))
    sys.modules[old] = importlib.import_module(new)


def _machinery(filename: str) -> bool:
    """True for the import system's frames (the warning names the importing line)."""
    return filename.startswith("<frozen") or "importlib" in filename
