"""Core's tolerance table and its one comparison with the oracle (:func:`compare`),
public as ``attn_backends.tolerances``; they belong to the judging layer
(:mod:`attn_backends.probe.tolerances`), whose docstring is the table's documentation."""

from .probe.tolerances import *  # noqa: F403 - the public names, listed once in __all__ there
from .probe.tolerances import __all__  # noqa: F401
