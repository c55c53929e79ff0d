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

import contextlib
import contextvars
from collections.abc import Iterator

import attn_backends

ENV_VAR = "ATTN_BACKENDS_TRITON_INTERPRET"
#: How error messages and reasons tell a user to turn the switch on.
HOW_TO_ENABLE = (
    f"set {ENV_VAR}=1 or wrap the call in attn_backend_flash_triton.interpret_mode() "
    "to run the Pallas Triton kernel emulated on cpu (slow; for tests)"
)

_forced: contextvars.ContextVar[bool | None] = contextvars.ContextVar(
    "attn_backend_flash_triton_interpret", default=None
)


def interpret_enabled() -> bool:
    """Whether cpu runs the kernel in Pallas' interpreter (so the backend serves cpu)."""
    forced = _forced.get()
    return attn_backends.env_flag(ENV_VAR) if forced is None else forced


@contextlib.contextmanager
def interpret_mode(enabled: bool = True) -> Iterator[None]:
    """Run the Pallas Triton kernel emulated on CPU inside this block (or forbid it).

    ``interpret_mode(False)`` turns the switch off inside the block even when the
    environment variable is set. Nesting restores the outer state on exit.
    """
    token = _forced.set(bool(enabled))
    try:
        yield
    finally:
        _forced.reset(token)
