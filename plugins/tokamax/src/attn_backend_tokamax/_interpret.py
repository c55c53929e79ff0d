"""The switch that lets tokamax's Mosaic TPU kernels run emulated on CPU (Pallas
TPU interpret mode): the same variable as flash_pallas's, since it means the
same thing (Pallas TPU kernels interpreted on cpu), with this package's own
context manager.

Off by default: without it ``tokamax_mosaic_tpu`` serves only ``tpu``. With
``ATTN_BACKENDS_PALLAS_INTERPRET=1`` or inside
``attn_backend_tokamax.interpret_mode()`` it also serves ``cpu``, where the
kernels run in Pallas' TPU interpreter; a TPU lowering of the same program
still gets the compiled kernels (the adapter interprets only when lowering for
cpu).
"""

from __future__ import annotations

from attn_backends.authoring import InterpretSwitch

SWITCH = InterpretSwitch(
    "ATTN_BACKENDS_PALLAS_INTERPRET",
    package="attn_backend_tokamax",
    kernel="tokamax's Mosaic TPU kernels",
    mode_name="Pallas TPU interpret mode",
)
#: ``with interpret_mode(): ...`` runs the kernels emulated on CPU inside the block.
interpret_mode = SWITCH.mode
