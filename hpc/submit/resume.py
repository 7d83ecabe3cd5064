"""Moved to :mod:`hpc.checkpoint.resume`; this path warns and goes away in the next release."""

from hpc._moved import moved

moved(__name__, "hpc.checkpoint.resume")
