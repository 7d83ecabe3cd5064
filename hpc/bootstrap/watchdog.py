"""Moved to :mod:`hpc.watchdog.monitor`; this path warns and goes away in the next release."""

from hpc._moved import moved

moved(__name__, "hpc.watchdog.monitor")
