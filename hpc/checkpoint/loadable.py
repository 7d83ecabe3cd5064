"""What a checkpoint may hold: ``torch.load(weights_only=True)``'s rule, applied at save.

Every resume loads with ``weights_only=True``, which rebuilds tensors, plain Python
values and containers (``None``, bool, int, float, complex, str, bytes, list, tuple,
dict, set, ``OrderedDict``, ``Counter``), ``torch.dtype``/``device``/``Size`` and
whatever the script registered with ``torch.serialization.add_safe_globals``, and
refuses anything else: a numpy scalar or array, a ``Path``, an ``argparse.Namespace``,
a dataclass, an int of more than 255 bytes. Such a file saves fine and is then skipped
by every resume, so :func:`hpc.checkpoint.files.save_atomic` loads its temporary file
back by the loader itself (:func:`check_loads`, memory-mapped) before the rename, and
a refusal names the value (:func:`refused_value`) with the fix.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import pickle
import re
import reprlib
from collections import Counter, OrderedDict
from pathlib import Path, PurePath
from typing import Any, Optional

import numpy as np
import torch

from hpc.errors import CheckpointError

__all__ = ["check_loads", "refused_value", "unpickler_reason"]

# what torch.load(weights_only=True) rebuilds without an allowlist (torch 2.13's
# _weights_only_unpickler: GLOBALs of these types only, APPEND to lists, SETITEM to
# dicts); only used to *name* a refused value, the rule itself is the loader's
_PLAIN = (type(None), bool, int, float, complex, str, bytes, bytearray, torch.dtype,
          torch.device, torch.Size, torch.layout, torch.Tensor, torch.nn.Parameter)
_MAPPINGS = (dict, OrderedDict, Counter)
_SEQUENCES = (list, tuple, set)
_repr = reprlib.Repr()
_repr.maxstring = _repr.maxother = 60


def _type_name(value: Any) -> str:
    kind = type(value)
    return kind.__qualname__ if kind.__module__ == "builtins" else \
        f"{kind.__module__}.{kind.__qualname__}"


def refused_value(obj: Any, where: str = "") -> Optional[tuple[str, Any]]:
    """(where, value) of the first value inside ``obj`` the weights_only loader refuses.

    A class registered with ``torch.serialization.add_safe_globals`` counts as allowed;
    an ``int`` of more than 255 bytes does not (it pickles with an opcode the loader
    does not know).
    """
    kind = type(obj)
    if kind in _MAPPINGS:
        for key, value in obj.items():
            found = (refused_value(key, f"{where} key {key!r}")
                     or refused_value(value, f"{where}[{key!r}]"))
            if found:
                return found
        return None
    if kind in _SEQUENCES:
        items = sorted(obj, key=repr) if kind is set else obj
        for i, value in enumerate(items):
            found = refused_value(value, f"{where}[{i}]")
            if found:
                return found
        return None
    if kind is int and obj.bit_length() >= 255 * 8:
        return where, obj
    if kind in _PLAIN or kind in torch.serialization.get_safe_globals():
        return None
    return where, obj


def _hint(value: Any) -> str:
    if isinstance(value, np.generic):
        return ("store a plain number: float(x), int(x) or bool(x) (x.item() converts "
                "any numpy scalar).")
    if isinstance(value, np.ndarray):
        return "store torch.from_numpy(x) (or x.tolist())."
    if isinstance(value, (PurePath, os.PathLike)):
        return "store str(path), and make it a Path again after the restore."
    if isinstance(value, argparse.Namespace):
        return ("store vars(ns), a dict, and argparse.Namespace(**d) it again after the "
                "restore.")
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return "store dataclasses.asdict(x), a dict, and rebuild it after the restore."
    if type(value) is int:
        return "store it as str(n) and int() it again after the restore."
    return ("store it as tensors and plain Python values (None, bool, int, float, str, "
            "bytes, list, tuple, dict, set), or, if you trust the class, register it "
            f"with torch.serialization.add_safe_globals([{type(value).__qualname__}]) "
            "in the script, before every save and every restore.")


def unpickler_reason(error: BaseException) -> str:
    """The weights_only unpickler's own one-line reason inside torch's long message."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(error))
    text = text.split("\n\nCheck the documentation")[0].strip()
    last = text.splitlines()[-1].strip() if text else type(error).__name__
    last = last.removeprefix("WeightsUnpickler error:").strip()
    return last.split(". Please use")[0]


def check_loads(tmp: Path, obj: Any, name: str) -> None:
    """Load ``tmp`` (``obj`` as written, to be renamed to ``name``) as a resume will.

    ``mmap=True`` maps the tensor bytes instead of reading them, so the cost is the
    unpickling (per tensor), not the file size; a filesystem that cannot map files
    gets a plain load.

    Raises:
        CheckpointError: ``weights_only=True`` refuses it; the message names the value.
    """
    try:
        try:
            torch.load(tmp, map_location="cpu", weights_only=True, mmap=True)
        except pickle.UnpicklingError:
            raise
        except Exception:  # no mmap here (some network filesystems): read it
            torch.load(tmp, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise CheckpointError(_refusal(obj, name, e)) from e


def _refusal(obj: Any, name: str, error: BaseException) -> str:
    found = refused_value(obj)
    if found:
        where, value = found
        kind = _type_name(value)
        article = "an" if kind[0] in "aeiouAEIOU" else "a"
        what = f"{where.strip() or 'the payload'} is {article} {kind} ({_repr.repr(value)})"
        hint = _hint(value)
    else:  # the loader refused what looks plain: its own reason says what
        what, hint = "it holds a value", ("store only tensors and plain Python values "
                                          "(None, bool, int, float, str, bytes, list, "
                                          "tuple, dict, set).")
    return (f"cannot save checkpoint {name}: {what}, which "
            f"torch.load(weights_only=True) refuses ({unpickler_reason(error)}).\n"
            "Every resume loads with weights_only=True and would skip this file, so it "
            "was not written and no older checkpoint was deleted.\n"
            f"HINT: {hint}")
