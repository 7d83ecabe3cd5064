"""Moved to :mod:`hpc.search.search_cli`; this path warns and goes away in the next release."""

from hpc._moved import moved

moved(__name__, "hpc.search.search_cli")
