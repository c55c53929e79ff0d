"""The suite's oracle: core's NumPy float64 oracle of the contract.

The probe and the suite judge backends against the same oracle, so it lives
in core (:mod:`attn_backends.oracle`); this module keeps the suite's import path.
"""

from attn_backends.oracle import attention, attention_vjp, magnitudes, visibility

__all__ = ["attention", "attention_vjp", "magnitudes", "visibility"]
