"""The switch that lets the Pallas Triton kernel run emulated on CPU (interpret mode).

Off by default: without it the backend serves only ``gpu``, so a CPU program
never lands in the (slow) interpreter by accident. With it the backend also
serves ``cpu``, where the kernel runs in Pallas' interpreter (``interpret=True``:
the kernel body becomes plain HLO); a GPU lowering of the same program still
gets the compiled Triton kernel. Turn it on deliberately with either

- the environment variable ``ATTN_BACKENDS_TRITON_INTERPRET=1``, or
- ``with attn_backend_flash_triton.interpret_mode(): ...`` around the code that
  selects and traces attention.

The switch is read when a call is selected and traced (not per step), so set it
before the first call of a given shape.
"""

from __future__ import annotations

from attn_backends.authoring import InterpretSwitch

SWITCH = InterpretSwitch(
    "ATTN_BACKENDS_TRITON_INTERPRET",
    package="attn_backend_flash_triton",
    kernel="the Pallas Triton kernel",
    mode_name="Pallas Triton interpret mode",
)
ENV_VAR = SWITCH.env_var
#: Whether cpu runs the kernel in Pallas' interpreter (so the backend serves cpu).
interpret_enabled = SWITCH.enabled
#: ``with interpret_mode(): ...`` runs the kernel emulated on CPU inside the block;
#: ``interpret_mode(False)`` forbids it there even when the variable is set.
interpret_mode = SWITCH.mode
