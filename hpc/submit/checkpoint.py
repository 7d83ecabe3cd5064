"""Moved to :mod:`hpc.checkpoint.files`; this path warns and goes away in the next release."""

from hpc._moved import moved

moved(__name__, "hpc.checkpoint.files")
