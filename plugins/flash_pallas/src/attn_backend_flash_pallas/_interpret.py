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

import contextlib
import contextvars
from collections.abc import Iterator

import attn_backends

ENV_VAR = "ATTN_BACKENDS_PALLAS_INTERPRET"
#: How error messages and reasons tell a user to turn the switch on.
HOW_TO_ENABLE = (
    f"set {ENV_VAR}=1 or wrap the call in attn_backend_flash_pallas.interpret_mode() "
    "to run the Pallas TPU kernels emulated on cpu (slow; for tests)"
)

_forced: contextvars.ContextVar[bool | None] = contextvars.ContextVar(
    "attn_backend_flash_pallas_interpret", default=None
)


def interpret_enabled() -> bool:
    """Whether cpu runs the kernels in Pallas' interpreter (so the backend serves cpu)."""
    forced = _forced.get()
    return attn_backends.env_flag(ENV_VAR) if forced is None else forced


@contextlib.contextmanager
def interpret_mode(enabled: bool = True) -> Iterator[None]:
    """Run the Pallas TPU kernels emulated on CPU inside this block (or forbid it).

    ``interpret_mode(False)`` turns the switch off inside the block even when the
    environment variable is set. Nesting restores the outer state on exit.
    """
    token = _forced.set(bool(enabled))
    try:
        yield
    finally:
        _forced.reset(token)
