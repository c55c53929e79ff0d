"""attn-backends adapter over tokamax's attention implementations (lazy: importing
this package imports no tokamax)."""

from ._environment import TOKAMAX_CERTIFIED
from ._interpret import interpret_mode
from ._plugin import (
    ChunkSizes,
    TokamaxBackend,
    TokamaxMosaicGpuBackend,
    TokamaxMosaicTpuBackend,
    TokamaxTritonBackend,
    TokamaxXlaBackend,
    TokamaxXlaChunkedBackend,
    attn_backends_register,
)

__all__ = [
    "ChunkSizes",
    "TOKAMAX_CERTIFIED",
    "TokamaxBackend",
    "TokamaxMosaicGpuBackend",
    "TokamaxMosaicTpuBackend",
    "TokamaxTritonBackend",
    "TokamaxXlaBackend",
    "TokamaxXlaChunkedBackend",
    "attn_backends_register",
    "interpret_mode",
]
