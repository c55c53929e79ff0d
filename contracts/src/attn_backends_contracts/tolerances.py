"""The suite's tolerances: core's :mod:`attn_backends.tolerances`, re-exported.

One error measure and one tolerance table serve the runtime probe and this
suite alike; they live in core so that the probe does not depend on the
suite. See that module for the measure, the table and its sources.
"""

from attn_backends.tolerances import (
    GRADIENT_FINITE_ONLY_INPUTS,
    OUTPUTS,
    PLATFORMS,
    TOLERANCES,
    Tolerance,
    normalised_error,
    tolerance,
)

__all__ = [
    "GRADIENT_FINITE_ONLY_INPUTS",
    "OUTPUTS",
    "PLATFORMS",
    "TOLERANCES",
    "Tolerance",
    "normalised_error",
    "tolerance",
]
