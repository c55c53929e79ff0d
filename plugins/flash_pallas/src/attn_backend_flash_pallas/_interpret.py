"""The switch that lets the TPU kernels run emulated on CPU (Pallas interpret mode).

Off by default: without it the backend serves only ``tpu``, so a CPU program
never lands in the (slow) interpreter by accident. With it the backend also
serves ``cpu``, where the kernels run in Pallas' interpreter (``interpret=True``:
the kernel body becomes plain HLO); a TPU lowering of the same program still
gets the compiled kernels. Turn it on deliberately with either

- the environment variable ``ATTN_BACKENDS_PALLAS_INTERPRET=1``, or
- ``with attn_backend_flash_pallas.interpret_mode(): ...`` around the code that
  selects and traces attention.

The switch is read when a call is selected and traced (not per step), so set it
before the first call of a given shape.
"""

from __future__ import annotations

from attn_backends.authoring import InterpretSwitch

SWITCH = InterpretSwitch(
    "ATTN_BACKENDS_PALLAS_INTERPRET",
    package="attn_backend_flash_pallas",
    kernel="the Pallas TPU kernels",
    mode_name="Pallas TPU interpret mode",
)
ENV_VAR = SWITCH.env_var
#: Whether cpu runs the kernels in Pallas' interpreter (so the backend serves cpu).
interpret_enabled = SWITCH.enabled
#: ``with interpret_mode(): ...`` runs the kernels emulated on CPU inside the block;
#: ``interpret_mode(False)`` forbids it there even when the variable is set.
interpret_mode = SWITCH.mode
