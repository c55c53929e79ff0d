"""attn-backend-flash-triton: JAX's Pallas Triton flash-attention kernel behind attn-backends."""

from ._config import TritonBlockSizes, TritonPagedBlocks
from ._interpret import ENV_VAR, interpret_enabled, interpret_mode
from ._plugin import FlashTritonBackend

__all__ = [
    "ENV_VAR",
    "FlashTritonBackend",
    "TritonBlockSizes",
    "TritonPagedBlocks",
    "interpret_enabled",
    "interpret_mode",
]
