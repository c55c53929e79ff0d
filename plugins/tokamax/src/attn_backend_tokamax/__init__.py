"""attn-backends adapter over tokamax's attention implementations (lazy: importing
this package imports no tokamax)."""

from ._environment import TOKAMAX_CERTIFIED
from ._plugin import (
    TokamaxBackend,
    TokamaxXlaBackend,
    TokamaxXlaChunkedBackend,
    attn_backends_register,
)

__all__ = [
    "TOKAMAX_CERTIFIED",
    "TokamaxBackend",
    "TokamaxXlaBackend",
    "TokamaxXlaChunkedBackend",
    "attn_backends_register",
]
