"""Core's NumPy float64 oracle, public as ``attn_backends.oracle``; it belongs to
the judging layer (:mod:`attn_backends.probe.oracle`)."""

from .probe.oracle import *  # noqa: F403 - the public names, listed once in __all__ there
from .probe.oracle import __all__  # noqa: F401
