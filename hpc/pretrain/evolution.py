"""Moved to :mod:`hpc.search.evolution`; this path warns and goes away in the next release."""

from hpc._moved import moved

moved(__name__, "hpc.search.evolution")
