"""The suite's tolerances: core's :mod:`attn_backends.tolerances`, re-exported.

One error measure, one tolerance table and one comparison with the oracle
(:func:`compare`) serve the runtime probe and this suite alike; they live in
core so that the probe does not depend on the suite. See that module for the
measure, the table and its sources.
"""

from attn_backends.tolerances import *  # noqa: F403 - the public names, listed once in __all__ there
from attn_backends.tolerances import __all__  # noqa: F401
